#pragma once
/// @file sequence/run_sequenced.hpp run_sequenced(): SequenceGate on a store in transactional mode
/// (PostgresStore, TieredStore over one), whose advance commits with the business writes; one
/// function for every such store. Refuses lease mode.

#include <cstdint>
#include <string_view>
#include <utility>

#include "idem/core/error.hpp"
#include "idem/core/validate.hpp"
#include "idem/guard/guard.hpp"
#include "idem/sequence/gate.hpp"
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
 * On a TieredStore the stale check reads PostgreSQL (`seqs`); a duplicate is still answered by
 * Redis. The stored result is the handler's, encoded by codec<R> as guard.run stores it. The
 * handler takes `const context_type&` (or nothing) and may return any Encodable R. Throws
 * usage_error when the store is not in transactional mode (use SequenceGate there).
 */
template <StateStore Store, class Seq, class F>
  requires AdvancesInTransaction<Seq, Store>
auto run_sequenced(IdempotencyGuard<Store>& guard, Seq& seqs, const SequenceGateOptions& options,
                   const SequencedEvent& ev, F&& handler) {
  SequenceGate<Seq> gate(seqs, options);
  detail::check_entity(ev.entity, options.max_entity_bytes);
  detail::check_key(ev.key, guard.options().max_key_bytes);
  if (!guard.store().transactional())
    throw usage_error("idem: run_sequenced needs a store in transactional mode (PostgresStore, or a TieredStore over "
                      "one); use SequenceGate in lease mode");
  return gate.run(guard, ev, std::forward<F>(handler));
}

/// run_sequenced with the default SequenceGateOptions (gaps allowed).
template <StateStore Store, class Seq, class F>
  requires AdvancesInTransaction<Seq, Store>
auto run_sequenced(IdempotencyGuard<Store>& guard, Seq& seqs, const SequencedEvent& ev, F&& handler) {
  return run_sequenced(guard, seqs, SequenceGateOptions{}, ev, std::forward<F>(handler));
}

/// Positional form of run_sequenced(guard, seqs, SequencedEvent{key, entity, seq}, handler).
template <StateStore Store, class Seq, class F>
  requires AdvancesInTransaction<Seq, Store>
auto run_sequenced(IdempotencyGuard<Store>& guard, Seq& seqs, std::string_view key, std::string_view entity,
                   std::uint64_t seq, F&& handler) {
  return run_sequenced(guard, seqs, SequencedEvent{key, entity, seq, {}}, std::forward<F>(handler));
}

}  // namespace idem
