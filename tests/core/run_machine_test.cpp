// The run machine alone: every status, failure-policy branch, wait, lease loss, in-doubt write and
// cache hit, stepped by hand with scripted store answers and a fake clock. No store, no thread.
#include <catch2/catch.hpp>

#include <chrono>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "idem/guard/run_machine.hpp"
#include "idem/guard/sequence_phase.hpp"
#include "idem/detail/warning_relay.hpp"
#include "idem/idem.hpp"

using namespace std::chrono_literals;
using idem::AcquireResult;
using idem::AcquireStatus;
using idem::Status;
using idem::WriteStatus;
using idem::detail::Call;
using idem::detail::Next;
using Catch::Matchers::Contains;

namespace {

std::chrono::steady_clock::time_point fake_now{};
std::chrono::steady_clock::time_point read_fake() { return fake_now; }

struct Recorder : idem::Observer {
  std::vector<Status> outcomes;
  int store_errors = 0, handler_errors = 0;
  void on_outcome(const idem::OutcomeEvent& e) noexcept override { outcomes.push_back(e.status); }
  void on_store_error(std::string_view, const std::exception&) noexcept override { ++store_errors; }
  void on_handler_error(std::string_view, const std::exception_ptr&) noexcept override { ++handler_errors; }
};

struct Rig {
  idem::GuardOptions options;
  std::shared_ptr<Recorder> rec = std::make_shared<Recorder>();
  std::unique_ptr<idem::detail::LruCache> cache;
  idem::detail::MachineConfig cfg;

  explicit Rig(idem::GuardOptions o = {}, std::size_t cache_capacity = 0) : options(std::move(o)) {
    options.observer = rec;
    options.owner = "test";
    if (cache_capacity) cache = std::make_unique<idem::detail::LruCache>(cache_capacity, options.retention);
    cfg.options = &options;
    cfg.cache = cache.get();
    cfg.completes_unavailable = true;
    cfg.now = &read_fake;
  }
};

AcquireResult acquired(std::uint64_t fence = 1, std::uint32_t attempts = 1, bool takeover = false) {
  AcquireResult r;
  r.status = AcquireStatus::acquired;
  r.holder = {fence, 77};
  r.attempts = attempts;
  r.takeover = takeover;
  return r;
}

AcquireResult answered(AcquireStatus s, std::string payload = {}, idem::millis retry_after = 0ms) {
  AcquireResult r;
  r.status = s;
  r.payload = std::move(payload);
  r.retry_after = retry_after;
  r.attempts = 2;
  return r;
}

template <class M>
std::string raised_text(const M& m) {
  try {
    std::rethrow_exception(m.error());
  } catch (const std::exception& e) {
    return e.what();
  }
}

struct Unencodable {};

}  // namespace

template <>
struct idem::codec<Unencodable> {
  static std::string encode(const Unencodable&) { throw std::runtime_error("no encoding for this"); }
  static Unencodable decode(std::string_view) { return {}; }
};

TEST_CASE("machine: a fresh key runs the handler and completes with the encoded result", "[machine]") {
  Rig rig;
  idem::detail::RunMachine<int> m(rig.cfg, "k1", "fp");
  REQUIRE(m.start() == Next::send);
  CHECK(m.call() == Call::acquire);
  CHECK(m.acquire_params().token != 0);
  CHECK(m.acquire_params().fingerprint == "fp");
  CHECK(m.acquire_params().owner == "test");
  REQUIRE(m.on_acquired(acquired(3, 2, true)) == Next::run_handler);
  idem::Context ctx;
  m.fill(ctx, {});
  CHECK(ctx.key == "k1");
  CHECK(ctx.fence == 3);
  CHECK(ctx.attempt == 2);
  CHECK(ctx.takeover);
  REQUIRE(m.on_returned(42) == Next::send);
  CHECK(m.call() == Call::complete);
  CHECK(m.result() == "42");
  CHECK(m.holder() == idem::Holder{3, 77});
  REQUIRE(m.on_written(WriteStatus::ok) == Next::done);
  CHECK(m.outcome().status == Status::executed);
  CHECK(m.outcome().value == 42);
  CHECK(m.outcome().fence == 3);
  CHECK(m.outcome().takeover);
  CHECK(rig.rec->outcomes == std::vector<Status>{Status::executed});
}

