#pragma once
/// @file sequence.hpp Out-of-order events: the last applied sequence per entity, and SequenceGate,
/// which skips an event as Status::stale when a newer one of its entity was already applied.
/// Semantics and the Redis/PostgreSQL plan: docs/ordering.md.

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "idem/error.hpp"
#include "idem/guard.hpp"
#include "idem/detail/sharded_map.hpp"
#include "idem/memory_store.hpp"
#include "idem/observer.hpp"
#include "idem/outcome.hpp"
#include "idem/record.hpp"
#include "idem/store.hpp"

namespace idem {

/// The entity id given to a sequence store or gate is empty or too long: fix the call, do not retry.
class invalid_entity_error : public usage_error {
public:
  using usage_error::usage_error;
};

/// What one compare-and-set "advance only if newer" did.
struct AdvanceResult {
  bool advanced = false;                  ///< true: last applied is now the given seq; false: nothing changed
  std::optional<std::uint64_t> previous;  ///< last applied before the call; nullopt = none applied yet
};

/**
 * A store that keeps the last applied sequence per entity and advances it with one atomic
 * compare-and-set: `advance(entity, seq)` sets it to `seq` only when nothing was applied yet or
 * the stored value is strictly lower, and says what it found. An equal sequence never advances.
 * Any failure throws an idem::store_error; a store never reports an advance it did not make.
 * Implementations must be safe to call from many threads (and, for shared stores, processes).
 *
 * @code
 * idem::MemorySequenceStore seqs;
 * seqs.advance("account-7", 3);           // {advanced=true,  previous=nullopt}
 * seqs.advance("account-7", 2);           // {advanced=false, previous=3}
 * auto last = seqs.last_applied("account-7");   // 3
 * @endcode
 *
 * Redis (one Lua compare-and-set on a key with the entity's hash tag) and PostgreSQL
 * (`INSERT … ON CONFLICT … WHERE last_seq < $seq`) model it the same way; docs/ordering.md.
 */
template <class S>
concept SequenceStore = requires(S& s, std::string_view entity, std::uint64_t seq) {
  { s.last_applied(entity) } -> std::same_as<std::optional<std::uint64_t>>;
  { s.advance(entity, seq) } -> std::same_as<AdvanceResult>;
};

/// What a combined complete-and-advance did: the completion's status, and (status ok only) the advance.
struct CompleteAdvanceResult {
  WriteStatus status = WriteStatus::lease_lost;  ///< lease_lost: nothing was written, nothing advanced
  AdvanceResult advance;                         ///< the compare-and-set, made in the same atomic step
};

/// A sequence store that can complete a StateStore record and advance the entity in one atomic
/// step (RedisSequenceStore with RedisStore: one script). SequenceGate uses it when available,
/// so no crash can leave an event completed with its entity's sequence behind it.
template <class Seq, class Store>
concept CompletesWithAdvance = requires(Seq& q, Store& s, std::string_view key, const Holder& h,
                                        std::string_view result, millis retention, std::uint64_t seq) {
  { q.complete_advance(s, key, h, result, retention, key, seq) } -> std::same_as<CompleteAdvanceResult>;
};

namespace detail {
/// Default limit on entity id length in bytes (SequenceGateOptions::max_entity_bytes overrides it).
inline constexpr std::size_t default_max_entity_bytes = 1024;

inline void check_entity(std::string_view entity, std::size_t max_bytes = default_max_entity_bytes) {
  if (entity.empty())
    throw invalid_entity_error(
        "idem: the entity id is empty; pass the id of the aggregate the sequence belongs to (account, order, ...)");
  if (entity.size() > max_bytes)
    throw invalid_entity_error("idem: the entity id is " + std::to_string(entity.size()) +
                               " bytes, over the limit of " + std::to_string(max_bytes) +
                               "; hash long ids or raise max_entity_bytes");
}
}  // namespace detail

/// Options of MemorySequenceStore.
struct MemorySequenceStoreOptions {
  /// Number of independently locked shards; more shards, less contention. Must be > 0.
  std::size_t shards = 64;
  /// Upper bound on tracked entities (0 = unbounded). At the bound, advancing a new entity throws
  /// capacity_error: an entry is never evicted, since forgetting it would let stale events apply.
  std::size_t max_entities = 1'000'000;
};

/**
 * In-process SequenceStore: thread-safe, sharded (one mutex per shard), one entry per entity that
 * lives as long as the store (sequences have no retention: forgetting one would let an old event
 * apply again). Pair it with MemoryStore; like it, it protects one process only.
 */
class MemorySequenceStore {
public:
  /// Creates an empty store; throws invalid_options_error on zero shards.
  explicit MemorySequenceStore(MemorySequenceStoreOptions options = {}) : options_(options) {
    if (options_.shards == 0) throw invalid_options_error("idem: MemorySequenceStoreOptions::shards must be > 0");
    per_shard_cap_ = options_.max_entities == 0
                         ? 0
                         : std::max<std::size_t>(1, (options_.max_entities + options_.shards - 1) / options_.shards);
  }
  MemorySequenceStore(MemorySequenceStore&&) noexcept = default;             ///< Movable; not copyable.
  MemorySequenceStore& operator=(MemorySequenceStore&&) noexcept = default;  ///< Movable; not copyable.

