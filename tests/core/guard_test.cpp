// IdempotencyGuard behaviour on the memory store: outcomes, context, codecs, failure policies,
// heartbeat, waiting, cache, observers and fail-closed store errors.
#include <catch2/catch.hpp>

#include <chrono>
#include <future>
#include <memory>
#include <thread>

#include "core/test_stores.hpp"
#include "idem/idem.hpp"

using namespace std::chrono_literals;
using idem::Status;

namespace {

struct Receipt {
  std::string id;
  long cents = 0;
};

struct HandlerFailure : std::runtime_error {
  int code;
  HandlerFailure(const char* w, int c) : std::runtime_error(w), code(c) {}
};

struct Fixture {
  std::shared_ptr<idem::ManualClock> clock = std::make_shared<idem::ManualClock>();
  idem::MemoryStore store{idem::MemoryStoreOptions{.shards = 8, .max_records = 0, .clock = clock}};
};

}  // namespace

template <>
struct idem::codec<Receipt> {
  static std::string encode(const Receipt& r) { return r.id + "|" + std::to_string(r.cents); }
  static Receipt decode(std::string_view s) {
    auto bar = s.find('|');
    if (bar == std::string_view::npos) throw std::invalid_argument("no separator");
    return Receipt{std::string(s.substr(0, bar)), std::stol(std::string(s.substr(bar + 1)))};
  }
};

TEST_CASE("executed then duplicate replays the stored result", "[guard]") {
  Fixture fx;
  idem::IdempotencyGuard guard(fx.store);
  int charges = 0;
  auto charge = [&] {
    ++charges;
    return Receipt{"rcpt-1", 1250};
  };
  auto a = guard.run("pay-1", charge);
  CHECK(a.status == Status::executed);
  CHECK(a.action() == idem::BrokerAction::ack);
  CHECK(a.fence == 1);
  CHECK(a.attempt == 1);
  auto b = guard.run("pay-1", charge);
  CHECK(b.status == Status::duplicate);
  REQUIRE(b.value);
  CHECK(b.value->id == "rcpt-1");
  CHECK(b.value->cents == 1250);
  CHECK_FALSE(b.handler_ran());
  CHECK(charges == 1);
}

TEST_CASE("void and arithmetic handlers", "[guard]") {
  Fixture fx;
  idem::IdempotencyGuard guard(fx.store);
  int n = 0;
  CHECK(guard.run("v", [&] { ++n; }).status == Status::executed);
  CHECK(guard.run("v", [&] { ++n; }).status == Status::duplicate);
  CHECK(n == 1);
  CHECK(*guard.run("d", [] { return 2.5; }).value == 2.5);
  CHECK(*guard.run("d", [] { return 9.0; }).value == 2.5);
  CHECK(*guard.run("b", [] { return true; }).value);
  CHECK(*guard.run("b", [] { return false; }).value);
}

TEST_CASE("handler exception is rethrown unchanged and release frees the key", "[guard]") {
  Fixture fx;
  idem::IdempotencyGuard guard(fx.store);  // default policy: release
  try {
    guard.run("k", []() -> int { throw HandlerFailure("nope", 42); });
    FAIL("no exception");
  } catch (const HandlerFailure& e) {
    CHECK(e.code == 42);
    CHECK(std::string(e.what()) == "nope");
  }
  auto again = guard.run("k", [](const idem::Context& ctx) { return static_cast<int>(ctx.attempt); });
  CHECK(again.status == Status::executed);
  CHECK(*again.value == 2);
  CHECK(again.fence == 2);
}

TEST_CASE("record policy backs off, then fails permanently after max_attempts", "[guard]") {
  Fixture fx;
  idem::GuardOptions o;
  o.failure = {idem::FailureMode::record, 3, 100ms, 150ms};
  idem::IdempotencyGuard guard(fx.store, o);
  auto boom = []() -> int { throw std::runtime_error("gateway 503"); };
  CHECK_THROWS_AS(guard.run("k", boom), std::runtime_error);
  auto wait = guard.run("k", boom);
  CHECK(wait.status == Status::in_flight);
  CHECK(wait.retry_after == 100ms);
  CHECK(wait.action() == idem::BrokerAction::requeue);
  fx.clock->advance(100ms);
  CHECK_THROWS_AS(guard.run("k", boom), std::runtime_error);
  CHECK(guard.run("k", boom).retry_after == 150ms);  // doubled, capped at max_backoff
  fx.clock->advance(150ms);
  CHECK_THROWS_AS(guard.run("k", boom), std::runtime_error);
  auto dead = guard.run("k", boom);
  CHECK(dead.status == Status::previously_failed);
  CHECK(dead.error == "gateway 503");
  CHECK(dead.attempt == 3);
}

TEST_CASE("context carries fence, attempt and takeover after a lapsed lease", "[guard]") {
  Fixture fx;
  idem::GuardOptions o;
  o.lease = 1s;
  idem::IdempotencyGuard guard(fx.store, o);
  // A crashed holder: acquired and never finished.
  auto crashed = fx.store.acquire("k", idem::AcquireParams{.lease = 1s, .retention = 1h, .token = 99});
  REQUIRE(crashed.status == idem::AcquireStatus::acquired);
  CHECK(guard.run("k", [] {}).status == Status::in_flight);
  fx.clock->advance(1001ms);
  auto out = guard.run("k", [](const idem::Context& ctx) {
    return std::to_string(ctx.fence) + " " + std::to_string(ctx.attempt) + " " + (ctx.takeover ? "t" : "f");
  });
  CHECK(out.status == Status::executed);
  CHECK(*out.value == "2 2 t");
  CHECK(out.takeover);
  CHECK(fx.store.complete("k", crashed.holder, "late", 1h) == idem::WriteStatus::lease_lost);
}

TEST_CASE("a holder taken over mid-handler gets lease_lost and its result is not recorded", "[guard]") {
  Fixture fx;
  idem::GuardOptions o;
  o.lease = 1s;
  idem::IdempotencyGuard guard(fx.store, o);
  auto out = guard.run("k", [&] {
    fx.clock->advance(2s);  // the handler stalls past its lease ...
    auto rival = guard.run("k", [] { return std::string("rival"); });  // ... and a redelivery takes over
    CHECK(rival.status == Status::executed);
    return std::string("slow");
  });
  CHECK(out.status == Status::lease_lost);
  CHECK(*out.value == "slow");
  CHECK(out.action() == idem::BrokerAction::ack);
  CHECK(*guard.run("k", [] { return std::string("x"); }).value == "rival");
}

TEST_CASE("heartbeat keeps a long handler's lease", "[guard][heartbeat]") {
  idem::MemoryStore store;  // steady clock: the heartbeat runs in real time
  idem::GuardOptions o;
  // The lease is short next to the handler (5x) yet long enough for a loaded sanitizer run to
  // schedule the heartbeat thread (every 200 ms).
  o.lease = 600ms;
  o.heartbeat = true;
  idem::IdempotencyGuard guard(store, o);
  std::atomic<bool> rival_got_in{false};
  auto out = guard.run("long", [&](const idem::Context& ctx) {
    for (int i = 0; i < 15; ++i) {
      std::this_thread::sleep_for(200ms);
      auto r = store.acquire("long", idem::AcquireParams{.lease = 1s, .retention = 1h, .token = 5});
      if (r.status == idem::AcquireStatus::acquired) rival_got_in = true;
    }
    return ctx.stop.stop_requested();
  });
  CHECK(out.status == Status::executed);
  CHECK_FALSE(*out.value);
  CHECK_FALSE(rival_got_in);
}

TEST_CASE("heartbeat fires the stop token when the lease is lost", "[guard][heartbeat]") {
  Fixture fx;
  idem::GuardOptions o;
  o.lease = 300ms;
  o.heartbeat = true;
  idem::IdempotencyGuard guard(fx.store, o);
  auto out = guard.run("k", [&](const idem::Context& ctx) {
    fx.clock->advance(1s);
    auto r = fx.store.acquire("k", idem::AcquireParams{.lease = 10s, .retention = 1h, .token = 7});
    REQUIRE(r.takeover);
    for (int i = 0; i < 200 && !ctx.stop.stop_requested(); ++i) std::this_thread::sleep_for(10ms);
    return ctx.stop.stop_requested();
  });
  CHECK(out.status == Status::lease_lost);
  CHECK(*out.value);
}

