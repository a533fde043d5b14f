#pragma once
/// @file sqlite.hpp The SQLite backend in one include (link idem::sqlite): SqliteStore with its
/// transactions, SqliteSequenceStore and run_sequenced.

#include "idem/idem.hpp"
#include "idem/sqlite/run_sequenced.hpp"
#include "idem/sqlite/sequence_store.hpp"
#include "idem/sqlite/store.hpp"
