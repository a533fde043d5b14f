#pragma once
/// @file idem.hpp The core in one include (link idem::idem): the vocabulary, the guard, the
/// in-memory stores and SequenceGate. Backends add idem/redis.hpp or idem/postgres.hpp.

#include "idem/core/clock.hpp"
#include "idem/core/codec.hpp"
#include "idem/core/error.hpp"
#include "idem/core/fingerprint.hpp"
#include "idem/core/observer.hpp"
#include "idem/core/options.hpp"
#include "idem/core/outcome.hpp"
#include "idem/core/record.hpp"
#include "idem/core/store.hpp"
#include "idem/core/version.hpp"
#include "idem/guard/guard.hpp"
#include "idem/memory/memory_sequence_store.hpp"
#include "idem/memory/memory_store.hpp"
#include "idem/sequence/gate.hpp"
#include "idem/sequence/sequence_store.hpp"