TEST_CASE("wait_for_in_flight turns a racing redelivery into a duplicate", "[guard]") {
  idem::MemoryStore store;
  idem::GuardOptions o;
  o.wait_for_in_flight = 3s;
  idem::IdempotencyGuard guard(store, o);
  std::promise<void> started;
  auto first = std::async(std::launch::async, [&] {
    return guard.run("k", [&] {
      started.set_value();
      std::this_thread::sleep_for(100ms);
      return 7;
    });
  });
  started.get_future().wait();
  auto second = guard.run("k", [] { return 8; });
  CHECK(first.get().status == Status::executed);
  CHECK(second.status == Status::duplicate);
  CHECK(*second.value == 7);
}

TEST_CASE("wait_for_in_flight is bounded", "[guard]") {
  idem::MemoryStore store;
  idem::GuardOptions o;
  o.wait_for_in_flight = 60ms;
  idem::IdempotencyGuard guard(store, o);
  REQUIRE(store.acquire("k", idem::AcquireParams{.lease = 10s, .retention = 1h, .token = 3}).status ==
          idem::AcquireStatus::acquired);
  const auto t0 = std::chrono::steady_clock::now();
  auto out = guard.run("k", [] {});
  const auto waited = std::chrono::steady_clock::now() - t0;
  CHECK(out.status == Status::in_flight);
  CHECK(waited >= 60ms);
  CHECK(waited < 2s);
}

