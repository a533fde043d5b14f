// The names docs/async.md's blocks use without declaring them (tests/docs/CMakeLists.txt).
#pragma once

#include <string>
#include <utility>  // before Boost.Asio 1.74, whose awaitable.hpp uses std::exchange without it

#include <boost/asio.hpp>

#include <idem/asio/guard.hpp>
#include <idem/asio/redis_store.hpp>
#include <idem/idem.hpp>

using namespace std::chrono_literals;

namespace docs {
struct Message {
  std::string id;
  std::string body;
};
struct Payments {
  boost::asio::awaitable<std::string> charge(const Message& m);
};
struct Consumer {
  void ack(const Message& m);
};
}  // namespace docs
using Receipt = std::string;

extern docs::Message msg;
extern docs::Payments payments;
extern docs::Consumer consumer;
