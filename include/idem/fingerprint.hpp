#pragma once
/// @file fingerprint.hpp Payload fingerprints: hex SHA-256 through OpenSSL's libcrypto.

#include <openssl/evp.h>

#include <string>
#include <string_view>

#include "idem/error.hpp"

namespace idem {

/// Lower-case hex SHA-256 of `payload` (64 characters); also a way to shorten over-long keys.
inline std::string fingerprint(std::string_view payload) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_Digest(payload.data(), payload.size(), md, &len, EVP_sha256(), nullptr) != 1)
    throw error("idem: OpenSSL EVP_Digest(SHA-256) failed", false);
  static constexpr char hex[] = "0123456789abcdef";
  std::string out(static_cast<std::size_t>(len) * 2, '\0');
  for (unsigned int i = 0; i < len; ++i) {
    out[2 * i] = hex[md[i] >> 4];
    out[2 * i + 1] = hex[md[i] & 0xf];
  }
  return out;
}

}  // namespace idem