TEST_CASE("machine: every acquire answer becomes its status", "[machine]") {
  Rig rig;
  SECTION("duplicate replays the decoded value") {
    idem::detail::RunMachine<int> m(rig.cfg, "k", "");
    m.start();
    REQUIRE(m.on_acquired(answered(AcquireStatus::duplicate, "7")) == Next::done);
    CHECK(m.outcome().status == Status::duplicate);
    CHECK(m.outcome().value == 7);
    CHECK(m.outcome().action() == idem::BrokerAction::ack);
  }
  SECTION("duplicate completed without its result") {
    idem::detail::RunMachine<int> m(rig.cfg, "k", "");
    m.start();
    auto a = answered(AcquireStatus::duplicate, "too large");
    a.result_unavailable = true;
    REQUIRE(m.on_acquired(a) == Next::done);
    CHECK(m.outcome().result_unavailable);
    CHECK(m.outcome().error == "too large");
    CHECK_FALSE(m.outcome().value);
  }
  SECTION("an unreadable stored result is a corrupt record, never a duplicate") {
    idem::detail::RunMachine<int> m(rig.cfg, "k", "");
    m.start();
    REQUIRE(m.on_acquired(answered(AcquireStatus::duplicate, "not a number")) == Next::raise);
    CHECK_THROWS_AS(std::rethrow_exception(m.error()), idem::corrupt_record_error);
    CHECK(rig.rec->store_errors == 1);
    CHECK(rig.rec->outcomes.empty());
  }
  SECTION("previously_failed carries the stored error") {
    idem::detail::RunMachine<void> m(rig.cfg, "k", "");
    m.start();
    REQUIRE(m.on_acquired(answered(AcquireStatus::previously_failed, "card declined")) == Next::done);
    CHECK(m.outcome().status == Status::previously_failed);
    CHECK(m.outcome().error == "card declined");
    CHECK(m.outcome().action() == idem::BrokerAction::dead_letter);
  }
  SECTION("mismatch") {
    idem::detail::RunMachine<void> m(rig.cfg, "k", "fp");
    m.start();
    REQUIRE(m.on_acquired(answered(AcquireStatus::mismatch)) == Next::done);
    CHECK(m.outcome().status == Status::mismatch);
  }
  SECTION("in_flight without waiting answers at once with retry_after") {
    idem::detail::RunMachine<void> m(rig.cfg, "k", "");
    m.start();
    REQUIRE(m.on_acquired(answered(AcquireStatus::in_flight, "", 900ms)) == Next::done);
    CHECK(m.outcome().status == Status::in_flight);
    CHECK(m.outcome().retry_after == 900ms);
    CHECK(m.outcome().action() == idem::BrokerAction::requeue);
  }
}

TEST_CASE("machine: a bad key raises before any store call", "[machine]") {
  Rig rig{{.max_key_bytes = 4}};
  idem::detail::RunMachine<void> empty(rig.cfg, "", "");
  REQUIRE(empty.start() == Next::raise);
  CHECK_THROWS_AS(std::rethrow_exception(empty.error()), idem::invalid_key_error);
  idem::detail::RunMachine<void> long_key(rig.cfg, "12345", "");
  REQUIRE(long_key.start() == Next::raise);
  CHECK_THAT(raised_text(long_key), Contains("5 bytes") && Contains("limit of 4"));
  CHECK(idem::action_of(long_key.error()) == idem::BrokerAction::dead_letter);
}

