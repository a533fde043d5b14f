// idem::fingerprint: SHA-256 through libcrypto, compiled here so that no idem header pulls
// OpenSSL's headers (and their macros) into a consumer's compile.
#include "idem/core/fingerprint.hpp"

#include <openssl/evp.h>

#include "idem/core/error.hpp"
#include "idem/core/hex.hpp"

namespace idem {

std::string fingerprint(std::string_view payload) {
  unsigned char md[32];  // SHA-256
  unsigned int len = 0;
  if (EVP_Digest(payload.data(), payload.size(), md, &len, EVP_sha256(), nullptr) != 1 || len != sizeof md)
    throw error("idem: OpenSSL EVP_Digest(SHA-256) failed", false);
  return detail::to_hex(md, len);
}

}  // namespace idem
