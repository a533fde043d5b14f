#pragma once
/// @file outbox/outbox.hpp The transactional outbox in one include: the writer (ctx.outbox()),
/// the relay, the publisher interface and the Redis Streams publisher (target idem::outbox).

#include "idem/outbox/publisher.hpp"
#include "idem/outbox/redis_streams_publisher.hpp"
#include "idem/outbox/relay.hpp"
#include "idem/outbox/writer.hpp"
