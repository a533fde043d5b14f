// The names docs/outbox.md's blocks use without declaring them (tests/docs/CMakeLists.txt).
#pragma once

#include <cstdint>
#include <string>

#include <idem/outbox/outbox.hpp>
#include <idem/postgres.hpp>

namespace docs {
struct Message {
  std::string id;
  std::string account;
  std::int64_t amount = 0;
};
struct StreamEntry {
  std::string field(std::string_view name) const;
};
}  // namespace docs

extern docs::Message msg;
extern std::string ci;  // a conninfo
extern docs::StreamEntry entry;
extern idem::IdempotencyGuard<idem::MemoryStore> guard;
void apply(const std::string& payload);
