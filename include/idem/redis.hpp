#pragma once
/// @file redis.hpp The Redis backend in one include (link idem::redis): the client, RedisStore and
/// RedisSequenceStore.

#include "idem/idem.hpp"
#include "idem/redis/sequence_store.hpp"
#include "idem/redis/store.hpp"
