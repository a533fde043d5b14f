#pragma once
// What the HTTP / RabbitMQ pipeline's driver (rabbitmq_pipeline_test.cpp) and its workers
// (http_pipeline_worker.cpp) agree on: the route, the queue, the tables, the request body, and the
// Redis hashes the consumers' effect writes and the driver counts. The events themselves and each
// client's order of submissions are pipeline_plan.hpp's.

#include <cstdlib>
#include <string>
#include <string_view>

namespace pipeline::rmq {

inline constexpr const char* kRoute = "/payments";
inline constexpr const char* kQueue = "pipe-payments";  // the outbox's destination: a queue on the default exchange
inline constexpr const char* kUpTable = "http_records";  // the HTTP servers' store (and its outbox)

// The consumers' effect in Redis (one script, atomic on the server), hashes keyed as noted:
inline constexpr const char* kEffects = "pipe:effects";  // event id -> times its effect was applied (must be 1)
inline constexpr const char* kBalance = "pipe:balance";  // account -> sum of the amounts applied
inline constexpr const char* kFence = "pipe:fence";      // message key (outbox id) -> fence of the run that wrote last
inline constexpr const char* kRuns = "pipe:runs";        // message key -> handler runs that reached the effect
inline constexpr const char* kAgain = "pipe:again";      // message key -> re-runs by a takeover (crash between effect and completion)
inline constexpr const char* kAgainNoTakeover = "pipe:again-nt";  // message key -> re-runs without a takeover
inline constexpr const char* kStale = "pipe:stale";      // message key -> runs refused: an older fence than the last writer's

// The request body, which is also the message's payload: "event;account;amount".
struct Body {
  std::string event;
  int account = -1;
  long long amount = 0;
  [[nodiscard]] bool ok() const { return !event.empty() && account >= 0 && amount > 0; }
};
inline Body parse_body(std::string_view b) {
  Body out;
  const auto a = b.find(';');
  const auto c = a == std::string_view::npos ? a : b.find(';', a + 1);
  if (c == std::string_view::npos) return out;
  out.event = std::string(b.substr(0, a));
  out.account = std::atoi(std::string(b.substr(a + 1, c - a - 1)).c_str());
  out.amount = std::atoll(std::string(b.substr(c + 1)).c_str());
  return out;
}

}  // namespace pipeline::rmq
