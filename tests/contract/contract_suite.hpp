#pragma once
// The store contract of docs/design.md §1, written once and instantiated for every store:
//
//   struct MyFactory {
//     using store_type = idem::MyStore;
//     store_type& store();
//     std::string key(std::string_view name);   // unique per test run
//     void advance(idem::millis d);             // let store time pass (manual clock, or sleep)
//     idem::millis short_lease() const;         // lease for takeover / expiry cases
//     int race_threads() const; int race_keys() const; int race_rounds() const;
//   };
//   IDEM_CONTRACT_SUITE(MyFactory, "[mystore]")
//
// Each case is a function template here; the macro only names them, so Catch2 lists one CTest
// test per transition and per invariant for every store.

// The `idem conformance` command (tools/idem/conformance_check.hpp) compiles these same cases
// with CHECK/REQUIRE of its own, so the installed tool needs no Catch2.
#ifndef IDEM_CONTRACT_ASSERTIONS
#include <catch2/catch.hpp>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

#include "idem/idem.hpp"

namespace idem::contract {

using namespace std::chrono_literals;

inline AcquireParams params(std::uint64_t token, millis lease = 30s, std::string_view fp = {}) {
  AcquireParams p;
  p.lease = lease;
  p.retention = std::max<millis>(lease * 4, 2s);
  p.token = token;
  p.fingerprint = fp;
  p.owner = "contract";
  return p;
}

template <class F>
void acquire_fresh(F& f) {
  auto& s = f.store();
  const auto k = f.key("fresh");
  auto r = s.acquire(k, params(11, 30s, "fp-a"));
  CHECK(r.status == AcquireStatus::acquired);
  CHECK(r.holder.fence == 1);
  CHECK(r.holder.token == 11);
  CHECK(r.attempts == 1);
  CHECK_FALSE(r.takeover);
  auto rec = s.inspect(k);
  REQUIRE(rec);
  CHECK(rec->state == State::in_progress);
  CHECK(rec->holder == r.holder);
  CHECK(rec->fingerprint == "fp-a");
  CHECK(rec->owner == "contract");
  CHECK(rec->attempts == 1);
}

template <class F>
void acquire_live_lease_is_in_flight(F& f) {
  auto& s = f.store();
  const auto k = f.key("live");
  REQUIRE(s.acquire(k, params(1, 30s)).status == AcquireStatus::acquired);
  auto r = s.acquire(k, params(2, 30s));
  CHECK(r.status == AcquireStatus::in_flight);
  CHECK(r.retry_after > 0ms);
  CHECK(r.retry_after <= 30s);
  auto rec = s.inspect(k);
  REQUIRE(rec);
  CHECK(rec->holder == Holder{1, 1});  // the loser changed nothing
}

template <class F>
void takeover_after_lapsed_lease(F& f) {
  auto& s = f.store();
  const auto k = f.key("takeover");
  const millis lease = f.short_lease();
  REQUIRE(s.acquire(k, params(1, lease)).status == AcquireStatus::acquired);
  f.advance(lease + lease / 2);
  auto r = s.acquire(k, params(2, 30s));
  CHECK(r.status == AcquireStatus::acquired);
  CHECK(r.takeover);
  CHECK(r.holder == Holder{2, 2});
  CHECK(r.attempts == 2);
  // Invariant 3: the taken-over holder can neither complete, fail nor extend.
  CHECK(s.complete(k, Holder{1, 1}, "old", 60s) == WriteStatus::lease_lost);
  FailParams fp;
  fp.error = "old";
  CHECK(s.fail(k, Holder{1, 1}, fp) == WriteStatus::lease_lost);
  CHECK(s.extend(k, Holder{1, 1}, 30s) == WriteStatus::lease_lost);
  CHECK(s.complete(k, r.holder, "new", 60s) == WriteStatus::ok);
  auto d = s.acquire(k, params(3));
  CHECK(d.status == AcquireStatus::duplicate);
  CHECK(d.payload == "new");
}

template <class F>
void complete_then_duplicate_replays(F& f) {
  auto& s = f.store();
  const auto k = f.key("dup");
  auto r = s.acquire(k, params(5));
  REQUIRE(r.status == AcquireStatus::acquired);
  static constexpr char raw[] = "bin\0ary \r\n\"{x}\" \xc3\xa9";
  const std::string result(raw, sizeof raw - 1);  // NUL, CR/LF, quotes, braces, UTF-8
  CHECK(s.complete(k, r.holder, result, 60s) == WriteStatus::ok);
  for (std::uint64_t t = 6; t < 9; ++t) {
    auto d = s.acquire(k, params(t));
    CHECK(d.status == AcquireStatus::duplicate);
    CHECK(d.payload == result);
  }
  auto rec = s.inspect(k);
  REQUIRE(rec);
  CHECK(rec->state == State::completed);
  CHECK(rec->result == result);
}

template <class F>
void empty_result_round_trips(F& f) {
  auto& s = f.store();
  const auto k = f.key("empty-result");
  auto r = s.acquire(k, params(5));
  REQUIRE(r.status == AcquireStatus::acquired);
  CHECK(s.complete(k, r.holder, "", 60s) == WriteStatus::ok);
  auto d = s.acquire(k, params(6));
  CHECK(d.status == AcquireStatus::duplicate);
  CHECK(d.payload.empty());
}

// A result the store cannot take completes the key without it (CompletesUnavailable): later
// acquires are duplicates that say why, and nothing overwrites the record.
template <class F>
void complete_unavailable_is_a_duplicate_without_result(F& f) {
  auto& s = f.store();
  using S = std::remove_reference_t<decltype(s)>;
  if constexpr (!CompletesUnavailable<S>) {
    FAIL("the store has no complete_unavailable: an effect whose result it cannot take would run again");
  } else {
    const auto k = f.key("unavailable");
    auto r = s.acquire(k, params(41));
    REQUIRE(r.status == AcquireStatus::acquired);
    CHECK(s.complete_unavailable(k, Holder{r.holder.fence, 999}, "why", 60s) == WriteStatus::lease_lost);
    CHECK(s.complete_unavailable(k, r.holder, "result too large", 60s) == WriteStatus::ok);
    for (std::uint64_t t = 42; t < 44; ++t) {
      auto d = s.acquire(k, params(t));
      CHECK(d.status == AcquireStatus::duplicate);
      CHECK(d.result_unavailable);
      CHECK(d.payload == "result too large");
    }
    CHECK(s.complete(k, r.holder, "late", 60s) == WriteStatus::lease_lost);
    auto rec = s.inspect(k);
    REQUIRE(rec);
    CHECK(rec->state == State::completed);
    CHECK(rec->permanent);
    CHECK(rec->error == "result too large");
    CHECK(rec->result.empty());
    // An ordinary completion is never taken for an unavailable one.
    const auto k2 = f.key("available");
    auto r2 = s.acquire(k2, params(45));
    REQUIRE(s.complete(k2, r2.holder, "value", 60s) == WriteStatus::ok);
    auto d2 = s.acquire(k2, params(46));
    CHECK_FALSE(d2.result_unavailable);
    CHECK(d2.payload == "value");
  }
}

template <class F>
void completed_is_never_overwritten(F& f) {
  auto& s = f.store();
  const auto k = f.key("final");
  auto r = s.acquire(k, params(7));
  REQUIRE(s.complete(k, r.holder, "first", 60s) == WriteStatus::ok);
  CHECK(s.complete(k, r.holder, "second", 60s) == WriteStatus::lease_lost);
  FailParams fp;
  fp.error = "late failure";
  CHECK(s.fail(k, r.holder, fp) == WriteStatus::lease_lost);
  CHECK(s.extend(k, r.holder, 30s) == WriteStatus::lease_lost);
  f.advance(f.short_lease() * 2);  // a lapsed "lease" must not reopen a completed record
  auto d = s.acquire(k, params(8, f.short_lease()));
  CHECK(d.status == AcquireStatus::duplicate);
  CHECK(d.payload == "first");
  auto rec = s.inspect(k);
  REQUIRE(rec);
  CHECK(rec->state == State::completed);
  CHECK(rec->holder == r.holder);
}

template <class F>
void wrong_holder_cannot_write(F& f) {
  auto& s = f.store();
  const auto k = f.key("holder");
  auto r = s.acquire(k, params(42));
  REQUIRE(r.status == AcquireStatus::acquired);
  CHECK(s.complete(k, Holder{r.holder.fence, 43}, "x", 60s) == WriteStatus::lease_lost);
  CHECK(s.complete(k, Holder{r.holder.fence + 1, 42}, "x", 60s) == WriteStatus::lease_lost);
  FailParams fp;
  fp.error = "x";
  CHECK(s.fail(k, Holder{r.holder.fence, 43}, fp) == WriteStatus::lease_lost);
  CHECK(s.extend(k, Holder{r.holder.fence, 43}, 30s) == WriteStatus::lease_lost);
  CHECK(s.complete(f.key("never-seen"), Holder{1, 42}, "x", 60s) == WriteStatus::lease_lost);
  auto rec = s.inspect(k);
  REQUIRE(rec);
  CHECK(rec->state == State::in_progress);
  CHECK(rec->holder == r.holder);
}

template <class F>
void extend_keeps_the_lease(F& f) {
  auto& s = f.store();
  const auto k = f.key("extend");
  const millis lease = f.short_lease();
  auto r = s.acquire(k, params(1, lease));
  REQUIRE(r.status == AcquireStatus::acquired);
  for (int i = 0; i < 3; ++i) {
    f.advance(lease / 2);
    REQUIRE(s.extend(k, r.holder, lease) == WriteStatus::ok);
  }
  // 1.5 leases have passed since acquire, but the heartbeat kept it: a rival is still in flight.
  CHECK(s.acquire(k, params(2, lease)).status == AcquireStatus::in_flight);
  CHECK(s.complete(k, r.holder, "done", 60s) == WriteStatus::ok);
}

template <class F>
void release_frees_the_key_and_fence_grows(F& f) {
  auto& s = f.store();
  const auto k = f.key("release");
  auto r1 = s.acquire(k, params(1));
  FailParams fp;
  fp.error = "transient";
  fp.release = true;
  fp.retention = 60s;
  REQUIRE(s.fail(k, r1.holder, fp) == WriteStatus::ok);
  auto r2 = s.acquire(k, params(2));
  CHECK(r2.status == AcquireStatus::acquired);
  CHECK(r2.holder.fence == r1.holder.fence + 1);
  CHECK(r2.attempts == 2);
  CHECK_FALSE(r2.takeover);
  // The released holder cannot complete over its successor.
  CHECK(s.complete(k, r1.holder, "stale", 60s) == WriteStatus::lease_lost);
  CHECK(s.complete(k, r2.holder, "ok", 60s) == WriteStatus::ok);
}

template <class F>
void record_policy_backs_off_then_retries(F& f) {
  auto& s = f.store();
  const auto k = f.key("backoff");
  const millis backoff = f.short_lease();
  auto r1 = s.acquire(k, params(1));
  FailParams fp;
  fp.error = "db timeout";
  fp.backoff = backoff;
  fp.retention = 60s;
  REQUIRE(s.fail(k, r1.holder, fp) == WriteStatus::ok);
  auto busy = s.acquire(k, params(2));
  CHECK(busy.status == AcquireStatus::in_flight);
  CHECK(busy.retry_after > 0ms);
  CHECK(busy.retry_after <= backoff);
  auto rec = s.inspect(k);
  REQUIRE(rec);
  CHECK(rec->state == State::failed);
  CHECK(rec->error == "db timeout");
  f.advance(backoff + backoff / 2);
  auto r2 = s.acquire(k, params(3));
  CHECK(r2.status == AcquireStatus::acquired);
  CHECK(r2.holder.fence == 2);
  CHECK(r2.attempts == 2);
}

template <class F>
void permanent_failure_is_replayed(F& f) {
  auto& s = f.store();
  const auto k = f.key("permanent");
  auto r = s.acquire(k, params(1));
  FailParams fp;
  fp.error = "card declined";
  fp.permanent = true;
  fp.retention = 60s;
  REQUIRE(s.fail(k, r.holder, fp) == WriteStatus::ok);
  auto again = s.acquire(k, params(2));
  CHECK(again.status == AcquireStatus::previously_failed);
  CHECK(again.payload == "card declined");
  auto rec = s.inspect(k);
  REQUIRE(rec);
  CHECK(rec->state == State::failed);
  CHECK(rec->permanent);
  CHECK(rec->holder == r.holder);
}

template <class F>
void mismatch_changes_nothing(F& f) {
  auto& s = f.store();
  const auto k = f.key("mismatch");
  auto r = s.acquire(k, params(1, 30s, "fp-one"));
  REQUIRE(r.status == AcquireStatus::acquired);
  auto before = s.inspect(k);
  auto m = s.acquire(k, params(2, 30s, "fp-two"));
  CHECK(m.status == AcquireStatus::mismatch);
  auto after = s.inspect(k);
  REQUIRE(before);
  REQUIRE(after);
  CHECK(after->holder == before->holder);
  CHECK(after->fingerprint == "fp-one");
  CHECK(after->lease_until_ms == before->lease_until_ms);
  CHECK(after->attempts == before->attempts);
  REQUIRE(s.complete(k, r.holder, "done", 60s) == WriteStatus::ok);
  CHECK(s.acquire(k, params(3, 30s, "fp-two")).status == AcquireStatus::mismatch);
  auto d = s.acquire(k, params(4, 30s, "fp-one"));
  CHECK(d.status == AcquireStatus::duplicate);
  CHECK(d.payload == "done");
  // A delivery without a fingerprint is not checked.
  CHECK(s.acquire(k, params(5)).status == AcquireStatus::duplicate);
}

template <class F>
void retention_expiry_forgets_and_token_fences(F& f) {
  auto& s = f.store();
  const auto k = f.key("expiry");
  const millis lease = f.short_lease();
  AcquireParams p = params(1, lease);
  p.retention = lease;
  auto r1 = s.acquire(k, p);
  REQUIRE(r1.status == AcquireStatus::acquired);
  f.advance(lease * 2);
  CHECK_FALSE(s.inspect(k).has_value());
  AcquireParams p2 = params(2, 30s);
  auto r2 = s.acquire(k, p2);
  CHECK(r2.status == AcquireStatus::acquired);
  // The record was recreated, so the fence may restart; the token still tells the holders apart.
  CHECK(s.complete(k, Holder{r2.holder.fence, 1}, "paused holder", 60s) == WriteStatus::lease_lost);
  CHECK(s.complete(k, r2.holder, "fresh", 60s) == WriteStatus::ok);
  // A completed record expires after its retention too.
  const auto k2 = f.key("expiry-completed");
  auto c = s.acquire(k2, params(3, lease));
  REQUIRE(s.complete(k2, c.holder, "v", lease) == WriteStatus::ok);
  CHECK(s.acquire(k2, params(4)).status == AcquireStatus::duplicate);
  f.advance(lease * 2);
  CHECK_FALSE(s.inspect(k2).has_value());
  auto again = s.acquire(k2, params(5));
  CHECK(again.status == AcquireStatus::acquired);
  CHECK(again.attempts == 1);
}

template <class F>
void bad_input_is_rejected(F& f) {
  auto& s = f.store();
  const auto k = f.key("bad");
  CHECK_THROWS_AS(s.acquire("", params(1)), invalid_key_error);
  CHECK_THROWS_AS(s.acquire(k, params(0)), invalid_options_error);
  CHECK_THROWS_AS(s.acquire(k, params(1, 0ms)), invalid_options_error);
  AcquireParams p = params(1, 10s);
  p.retention = 1s;
  CHECK_THROWS_AS(s.acquire(k, p), invalid_options_error);
  CHECK_THROWS_AS(s.complete(k, Holder{0, 1}, "x", 1s), invalid_options_error);
  CHECK_THROWS_AS(s.complete(k, Holder{1, 0}, "x", 1s), invalid_options_error);
  CHECK_FALSE(s.inspect(k).has_value());  // nothing was written by the rejected calls
}

template <class F>
void concurrent_acquire_has_one_winner(F& f) {
  auto& s = f.store();
  const int threads = std::max(2, f.race_threads());
  for (int round = 0; round < 20; ++round) {
    const auto k = f.key("one-winner-" + std::to_string(round));
    std::atomic<int> winners{0}, ready{0};
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) {
      ts.emplace_back([&, t] {
        ready.fetch_add(1);
        while (ready.load() < threads) std::this_thread::yield();
        auto r = s.acquire(k, params(static_cast<std::uint64_t>(t + 1)));
        if (r.status == AcquireStatus::acquired) winners.fetch_add(1);
      });
    }
    for (auto& t : ts) t.join();
    CHECK(winners.load() == 1);
  }
}

