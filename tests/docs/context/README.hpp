// The names README.md's first block uses without declaring them (tests/docs/CMakeLists.txt).
#pragma once

#include <string>

#include <idem/idem.hpp>

namespace docs {
struct Message {
  std::string id() const;
  std::string payload() const;
};
struct Payments {
  std::string charge(const Message& m, std::uint64_t fence);
};
struct Consumer {
  void ack(const Message& m);
  void nack(const Message& m, idem::millis delay);
  void dead_letter(const Message& m);
};
}  // namespace docs

extern docs::Message msg;
extern docs::Payments payments;
extern docs::Consumer consumer;
