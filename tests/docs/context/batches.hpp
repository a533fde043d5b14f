// The names docs/batches.md's block uses without declaring them (tests/docs/CMakeLists.txt).
#pragma once

#include <string>
#include <vector>

#include <idem/idem.hpp>

namespace docs {
struct Message {
  std::string id;
  std::string body;
};
struct Consumer {
  void commit_up_to(std::size_t settled);
};
}  // namespace docs

extern std::vector<docs::Message> polled;
extern idem::MemoryStore store;
extern idem::IdempotencyGuard<idem::MemoryStore> guard;
extern docs::Consumer consumer;
std::string handle(std::string_view payload, std::uint64_t fence);
