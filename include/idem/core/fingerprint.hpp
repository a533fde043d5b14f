#pragma once
/// @file fingerprint.hpp Payload fingerprints: hex SHA-256 through OpenSSL's libcrypto (compiled in
/// libidem, so no idem header includes OpenSSL's).

#include <string>
#include <string_view>


namespace idem {

/// Lower-case hex SHA-256 of `payload` (64 characters); also a way to shorten over-long keys.
/// Throws idem::error if libcrypto fails. Thread-safe.
std::string fingerprint(std::string_view payload);

}  // namespace idem
