#pragma once
/// @file sqlite/run_sequenced.hpp run_sequenced() on a transactional-mode SqliteStore: the one
/// run_sequenced of every transactional store (sequence/run_sequenced.hpp), with its stores.

#include "idem/sequence/run_sequenced.hpp"
#include "idem/sqlite/sequence_store.hpp"
#include "idem/sqlite/store.hpp"

static_assert(idem::AdvancesInTransaction<idem::SqliteSequenceStore, idem::SqliteStore>);
