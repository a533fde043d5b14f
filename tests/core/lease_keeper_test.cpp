// The lease keeper's thread model (one thread per guard, whatever the number of live holders) and
// whose error an idem error is when the handler threw it.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <memory>
#include <stop_token>
#include <string_view>
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

// The one rule of the keeper thread and the async heartbeat (detail/lease_watch.hpp), step by step.
TEST_CASE("lease watch: extended every lease / 3, lost when taken over or not extended for a whole lease",
          "[guard][heartbeat]") {
  using W = idem::detail::LeaseWatch;
  const auto t0 = W::clock::now();
  W w(900ms, t0);
  CHECK(w.due() == t0 + 300ms);
  CHECK(w.answered(idem::WriteStatus::ok, t0 + 300ms) == W::Event::extended);
  CHECK(w.due() == t0 + 600ms);
  // The store fails: tried again a period later, until a whole lease has passed since the last ok.
  CHECK(w.failed(t0 + 600ms) == W::Event::failed);
  CHECK(w.due() == t0 + 900ms);
  CHECK_FALSE(w.lost());
  CHECK(w.failed(t0 + 1100ms) == W::Event::failed);  // 800 ms since the last ok
  CHECK(w.answered(idem::WriteStatus::ok, t0 + 1150ms) == W::Event::extended);  // back in time: kept
  CHECK(w.failed(t0 + 2000ms) == W::Event::failed);
  CHECK(w.failed(t0 + 2050ms) == W::Event::lost);  // 900 ms without a success
  CHECK(w.lost());
  W taken(900ms, t0);
  CHECK(taken.answered(idem::WriteStatus::lease_lost, t0 + 300ms) == W::Event::lost);
  CHECK(taken.lost());
}

TEST_CASE("lease watch: every event is reported the same way, and a lost lease fires the stop token",
          "[guard][heartbeat]") {
  struct Seen : idem::Observer {
    int extended = 0, lost = 0, errors = 0;
    void on_lease_extended(std::string_view, std::uint64_t) noexcept override { ++extended; }
    void on_lease_lost(std::string_view, std::uint64_t) noexcept override { ++lost; }
    void on_store_error(std::string_view, const std::exception&) noexcept override { ++errors; }
  } seen;
  std::stop_source stop;
  const idem::connection_error down("down", "X", true);
  using E = idem::detail::LeaseWatch::Event;
  idem::detail::report(E::extended, &seen, "k", 1, nullptr, stop);
  idem::detail::report(E::failed, &seen, "k", 1, &down, stop);
  CHECK_FALSE(stop.stop_requested());
  idem::detail::report(E::lost, &seen, "k", 1, &down, stop);
  CHECK(stop.stop_requested());
  CHECK(seen.extended == 1);
  CHECK(seen.errors == 2);  // the async heartbeat reports an extension's error too (it swallowed it before)
  CHECK(seen.lost == 1);
  idem::detail::report(E::lost, nullptr, "k", 1, nullptr, stop);  // no observer: still stops
}
