#pragma once
/// @file redis_store.hpp RedisStore: the StateStore on a Redis server, one Lua script per transition.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "idem/core/observer.hpp"
#include "idem/core/record.hpp"
#include "idem/core/store.hpp"

namespace idem {

/// Options of RedisStore. Every duration is in milliseconds; docs/redis.md explains each choice.
struct RedisOptions {
  /// `redis://[user[:password]@]host[:port][/db]` or `unix://[user[:password]@]/path[?db=N]`
  /// (user and password percent-decoded); when set it overrides host, port, unix_socket, user,
  /// password and db. Empty = use those fields. `rediss://` is refused: hiredis is built without TLS.
  std::string url;
  /// Server host name or address, used when unix_socket is empty.
  std::string host = "127.0.0.1";
  /// Server TCP port, 1..65535.
  int port = 6379;
  /// Path of the server's Unix socket; non-empty = connect there instead of host:port.
  std::string unix_socket;
  /// ACL user name (Redis 6+); empty = the `default` user (AUTH with the password alone).
  std::string user;
  /// Password for AUTH; empty = no AUTH.
  std::string password;
  /// Logical database index (SELECT), >= 0.
  int db = 0;
  /// Prepended to every idempotency key. No braces unless it is one whole `{tag}`, which pins every
  /// key to one cluster slot; without braces, a `{tag}` inside a user key decides the slot.
  std::string key_prefix = "idem:";
  /// Bound on establishing a connection (TCP connect); > 0.
  millis connect_timeout{1'000};
  /// Bound on one command's send and reply; > 0. A timed-out call throws timeout_error, retryable.
  millis command_timeout{1'000};
  /// Most connections kept open; each in-flight call holds one. > 0. Match the calling threads.
  std::size_t pool_size = 8;
  /// How long a call waits for a free connection when all pool_size are busy (0 = fail at once).
  millis pool_wait{1'000};
  /// Read `maxmemory-policy` at construction and warn through observer when it can evict keys.
  bool check_eviction_policy = true;
  /// Receives store advisories (on_warning); null = none.
  std::shared_ptr<Observer> observer;
};

/// Parses a `redis://` or `unix://` URL onto `base`; throws invalid_options_error naming the flaw.
RedisOptions parse_redis_url(std::string_view url, RedisOptions base = {});

/// One item of RedisStore::complete_batch: the key, the holder acquire returned, and the result.
struct CompleteItem {
  std::string_view key;    ///< the idempotency key
  Holder holder;           ///< the holder returned by acquire or acquire_batch
  std::string_view result; ///< encoded result to store
};

/**
 * StateStore on a Redis server (hiredis). Each transition is one Lua script run with EVALSHA —
 * one round trip, atomic on the server, timed by the server's `TIME` — and the scripts reload
 * themselves after `SCRIPT FLUSH` or a restart. Thread-safe (a connection pool), move-only.
 * Errors fail closed: connection_error / timeout_error (retryable), capacity_error (OOM under
 * noeviction), store_error with the Redis error prefix as code(), corrupt_record_error.
 *
 * @code
 * idem::RedisStore store{{.url = "redis://idem:secret@127.0.0.1:6379/0"}};
 * idem::IdempotencyGuard guard{store, {.lease = 30s, .retention = 24h}};
 * auto out = guard.run(msg.id, [&] { return handle(msg); });
 * @endcode
 */
class RedisStore {
public:
  /// Connects once (to fail fast), loads the scripts and checks the eviction policy.
  /// Throws invalid_options_error, connection_error / timeout_error, or store_error (e.g. WRONGPASS).
  explicit RedisStore(RedisOptions options = {});
  ~RedisStore();                                      ///< Closes every pooled connection.
  RedisStore(RedisStore&&) noexcept;                  ///< Movable; the moved-from store throws usage_error.
  RedisStore& operator=(RedisStore&&) noexcept;       ///< Movable; not copyable.
  RedisStore(const RedisStore&) = delete;             ///< A pool has one owner.
  RedisStore& operator=(const RedisStore&) = delete;  ///< A pool has one owner.

  /// Atomic acquire of DESIGN §1 in one round trip; see AcquireStatus for the outcomes.
  AcquireResult acquire(std::string_view key, const AcquireParams& p);
  /// Records the result if `h` still holds the key; else lease_lost and nothing changes.
  WriteStatus complete(std::string_view key, const Holder& h, std::string_view result, millis retention);
  /// Releases or records a failure if `h` still holds the key; else lease_lost.
  WriteStatus fail(std::string_view key, const Holder& h, const FailParams& f);
  /// Pushes the lease of a live holder to now + lease; lease_lost if taken over or gone.
  WriteStatus extend(std::string_view key, const Holder& h, millis lease);
  /// A snapshot of the live record, or nullopt if absent or expired. The owner is kept only while
  /// in_progress (it is diagnostics for a live holder; dropping it keeps retained records small).
  std::optional<Record> inspect(std::string_view key);

  /// Acquires many keys in one round trip, all with `p` (same lease, token, fingerprint): one
  /// script run per 256 keys, pipelined; each key decided exactly as by acquire(). Results are in
  /// key order. On an error reply it throws after reading every reply; keys acquired before it
  /// lapse after their lease (fail closed). Multi-key: on a future cluster, batch per hash slot.
  std::vector<AcquireResult> acquire_batch(std::span<const std::string_view> keys, const AcquireParams& p);
  /// Completes many keys in one round trip (as acquire_batch); statuses in item order.
  std::vector<WriteStatus> complete_batch(std::span<const CompleteItem> items, millis retention);

  /// The Redis key that holds `key`'s record: key_prefix + key (binary-safe).
  [[nodiscard]] std::string redis_key(std::string_view key) const;
  /// Redis Cluster slot (CRC16 of the `{hash tag}` if any, else of the whole key) of a Redis key.
  [[nodiscard]] static std::uint16_t hash_slot(std::string_view redis_key) noexcept;
  /// SHA1 of a script (`acquire`, `complete`, `fail`, `extend`, `inspect`, `acquire_batch`,
  /// `complete_batch`), as EVALSHA wants it.
  [[nodiscard]] std::string script_sha(std::string_view name) const;
  /// The server's `maxmemory-policy`, or "" when it cannot be read (e.g. CONFIG denied by ACL).
  [[nodiscard]] std::string eviction_policy();
  /// The options in force (URL applied).
  [[nodiscard]] const RedisOptions& options() const;

private:
  struct Impl;
  Impl& impl() const;
  std::unique_ptr<Impl> impl_;
};

static_assert(StateStore<RedisStore>);

}  // namespace idem