// The guard cases run a handler through f.run_guard(guard, key, handler) when the factory has one
// (the async guard's instance: guard.run_async, awaited), else through guard.run(key, handler).
template <class F, class G, class K, class H>
auto guarded(F& f, G& guard, const K& key, H handler) {
  if constexpr (requires { f.run_guard(guard, key, handler); })
    return f.run_guard(guard, key, std::move(handler));
  else
    return guard.run(key, std::move(handler));
}

// Invariant 1 through the guard: race_threads threads x race_keys keys x race_rounds rounds, every
// thread walking the keys in its own order; each key's handler must run exactly once.
template <class F>
void guard_race_exactly_once(F& f) {
  auto& s = f.store();
  const int threads = f.race_threads(), keys = f.race_keys(), rounds = f.race_rounds();
  std::vector<std::string> names;
  for (int i = 0; i < keys; ++i) names.push_back(f.key("race-" + std::to_string(i)));
  std::vector<std::atomic<int>> runs(static_cast<std::size_t>(keys));
  GuardOptions o;
  o.lease = 30s;
  o.retention = 600s;
  IdempotencyGuard guard(s, o);
  std::atomic<long> executed{0}, duplicates{0}, in_flight{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      std::vector<int> order(static_cast<std::size_t>(keys));
      for (int i = 0; i < keys; ++i) order[static_cast<std::size_t>(i)] = i;
      std::mt19937 rng(static_cast<unsigned>(t * 7919 + 1));
      for (int round = 0; round < rounds; ++round) {
        std::shuffle(order.begin(), order.end(), rng);
        for (int i : order) {
          auto out = guarded(f, guard, names[static_cast<std::size_t>(i)], [&] {
            runs[static_cast<std::size_t>(i)].fetch_add(1);
            return i;
          });
          switch (out.status) {
            case Status::executed: executed.fetch_add(1); break;
            case Status::duplicate:
              duplicates.fetch_add(1);
              if (*out.value != i) runs[static_cast<std::size_t>(i)].fetch_add(1000);  // wrong replay
              break;
            case Status::in_flight: in_flight.fetch_add(1); break;
            default: runs[static_cast<std::size_t>(i)].fetch_add(1000); break;
          }
        }
      }
    });
  }
  for (auto& t : ts) t.join();
  int wrong = 0;
  for (auto& r : runs) wrong += r.load() != 1;
  CHECK(wrong == 0);
  CHECK(executed.load() == keys);
  CHECK(executed.load() + duplicates.load() + in_flight.load() == static_cast<long>(threads) * keys * rounds);
}

