#pragma once
/// @file redis/sequence_store.hpp RedisSequenceStore: idem::SequenceStore on a Redis server — the last
/// applied sequence per entity under `<prefix>seq:{<entity>}`, advanced by one Lua compare-and-set.
/// docs/ordering.md ("Redis and PostgreSQL, as built") has the semantics.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "idem/redis/store.hpp"
#include "idem/sequence/sequence_store.hpp"

namespace idem {

/**
 * SequenceStore on Redis. One string key per entity, `<key_prefix>seq:{<entity>}`,
 * holding the decimal last applied sequence, with no TTL (a sequence is never forgotten: that
 * would let an old event apply again). `advance` is one Lua script run with EVALSHA (reloaded
 * after SCRIPT FLUSH or a restart) that compares the values as decimal strings, so the whole
 * uint64 range is exact; `last_applied` is one GET.
 *
 * The entity sits in a hash tag, so on a future Redis Cluster an idempotency key tagged the same
 * way (`{acct-42}:evt-9`) lands in the entity's slot. An entity containing `}` ends its tag early
 * (the key is still distinct per entity, the slot is then that of the prefix of the entity).
 *
 * Its calls travel on its RedisClient's engine, as RedisStore's: every store built on one client
 * shares its connections and loop thread, so a gate's advance may leave auto-batched with the
 * guard's steps. key_prefix is the client's.
 * Thread-safe, move-only (a moved-from store throws usage_error). Errors fail closed, typed like RedisStore's: connection_error /
 * timeout_error (retryable), capacity_error (OOM), store_error with the Redis error prefix as
 * code(), corrupt_record_error (the key holds something else), invalid_entity_error (empty or
 * over-long entity).
 *
 * @code
 * idem::RedisStore store{{.url = "redis://127.0.0.1:6379/0"}};
 * idem::RedisSequenceStore seqs{store};  // the same client, so complete_advance works
 * idem::IdempotencyGuard guard{store};
 * idem::SequenceGate gate{seqs};
 * auto out = gate.run(guard, {.key = ev.id, .entity = ev.account, .seq = ev.version}, handler);
 * @endcode
 */
class RedisSequenceStore : public detail::redis::ClientHandle {
public:
  /// On the client and connection of `store` (shared, not copied): what complete_advance(store, ...) requires.
  explicit RedisSequenceStore(RedisStore& store);
  /// Over a client shared with other stores (and its connections).
  explicit RedisSequenceStore(std::shared_ptr<RedisClient> client);
  /// Builds its own RedisClient (connects once to fail fast). Throws invalid_options_error,
  /// connection_error / timeout_error, or store_error (e.g. WRONGPASS, NOPERM). It cannot
  /// complete_advance for a RedisStore, which has a client of its own.
  explicit RedisSequenceStore(RedisOptions options);

  /// The last applied sequence of `entity` (one GET), or nullopt when none was applied.
  std::optional<std::uint64_t> last_applied(std::string_view entity);
  /// Atomic compare-and-set (one EVALSHA): sets `entity` to `seq` iff none applied yet or the
  /// stored value is strictly lower. `previous` is the value the script found.
  AdvanceResult advance(std::string_view entity, std::uint64_t seq);
  /// RedisStore::complete(key, h, result, retention) and advance(entity, seq) in one atomic script:
  /// SequenceGate calls it, so no crash can separate the two. `store` must run on this store's
  /// client (build this store from it; usage_error otherwise). Lease lost: nothing written. A damaged sequence key: the
  /// result is recorded, then corrupt_record_error / store_error is thrown (the key is not touched).
  CompleteAdvanceResult complete_advance(RedisStore& store, std::string_view key, const Holder& h,
                                         std::string_view result, millis retention, std::string_view entity,
                                         std::uint64_t seq);
  /// What complete_advance(store, key, ..., entity, ...) would refuse before sending, checked
  /// before the run starts (SequenceGate calls it before acquiring, so a refused event never runs
  /// its handler): `store` on another client, or on a cluster the key and the entity's sequence in
  /// two slots (usage_error naming the hash tag to use).
  void check_complete_advance(RedisStore& store, std::string_view key, std::string_view entity);
  /// Deletes the entity's sequence (its next event of any sequence applies); true if it existed.
  /// For tests and for deleting an entity for good, never to "fix" a stale event.
  bool erase(std::string_view entity);

  /// Operational diagnostics: the Redis key that holds `entity`'s sequence
  /// (key_prefix + "seq:{" + entity + "}", binary-safe), for redis-cli.
  [[nodiscard]] std::string sequence_key(std::string_view entity) const;

  ~RedisSequenceStore();  ///< The client's connections close with the client's last store.
  RedisSequenceStore(RedisSequenceStore&&) noexcept;             ///< Movable; the moved-from store throws usage_error.
  RedisSequenceStore& operator=(RedisSequenceStore&&) noexcept;  ///< Movable.

private:
  detail::asio_redis::EngineStore& core() const;
  const char* unpaired(const RedisStore& store) const;
  std::shared_ptr<detail::asio_redis::RedisCore> core_;
};

static_assert(SequenceStore<RedisSequenceStore>);
static_assert(CompletesWithAdvance<RedisSequenceStore, RedisStore>);

}  // namespace idem