  /// The last applied sequence of `entity`, or nullopt when none was applied.
  std::optional<std::uint64_t> last_applied(std::string_view entity) const {
    detail::check_entity(entity, static_cast<std::size_t>(-1));
    const Shard& sh = shard(entity);
    std::lock_guard lock(sh.mu);
    auto it = sh.map.find(entity);
    if (it == sh.map.end()) return std::nullopt;
    return it->second;
  }

  /// Atomic compare-and-set: sets `entity` to `seq` iff none applied yet or the stored one is < seq.
  AdvanceResult advance(std::string_view entity, std::uint64_t seq) {
    detail::check_entity(entity, static_cast<std::size_t>(-1));
    Shard& sh = shard(entity);
    std::lock_guard lock(sh.mu);
    auto it = sh.map.find(entity);
    if (it == sh.map.end()) {
      if (per_shard_cap_ != 0 && sh.map.size() >= per_shard_cap_)
        throw capacity_error("idem: MemorySequenceStore is full (max_entities=" +
                                 std::to_string(options_.max_entities) + "); raise max_entities",
                             "FULL");
      sh.map.emplace(std::string(entity), seq);
      return {true, std::nullopt};
    }
    const std::uint64_t prev = it->second;
    if (prev >= seq) return {false, prev};
    it->second = seq;
    return {true, prev};
  }

  /// Forgets `entity` (its next event of any sequence applies); true if it was tracked. For tests
  /// and for deleting an entity for good; never call it to "fix" a stale event.
  bool erase(std::string_view entity) {
    detail::check_entity(entity, static_cast<std::size_t>(-1));
    Shard& sh = shard(entity);
    std::lock_guard lock(sh.mu);
    auto it = sh.map.find(entity);
    if (it == sh.map.end()) return false;
    sh.map.erase(it);
    return true;
  }

  /// Number of tracked entities.
  [[nodiscard]] std::size_t size() const { return shards_.size(); }

private:
  using Shard = detail::ShardedMap<std::uint64_t>::Shard;

  Shard& shard(std::string_view entity) const noexcept { return shards_.shard(entity); }

