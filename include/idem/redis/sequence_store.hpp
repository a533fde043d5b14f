#pragma once
/// @file redis_sequence.hpp RedisSequenceStore: idem::SequenceStore on a Redis server — the last
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
 * SequenceStore on Redis (hiredis). One string key per entity, `<key_prefix>seq:{<entity>}`,
 * holding the decimal last applied sequence, with no TTL (a sequence is never forgotten: that
 * would let an old event apply again). `advance` is one Lua script run with EVALSHA (reloaded
 * after SCRIPT FLUSH or a restart) that compares the values as decimal strings, so the whole
 * uint64 range is exact; `last_applied` is one GET.
 *
 * The entity sits in a hash tag, so on a future Redis Cluster an idempotency key tagged the same
 * way (`{acct-42}:evt-9`) lands in the entity's slot. An entity containing `}` ends its tag early
 * (the key is still distinct per entity, the slot is then that of the prefix of the entity).
 *
 * The store takes its own RedisOptions and owns a small connection pool of its own (RedisStore's
 * pool is private to it); the same options as the RedisStore's work, and key_prefix is shared.
 * Thread-safe, move-only. Errors fail closed, typed like RedisStore's: connection_error /
 * timeout_error (retryable), capacity_error (OOM), store_error with the Redis error prefix as
 * code(), corrupt_record_error (the key holds something else), invalid_entity_error (empty or
 * over-long entity).
 *
 * @code
 * idem::RedisStore store{{.url = "redis://127.0.0.1:6379/0"}};
 * idem::RedisSequenceStore seqs{{.url = "redis://127.0.0.1:6379/0"}};
 * idem::IdempotencyGuard guard{store};
 * idem::SequenceGate gate{seqs};
 * auto out = gate.run(guard, {.key = ev.id, .entity = ev.account, .seq = ev.version}, handler);
 * @endcode
 */
class RedisSequenceStore {
public:
  /// Connects once (to fail fast) and loads the script. Throws invalid_options_error,
  /// connection_error / timeout_error, or store_error (e.g. WRONGPASS, NOPERM).
  explicit RedisSequenceStore(RedisOptions options = {});
  ~RedisSequenceStore();                                              ///< Closes the pooled connections.
  RedisSequenceStore(RedisSequenceStore&&) noexcept;                  ///< Movable; the moved-from store throws usage_error.
  RedisSequenceStore& operator=(RedisSequenceStore&&) noexcept;       ///< Movable; not copyable.
  RedisSequenceStore(const RedisSequenceStore&) = delete;             ///< A pool has one owner.
  RedisSequenceStore& operator=(const RedisSequenceStore&) = delete;  ///< A pool has one owner.

  /// The last applied sequence of `entity` (one GET), or nullopt when none was applied.
  std::optional<std::uint64_t> last_applied(std::string_view entity);
  /// Atomic compare-and-set (one EVALSHA): sets `entity` to `seq` iff none applied yet or the
  /// stored value is strictly lower. `previous` is the value the script found.
  AdvanceResult advance(std::string_view entity, std::uint64_t seq);
  /// RedisStore::complete(key, h, result, retention) and advance(entity, seq) in one atomic script:
  /// SequenceGate calls it, so no crash can separate the two. `store` must be on the same server
  /// and db (usage_error otherwise). Lease lost: nothing written. A damaged sequence key: the
  /// result is recorded, then corrupt_record_error / store_error is thrown (the key is not touched).
  CompleteAdvanceResult complete_advance(RedisStore& store, std::string_view key, const Holder& h,
                                         std::string_view result, millis retention, std::string_view entity,
                                         std::uint64_t seq);
  /// Deletes the entity's sequence (its next event of any sequence applies); true if it existed.
  /// For tests and for deleting an entity for good, never to "fix" a stale event.
  bool erase(std::string_view entity);

  /// The Redis key of `entity`'s sequence: key_prefix + "seq:{" + entity + "}" (binary-safe).
  [[nodiscard]] std::string sequence_key(std::string_view entity) const;
  /// SHA1 of the compare-and-set script, as EVALSHA wants it.
  [[nodiscard]] const std::string& script_sha() const;
  /// The compare-and-set script's source (record.lua prelude included), e.g. for redis-cli --eval.
  [[nodiscard]] static std::string_view script_source() noexcept;
  /// SHA1 of the complete-and-advance script (complete_advance.lua).
  [[nodiscard]] const std::string& complete_advance_sha() const;
  /// The options in force (URL applied).
  [[nodiscard]] const RedisOptions& options() const;

private:
  struct Impl;
  Impl& impl() const;
  std::unique_ptr<Impl> impl_;
};

static_assert(SequenceStore<RedisSequenceStore>);
static_assert(CompletesWithAdvance<RedisSequenceStore, RedisStore>);

}  // namespace idem