template <class F>
void guard_replays_and_records_failures(F& f) {
  auto& s = f.store();
  GuardOptions o;
  o.lease = 30s;
  o.retention = 600s;
  o.failure.mode = FailureMode::record;
  o.failure.max_attempts = 2;
  o.failure.backoff = 1ms;
  o.failure.max_backoff = 1ms;
  IdempotencyGuard guard(s, o);
  const auto k = f.key("guard-fail");
  int calls = 0;
  auto boom = [&]() -> int {
    ++calls;
    throw std::runtime_error("downstream said no");
  };
  CHECK_THROWS_WITH(guarded(f, guard, k, boom), "downstream said no");
  f.advance(20ms);
  CHECK_THROWS_WITH(guarded(f, guard, k, boom), "downstream said no");
  auto out = guarded(f, guard, k, boom);
  CHECK(out.status == Status::previously_failed);
  CHECK(out.error == "downstream said no");
  CHECK(out.action() == BrokerAction::dead_letter);
  CHECK(calls == 2);

  const auto k2 = f.key("guard-ok");
  auto first = guarded(f, guard, k2, [](const Context& ctx) { return std::to_string(ctx.fence) + "/" + std::to_string(ctx.attempt); });
  CHECK(first.status == Status::executed);
  auto second = guarded(f, guard, k2, []() -> std::string { return "never"; });
  CHECK(second.status == Status::duplicate);
  CHECK(*second.value == "1/1");
}

