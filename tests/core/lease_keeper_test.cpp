// The lease keeper's thread model (one thread per guard, whatever the number of live holders) and
// whose error an idem error is when the handler threw it.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/test_stores.hpp"
#include "idem/idem.hpp"

using namespace std::chrono_literals;
using idem::Status;

namespace {

// Threads of this process. A sanitizer may add a background thread of its own when the first
// thread starts, so a baseline is taken only after one thread has come and gone.
std::size_t thread_count() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

}  // namespace

TEST_CASE("heartbeat of 200 concurrent long handlers uses one keeper thread", "[guard][heartbeat]") {
  constexpr int handlers = 200;
  auto clock = std::make_shared<idem::SteadyClock>();
  idem::MemoryStore store{idem::MemoryStoreOptions{.clock = clock}};
  idem::GuardOptions o;
  o.lease = 300ms;  // extended every 100 ms; the handlers outlive it several times over
  o.heartbeat = true;
  idem::IdempotencyGuard guard(store, o);

  std::thread([] {}).join();
  const std::size_t before = thread_count();
  std::atomic<int> inside{0};
  std::atomic<bool> release{false};
  std::vector<std::thread> workers;
  std::vector<Status> statuses(handlers);
  for (int i = 0; i < handlers; ++i) {
    workers.emplace_back([&, i] {
      statuses[static_cast<std::size_t>(i)] = guard.run("long-" + std::to_string(i), [&] {
        inside.fetch_add(1);
        while (!release) std::this_thread::sleep_for(5ms);
      }).status;
    });
  }
  while (inside < handlers) std::this_thread::sleep_for(5ms);
  std::this_thread::sleep_for(900ms);  // three leases: without extensions every lease has lapsed

  const std::size_t during = thread_count();
  std::size_t live = 0;
  for (int i = 0; i < handlers; ++i) {
    auto rec = store.inspect("long-" + std::to_string(i));
    if (rec && rec->lease_until_ms > clock->now_ms()) ++live;
  }
  release = true;
  for (auto& w : workers) w.join();

  INFO("threads before " << before << ", with " << handlers << " handlers running " << during);
  CHECK(during == before + handlers + 1);  // the workers and one keeper, not one per handler
  CHECK(live == static_cast<std::size_t>(handlers));
  for (Status s : statuses) CHECK(s == Status::executed);
}

TEST_CASE("a guard without heartbeat starts no keeper thread", "[guard][heartbeat]") {
  idem::MemoryStore store;
  idem::IdempotencyGuard guard(store);
  std::thread([] {}).join();
  const std::size_t before = thread_count();
  std::size_t during = 0;
  guard.run("k", [&] { during = thread_count(); });
  CHECK(during == before);
}

TEST_CASE("an idem error thrown by the handler is the handler's, reported once", "[guard][errors]") {
  idem::MemoryStore inner;
  idem::test::FaultyStore store{inner};
  auto counter = std::make_shared<idem::CountingObserver>();
  idem::GuardOptions o;
  o.observer = counter;
  idem::IdempotencyGuard guard(store, o);
  try {
    guard.run("k", []() -> int { throw idem::store_error("business table locked", "55P03", true); });
    FAIL("no exception");
  } catch (const idem::store_error& e) {
    CHECK(e.from_handler());
    CHECK(e.code() == "55P03");
  }
  CHECK(counter->handler_errors() == 1);
  CHECK(counter->store_errors() == 0);

  store.fail_acquire = true;  // the guard's own store call fails: a store error, not the handler's
  try {
    guard.run("k2", [] { return 1; });
    FAIL("no exception");
  } catch (const idem::connection_error& e) {
    CHECK_FALSE(e.from_handler());
  }
  CHECK(counter->store_errors() == 1);
  CHECK(counter->handler_errors() == 1);
}
