#pragma once
/// @file idem.hpp The core in one include: the guard, the in-memory store, outcomes, options and errors.

#include "idem/clock.hpp"
#include "idem/codec.hpp"
#include "idem/error.hpp"
#include "idem/fingerprint.hpp"
#include "idem/guard.hpp"
#include "idem/memory_store.hpp"
#include "idem/observer.hpp"
#include "idem/options.hpp"
#include "idem/outcome.hpp"
#include "idem/record.hpp"
#include "idem/sequence.hpp"
#include "idem/store.hpp"
#include "idem/version.hpp"