// The batch cases' guard: a long lease, in_flight answered at once, failures released.
inline GuardOptions batch_guard_options() {
  GuardOptions o;
  o.lease = 30s;
  o.retention = 600s;
  o.wait_for_in_flight = 0ms;
  o.failure.mode = FailureMode::release;
  return o;
}

// A polled batch through the guard: every kind of item in one call (BatchStore or not).
template <class F>
void batch_mixed_items(F& f) {
  auto& s = f.store();
  const GuardOptions o = batch_guard_options();
  IdempotencyGuard guard(s, o);
  GuardOptions once = o;
  once.failure.mode = FailureMode::record;
  once.failure.max_attempts = 1;
  IdempotencyGuard failing(s, once);

  const auto done = f.key("b-done"), held = f.key("b-held"), failed = f.key("b-failed"), mm = f.key("b-mm");
  const auto new1 = f.key("b-new1"), new2 = f.key("b-new2"), boom = f.key("b-boom");
  REQUIRE(guard.run(done, [] { return 7; }).status == Status::executed);
  REQUIRE(s.acquire(held, params(901)).status == AcquireStatus::acquired);
  CHECK_THROWS(failing.run(failed, []() -> int { throw std::runtime_error("no"); }));
  REQUIRE(guard.run(mm, "payload a", [] { return 1; }).status == Status::executed);

  const std::vector<BatchItem> items{{new1, ""}, {done, ""}, {held, ""}, {failed, ""}, {mm, "payload b"},
                                     {new2, ""}, {new1, ""}, {boom, ""}};
  std::vector<std::string> ran;
  auto handler = [&](const BatchItem& it, const Context& ctx) -> int {
    ran.emplace_back(it.key);
    CHECK(ctx.key == it.key);
    if (it.key == boom) throw std::runtime_error("item failed");
    return static_cast<int>(ctx.fence) * 100 + static_cast<int>(it.key.size());
  };
  auto r = guard.run_batch(items, handler);
  REQUIRE(r.outcomes.size() == items.size());
  CHECK(ran == std::vector<std::string>{new1, new2, boom});  // in input order, once each
  CHECK(r.outcomes[0].status == Status::executed);
  CHECK(r.outcomes[0].fence == 1);
  CHECK(r.outcomes[1].status == Status::duplicate);
  CHECK(r.outcomes[1].value == 7);
  CHECK(r.outcomes[2].status == Status::in_flight);
  CHECK(r.outcomes[3].status == Status::previously_failed);
  CHECK(r.outcomes[3].error == "no");
  CHECK(r.outcomes[4].status == Status::mismatch);
  CHECK(r.outcomes[5].status == Status::executed);
  CHECK(r.outcomes[6].status == Status::duplicate);  // the same key again: ran once
  CHECK(r.outcomes[6].value == r.outcomes[0].value);
  REQUIRE(r.errors[7]);
  CHECK_THROWS_WITH(std::rethrow_exception(r.errors[7]), "item failed");
  for (std::size_t i = 0; i < 7; ++i) CHECK_FALSE(r.errors[i]);
  CHECK(r.executed() == 2);
  CHECK(r.settled_prefix() == 2);  // item 2 (in flight elsewhere) must be redelivered
  CHECK(r.to_retry() == std::vector<std::size_t>{2, 7});
  CHECK(r.action(3) == BrokerAction::dead_letter);

  // Redelivered: the completed items are duplicates with their values, the released one runs again.
  ran.clear();
  auto again = guard.run_batch(items, handler);
  CHECK(ran == std::vector<std::string>{boom});
  CHECK(again.outcomes[0].status == Status::duplicate);
  CHECK(again.outcomes[0].value == r.outcomes[0].value);
  CHECK(again.outcomes[5].status == Status::duplicate);
  CHECK(again.errors[7]);
  auto rec = s.inspect(boom);
  REQUIRE(rec);
  CHECK(rec->state == State::failed);
  CHECK(rec->attempts == 2);

  // A repeat with another payload is a mismatch, as run() would say; a bad key is its item's
  // error alone (dead-letter), the others still run.
  const auto new3 = f.key("b-new3");
  const std::vector<BatchItem> third{{new3, "p1"}, {new3, "p2"}, {"", ""}, {new3, "p1"}};
  ran.clear();
  auto r3 = guard.run_batch(third, handler);
  CHECK(ran == std::vector<std::string>{new3});
  CHECK(r3.outcomes[0].status == Status::executed);
  CHECK(r3.outcomes[1].status == Status::mismatch);
  REQUIRE(r3.errors[2]);
  CHECK_THROWS_AS(std::rethrow_exception(r3.errors[2]), invalid_key_error);
  CHECK(r3.action(2) == BrokerAction::dead_letter);
  CHECK(r3.outcomes[3].status == Status::duplicate);
}

