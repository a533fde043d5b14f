#pragma once
/// @file postgres.hpp The PostgreSQL backend in one include (link idem::postgres): the client,
/// PostgresStore with its transactions, and PostgresSequenceStore.

#include "idem/idem.hpp"
#include "idem/postgres/client.hpp"
#include "idem/postgres/joined.hpp"
#include "idem/postgres/result.hpp"
#include "idem/postgres/sequence_store.hpp"
#include "idem/postgres/run_sequenced.hpp"
#include "idem/postgres/store.hpp"
