#pragma once
/// @file redis.hpp The Redis backend in one include (link idem::redis): RedisClient, RedisStore,
/// RedisSequenceStore and the cluster hash slot.

#include "idem/idem.hpp"
#include "idem/redis/client.hpp"
#include "idem/redis/hash_slot.hpp"
#include "idem/redis/options.hpp"
#include "idem/redis/sequence_store.hpp"
#include "idem/redis/store.hpp"
