// The names docs/redis.md's blocks use without declaring them (tests/docs/CMakeLists.txt).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <idem/redis.hpp>

using namespace std::chrono_literals;

namespace docs {
struct Message {
  std::string id;
};
}  // namespace docs

extern docs::Message msg;
std::string charge(const docs::Message& m, std::uint64_t fence);
extern idem::RedisStore store;
extern idem::AcquireParams params;
void handle(std::size_t i);
std::vector<std::string_view> polled_ids();
