#pragma once
/// @file redis/admin.hpp RedisAdmin: the operator's view of a Redis store (inspect, list, fenced
/// release, stats, doctor), used by the `idem` command; docs/operations.md.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "idem/core/admin.hpp"
#include "idem/redis/options.hpp"

namespace idem {

/**
 * Admin access to the records of a RedisStore: a client of its own on the stores' Redis engine
 * (never a store's connections; TLS, Sentinel), a single server or a Redis Cluster (`redis-cluster://`: every master is scanned,
 * each key goes to its slot's master). Reads go through a script that decodes the record with the
 * stores' own codec on the server; release is one script that checks the fence. Not thread-safe.
 * Errors: invalid_options_error (URL), connection_error, store_error (code NOPERM for a missing
 * ACL permission), corrupt_record_error. remove_all() deletes whatever lies under the prefix,
 * idem's or not: it is for a prefix of one's own (`idem conformance`'s run), never a live store's.
 */
class RedisAdmin {
public:
  /// Connects to the server (or every master of the cluster; one PING each); the admin scripts load on first use.
  explicit RedisAdmin(RedisOptions options);
  ~RedisAdmin();                                    ///< Closes its connections.
  RedisAdmin(const RedisAdmin&) = delete;           ///< Owns connections.
  RedisAdmin& operator=(const RedisAdmin&) = delete;  ///< Owns connections.

  /// The record of `key` with the store clock, or nullopt when absent or expired.
  std::optional<AdminRecord> inspect(std::string_view key);
  /// Calls `each` for every record `filter` selects (each callback's record is gone after it
  /// returns), SCAN page by page on every master; `each` returns false to stop. Returns how many
  /// were passed. Records are read `filter.page` at a time, so memory does not grow with the store.
  std::size_t list(const ListFilter& filter, const std::function<bool(const AdminRecord&)>& each);
  /// Frees `key` (failed, retry at once, no holder) only if its fence is still `fence`, in one
  /// script; a live lease only with `force`.
  ReleaseResult release(std::string_view key, std::uint64_t fence, bool force);
  /// Counts by state, sizes and the most overdue lease, from one full pass.
  AdminStats stats();
  /// The settings that decide whether the guarantee holds: eviction, persistence, replicas, version,
  /// ACL permissions, cluster state.
  std::vector<Finding> doctor();
  /// Deletes every key under the key prefix on every master (SCAN, one DEL per key); returns how many.
  std::size_t remove_all();
  /// Runs the commands the scripts call as the URL's user on a probe key: the first ACL refusal's text, "" if none.
  std::string refused_script_command();
  /// "host:port" (or the socket) of each master it talks to, comma-separated.
  [[nodiscard]] std::string address() const;

private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem
