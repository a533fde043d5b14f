// quickstart: at-least-once delivery in, exactly-once effects out, on the in-memory store.
//
// A tiny broker hands 4 worker threads N messages, each delivered 1-3 times in shuffled order.
// Some deliveries "crash" mid-handler: the worker dies before applying the effect and before
// telling the store anything, so the key stays in_progress until its lease lapses and a
// redelivery takes it over. At the end every message's effect must have happened exactly once.
//
// Copy the worker loop: it is the shape of any consumer (Kafka, RabbitMQ, SQS, Redis Streams).
//
//   idem_quickstart [--messages N] [--crash-percent P] [--lease-ms L] [--seed S]

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <queue>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

// A process that crashed never sends its complete/fail: this wrapper drops them for the thread
// that is "crashing", exactly as the store would see it.
thread_local bool t_crashed = false;

struct CrashableStore {
  idem::MemoryStore& inner;
  idem::AcquireResult acquire(std::string_view k, const idem::AcquireParams& p) { return inner.acquire(k, p); }
  idem::WriteStatus complete(std::string_view k, const idem::Holder& h, std::string_view r, idem::millis d) {
    if (t_crashed) throw idem::connection_error("process is dead");
    return inner.complete(k, h, r, d);
  }
  idem::WriteStatus fail(std::string_view k, const idem::Holder& h, const idem::FailParams& f) {
    if (t_crashed) throw idem::connection_error("process is dead");
    return inner.fail(k, h, f);
  }
  idem::WriteStatus extend(std::string_view k, const idem::Holder& h, idem::millis d) { return inner.extend(k, h, d); }
  std::optional<idem::Record> inspect(std::string_view k) { return inner.inspect(k); }
};

struct SimulatedCrash {};

struct Delivery {
  Clock::time_point due;
  int message;
  bool operator>(const Delivery& o) const { return due > o.due; }
};

// The broker: redelivers whatever is not acked, after a delay.
class Broker {
public:
  void publish(Delivery d) {
    std::lock_guard lock(mu_);
    q_.push(d);
    ++pending_;
  }
  bool next(Delivery& out) {
    std::unique_lock lock(mu_);
    for (;;) {
      if (pending_ == 0) return false;
      if (!q_.empty() && q_.top().due <= Clock::now()) {
        out = q_.top();
        q_.pop();
        return true;
      }
      lock.unlock();
      std::this_thread::sleep_for(1ms);
      lock.lock();
    }
  }
  void ack() {
    std::lock_guard lock(mu_);
    --pending_;
  }
  void requeue(Delivery d, idem::millis delay) {
    std::lock_guard lock(mu_);
    d.due = Clock::now() + delay;
    q_.push(d);
  }

private:
  std::mutex mu_;
  std::priority_queue<Delivery, std::vector<Delivery>, std::greater<>> q_;
  long pending_ = 0;
};

long arg(int argc, char** argv, const char* name, long dflt) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == name) return std::strtol(argv[i + 1], nullptr, 10);
  return dflt;
}

}  // namespace

int main(int argc, char** argv) {
  const int messages = static_cast<int>(arg(argc, argv, "--messages", 10'000));
  const int crash_percent = static_cast<int>(arg(argc, argv, "--crash-percent", 3));
  const auto lease = idem::millis{arg(argc, argv, "--lease-ms", 50)};
  const auto seed = static_cast<unsigned>(arg(argc, argv, "--seed", 2026));
  if (messages <= 0 || crash_percent < 0 || crash_percent > 100 || lease <= 0ms) {
    std::fprintf(stderr, "usage: idem_quickstart [--messages N>0] [--crash-percent 0..100] [--lease-ms L>0]\n");
    return 2;
  }

  idem::MemoryStore memory;
  CrashableStore store{memory};
  auto stats = std::make_shared<idem::CountingObserver>();
  idem::IdempotencyGuard guard(store, {.lease = lease, .retention = 1h, .observer = stats});

  // Each message is published 1-3 times; the copies are spread over the first 200 ms so that
  // duplicates arrive both while the first copy is in flight and after it completed.
  Broker broker;
  std::mt19937 rng(seed);
  long published = 0;
  const auto t0 = Clock::now();
  for (int m = 0; m < messages; ++m) {
    const int copies = 1 + static_cast<int>(rng() % 3);
    for (int c = 0; c < copies; ++c, ++published)
      broker.publish({t0 + std::chrono::microseconds(rng() % 200'000), m});
  }

  std::vector<std::atomic<int>> effects(static_cast<std::size_t>(messages));
  std::atomic<long> deliveries{0}, crashes{0}, requeues{0};
  std::vector<std::thread> workers;
  for (int w = 0; w < 4; ++w) {
    workers.emplace_back([&, w] {
      std::mt19937 local(seed * 31 + static_cast<unsigned>(w));
      Delivery d{};
      while (broker.next(d)) {
        deliveries.fetch_add(1);
        const std::string key = "payment-" + std::to_string(d.message);
        t_crashed = static_cast<int>(local() % 100) < crash_percent;
        try {
          auto out = guard.run(key, [&](const idem::Context& ctx) {
            if (t_crashed) throw SimulatedCrash{};          // died before the effect
            effects[static_cast<std::size_t>(d.message)].fetch_add(1);  // <- your business logic
            return static_cast<long>(ctx.fence);
          });
          switch (out.action()) {
            case idem::BrokerAction::ack: broker.ack(); break;
            case idem::BrokerAction::requeue:
              requeues.fetch_add(1);
              broker.requeue(d, std::max(out.retry_after, idem::millis{1}));
              break;
            case idem::BrokerAction::dead_letter: broker.ack(); break;  // not reached here
          }
        } catch (const SimulatedCrash&) {
          // The consumer is gone: no ack, so the broker redelivers after its visibility timeout.
          crashes.fetch_add(1);
          broker.requeue(d, lease / 2);
        }
        t_crashed = false;
      }
    });
  }
  for (auto& t : workers) t.join();
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();

  long once = 0, twice = 0, never = 0;
  for (auto& e : effects) {
    const int n = e.load();
    once += n == 1;
    twice += n > 1;
    never += n == 0;
  }
  std::printf("idem quickstart: %d messages, 4 workers, memory store, lease %lld ms\n", messages,
              static_cast<long long>(lease.count()));
  std::printf("  %-28s %10ld\n", "published copies", published);
  std::printf("  %-28s %10ld\n", "deliveries", deliveries.load());
  std::printf("  %-28s %10llu\n", "executed", static_cast<unsigned long long>(stats->count(idem::Status::executed)));
  std::printf("  %-28s %10llu\n", "duplicates suppressed",
              static_cast<unsigned long long>(stats->count(idem::Status::duplicate)));
  std::printf("  %-28s %10ld\n", "in-flight retries", requeues.load());
  std::printf("  %-28s %10ld\n", "crashes mid-handler", crashes.load());
  std::printf("  %-28s %10llu\n", "takeovers after lease", static_cast<unsigned long long>(stats->takeovers()));
  std::printf("  %-28s %10.2f\n", "wall seconds", secs);
  std::printf("  effects applied once: %ld of %d (twice or more: %ld, never: %ld)\n", once, messages, twice, never);
  return once == messages ? 0 : 1;
}
