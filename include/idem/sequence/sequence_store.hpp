#pragma once
/// @file sequence/sequence_store.hpp Out-of-order events, the vocabulary: the SequenceStore concept
/// (last applied sequence per entity, advanced by compare-and-set), the events and options a gate
/// takes, and the outcome it returns. Never includes the guard. Semantics: docs/ordering.md.

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/core.h>

#include "idem/core/error.hpp"
#include "idem/core/outcome.hpp"
#include "idem/core/record.hpp"
#include "idem/core/store.hpp"

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

/// A CompletesWithAdvance sequence store that can say before a run whether complete_advance will
/// take this key and entity (`q.check_complete_advance(s, key, entity)` throws usage_error if
/// not): SequenceGate asks before acquiring, so a refused event never runs its handler.
template <class Seq, class Store>
concept ChecksCompleteAdvance = requires(Seq& q, Store& s, std::string_view key) {
  q.check_complete_advance(s, key, key);
};

/// A sequence store that can advance inside the open transaction of a TransactionalStore
/// (PostgresSequenceStore with a transactional-mode PostgresStore): the advance commits or rolls
/// back with the handler's writes. SequenceGate uses it whenever `store.transactional()` is true.
template <class Seq, class Store>
concept AdvancesInTransaction =
    TransactionalStore<Store> && requires(Seq& q, const Store& s, transaction_t<Store>& tx, std::string_view entity,
                                          std::uint64_t seq) {
      { s.transactional() } -> std::convertible_to<bool>;
      { q.advance(tx, entity, seq) } -> std::same_as<AdvanceResult>;
    };

namespace detail {
/// Default limit on entity id length in bytes (SequenceGateOptions::max_entity_bytes overrides it).
inline constexpr std::size_t default_max_entity_bytes = 1024;

inline void check_entity(std::string_view entity, std::size_t max_bytes = default_max_entity_bytes) {
  if (entity.empty())
    throw invalid_entity_error(
        "idem: the entity id is empty; pass the id of the aggregate the sequence belongs to (account, order, ...)");
  if (entity.size() > max_bytes)
    throw invalid_entity_error(fmt::format("idem: the entity id is {} bytes, over the limit of {}; hash long ids or "
                                           "raise max_entity_bytes",
                                           entity.size(), max_bytes));
}
}  // namespace detail

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

}  // namespace idem
