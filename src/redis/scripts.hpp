#pragma once
// Internal to idem_redis: the one registry of idem's Lua scripts (name, source, SHA1), for both
// stores; the client loads them all and reloads one on NOSCRIPT.

#include <cstddef>
#include <string>
#include <string_view>

namespace idem::detail::redis {

enum class Script : std::size_t {
  acquire,
  complete,
  fail,
  extend,
  inspect,
  sequence_advance,
  complete_advance,
  many,  // several one-key steps in one call: auto-batching and every batch
};
inline constexpr std::size_t script_count = 8;

struct ScriptInfo {
  std::string_view name;
  std::string_view source;  // the generated script: its preludes (record.lua, ...) and its body
  std::string sha;          // SHA1 of source, as EVALSHA wants it
};

const ScriptInfo& script(Script s);

}  // namespace idem::detail::redis

struct redisReply;

namespace idem::detail::redis {

// Whether `s` only reads (inspect): no WAIT is sent after it.
constexpr bool reads_only(Script s) { return s == Script::inspect; }
// Whether the reply `r` of `s` says the script changed a record (took a key, completed, failed,
// extended, advanced a sequence): the answers whose loss in a failover matters, and so the ones
// min_replica_acks checks. A duplicate or in_flight answer changed nothing.
bool wrote(Script s, const redisReply* r);

std::string sha1_hex(std::string_view text);

}  // namespace idem::detail::redis