  MemorySequenceStoreOptions options_;
  std::size_t per_shard_cap_ = 0;
  detail::ShardedMap<std::uint64_t> shards_{options_.shards};
};

static_assert(SequenceStore<MemorySequenceStore>);

/// One event as SequenceGate sees it. Use designated initialisers: key and entity are both strings.
struct SequencedEvent {
  std::string_view key;      ///< idempotency key of this event (its stable event id)
  std::string_view entity;   ///< the aggregate whose order matters (account id, order id, ...)
  std::uint64_t seq = 0;     ///< the event's position in its entity's history; higher = newer
  std::string_view payload;  ///< optional: fingerprinted like IdempotencyGuard::run(key, payload, h)
};

/// Options of SequenceGate. Every duration is in milliseconds.
struct SequenceGateOptions {
  /// false (default): gaps are allowed, any seq above the last applied one runs.
  /// true: only last + 1 runs (or `first` when none applied); a later seq answers in_flight with
  /// `gap = true` and retry_after = gap_retry_after, so the broker redelivers it after its predecessor.
  bool contiguous = false;
  /// contiguous: the sequence the first event of an entity must carry.
  std::uint64_t first = 1;
  /// contiguous: retry_after of an event whose predecessor has not been applied yet; >= 0.
  millis gap_retry_after{1'000};
  /// Longest accepted entity id in bytes; > 0.
  std::size_t max_entity_bytes = detail::default_max_entity_bytes;
};

/// Outcome of SequenceGate::run: the guard's Outcome plus what happened to the entity's sequence.
template <class T>
struct SequencedOutcome : Outcome<T> {
  /// The entity's last applied sequence after this call, as far as this call saw it (nullopt = none).
  /// stale: the value that made the event stale.
  std::optional<std::uint64_t> last_applied;
  /// True when this call advanced the entity's sequence to the event's seq.
  bool advanced = false;
  /// contiguous mode: the event is ahead of its entity (a predecessor is missing); status in_flight.
  bool gap = false;

  /// An empty outcome (status in_flight until set).
  SequencedOutcome() = default;
  /// Wraps a guard outcome.
  explicit SequencedOutcome(Outcome<T> base) : Outcome<T>(std::move(base)) {}
};

/**
 * Applies events in entity order on top of an IdempotencyGuard: an event whose sequence is not
 * newer than its entity's last applied one is skipped as Status::stale (handler not run, ack it);
 * otherwise it runs through the guard, and the sequence advances (compare-and-set) when the guard
 * reports executed — or duplicate, which repairs a crash between the completion and the advance.
 * When the sequence store CompletesWithAdvance on the guard's store (Redis), a lease-mode run
 * completes and advances in one atomic step instead, so there is no such crash window.
 * Thread-safe when the sequence store is; share one gate between workers. The store must outlive it.
 *
 * Concurrent events of one entity: the check before the handler and the advance after it are two
 * atomic steps, so two newer events can run at once. The one that finishes last with the lower
 * sequence still reports executed (its result is recorded under its key) with `advanced == false`,
 * and the sequence keeps the higher value: it never goes backwards. When an effect must never be
 * applied after a newer one, make it conditional on the sequence itself (docs/ordering.md).
 *
 * @code
 * idem::MemoryStore store;
 * idem::MemorySequenceStore seqs;
 * idem::IdempotencyGuard guard{store};
 * idem::SequenceGate gate{seqs};
 * auto out = gate.run(guard, {.key = ev.id, .entity = ev.account, .seq = ev.version},
 *                     [&] { set_status(ev.account, ev.status); });
 * if (out.action() == idem::BrokerAction::ack) consumer.ack(msg);  // stale is acked too
 * @endcode
 */
template <SequenceStore Seq>
class SequenceGate {
public:
  /// Binds to `store` (not owned); throws invalid_options_error when the options cannot work.
  explicit SequenceGate(Seq& store, SequenceGateOptions options = {}) : store_(&store), options_(options) {
    if (options_.max_entity_bytes == 0)
      throw invalid_options_error("idem: max_entity_bytes is 0; entity ids need at least one byte");
    if (options_.gap_retry_after < millis{0})
      throw invalid_options_error("idem: gap_retry_after is negative; use 0 to requeue at once");
  }

