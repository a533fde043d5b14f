#pragma once
/// @file redis/store.hpp RedisStore: the StateStore on a Redis server, one Lua script per transition.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "idem/core/batch_store.hpp"
#include "idem/core/record.hpp"
#include "idem/core/store.hpp"
#include "idem/redis/client.hpp"
#include "idem/redis/options.hpp"
#include "idem/redis/transport.hpp"

namespace idem {

namespace detail::asio_redis {
class EngineStore;
struct RedisCore;
}  // namespace detail::asio_redis

/**
 * StateStore on a Redis server. Each transition is one Lua script run with EVALSHA —
 * one round trip, atomic on the server, timed by the server's `TIME` — and the scripts reload
 * themselves after `SCRIPT FLUSH` or a restart. Its calls travel on one multiplexed connection per
 * server (per master on a cluster), the transport AsyncRedisStore uses, driven by a thread of its
 * RedisClient's (every store on one client shares them): a caller that finds a connection idle writes and reads on its own thread (no
 * hand-off; off a cluster up to pool.size callers at once, each on a connection opened for it),
 * callers past that are pipelined and auto-batched on the first (RedisOptions::auto_batch). The
 * RedisClient it is built over (its own, or one shared with other stores; client() gives it)
 * checks the server at construction and opens the connections. Thread-safe, move-only (a moved-from store throws usage_error).
 * Errors fail closed: connection_error / timeout_error (retryable), capacity_error (OOM under
 * noeviction), store_error with the Redis error prefix as code(), corrupt_record_error. A write
 * whose reply was lost is sent once more as the same holder (the scripts answer a step already
 * made as made); if that does not settle it, outcome_unknown_error.
 *
 * @code
 * idem::RedisStore store{{.url = "redis://idem:secret@127.0.0.1:6379/0"}};
 * idem::IdempotencyGuard guard{store, {.lease = 30s, .retention = 24h}};
 * auto out = guard.run(msg.id, [&] { return handle(msg); });
 * @endcode
 */
class RedisStore : public detail::redis::ClientHandle {
public:
  /// Builds its own RedisClient (connects once to fail fast, loads the scripts), then reads the
  /// server's settings (one round trip): a `maxmemory` with an evicting `maxmemory-policy` throws
  /// store_error (code `EVICTION`, not retryable) unless RedisOptions::unsafe_allow_eviction; the
  /// limits come from `proto-max-bulk-len`. Settings CONFIG GET cannot read (ACL) are warned about
  /// through the observer. Throws invalid_options_error, connection_error / timeout_error, or
  /// store_error (e.g. WRONGPASS).
  explicit RedisStore(RedisOptions options = {});
  /// A store over a client shared with other stores (e.g. a RedisSequenceStore); checks the server as above.
  explicit RedisStore(std::shared_ptr<RedisClient> client);
  ~RedisStore();                                   ///< The client's connections close with the client's last store.
  RedisStore(RedisStore&&) noexcept;               ///< Movable; the moved-from store throws usage_error.
  RedisStore& operator=(RedisStore&&) noexcept;    ///< Movable.

  /// Atomic acquire in one round trip; see AcquireStatus for the outcomes.
  AcquireResult acquire(std::string_view key, const AcquireParams& p);
  /// Records the result if `h` still holds the key; else lease_lost and nothing changes.
  WriteStatus complete(std::string_view key, const Holder& h, std::string_view result, millis retention);
  /// Releases or records a failure if `h` still holds the key; else lease_lost.
  WriteStatus fail(std::string_view key, const Holder& h, const FailParams& f);
  /// Completes without the result (it could not be stored): `reason` is kept instead, later
  /// acquires answer duplicate with result_unavailable. Holder-checked like complete.
  WriteStatus complete_unavailable(std::string_view key, const Holder& h, std::string_view reason, millis retention);
  /// Pushes the lease of a live holder to now + lease; lease_lost if taken over or gone.
  WriteStatus extend(std::string_view key, const Holder& h, millis lease);
  /// A snapshot of the live record, or nullopt if absent or expired. The owner is kept only while
  /// in_progress (it is diagnostics for a live holder; dropping it keeps retained records small).
  std::optional<Record> inspect(std::string_view key);

