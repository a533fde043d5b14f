#pragma once
/// @file tiered.hpp The tiered store in one include (link idem::tiered): TieredStore (Redis answers
/// duplicates, PostgreSQL is the truth) and run_sequenced on it.

#include "idem/postgres.hpp"
#include "idem/redis.hpp"
#include "idem/tiered/run_sequenced.hpp"
#include "idem/tiered/store.hpp"