// A lapsed lease inside a batch is taken over with fence + 1; stop_at_first_error leaves the rest.
template <class F>
void batch_takeover_and_stop(F& f) {
  auto& s = f.store();
  const GuardOptions o = batch_guard_options();
  IdempotencyGuard guard(s, o);
  const auto lapsed = f.key("b-lapsed"), a = f.key("b-a"), bad = f.key("b-bad"), c = f.key("b-c");
  REQUIRE(s.acquire(lapsed, params(902, f.short_lease())).status == AcquireStatus::acquired);
  f.advance(f.short_lease() + 50ms);
  const std::vector<BatchItem> items{{lapsed, ""}, {a, ""}, {bad, ""}, {c, ""}};
  int runs = 0;
  auto handler = [&](const BatchItem& it) {
    ++runs;
    if (it.key == bad) throw std::runtime_error("stop here");
  };
  auto r = guard.run_batch(items, handler, {.stop_at_first_error = true});
  CHECK(runs == 3);  // lapsed, a, bad; not c
  CHECK(r.outcomes[0].status == Status::executed);
  CHECK(r.outcomes[0].takeover);
  CHECK(r.outcomes[0].fence == 2);
  CHECK(r.outcomes[1].status == Status::executed);
  CHECK(r.errors[2]);
  CHECK(r.outcomes[3].status == Status::in_flight);
  CHECK(r.action(3) == BrokerAction::requeue);
  CHECK(r.settled_prefix() == 2);
  // c was released, not failed: the next batch runs it at once.
  auto next = guard.run_batch(std::span<const BatchItem>(items).subspan(3), handler);
  CHECK(next.outcomes[0].status == Status::executed);
  CHECK(runs == 4);
}

