#pragma once
/// @file tiered/run_sequenced.hpp run_sequenced() on a TieredStore: SequenceGate with the advance
/// committed in the PostgreSQL transaction, as on a transactional-mode PostgresStore.

#include <cstdint>
#include <string_view>
#include <utility>

#include "idem/core/error.hpp"
#include "idem/core/validate.hpp"
#include "idem/guard/guard.hpp"
#include "idem/postgres/sequence_store.hpp"
#include "idem/sequence/gate.hpp"
#include "idem/tiered/store.hpp"

namespace idem {

/**
 * Runs `handler` through a guard on a TieredStore with the entity's sequence advanced inside the
 * PostgreSQL transaction, before the handler, exactly as run_sequenced() on PostgresStore
 * (include/idem/postgres/run_sequenced.hpp): the business writes, the advance and the record commit
 * together. The stale check reads PostgreSQL (`seqs`); a duplicate is still answered by Redis.
 * Throws usage_error when the PostgreSQL store is not in transactional mode.
 */
template <class F>
auto run_sequenced(IdempotencyGuard<TieredStore>& guard, PostgresSequenceStore& seqs,
                   const SequenceGateOptions& options, const SequencedEvent& ev, F&& handler) {
  static_assert(AdvancesInTransaction<PostgresSequenceStore, TieredStore>);
  SequenceGate<PostgresSequenceStore> gate(seqs, options);
  detail::check_entity(ev.entity, options.max_entity_bytes);
  detail::check_key(ev.key, guard.options().max_key_bytes);
  if (!guard.store().transactional())
    throw usage_error(
        "idem: run_sequenced needs the TieredStore's PostgresStore in transactional mode; use SequenceGate in lease mode");
  return gate.run(guard, ev, std::forward<F>(handler));
}

/// run_sequenced on a TieredStore with the default SequenceGateOptions (gaps allowed).
template <class F>
auto run_sequenced(IdempotencyGuard<TieredStore>& guard, PostgresSequenceStore& seqs, const SequencedEvent& ev,
                   F&& handler) {
  return run_sequenced(guard, seqs, SequenceGateOptions{}, ev, std::forward<F>(handler));
}

}  // namespace idem
