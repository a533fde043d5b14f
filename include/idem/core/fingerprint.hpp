#pragma once
/// @file fingerprint.hpp Payload fingerprints: hex SHA-256 through OpenSSL's libcrypto.

#include <string>
#include <string_view>

#include "idem/core/hex.hpp"
#include "idem/core/platform.hpp"
#include "idem/core/error.hpp"

namespace idem {

/// Lower-case hex SHA-256 of `payload` (64 characters); also a way to shorten over-long keys.
inline std::string fingerprint(std::string_view payload) {
  unsigned char md[32];  // SHA-256
  unsigned int len = 0;
  if (EVP_Digest(payload.data(), payload.size(), md, &len, EVP_sha256(), nullptr) != 1 || len != sizeof md)
    throw error("idem: OpenSSL EVP_Digest(SHA-256) failed", false);
  return detail::to_hex(md, len);
}

}  // namespace idem