// A store's batch path decides each request as acquire() does, in request order: a key asked
// twice in one call is acquired, then in_flight (the guard never asks twice, a caller may).
template <class F>
void batch_acquire_many_in_request_order(F& f) {
  auto& s = f.store();
  using S = std::remove_reference_t<decltype(s)>;
  // A store without a batch path is held to the same answers from acquire() in turn: what
  // run_batch falls back to.
  auto decide = [&s](const std::vector<AcquireRequest>& req) {
    if constexpr (BatchStore<S>) {
      return s.acquire_many(req);
    } else {
      std::vector<AcquireResult> out;
      for (const auto& r : req) out.push_back(s.acquire(r.key, r.params));
      return out;
    }
  };
  const auto a = f.key("m-a"), b = f.key("m-b"), done = f.key("m-done"), held = f.key("m-held");
  auto d = s.acquire(done, params(931));
  REQUIRE(d.status == AcquireStatus::acquired);
  REQUIRE(s.complete(done, d.holder, "r", 60s) == WriteStatus::ok);
  REQUIRE(s.acquire(held, params(932)).status == AcquireStatus::acquired);
  const std::vector<AcquireRequest> req{{a, params(933)}, {b, params(934)}, {a, params(935)},
                                        {done, params(936)}, {held, params(937)}, {b, params(938)}};
  const auto out = decide(req);
  REQUIRE(out.size() == req.size());
  CHECK(out[0].status == AcquireStatus::acquired);
  CHECK(out[0].holder.token == 933);
  CHECK(out[1].status == AcquireStatus::acquired);
  CHECK(out[2].status == AcquireStatus::in_flight);
  CHECK(out[3].status == AcquireStatus::duplicate);
  CHECK(out[3].payload == "r");
  CHECK(out[4].status == AcquireStatus::in_flight);
  CHECK(out[5].status == AcquireStatus::in_flight);
  CHECK(s.inspect(a)->holder.token == 933);
}

