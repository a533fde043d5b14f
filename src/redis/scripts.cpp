// The script registry (scripts.hpp) over the sources embed_lua.cmake generates.

#include "scripts.hpp"

#include <array>

#include <hiredis/hiredis.h>
#include <openssl/evp.h>

#include "idem/core/error.hpp"
#include "idem/core/hex.hpp"
#include "idem_redis_scripts.hpp"
#include "seq/idem_redis_scripts.hpp"

namespace idem::detail::redis {

std::string sha1_hex(std::string_view text) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_Digest(text.data(), text.size(), md, &len, EVP_sha1(), nullptr) != 1)
    throw error("idem: OpenSSL EVP_Digest(SHA-1) failed", false);
  return to_hex(md, len);
}

namespace {

// In Script's order.
constexpr std::array<std::pair<std::string_view, std::string_view>, script_count> sources{{
    {"acquire", redis_lua::acquire},
    {"complete", redis_lua::complete},
    {"fail", redis_lua::fail},
    {"extend", redis_lua::extend},
    {"inspect", redis_lua::inspect},
    {"sequence_advance", redis_lua::sequence_advance},
    {"complete_advance", redis_lua::complete_advance},
    {"many", redis_lua::many},
}};

}  // namespace

const ScriptInfo& script(Script s) {
  // Hashed once, on first use (the first client).
  static const std::array<ScriptInfo, script_count> registry = [] {
    std::array<ScriptInfo, script_count> r;
    for (std::size_t i = 0; i < script_count; ++i) r[i] = {sources[i].first, sources[i].second, sha1_hex(sources[i].second)};
    return r;
  }();
  return registry[static_cast<std::size_t>(s)];
}

namespace {
bool first_is_one(const redisReply* r) {
  return r->type == REDIS_REPLY_ARRAY && r->elements > 0 && r->element[0]->type == REDIS_REPLY_INTEGER &&
         r->element[0]->integer == 1;
}
bool is_one(const redisReply* r) { return r->type == REDIS_REPLY_INTEGER && r->integer == 1; }
template <class P>
bool any_element(const redisReply* r, P p) {
  if (r->type != REDIS_REPLY_ARRAY) return false;
  for (std::size_t i = 0; i < r->elements; ++i)
    if (p(r->element[i])) return true;
  return false;
}
}  // namespace

// The reply shapes are the scripts' (src/redis/lua/*.lua): acquire 1 (a new key) or {1 acquired,
// ...}; complete, fail, extend 1; sequence_advance {1 advanced, previous}; complete_advance
// {1 completed, ...}.
bool wrote(Script s, const redisReply* r) {
  const auto acquired = [](const redisReply* e) { return is_one(e) || first_is_one(e); };
  switch (s) {
    case Script::acquire: return acquired(r);
    case Script::sequence_advance:
    case Script::complete_advance: return first_is_one(r);
    case Script::complete:
    case Script::fail:
    case Script::extend: return is_one(r);
    case Script::many: return any_element(r, acquired);  // an acquire's 1 or {1, ...}, a write's 1
    case Script::inspect: return false;
  }
  return true;  // not reached; a script not listed is taken as a write
}

}  // namespace idem::detail::redis
