// The names docs/tiered.md's block uses without declaring them (tests/docs/CMakeLists.txt).
#pragma once

#include <cstdint>
#include <string>

#include <idem/tiered.hpp>

using namespace std::chrono_literals;

namespace docs {
struct Message {
  std::string id;
  std::string body;
  std::string account;
  std::int64_t amount = 0;
};
}  // namespace docs

extern docs::Message msg;
