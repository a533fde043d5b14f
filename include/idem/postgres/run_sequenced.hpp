#pragma once
/// @file postgres/run_sequenced.hpp run_sequenced(): SequenceGate's in-transaction advance on a
/// transactional-mode PostgresStore, the advance committing with the business writes.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "idem/core/codec.hpp"
#include "idem/core/error.hpp"
#include "idem/guard/guard.hpp"
#include "idem/postgres/sequence_store.hpp"
#include "idem/postgres/store.hpp"
#include "idem/sequence/sequence_store.hpp"

namespace idem {

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
