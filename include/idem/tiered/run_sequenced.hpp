#pragma once
/// @file tiered/run_sequenced.hpp run_sequenced() on a TieredStore: the one run_sequenced of every
/// transactional store (sequence/run_sequenced.hpp), the advance committed in the PostgreSQL transaction.

#include "idem/postgres/sequence_store.hpp"
#include "idem/sequence/run_sequenced.hpp"
#include "idem/tiered/store.hpp"

static_assert(idem::AdvancesInTransaction<idem::PostgresSequenceStore, idem::TieredStore>);
