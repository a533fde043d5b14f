#pragma once
/// @file postgres_sequence.hpp PostgresSequenceStore: idem::SequenceStore on PostgreSQL — one row
/// per entity, advanced by one `INSERT … ON CONFLICT … DO UPDATE … WHERE` statement — and
/// run_sequenced(), which advances inside a transactional-mode transaction so the advance commits
/// with the business write (or not at all). docs/ordering.md ("Redis and PostgreSQL, as built").

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "idem/codec.hpp"
#include "idem/error.hpp"
#include "idem/guard.hpp"
#include "idem/postgres_store.hpp"
#include "idem/sequence.hpp"

namespace idem {

/// Options of PostgresSequenceStore. Durations are milliseconds.
struct PostgresSequenceOptions {
  /// libpq conninfo or URI, as PostgresOptions::conninfo (use the PostgresStore's own).
  std::string conninfo;
  /// Schema of the table: [a-z_][a-z0-9_]*, at most 63 bytes, not pg_*; created if missing.
  std::string schema = "idem";
  /// Table of sequences: [a-z_][a-z0-9_]*, at most 63 bytes, not pg_*.
  std::string table = "idem_sequences";
  /// Most connections of the store's own pool (lease-mode calls; the in-transaction advance uses
  /// the transaction's connection); > 0.
  std::size_t pool_size = 4;
  /// How long a call waits for a free pooled connection before timeout_error; 0 = no limit.
  millis pool_wait{10'000};
  /// Session statement_timeout of the pooled connections; 0 = none.
  millis statement_timeout{30'000};
  /// Create the schema and table on first use; false = call migrate() from a deploy step.
  bool auto_migrate = true;
};

/**
 * SequenceStore on PostgreSQL (libpq). Table `<schema>.<table> (entity bytea PRIMARY KEY,
 * last_seq numeric(20,0) NOT NULL)`: bytea keeps entity ids binary-safe, numeric(20,0) the full
 * uint64 range. `advance` is one statement, atomic by itself:
 *
 * @code{.sql}
 * INSERT INTO t AS s (entity, last_seq) VALUES ($1, $2)
 * ON CONFLICT (entity) DO UPDATE SET last_seq = EXCLUDED.last_seq WHERE s.last_seq < EXCLUDED.last_seq
 * RETURNING …
 * @endcode
 *
 * The store owns a small pool of its own (PostgresStore's is private to it); give it the same
 * conninfo. Thread-safe; move-only. Errors fail closed with the SQLSTATE as code(), mapped like
 * PostgresStore's: connection_error (08…), timeout_error (57014, 55P03), capacity_error (53…),
 * store_error (retryable for 40…/55…/57…), invalid_entity_error, corrupt_record_error.
 *
 * In transactional mode, advance(tx, entity, seq) runs the same statement on the guard's open
 * transaction: the row lock it takes serialises the entity's events until commit, and a rollback
 * (handler exception) undoes it with the business writes. run_sequenced() packages that.
 */
class PostgresSequenceStore {
public:
  /// Validates the options (invalid_options_error); connects on first use.
  explicit PostgresSequenceStore(PostgresSequenceOptions options = {});
  ~PostgresSequenceStore();                                                 ///< Closes the pooled connections.
  PostgresSequenceStore(PostgresSequenceStore&&) noexcept;                  ///< Movable; not copyable.
  PostgresSequenceStore& operator=(PostgresSequenceStore&&) noexcept;       ///< Movable; not copyable.
  PostgresSequenceStore(const PostgresSequenceStore&) = delete;             ///< A pool has one owner.
  PostgresSequenceStore& operator=(const PostgresSequenceStore&) = delete;  ///< A pool has one owner.

  /// The last applied sequence of `entity`, or nullopt when none was applied.
  std::optional<std::uint64_t> last_applied(std::string_view entity);
  /// Atomic compare-and-set in its own (implicit) transaction: sets `entity` to `seq` iff none
  /// applied yet or the stored value is strictly lower. When advanced, `previous` is the value the
  /// statement's snapshot saw (under a concurrent advance it can be lower than the value replaced).
  AdvanceResult advance(std::string_view entity, std::uint64_t seq);
  /// The same compare-and-set inside an open transactional-mode transaction (`*ctx.tx`): commits
  /// or rolls back with it. The entity's row stays locked until then, so concurrent events of the
  /// entity wait (statement_timeout / lock_timeout bound the wait). Throws usage_error if `tx` is
  /// not open. The caller decides what "not advanced" means; run_sequenced() answers stale.
  AdvanceResult advance(PostgresStore::transaction& tx, std::string_view entity, std::uint64_t seq);
  /// Deletes the entity's row (its next event of any sequence applies); true if it existed.
  /// For tests and deleting an entity for good, never to "fix" a stale event.
  bool erase(std::string_view entity);

  /// Creates the schema and table now (idempotent; serialised by an advisory lock).
  void migrate();
  /// The options in force.
  [[nodiscard]] const PostgresSequenceOptions& options() const;
  /// The schema-qualified, quoted table name, for queries of your own.
  [[nodiscard]] const std::string& qualified_table() const;

private:
  struct Impl;
  Impl& impl() const;
  std::unique_ptr<Impl> impl_;
};

static_assert(SequenceStore<PostgresSequenceStore>);

/**
 * Runs `handler` through a transactional-mode `guard` with the entity's sequence advanced in the
 * same transaction, before the handler: the business writes (through ctx.tx), the advance and the
 * idempotency record commit together, or — on a handler exception — roll back together.
 *
 * 1. `last_applied(entity) >= seq` → Status::stale at once (no transaction, no record).
 * 2. Otherwise the guard claims the key and, inside its transaction, advance(tx, entity, seq):
 *    not advanced (a newer event of the entity committed meanwhile) → the handler does not run,
 *    the transaction rolls back (the key is released, no failure counted) and the outcome is
 *    Status::stale; a redelivery answers stale at step 1. Advanced → the handler runs.
 *    With `options.contiguous` (deltas: payments, counters), step 1 also answers Status::in_flight
 *    with `gap = true` and `retry_after = options.gap_retry_after` when `seq` is not
 *    `last_applied + 1` (or `options.first` for a new entity): requeue it, it runs once its
 *    predecessor has committed. No transaction is opened and nothing is recorded for it.
 * 3. Guard outcomes pass through; a duplicate replays the stored value. The handler's exceptions
 *    propagate after the guard's failure policy, with the advance rolled back. `advanced` is true
 *    only when this call's advance committed.
 *
 * The stored result is the handler's, encoded by codec<R> as guard.run stores it. The handler takes
 * `const IdempotencyGuard<PostgresStore>::context_type&` (or nothing) and may return any Encodable R.
 * Throws usage_error when the store is not in transactional mode (use SequenceGate there).
 */
template <class F>
auto run_sequenced(IdempotencyGuard<PostgresStore>& guard, PostgresSequenceStore& seqs,
                   const SequenceGateOptions& options, const SequencedEvent& ev, F&& handler) {
  using Ctx = typename IdempotencyGuard<PostgresStore>::context_type;
  constexpr bool takes_ctx = std::is_invocable_v<F&, const Ctx&>;
  static_assert(takes_ctx || std::is_invocable_v<F&>,
                "idem: the handler must be callable with () or with (const context_type&)");
  using Inv = std::conditional_t<takes_ctx, std::invoke_result<F&, const Ctx&>, std::invoke_result<F&>>;
  using R = std::decay_t<typename Inv::type>;
  static_assert(std::is_void_v<R> || Encodable<R>, "idem: the handler's result type needs an idem::codec<T>");
  using Out = SequencedOutcome<R>;

  if (options.max_entity_bytes == 0)
    throw invalid_options_error("idem: max_entity_bytes is 0; entity ids need at least one byte");
  if (options.gap_retry_after < millis{0})
    throw invalid_options_error("idem: gap_retry_after is negative; use 0 to requeue at once");
  detail::check_entity(ev.entity, options.max_entity_bytes);
  detail::check_key(ev.key, guard.options().max_key_bytes);
  if (!guard.store().transactional())
    throw usage_error(
        "idem: run_sequenced needs a PostgresStore in PgMode::transactional; use SequenceGate in lease mode");
  const auto started = std::chrono::steady_clock::now();
  auto report = [&](Status s) {
    if (const auto& obs = guard.options().observer)
      obs->on_outcome(OutcomeEvent{ev.key, s, std::chrono::steady_clock::now() - started, 0, false, false});
  };

  Out out;
  const std::optional<std::uint64_t> last = seqs.last_applied(ev.entity);
  out.last_applied = last;
  if (last && ev.seq <= *last) {
    out.status = Status::stale;
    report(Status::stale);
    return out;
  }
  if (options.contiguous) {
    // Sequences never go down, so an event that is next here is next or stale inside the
    // transaction too: the gap decision needs no lock and no transaction.
    const std::uint64_t want = last ? *last + 1 : options.first;
    if (ev.seq != want) {
      if (!last && ev.seq < options.first) {
        out.status = Status::stale;
        report(Status::stale);
        return out;
      }
      out.status = Status::in_flight;
      out.gap = true;
      out.retry_after = options.gap_retry_after;
      report(Status::in_flight);
      return out;
    }
  }

  std::optional<std::uint64_t> stale_at;  // set when the in-transaction advance lost
  auto inner = [&](const Ctx& ctx) -> R {
    const AdvanceResult a = seqs.advance(*ctx.tx, ev.entity, ev.seq);
    if (!a.advanced) {
      stale_at = a.previous;
      throw detail::stale_signal{};  // the guard rolls back and answers stale
    }
    // Only an erase() racing this event can open a gap after the check above: roll back, retry.
    if (options.contiguous && a.previous != last)
      throw store_error("idem: the sequence of entity '" + std::string(ev.entity.substr(0, 64)) +
                            "' changed under a contiguous event (erased meanwhile?); retry it",
                        "", true);
    if constexpr (takes_ctx)
      return handler(ctx);
    else
      return handler();
  };
  out = Out(ev.payload.empty() ? guard.run(ev.key, inner) : guard.run(ev.key, ev.payload, inner));
  out.last_applied = last;
  if (out.status == Status::stale) {
    out.last_applied = stale_at;
  } else if (out.status == Status::executed) {
    out.advanced = true;
    out.last_applied = ev.seq;
  }
  return out;
}

/// run_sequenced with the default SequenceGateOptions (gaps allowed).
template <class F>
auto run_sequenced(IdempotencyGuard<PostgresStore>& guard, PostgresSequenceStore& seqs, const SequencedEvent& ev,
                   F&& handler) {
  return run_sequenced(guard, seqs, SequenceGateOptions{}, ev, std::forward<F>(handler));
}

/// Positional form of run_sequenced(guard, seqs, SequencedEvent{key, entity, seq}, handler).
template <class F>
auto run_sequenced(IdempotencyGuard<PostgresStore>& guard, PostgresSequenceStore& seqs, std::string_view key,
                   std::string_view entity, std::uint64_t seq, F&& handler) {
  return run_sequenced(guard, seqs, SequencedEvent{key, entity, seq, {}}, std::forward<F>(handler));
}

}  // namespace idem