TEST_CASE("payload fingerprint: same key with another payload is a mismatch", "[guard]") {
  Fixture fx;
  idem::IdempotencyGuard guard(fx.store);
  int runs = 0;
  CHECK(guard.run("order-9", R"({"amount":10})", [&] { ++runs; }).status == Status::executed);
  CHECK(guard.run("order-9", R"({"amount":10})", [&] { ++runs; }).status == Status::duplicate);
  auto m = guard.run("order-9", R"({"amount":99})", [&] { ++runs; });
  CHECK(m.status == Status::mismatch);
  CHECK(m.action() == idem::BrokerAction::dead_letter);
  CHECK(runs == 1);
  CHECK(idem::fingerprint("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST_CASE("cache answers duplicates without a store round trip", "[guard][cache]") {
  idem::MemoryStore inner;
  idem::test::FaultyStore store{inner};
  idem::GuardOptions o;
  o.cache_capacity = 128;
  auto counter = std::make_shared<idem::CountingObserver>();
  o.observer = counter;
  idem::IdempotencyGuard guard(store, o);
  CHECK(guard.run("k", [] { return 1; }).status == Status::executed);
  const int trips = store.acquires.load();
  auto d = guard.run("k", [] { return 2; });
  CHECK(d.status == Status::duplicate);
  CHECK(d.from_cache);
  CHECK(*d.value == 1);
  CHECK(store.acquires.load() == trips);
  CHECK(guard.run("k", "other payload", [] { return 3; }).status == Status::duplicate);  // no fp stored
  CHECK(counter->count(Status::executed) == 1);
  CHECK(counter->count(Status::duplicate) == 2);
  CHECK(counter->cache_hits() == 2);
}

TEST_CASE("store down: the handler never runs and the error is typed", "[guard][fail-closed]") {
  idem::MemoryStore inner;
  idem::test::FaultyStore store{inner};
  auto counter = std::make_shared<idem::CountingObserver>();
  idem::GuardOptions o;
  o.observer = counter;
  idem::IdempotencyGuard guard(store, o);
  store.fail_acquire = true;
  bool ran = false;
  try {
    guard.run("k", [&] { ran = true; });
    FAIL("no exception");
  } catch (const idem::connection_error& e) {
    CHECK(e.retryable());
    CHECK(e.code() == "DOWN");
  }
  CHECK_FALSE(ran);
  CHECK(counter->store_errors() == 1);
  CHECK(counter->count(Status::executed) == 0);
}

TEST_CASE("store error on complete is raised, never reported as executed", "[guard][fail-closed]") {
  idem::MemoryStore inner;
  idem::test::FaultyStore store{inner};
  idem::IdempotencyGuard guard(store);
  store.fail_complete = true;
  CHECK_THROWS_AS(guard.run("k", [] { return 1; }), idem::timeout_error);
  auto rec = inner.inspect("k");
  REQUIRE(rec);
  CHECK(rec->state == idem::State::in_progress);  // left for the lease to lapse, never guessed
  store.fail_complete = false;
  CHECK(guard.run("k", [] { return 1; }).status == Status::in_flight);
}

TEST_CASE("a failure that cannot be recorded still rethrows the handler's exception", "[guard][fail-closed]") {
  idem::MemoryStore inner;
  idem::test::FaultyStore store{inner};
  idem::IdempotencyGuard guard(store);
  store.fail_fail = true;
  CHECK_THROWS_AS(guard.run("k", []() -> int { throw HandlerFailure("x", 1); }), HandlerFailure);
}

TEST_CASE("broker actions for every status", "[guard]") {
  using idem::BrokerAction;
  CHECK(idem::broker_action(Status::executed) == BrokerAction::ack);
  CHECK(idem::broker_action(Status::duplicate) == BrokerAction::ack);
  CHECK(idem::broker_action(Status::stale) == BrokerAction::ack);
  CHECK(idem::broker_action(Status::lease_lost) == BrokerAction::ack);
  CHECK(idem::broker_action(Status::in_flight) == BrokerAction::requeue);
  CHECK(idem::broker_action(Status::previously_failed) == BrokerAction::dead_letter);
  CHECK(idem::broker_action(Status::mismatch) == BrokerAction::dead_letter);
  CHECK(idem::to_string(Status::lease_lost) == "lease_lost");
}

TEST_CASE("MemoryStore bound: full shard fails closed, purge makes room", "[memory]") {
  auto clock = std::make_shared<idem::ManualClock>();
  idem::MemoryStore store(idem::MemoryStoreOptions{.shards = 1, .max_records = 4, .clock = clock});
  idem::GuardOptions o;
  o.lease = 1s;
  o.retention = 2s;
  idem::IdempotencyGuard guard(store, o);
  for (int i = 0; i < 4; ++i) CHECK(guard.run("k" + std::to_string(i), [] {}).status == Status::executed);
  CHECK_THROWS_AS(guard.run("k4", [] {}), idem::capacity_error);
  CHECK(guard.run("k0", [] {}).status == Status::duplicate);  // existing keys still answer
  clock->advance(3s);
  CHECK(guard.run("k4", [] {}).status == Status::executed);
  CHECK(store.size() == 1);
}

TEST_CASE("run_with_completion writes the completion through the caller's step", "[guard]") {
  Fixture f;
  idem::IdempotencyGuard guard{f.store};
  int completions = 0;
  auto complete = [&](const idem::Holder& h, std::string_view encoded, idem::millis retention) {
    ++completions;
    return f.store.complete("k", h, encoded, retention);
  };
  auto out = guard.run_with_completion("k", "", [] { return 7; }, complete);
  CHECK(out.status == Status::executed);
  CHECK(completions == 1);
  CHECK(guard.run("k", [] { return 0; }).value == 7);  // recorded by the caller's step
  // A step that reports lease_lost makes the run lease_lost, like the store's own complete.
  auto lost = guard.run_with_completion("k2", "payload", [] { return 1; },
                                        [](const idem::Holder&, std::string_view, idem::millis) {
                                          return idem::WriteStatus::lease_lost;
                                        });
  CHECK(lost.status == Status::lease_lost);
  // A non-empty payload is fingerprinted as by run(key, payload, h).
  CHECK(guard.run("k2", "other", [] { return 1; }).status == Status::mismatch);
}

TEST_CASE("stale_signal from a handler releases the key without a failure", "[guard]") {
  Fixture f;
  auto counts = std::make_shared<idem::CountingObserver>();
  idem::IdempotencyGuard guard{f.store, {.failure = {.mode = idem::FailureMode::record}, .observer = counts}};
  auto out = guard.run("k", []() -> int { throw idem::detail::stale_signal{}; });
  CHECK(out.status == Status::stale);
  CHECK(out.action() == idem::BrokerAction::ack);
  auto rec = f.store.inspect("k");  // released (the record keeps its fence), retryable at once
  REQUIRE(rec);
  CHECK(rec->state == idem::State::failed);
  CHECK_FALSE(rec->permanent);
  CHECK(counts->count(Status::stale) == 1);
  CHECK(counts->handler_errors() == 0);
  CHECK(guard.run("k", [] { return 3; }).status == Status::executed);
}
