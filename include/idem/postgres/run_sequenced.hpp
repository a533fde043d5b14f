#pragma once
/// @file postgres/run_sequenced.hpp run_sequenced() on a transactional-mode PostgresStore: the
/// one run_sequenced of every transactional store (sequence/run_sequenced.hpp), with its stores.

#include "idem/postgres/sequence_store.hpp"
#include "idem/postgres/store.hpp"
#include "idem/sequence/run_sequenced.hpp"

static_assert(idem::AdvancesInTransaction<idem::PostgresSequenceStore, idem::PostgresStore>);