TEST_CASE("machine: waiting for an in-flight holder pauses with doubling steps within its bound", "[machine]") {
  Rig rig{{.wait_for_in_flight = 100ms}};
  idem::detail::RunMachine<int> m(rig.cfg, "k", "");
  m.start();
  std::vector<idem::millis> pauses;
  Next next = m.on_acquired(answered(AcquireStatus::in_flight, "", 10s));
  while (next == Next::wait) {
    pauses.push_back(m.pause());
    fake_now += m.pause();
    REQUIRE(m.on_waited() == Next::send);
    next = m.on_acquired(answered(AcquireStatus::in_flight, "", 10s));
  }
  // 10, 20, 40, then what is left of the 100 ms bound.
  CHECK(pauses == std::vector<idem::millis>{10ms, 20ms, 40ms, 30ms});
  REQUIRE(next == Next::done);
  CHECK(m.outcome().status == Status::in_flight);
  CHECK(m.outcome().retry_after == 10s);

  SECTION("a holder that finishes meanwhile turns the wait into a duplicate") {
    idem::detail::RunMachine<int> w(rig.cfg, "k2", "");
    w.start();
    REQUIRE(w.on_acquired(answered(AcquireStatus::in_flight, "", 3ms)) == Next::wait);
    CHECK(w.pause() == 3ms);  // never past the holder's lease
    w.on_waited();
    REQUIRE(w.on_acquired(answered(AcquireStatus::duplicate, "5")) == Next::done);
    CHECK(w.outcome().value == 5);
  }
}

TEST_CASE("machine: failure policy branches", "[machine]") {
  SECTION("release frees the key and the handler's exception is raised unchanged") {
    Rig rig{{.failure = {.mode = idem::FailureMode::release}}};
    idem::detail::RunMachine<int> m(rig.cfg, "k", "");
    m.start();
    m.on_acquired(acquired());
    const auto thrown = std::make_exception_ptr(std::runtime_error("boom"));
    REQUIRE(m.on_threw(thrown) == Next::send);
    CHECK(m.handler_threw());
    CHECK(m.call() == Call::fail);
    CHECK(m.fail_params().release);
    CHECK(m.fail_params().error == "boom");
    REQUIRE(m.on_written(WriteStatus::ok) == Next::raise);
    CHECK(m.error() == thrown);
    CHECK(rig.rec->handler_errors == 1);
    CHECK(rig.rec->outcomes.empty());
  }
  SECTION("record backs off, doubling per attempt, permanent at max_attempts") {
    Rig rig{{.failure = {.mode = idem::FailureMode::record, .max_attempts = 3, .backoff = 100ms, .max_backoff = 150ms}}};
    auto step = [&](std::uint32_t attempt) {
      idem::detail::RunMachine<int> m(rig.cfg, "k", "");
      m.start();
      m.on_acquired(acquired(attempt, attempt));
      m.on_threw(std::make_exception_ptr(std::runtime_error("declined")));
      return m.fail_params();
    };
    const auto first = step(1), second = step(2), third = step(3);
    CHECK_FALSE(first.release);
    CHECK_FALSE(first.permanent);
    CHECK(first.backoff == 100ms);
    CHECK(second.backoff == 150ms);  // 200 capped
    CHECK_FALSE(second.permanent);
    CHECK(third.permanent);
  }
  SECTION("a failure that cannot be written still raises the handler's exception") {
    Rig rig;
    idem::detail::RunMachine<int> m(rig.cfg, "k", "");
    m.start();
    m.on_acquired(acquired());
    const auto thrown = std::make_exception_ptr(std::logic_error("bug"));
    m.on_threw(thrown);
    REQUIRE(m.on_store_error(std::make_exception_ptr(idem::connection_error("down"))) == Next::raise);
    CHECK(m.error() == thrown);
    CHECK(rig.rec->store_errors == 1);
  }
  SECTION("stale releases without a failure") {
    Rig rig;
    idem::detail::RunMachine<int> m(rig.cfg, "k", "");
    m.start();
    m.on_acquired(acquired());
    REQUIRE(m.on_stale() == Next::send);
    CHECK(m.fail_params().release);
    CHECK_THAT(std::string(m.fail_params().error), Contains("stale"));
    REQUIRE(m.on_written(WriteStatus::ok) == Next::done);
    CHECK(m.outcome().status == Status::stale);
  }
}

TEST_CASE("machine: a lost lease at completion is lease_lost with the handler's value", "[machine]") {
  Rig rig;
  idem::detail::RunMachine<std::string> m(rig.cfg, "k", "");
  m.start();
  m.on_acquired(acquired());
  m.on_returned(std::string("v"));
  REQUIRE(m.on_written(WriteStatus::lease_lost) == Next::done);
  CHECK(m.outcome().status == Status::lease_lost);
  CHECK(m.outcome().value == "v");
  CHECK(m.outcome().handler_ran());
  CHECK(m.outcome().action() == idem::BrokerAction::ack);
}

TEST_CASE("machine: in-doubt writes become what a redelivery does, said once", "[machine]") {
  Rig rig;
  SECTION("an acquire in doubt ran no handler: retryable, requeue") {
    idem::detail::RunMachine<int> m(rig.cfg, "k", "");
    m.start();
    REQUIRE(m.on_store_error(std::make_exception_ptr(idem::outcome_unknown_error("reply lost", "IO"))) == Next::raise);
    try {
      std::rethrow_exception(m.error());
    } catch (const idem::outcome_unknown_error& e) {
      CHECK(e.retryable());
      CHECK(e.code() == "IO");
      CHECK_THAT(e.what(), Contains("reply lost") && Contains("did not run"));
    }
    CHECK(idem::action_of(m.error()) == idem::BrokerAction::requeue);
    CHECK(rig.rec->store_errors == 1);
  }
  SECTION("a completion in doubt: retryable, requeue, and it says why") {
    idem::detail::RunMachine<int> m(rig.cfg, "k", "");
    m.start();
    m.on_acquired(acquired());
    m.on_returned(1);
    REQUIRE(m.on_store_error(std::make_exception_ptr(idem::outcome_unknown_error("commit unknown"))) == Next::raise);
    try {
      std::rethrow_exception(m.error());
    } catch (const idem::outcome_unknown_error& e) {
      CHECK(e.retryable());
      CHECK_THAT(e.what(), Contains("completion is in doubt") && Contains("requeue"));
    }
    CHECK(idem::action_of(m.error()) == idem::BrokerAction::requeue);
  }
  SECTION("other store errors pass unchanged") {
    idem::detail::RunMachine<int> m(rig.cfg, "k", "");
    m.start();
    const auto e = std::make_exception_ptr(idem::connection_error("refused"));
    REQUIRE(m.on_store_error(e) == Next::raise);
    CHECK(m.error() == e);
  }
}

TEST_CASE("machine: a result that cannot be stored completes the key without it", "[machine]") {
  SECTION("over the store's limit, on a store that completes without results") {
    Rig rig;
    rig.cfg.max_result_bytes = 3;
    idem::detail::RunMachine<std::string> m(rig.cfg, "k", "");
    m.start();
    m.on_acquired(acquired());
    REQUIRE(m.on_returned(std::string("long")) == Next::send);
    CHECK(m.call() == Call::complete_unavailable);
    CHECK(m.result() == "the encoded result is 4 bytes, over the store's limit of 3");
    REQUIRE(m.on_written(WriteStatus::ok) == Next::raise);
    CHECK_THROWS_AS(std::rethrow_exception(m.error()), idem::result_not_stored_error);
    CHECK_THAT(raised_text(m), Contains("will not run again"));
    CHECK(idem::action_of(m.error()) == idem::BrokerAction::ack);
  }
  SECTION("a codec that throws, on a store without it: a permanent failure whose text the machine owns") {
    Rig rig;
    rig.cfg.completes_unavailable = false;
    idem::detail::RunMachine<Unencodable> m(rig.cfg, "k", "");
    m.start();
    m.on_acquired(acquired());
    REQUIRE(m.on_returned(Unencodable{}) == Next::send);
    REQUIRE(m.call() == Call::fail);
    const idem::FailParams f = m.fail_params();
    CHECK(f.permanent);
    CHECK(std::string(f.error) == "result not stored: idem: codec<T>::encode threw: no encoding for this; fix the "
                                  "codec, the result was not recorded");
    REQUIRE(m.on_written(WriteStatus::lease_lost) == Next::done);
    CHECK(m.outcome().status == Status::lease_lost);
  }
  SECTION("transactional: rolled back and failed permanently") {
    Rig rig;
    rig.cfg.transactional = true;
    rig.cfg.max_result_bytes = 0;
    idem::detail::RunMachine<int> m(rig.cfg, "k", "");
    m.start();
    m.on_acquired(acquired());
    REQUIRE(m.on_returned(5) == Next::send);
    CHECK(m.call() == Call::fail);
    CHECK_FALSE(m.heartbeat());
    REQUIRE(m.on_written(WriteStatus::ok) == Next::raise);
    CHECK_THAT(raised_text(m), Contains("transaction was rolled back"));
  }
}

TEST_CASE("machine: the cache answers without a store call", "[machine][cache]") {
  Rig rig{{}, 16};
  {
    idem::detail::RunMachine<int> m(rig.cfg, "k", "fp");
    m.start();
    m.on_acquired(acquired());
    m.on_returned(9);
    REQUIRE(m.on_written(WriteStatus::ok) == Next::done);
  }
  idem::detail::RunMachine<int> hit(rig.cfg, "k", "fp");
  REQUIRE(hit.start() == Next::done);
  CHECK(hit.outcome().status == Status::duplicate);
  CHECK(hit.outcome().from_cache);
  CHECK(hit.outcome().value == 9);
  idem::detail::RunMachine<int> other(rig.cfg, "k", "another");
  REQUIRE(other.start() == Next::done);
  CHECK(other.outcome().status == Status::mismatch);
  // A duplicate from the store fills the cache too.
  idem::detail::RunMachine<int> d(rig.cfg, "k2", "");
  d.start();
  d.on_acquired(answered(AcquireStatus::duplicate, "4"));
  idem::detail::RunMachine<int> again(rig.cfg, "k2", "");
  REQUIRE(again.start() == Next::done);
  CHECK(again.outcome().from_cache);
  // An unreadable cached value is a corrupt record.
  idem::detail::RunMachine<Unencodable> any(rig.cfg, "k3", "");
  any.start();
  any.on_acquired(answered(AcquireStatus::duplicate, "x"));
  idem::detail::RunMachine<int> bad(rig.cfg, "k3", "");
  REQUIRE(bad.start() == Next::raise);
  CHECK_THROWS_AS(std::rethrow_exception(bad.error()), idem::corrupt_record_error);
}

TEST_CASE("machine: a batch may leave a claim unrun", "[machine][batch]") {
  Rig rig{{.lease = 5s}};
  idem::detail::RunMachine<int> abandoned(rig.cfg, "k", "");
  abandoned.start();
  abandoned.on_acquired(acquired());
  REQUIRE(abandoned.abandon() == Next::done);
  CHECK(abandoned.outcome().status == Status::in_flight);
  CHECK(abandoned.outcome().retry_after == 5s);

  idem::detail::RunMachine<int> released(rig.cfg, "k", "");
  released.start();
  released.on_acquired(acquired());
  REQUIRE(released.release_unrun() == Next::send);
  CHECK(released.fail_params().release);
  REQUIRE(released.on_store_error(std::make_exception_ptr(idem::connection_error("x"))) == Next::done);
  CHECK(released.outcome().status == Status::in_flight);
}

TEST_CASE("action_of: one mapping from an exception to the broker action", "[machine][action]") {
  using idem::BrokerAction;
  CHECK(idem::action_of(nullptr) == BrokerAction::ack);
  CHECK(idem::action_of(std::make_exception_ptr(idem::result_not_stored_error("x"))) == BrokerAction::ack);
  CHECK(idem::action_of(std::make_exception_ptr(idem::invalid_key_error("x"))) == BrokerAction::dead_letter);
  CHECK(idem::action_of(std::make_exception_ptr(idem::corrupt_record_error("x"))) == BrokerAction::requeue);
  CHECK(idem::action_of(std::make_exception_ptr(idem::connection_error("x"))) == BrokerAction::requeue);
  CHECK(idem::action_of(std::make_exception_ptr(idem::outcome_unknown_error("x"))) == BrokerAction::requeue);
  CHECK(idem::action_of(std::make_exception_ptr(std::runtime_error("handler"))) == BrokerAction::requeue);
}

namespace {
struct Heard : idem::Observer {
  std::vector<std::string> warnings;
  void on_warning(std::string_view m) noexcept override { warnings.emplace_back(m); }
};

// A store with advisories, as the Redis and tiered stores have: its configured observer behind a relay.
struct AdvisingStore : idem::MemoryStore {
  std::shared_ptr<idem::Observer> observer = idem::detail::WarningRelay::wrap(nullptr);
  void attach_observer(const std::shared_ptr<idem::Observer>& o) { idem::detail::attach_to_relay(observer, o); }
  void warn(std::string_view m) { observer->on_warning(m); }
};
}  // namespace

TEST_CASE("a guard's observer hears its store's advisories, those before it came first", "[machine][observer]") {
  AdvisingStore store;
  store.warn("eviction policy volatile-lru");
  auto first = std::make_shared<Heard>();
  idem::IdempotencyGuard a(store, {.observer = first});
  CHECK(first->warnings == std::vector<std::string>{"eviction policy volatile-lru"});
  auto second = std::make_shared<Heard>();
  {
    idem::IdempotencyGuard b(store, {.observer = second});
    idem::IdempotencyGuard again(store, {.observer = second});  // attached once
    store.warn("1 replica of 2");
  }
  CHECK(first->warnings.size() == 2);
  CHECK(second->warnings == std::vector<std::string>{"eviction policy volatile-lru", "1 replica of 2"});
  second.reset();  // held weakly: a gone observer is dropped, not kept alive
  store.warn("third");
  CHECK(first->warnings.back() == "third");
}

TEST_CASE("machine: a batch's repeats of a key are answered from its first item, without a store call",
          "[machine][batch]") {
  using M = idem::detail::RunMachine<int>;
  idem::Outcome<int> first;
  first.status = Status::executed;
  first.value = 7;
  first.fence = 3;
  idem::Outcome<int> out;
  std::exception_ptr error;
  M::repeat_of(first, nullptr, false, out, error);  // ran there: a duplicate here, with its value
  CHECK(out.status == Status::duplicate);
  CHECK(out.value == 7);
  CHECK_FALSE(error);
  M::repeat_of(first, nullptr, true, out, error);  // another payload under the key
  CHECK(out.status == Status::mismatch);
  CHECK_FALSE(out.value);
  first.status = Status::in_flight;  // held elsewhere there: held here too
  M::repeat_of(first, nullptr, false, out, error);
  CHECK(out.status == Status::in_flight);
  // An error there: redelivered here (reported once, on the first) ...
  M::repeat_of(first, std::make_exception_ptr(idem::connection_error("down")), false, out, error);
  CHECK(out.status == Status::in_flight);
  CHECK_FALSE(error);
  // ... unless no redelivery can fix it: as bad here.
  const auto bad = std::make_exception_ptr(idem::invalid_key_error("empty key"));
  M::repeat_of(first, bad, false, out, error);
  CHECK(error == bad);
  CHECK(M::untried().status == Status::in_flight);
  CHECK(M::untried().retry_after == 0s);
}