  /// Decides each request exactly as acquire() would (BatchStore): completed records are read
  /// first with one MGET per 256 keys (skipped for 7 batches after one that found none), the rest
  /// leave at once as many.lua calls of up to auto_batch steps (per slot on a cluster), pipelined;
  /// results in request order. On an error it throws after every answer; keys acquired meanwhile
  /// lapse after their lease (fail closed).
  std::vector<AcquireResult> acquire_many(std::span<const AcquireRequest> requests);

  /// The writes of one batch (BatchWriter): complete() and fail() send their request at once
  /// (auto-batched with what else is queued; with min_replica_acks each call carries its WAIT)
  /// and return; finish() waits for every answer, statuses in the order of the writes. An answer
  /// lost is asked again as the same holder. One thread.
  class BatchWriter {
  public:
    BatchWriter(BatchWriter&&) noexcept;             ///< Movable.
    BatchWriter& operator=(BatchWriter&&) noexcept;  ///< Movable.
    ~BatchWriter();                                  ///< Unanswered writes stay sent; their answers are dropped.
    /// Sends the completion of `key` by `h` now.
    void complete(std::string_view key, const Holder& h, std::string_view result, millis retention);
    /// Sends the failure (or release) of `key` by `h` now.
    void fail(std::string_view key, const Holder& h, const FailParams& f);
    /// Every answer, in the order of the writes; throws what a write could not settle.
    std::vector<WriteStatus> finish();
    /// A write could not be sent (the connection broke): run_batch runs no more handlers.
    [[nodiscard]] bool broken() const noexcept;

  private:
    friend class RedisStore;
    struct Impl;
    explicit BatchWriter(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
  };
  /// A writer for one batch (BatchStore).
  BatchWriter batch_writer();

  /// Acquires many keys, all with `p` (same lease, token, fingerprint), as acquire_many does;
  /// each key decided exactly as by acquire(). Results are in key order. On an error reply it throws after reading every reply;
  /// keys acquired before it lapse after their lease (fail closed). The guard's run_batch uses
  /// acquire_many (a token per message) instead.
  std::vector<AcquireResult> acquire_batch(std::span<const std::string_view> keys, const AcquireParams& p);
  /// Completes many keys, pipelined and auto-batched as acquire_many; statuses in item order.
  std::vector<WriteStatus> complete_batch(std::span<const CompleteItem> items, millis retention);

  /// Operational diagnostics: the Redis key that holds `key`'s record (key_prefix + key,
  /// binary-safe), for redis-cli.
  [[nodiscard]] std::string redis_key(std::string_view key) const;
  /// The server's `maxmemory-policy`, or "" when it cannot be read (e.g. CONFIG denied by ACL).
  [[nodiscard]] std::string eviction_policy();
  /// What one call can carry, from the server's `proto-max-bulk-len` read at construction (512 MiB
  /// when unreadable) less 1 MiB for the other arguments (and, for keys, the key prefix).
  [[nodiscard]] StoreLimits limits() const noexcept { return limits_; }

  /// Counters of the client's connections, shared by its stores (thread-safe): requests, writes,
  /// reconnects, resends, steps coalesced with other callers'.
  [[nodiscard]] AsyncRedisStats stats() const noexcept;

private:
  friend class RedisSequenceStore;  // built from a store, it sends on the store's connection
  detail::asio_redis::EngineStore& core() const;
  StoreLimits limits_;
  std::shared_ptr<detail::asio_redis::RedisCore> core_;
};

static_assert(StateStore<RedisStore>);
static_assert(HasStoreLimits<RedisStore>);
static_assert(CompletesUnavailable<RedisStore>);
static_assert(BatchStore<RedisStore>);

}  // namespace idem
