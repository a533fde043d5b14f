// Error mapping (client.hpp): Redis error replies and socket failures to idem's typed errors, each
// with the advice that fits it.

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include <fmt/format.h>

#include "client.hpp"
#include "idem/core/error.hpp"

namespace idem::detail::redis {

const ReplyErrorHints store_hints{
    "; delete or repair the key, idem will not guess its state",
    "; the server is at maxmemory under noeviction: raise maxmemory or lower retention",
    "; the ACL user needs EVALSHA, SCRIPT LOAD and access to the key prefix (docs/redis.md)", "RedisStore", false};

// IDEMUSAGE comes from sequence_advance.lua refusing its arguments.
const ReplyErrorHints sequence_hints{
    "; delete or repair the key, idem will not guess the last applied sequence",
    "; the server is at maxmemory under noeviction: raise maxmemory",
    "; the ACL user needs EVALSHA, SCRIPT LOAD, GET, SET and DEL on the key prefix", "idem", true};

std::string ms(millis d) { return fmt::format("{} ms", d.count()); }

void throw_reply_error(std::string_view text, std::string_view what, const ReplyErrorHints& hints) {
  const std::string code(error_code(text));
  const std::string msg = fmt::format("idem: Redis refused {}: {}", what, text);
  if (code == "IDEMCORRUPT")
    // min: a bare "IDEMCORRUPT" (no text after the code) is still a corrupt record, not std::out_of_range.
    throw corrupt_record_error(
        fmt::format("idem: {}: {}{}", what, text.substr(std::min(text.size(), code.size() + 1)), hints.corrupt));
  if (hints.usage_code && code == "IDEMUSAGE") throw usage_error(msg);
  if (code == "OOM") throw capacity_error(fmt::format("{}{}", msg, hints.oom), code, true);
  if (code == "READONLY")
    throw store_error(fmt::format("{}; the server is a read-only replica (failover in progress?): point idem at the "
                                  "primary",
                                  msg),
                      code, true);
  if (code == "NOAUTH" || code == "WRONGPASS")
    throw store_error(
        fmt::format("{}; authentication failed: set RedisOptions::user/password (or the URL) to credentials the "
                    "server accepts",
                    msg),
        code,
        false);
  if (code == "NOPERM") throw store_error(fmt::format("{}{}", msg, hints.noperm), code, false);
  if (code == "WRONGTYPE")
    throw store_error(fmt::format("{}; another application wrote a non-string value under idem's key prefix: use a "
                                  "prefix of idem's own",
                                  msg),
                      code, false);
  if (code == "LOADING" || code == "BUSY" || code == "MASTERDOWN" || code == "TRYAGAIN" || code == "CLUSTERDOWN")
    throw store_error(fmt::format("{}; the server is temporarily unable to serve, retry later", msg), code, true);
  // min-replicas-to-write unmet: nothing was written (Redis checks before the script's first
  // write, and a script that fails there writes nothing), and the replicas may come back.
  if (code == "NOREPLICAS")
    throw store_error(fmt::format("{}; the primary has fewer replicas than min-replicas-to-write, retry later", msg),
                      code, true);
  if (code == "MOVED" || code == "ASK")
    throw store_error(fmt::format("{}; this is a Redis Cluster node: connect with "
                                  "redis-cluster://host:port[,host:port...] (RedisOptions::cluster_nodes) so {} routes "
                                  "by slot",
                                  msg, hints.who),
                      code, false);
  if (code == "CROSSSLOT")
    throw store_error(
        fmt::format("{}; the keys of one call hash to different cluster slots: give them one {{hash tag}}", msg), code,
        false);
  if (text.find("max number of clients") != std::string_view::npos) throw connection_error(msg, code, true);
  throw store_error(msg, code, false);
}

void throw_bad_reply(std::string_view what) {
  throw store_error(fmt::format("idem: unexpected Redis reply to {}", what), "", false);
}

void throw_io_error(const IoFailure& f, bool maybe_ran) {
  const std::string msg = fmt::format(
      "idem: {}{}", f.text,
      maybe_ran ? "; the command may or may not have run, so nothing is assumed (retry later)" : "; retry later");
  if (f.timed_out) throw timeout_error(msg, "", true);
  throw connection_error(msg, "", true);
}

void throw_outcome_unknown(const IoFailure& first, std::string_view what, std::string_view second, std::string code) {
  throw outcome_unknown_error(fmt::format("idem: the outcome of {} is unknown: {}, and sending it once more as the "
                                          "same holder did not settle it ({}); it may or may not have been written. "
                                          "Nothing is assumed: a key it acquired lapses after its lease, a completion "
                                          "it made stands",
                                          what, first.text, second),
                              std::move(code));
}

}  // namespace idem::detail::redis