  /// Runs `handler` through `guard` unless `ev` is stale (or, contiguous, ahead of its entity).
  /// Throws invalid_entity_error / invalid_key_error on bad input, store errors as the guard does,
  /// and the handler's exceptions unchanged (the sequence is not advanced).
  template <StateStore Store, class F>
  auto run(IdempotencyGuard<Store>& guard, const SequencedEvent& ev, F&& handler) {
    using Base = decltype(guard.run(ev.key, handler));
    using R = typename outcome_traits<Base>::type;
    SequencedOutcome<R> out;
    detail::check_entity(ev.entity, options_.max_entity_bytes);
    detail::check_key(ev.key, guard.options().max_key_bytes);
    const auto started = std::chrono::steady_clock::now();

    const std::optional<std::uint64_t> last = store_->last_applied(ev.entity);
    out.last_applied = last;
    if (last && ev.seq <= *last) {
      out.status = Status::stale;
      report(guard, ev.key, Status::stale, started);
      return out;
    }
    if (options_.contiguous) {
      const std::uint64_t want = last ? *last + 1 : options_.first;
      if (ev.seq != want) {
        // Below `first` with nothing applied yet is a bad event, not a gap: it can never run.
        if (!last && ev.seq < options_.first) {
          out.status = Status::stale;
          report(guard, ev.key, Status::stale, started);
          return out;
        }
        out.status = Status::in_flight;
        out.gap = true;
        out.retry_after = options_.gap_retry_after;
        report(guard, ev.key, Status::in_flight, started);
        return out;
      }
    }

    std::optional<AdvanceResult> combined;  // set when the completion advanced in the same step
    if constexpr (CompletesWithAdvance<Seq, Store>) {
      auto complete = [&](const Holder& h, std::string_view encoded, millis retention) {
        CompleteAdvanceResult r =
            store_->complete_advance(guard.store(), ev.key, h, encoded, retention, ev.entity, ev.seq);
        if (r.status == WriteStatus::ok) combined = r.advance;
        return r.status;
      };
      out = SequencedOutcome<R>(guard.run_with_completion(ev.key, ev.payload, handler, complete));
    } else {
      out = SequencedOutcome<R>(ev.payload.empty() ? guard.run(ev.key, handler)
                                                   : guard.run(ev.key, ev.payload, handler));
    }
    out.last_applied = last;
    if (combined) {
      out.advanced = combined->advanced;
      out.last_applied = combined->advanced ? std::optional<std::uint64_t>(ev.seq) : combined->previous;
    } else if (out.status == Status::executed || out.status == Status::duplicate) {
      const AdvanceResult a = store_->advance(ev.entity, ev.seq);
      out.advanced = a.advanced;
      out.last_applied = a.advanced ? std::optional<std::uint64_t>(ev.seq) : a.previous;
    }
    return out;
  }

  /// Positional form of run(guard, SequencedEvent{key, entity, seq}, handler).
  template <StateStore Store, class F>
  auto run(IdempotencyGuard<Store>& guard, std::string_view key, std::string_view entity, std::uint64_t seq,
           F&& handler) {
    return run(guard, SequencedEvent{key, entity, seq, {}}, std::forward<F>(handler));
  }

  /// The last applied sequence of `entity` (nullopt = none).
  std::optional<std::uint64_t> last_applied(std::string_view entity) const {
    detail::check_entity(entity, options_.max_entity_bytes);
    return store_->last_applied(entity);
  }

  /// The options in force.
  [[nodiscard]] const SequenceGateOptions& options() const noexcept { return options_; }
  /// The sequence store this gate runs on.
  [[nodiscard]] Seq& store() const noexcept { return *store_; }

private:
  template <class O>
  struct outcome_traits;
  template <class T>
  struct outcome_traits<Outcome<T>> {
    using type = T;
  };

  // Outcomes decided by the gate itself reach the guard's observer too, so one CountingObserver
  // sees every delivery (the guard reports the ones it decides).
  template <class Store>
  static void report(IdempotencyGuard<Store>& guard, std::string_view key, Status s,
                     std::chrono::steady_clock::time_point started) {
    if (const auto& obs = guard.options().observer)
      obs->on_outcome(OutcomeEvent{key, s, std::chrono::steady_clock::now() - started, 0, false, false});
  }

  Seq* store_;
  SequenceGateOptions options_;
};

}  // namespace idem
