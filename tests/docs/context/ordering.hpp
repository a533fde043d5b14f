// The names docs/ordering.md's blocks use without declaring them (tests/docs/CMakeLists.txt).
#pragma once

#include <cstdint>
#include <string>

#include <idem/postgres.hpp>
#include <idem/redis.hpp>

namespace docs {
struct Event {
  std::string id;
  std::string account;
  std::string address;
  std::uint64_t version = 0;
  std::uint64_t seq = 0;
  std::int64_t delta = 0;
};
struct Message {};
}  // namespace docs

extern docs::Event ev;
extern docs::Message msg;
extern std::string ci;  // a conninfo
void set_address(const std::string& account, const std::string& address);
void ack(const docs::Message& m);
void nack_requeue(const docs::Message& m, idem::millis delay);
void dead_letter(const docs::Message& m);
inline auto handler = [] {};