// A store seen without complete_unavailable: the guard records an unstorable result as a
// permanent failure, and the text stored is exactly the text the guard built (it once viewed a
// temporary freed before the store wrote it; ASan read it).
template <class S>
struct WithoutCompleteUnavailable {
  S* s;
  AcquireResult acquire(std::string_view k, const AcquireParams& p) { return s->acquire(k, p); }
  WriteStatus complete(std::string_view k, const Holder& h, std::string_view r, millis d) { return s->complete(k, h, r, d); }
  WriteStatus fail(std::string_view k, const Holder& h, const FailParams& p) { return s->fail(k, h, p); }
  WriteStatus extend(std::string_view k, const Holder& h, millis d) { return s->extend(k, h, d); }
  std::optional<Record> inspect(std::string_view k) { return s->inspect(k); }
};

struct Unstorable {};
inline constexpr std::string_view unstorable_why =
    "this result has no encoding: the contract's codec refuses every value, on purpose";

template <class F>
void guard_stores_the_failure_text_it_built(F& f) {
  auto& s = f.store();
  WithoutCompleteUnavailable<std::remove_reference_t<decltype(s)>> plain{&s};
  IdempotencyGuard guard(plain, GuardOptions{.lease = 30s, .retention = 60s});
  const auto k = f.key("unstorable-text");
  int ran = 0;
  auto handler = [&] {
    ++ran;
    return Unstorable{};
  };
  CHECK_THROWS_AS(guard.run(k, handler), result_not_stored_error);
  const std::string expected = "result not stored: idem: codec<T>::encode threw: " + std::string(unstorable_why) +
                               "; fix the codec, the result was not recorded";
  auto again = s.acquire(k, params(951));
  CHECK(again.status == AcquireStatus::previously_failed);
  CHECK(again.payload == expected);
  auto out = guard.run(k, handler);
  CHECK(out.status == Status::previously_failed);
  CHECK(out.error == expected);
  CHECK(ran == 1);
}

}  // namespace idem::contract

