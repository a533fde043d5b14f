// The names docs/sqlite.md's blocks use without declaring them (tests/docs/CMakeLists.txt).
#pragma once

#include <cstdint>
#include <string>

#include <idem/sqlite.hpp>

namespace docs {
struct Message {
  std::string id;
  std::string account;
  std::int64_t amount = 0;
};
}  // namespace docs

extern docs::Message msg;
