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
  acquire_batch,
  complete_batch,
  sequence_advance,
  complete_advance,
};
inline constexpr std::size_t script_count = 9;

struct ScriptInfo {
  std::string_view name;
  std::string_view source;  // the generated script: its preludes (record.lua, ...) and its body
  std::string sha;          // SHA1 of source, as EVALSHA wants it
};

const ScriptInfo& script(Script s);

std::string sha1_hex(std::string_view text);

}  // namespace idem::detail::redis
