// Template: an event-loop consumer on Boost.Asio with hundreds of messages in flight on one thread.
//
// Each message runs through IdempotencyGuard::run_async (C++20 coroutines): the claim, the
// handler (itself asynchronous here: it awaits a timer standing in for a payment API call) and
// the completion never block the loop. With --redis the records live in Redis through
// AsyncRedisStore, whose one connection carries every call pipelined; without it, in memory.
// The "broker" below delivers each message 1-3 times in shuffled order, as a redelivering broker
// would; --selftest checks that every effect was applied exactly once.
//
//   idem_asio_consumer [--redis redis://127.0.0.1:6379] [--messages 2000] [--in-flight 256] [--selftest]
#include <utility>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>

#include "idem/asio/guard.hpp"
#include "idem/asio/redis_store.hpp"
#include "idem/idem.hpp"

namespace asio = boost::asio;
using namespace std::chrono_literals;

namespace {

struct Message {
  std::string id;
  std::string body;
  int amount = 0;
};

struct Options {
  std::string redis;
  int messages = 2000;
  int in_flight = 256;
  bool selftest = false;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--redis") o.redis = next();
    else if (a == "--messages") o.messages = std::stoi(next());
    else if (a == "--in-flight") o.in_flight = std::stoi(next());
    else if (a == "--selftest") o.selftest = true;
    else {
      std::printf("usage: idem_asio_consumer [--redis URL] [--messages N] [--in-flight N] [--selftest]\n");
      std::exit(a == "--help" || a == "-h" ? 0 : 2);
    }
  }
  return o;
}

// The consumer: `in_flight` workers take deliveries off the queue; each delivery is one run_async.
template <class Store>
int consume(asio::io_context& io, Store& store, const Options& o) {
  idem::IdempotencyGuard guard{store, {.lease = 30s, .retention = 24h}};
  std::vector<Message> messages;
  for (int i = 0; i < o.messages; ++i)
    messages.push_back({"pay-" + std::to_string(i) + "-" + std::to_string(std::random_device{}()), "{...}", 1 + i % 7});
  std::vector<const Message*> deliveries;
  std::mt19937 rng{42};
  for (const Message& m : messages)
    for (int n = 1 + static_cast<int>(rng() % 3); n > 0; --n) deliveries.push_back(&m);
  std::shuffle(deliveries.begin(), deliveries.end(), rng);

  long long balance = 0, expected = 0;  // one thread runs the loop: no atomics needed
  int executed = 0, duplicates = 0, redeliver = 0, errors = 0;
  for (const Message& m : messages) expected += m.amount;
  std::size_t next = 0;
  int live = o.in_flight;  // AsyncRedisStore keeps a read pending on its connection: stop the loop when done
  for (int w = 0; w < o.in_flight; ++w)
    asio::co_spawn(
        io,
        [&]() -> asio::awaitable<void> {
          while (next < deliveries.size()) {
            const Message& m = *deliveries[next++];
            try {
              auto out = co_await guard.run_async(m.id, m.body, [&]() -> asio::awaitable<long long> {
                asio::steady_timer api(co_await asio::this_coro::executor, 1ms);  // the payment API call
                co_await api.async_wait(asio::use_awaitable);
                balance += m.amount;  // the effect
                co_return balance;
              });
              switch (out.action()) {
                case idem::BrokerAction::ack: (out.status == idem::Status::executed ? executed : duplicates)++; break;
                case idem::BrokerAction::requeue: redeliver++; break;  // in flight elsewhere: nack, comes back
                case idem::BrokerAction::dead_letter: errors++; break;
              }
            } catch (const idem::error& e) {
              errors++;  // a store error: nothing was assumed; nack and let the broker redeliver
              std::fprintf(stderr, "store error: %s\n", e.what());
            }
          }
          if (--live == 0) io.stop();
        },
        asio::detached);
  io.run();
  std::printf("deliveries %zu, executed %d, duplicates %d, in flight (redeliver) %d, errors %d\n", deliveries.size(),
              executed, duplicates, redeliver, errors);
  std::printf("balance %lld, expected %lld\n", balance, expected);
  if (!o.selftest) return 0;
  // Redeliveries answered in_flight are the broker's to bring back; every message's effect must
  // have happened exactly once among those that completed.
  const bool ok = executed == o.messages && balance == expected && errors == 0;
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) try {
  const Options o = parse(argc, argv);
  asio::io_context io{1};
  if (o.redis.empty()) {
    idem::MemoryStore store;
    return consume(io, store, o);
  }
  idem::AsyncRedisStore store{io.get_executor(), {.url = o.redis}};
  const int rc = consume(io, store, o);
  const idem::AsyncRedisStats st = store.stats();
  std::printf("redis: %llu requests in %llu writes on %llu connection(s)\n",
              static_cast<unsigned long long>(st.requests), static_cast<unsigned long long>(st.writes),
              static_cast<unsigned long long>(st.connects));
  return rc;
} catch (const std::exception& e) {
  std::fprintf(stderr, "idem_asio_consumer: %s\n", e.what());
  return 1;
}