template <>
struct idem::codec<idem::contract::Unstorable> {
  static std::string encode(const idem::contract::Unstorable&) {
    throw std::runtime_error(std::string(idem::contract::unstorable_why));
  }
  static idem::contract::Unstorable decode(std::string_view) { return {}; }
};

#define IDEM_CONTRACT_CASE_(Factory, tag, name, fn) \
  TEST_CASE("contract: " name, tag "[contract]") {  \
    Factory f;                                      \
    ::idem::contract::fn(f);                        \
  }

/// Instantiates the guard's part of the contract for Factory, whose run_guard(guard, key, handler)
/// runs the handler through another entry point than guard.run (run_async); `name` prefixes the
/// case names (several instances can share a binary).
#define IDEM_GUARD_CONTRACT_SUITE(Factory, name, tag)                                      \
  TEST_CASE(name ": guard race: each key runs exactly once", tag "[contract]") {          \
    Factory f;                                                                           \
    ::idem::contract::guard_race_exactly_once(f);                                        \
  }                                                                                      \
  TEST_CASE(name ": guard replays results and records failures", tag "[contract]") {      \
    Factory f;                                                                           \
    ::idem::contract::guard_replays_and_records_failures(f);                             \
  }

/// Instantiates the whole store contract for Factory; tag is a Catch2 tag such as "[memory]".
#define IDEM_CONTRACT_SUITE(Factory, tag)                                                                      \
  IDEM_CONTRACT_CASE_(Factory, tag, "acquire of a new key", acquire_fresh)                                     \
  IDEM_CONTRACT_CASE_(Factory, tag, "live lease answers in_flight", acquire_live_lease_is_in_flight)           \
  IDEM_CONTRACT_CASE_(Factory, tag, "lapsed lease is taken over with fence+1", takeover_after_lapsed_lease)    \
  IDEM_CONTRACT_CASE_(Factory, tag, "completed key replays its result", complete_then_duplicate_replays)       \
  IDEM_CONTRACT_CASE_(Factory, tag, "empty result round-trips", empty_result_round_trips)                      \
  IDEM_CONTRACT_CASE_(Factory, tag, "completed record is never overwritten", completed_is_never_overwritten)   \
  IDEM_CONTRACT_CASE_(Factory, tag, "a result the store cannot take completes without it",                     \
                      complete_unavailable_is_a_duplicate_without_result)                                      \
  IDEM_CONTRACT_CASE_(Factory, tag, "wrong holder cannot complete fail or extend", wrong_holder_cannot_write)  \
  IDEM_CONTRACT_CASE_(Factory, tag, "extend keeps the lease", extend_keeps_the_lease)                          \
  IDEM_CONTRACT_CASE_(Factory, tag, "release frees the key and the fence grows",                               \
                      release_frees_the_key_and_fence_grows)                                                   \
  IDEM_CONTRACT_CASE_(Factory, tag, "record policy backs off then retries", record_policy_backs_off_then_retries) \
  IDEM_CONTRACT_CASE_(Factory, tag, "permanent failure is replayed", permanent_failure_is_replayed)             \
  IDEM_CONTRACT_CASE_(Factory, tag, "fingerprint mismatch changes nothing", mismatch_changes_nothing)          \
  IDEM_CONTRACT_CASE_(Factory, tag, "retention expiry forgets and the token fences",                           \
                      retention_expiry_forgets_and_token_fences)                                               \
  IDEM_CONTRACT_CASE_(Factory, tag, "bad input is rejected", bad_input_is_rejected)                            \
  IDEM_CONTRACT_CASE_(Factory, tag, "concurrent acquire has one winner", concurrent_acquire_has_one_winner)    \
  IDEM_CONTRACT_CASE_(Factory, tag, "guard race: each key runs exactly once", guard_race_exactly_once)         \
  IDEM_CONTRACT_CASE_(Factory, tag, "guard replays results and records failures",                              \
                      guard_replays_and_records_failures)                                                      \
  IDEM_CONTRACT_CASE_(Factory, tag, "guard stores the failure text it built",                                   \
                      guard_stores_the_failure_text_it_built)                                                  \
  IDEM_CONTRACT_CASE_(Factory, tag, "batch: every kind of item in one call", batch_mixed_items)                \
  IDEM_CONTRACT_CASE_(Factory, tag, "batch: a lapsed lease is taken over, stop at the first error",            \
                      batch_takeover_and_stop)                                                                 \
  IDEM_CONTRACT_CASE_(Factory, tag, "batch: the store decides a batch's keys in request order",                \
                      batch_acquire_many_in_request_order)
