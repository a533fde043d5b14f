// The names docs/nats.md's blocks use without declaring them (tests/docs/CMakeLists.txt).
#pragma once

#include <stop_token>
#include <string_view>

#include <idem/idem.hpp>
#include <idem/nats/consumer.hpp>

extern idem::MemoryStore store;
extern idem::IdempotencyGuard<idem::MemoryStore> guard;
extern idem::NatsConsumer consumer;
extern std::stop_token stop;
void apply(std::string_view payload);
void bill(const idem::NatsMessage& m);