TEST_CASE("machine: the sequence phase decides stale, gaps, the advance and what the outcome says", "[machine][sequence]") {
  using idem::detail::AdvanceWay;
  using idem::detail::SeqNext;
  using idem::detail::SequencePhase;
  using idem::detail::SequenceRule;
  using idem::detail::TxNext;
  const SequenceRule gaps{};
  const SequenceRule strict{.contiguous = true, .first = 1, .gap_retry_after = 250ms};

  SECTION("before the claim: stale, equal, newer, first of an entity") {
    SequencePhase older(gaps, 3, AdvanceWay::after);
    CHECK(older.on_last_applied(5u) == SeqNext::stale);
    CHECK(older.last_applied() == 5u);
    CHECK_FALSE(older.advanced());
    CHECK(SequencePhase(gaps, 5, AdvanceWay::after).on_last_applied(5u) == SeqNext::stale);
    CHECK(SequencePhase(gaps, 9, AdvanceWay::after).on_last_applied(5u) == SeqNext::claim);
    CHECK(SequencePhase(gaps, 0, AdvanceWay::after).on_last_applied(std::nullopt) == SeqNext::claim);
  }
  SECTION("contiguous: next runs, ahead is a gap with its delay, below first is stale") {
    CHECK(SequencePhase(strict, 6, AdvanceWay::after).on_last_applied(5u) == SeqNext::claim);
    CHECK(SequencePhase(strict, 1, AdvanceWay::after).on_last_applied(std::nullopt) == SeqNext::claim);
    SequencePhase ahead(strict, 8, AdvanceWay::after);
    CHECK(ahead.on_last_applied(5u) == SeqNext::gap);
    CHECK(ahead.gap());
    CHECK(ahead.gap_retry_after() == 250ms);
    CHECK(SequencePhase(strict, 0, AdvanceWay::after).on_last_applied(std::nullopt) == SeqNext::stale);
    CHECK(SequencePhase(strict, 3, AdvanceWay::after).on_last_applied(std::nullopt) == SeqNext::gap);
  }
  SECTION("a batch: behind an earlier event of its entity it waits, ahead of it runs unless contiguous") {
    CHECK(SequencePhase(gaps, 7, AdvanceWay::after).behind_earlier(5) == SeqNext::claim);
    CHECK(SequencePhase(gaps, 5, AdvanceWay::after).behind_earlier(5) == SeqNext::later);
    CHECK(SequencePhase(gaps, 4, AdvanceWay::after).behind_earlier(5) == SeqNext::later);
    SequencePhase next(strict, 6, AdvanceWay::after);
    CHECK(next.behind_earlier(5) == SeqNext::later);
    CHECK_FALSE(next.gap());  // not ahead of the entity: decided after its predecessor
  }
  SECTION("after the run: executed and duplicate advance, nothing else does; combined never twice") {
    SequencePhase p(gaps, 9, AdvanceWay::after);
    REQUIRE(p.on_last_applied(5u) == SeqNext::claim);
    CHECK(p.advance_after(Status::executed, false));
    CHECK(p.advance_after(Status::duplicate, false));  // repairs a crash between completion and advance
    for (Status s : {Status::in_flight, Status::lease_lost, Status::mismatch, Status::previously_failed})
      CHECK_FALSE(p.advance_after(s, false));
    CHECK_FALSE(p.advance_after(Status::executed, true));
    p.on_advanced(true, 5u);
    CHECK(p.advanced());
    CHECK(p.last_applied() == 9u);
    SequencePhase lost(gaps, 7, AdvanceWay::with_completion);
    REQUIRE(lost.on_last_applied(5u) == SeqNext::claim);
    lost.on_advanced(false, 8u);  // a newer event advanced while this one ran: never goes back
    CHECK_FALSE(lost.advanced());
    CHECK(lost.last_applied() == 8u);
    CHECK_FALSE(SequencePhase(gaps, 7, AdvanceWay::in_transaction).advance_after(Status::executed, false));
  }
  SECTION("in the transaction: advanced runs, a newer commit is stale, a moved contiguous sequence raises") {
    SequencePhase p(strict, 6, AdvanceWay::in_transaction);
    REQUIRE(p.on_last_applied(5u) == SeqNext::claim);
    CHECK(p.on_tx_advance(true, 5u) == TxNext::run_handler);
    p.on_tx_run(Status::executed);
    CHECK(p.advanced());
    CHECK(p.last_applied() == 6u);
    SequencePhase rolled(gaps, 6, AdvanceWay::in_transaction);
    REQUIRE(rolled.on_last_applied(5u) == SeqNext::claim);
    CHECK(rolled.on_tx_advance(true, 5u) == TxNext::run_handler);
    rolled.on_tx_run(Status::lease_lost);  // the commit did not happen: neither did the advance
    CHECK_FALSE(rolled.advanced());
    CHECK(rolled.last_applied() == 5u);
    SequencePhase beaten(gaps, 6, AdvanceWay::in_transaction);
    REQUIRE(beaten.on_last_applied(5u) == SeqNext::claim);
    CHECK(beaten.on_tx_advance(false, 8u) == TxNext::stale);
    beaten.on_tx_run(Status::stale);
    CHECK(beaten.last_applied() == 8u);
    SequencePhase erased(strict, 6, AdvanceWay::in_transaction);
    REQUIRE(erased.on_last_applied(5u) == SeqNext::claim);
    CHECK(erased.on_tx_advance(true, std::nullopt) == TxNext::raise);
    const idem::store_error e = erased.changed_error("acct-1");
    CHECK(e.retryable());
    CHECK_THAT(e.what(), Catch::Contains("acct-1"));
  }
}
