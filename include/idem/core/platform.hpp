#pragma once
/// @file core/platform.hpp libcrypto's one-shot digest, declared here instead of through
/// <openssl/evp.h>, so that including idem does not pull OpenSSL's headers (and their macros) into
/// every consumer's compile. Not part of idem's API.
///
/// The declarations are OpenSSL 3's own (openssl/evp.h), so a file that includes both compiles;
/// the core still links libcrypto (idem::idem's OpenSSL::Crypto). tests/core/validation_test.cpp
/// includes the header after idem to keep that true. (<unistd.h>, which the guard needs for the
/// default owner, comes with libstdc++'s own <atomic> anyway.)

#include <cstddef>

extern "C" {
struct evp_md_st;
struct engine_st;
const struct evp_md_st* EVP_sha256(void);
int EVP_Digest(const void* data, std::size_t count, unsigned char* md, unsigned int* size,
               const struct evp_md_st* type, struct engine_st* impl);
}
