// idem::verdict: one answer per outcome or exception for every consumer component and idem::http,
// its waits with full jitter inside their bounds (seeded entropy), and the attempt limit.

#include <catch2/catch.hpp>

#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>

#include "idem/guard/verdict.hpp"
#include "idem/idem.hpp"

using idem::BrokerAction;
using idem::millis;
using idem::Status;

namespace {

idem::Outcome<int> outcome(Status s, millis retry_after = millis{0}, std::string error = {}) {
  idem::Outcome<int> o;
  o.status = s;
  o.retry_after = retry_after;
  o.error = std::move(error);
  return o;
}

template <class E>
std::exception_ptr thrown(E e) {
  return std::make_exception_ptr(std::move(e));
}

std::exception_ptr from_handler(idem::error e) {
  idem::detail::mark_from_handler(e);
  return std::make_exception_ptr(e);
}

// min and max of f(entropy) over a spread of seeded entropies, 0 and ~0 included.
template <class F>
std::pair<millis, millis> range(F f) {
  millis lo = f(0), hi = lo;
  std::uint64_t state = 42;
  for (int i = 0; i < 2000; ++i) {
    const std::uint64_t e = i == 0 ? ~std::uint64_t{0} : idem::detail::splitmix64(state);
    lo = std::min(lo, f(e));
    hi = std::max(hi, f(e));
  }
  return {lo, hi};
}

}  // namespace

TEST_CASE("verdict: every status has one broker action, and a dead letter one reason") {
  const idem::RetryPolicy p;
  CHECK(idem::verdict(outcome(Status::executed), p).action == BrokerAction::ack);
  CHECK(idem::verdict(outcome(Status::duplicate), p).action == BrokerAction::ack);
  CHECK(idem::verdict(outcome(Status::stale), p).action == BrokerAction::ack);
  CHECK(idem::verdict(outcome(Status::lease_lost), p).action == BrokerAction::ack);
  CHECK(idem::verdict(outcome(Status::in_flight, millis{500}), p).action == BrokerAction::requeue);
  const auto failed = idem::verdict(outcome(Status::previously_failed, millis{0}, "card declined"), p);
  CHECK(failed.action == BrokerAction::dead_letter);
  CHECK(failed.reason == "failed permanently: card declined");
  const auto mismatch = idem::verdict(outcome(Status::mismatch), p);
  CHECK(mismatch.action == BrokerAction::dead_letter);
  CHECK(mismatch.reason == idem::dead_letter_reason(Status::mismatch));
  CHECK(mismatch.status == Status::mismatch);
  for (auto s : {Status::executed, Status::duplicate, Status::stale, Status::lease_lost})
    CHECK(idem::verdict(outcome(s), p).delay == millis{0});
}

TEST_CASE("verdict: exceptions — the handler's, the store's, a bad key, a result that could not be stored") {
  const idem::RetryPolicy p{.jitter = false};
  const auto handler = idem::verdict(thrown(std::runtime_error("boom")), p);
  CHECK(handler.action == BrokerAction::requeue);
  CHECK(handler.handler_failed);
  CHECK(handler.reason == "boom");
  CHECK(handler.delay == p.base);
  const auto marked = idem::verdict(from_handler(idem::connection_error("the handler's own client failed", "X", true)), p);
  CHECK(marked.handler_failed);
  CHECK(marked.delay == p.base);
  const auto store = idem::verdict(thrown(idem::connection_error("redis down", "X", true)), p, 3);
  CHECK(store.action == BrokerAction::requeue);
  CHECK_FALSE(store.handler_failed);
  CHECK(store.delay == p.base * 4);  // third delivery: base, 2 base, 4 base
  CHECK(idem::verdict(thrown(idem::connection_error("redis down", "X", true)), p, 40).delay == p.cap);
  const auto corrupt = idem::verdict(thrown(idem::corrupt_record_error("unreadable")), p);
  CHECK(corrupt.action == BrokerAction::requeue);
  CHECK(corrupt.delay == p.cap);  // no retry helps soon
  const auto bad_key = idem::verdict(thrown(idem::invalid_key_error("empty key")), p);
  CHECK(bad_key.action == BrokerAction::dead_letter);
  CHECK(bad_key.reason == "empty key");
  CHECK(idem::verdict(thrown(idem::result_not_stored_error("too big")), p).action == BrokerAction::ack);
  CHECK(idem::verdict(std::make_exception_ptr(42), p).reason == "a non-standard exception");
}

TEST_CASE("verdict: waits have full jitter, within their bounds") {
  const idem::RetryPolicy p;  // base 1 s, cap 30 s, jitter on
  // A store error at the first delivery: uniform in [0, base]; both ends are reached.
  const auto [lo, hi] = range([&](std::uint64_t e) {
    return idem::verdict(thrown(idem::connection_error("down", "X", true)), p, 1, e).delay;
  });
  CHECK(lo == millis{0});
  CHECK(hi <= p.base);
  CHECK(hi >= p.base * 9 / 10);
  // At the fifth delivery: within [0, 16 base].
  const auto fifth = range([&](std::uint64_t e) {
    return idem::verdict(thrown(idem::connection_error("down", "X", true)), p, 5, e).delay;
  });
  CHECK(fifth.second <= p.base * 16);
  CHECK(fifth.second > p.base * 8);
  // in_flight: never before the holder's lease ends, at most half of it later.
  const auto held = range([&](std::uint64_t e) { return idem::verdict(outcome(Status::in_flight, millis{4'000}), p, 1, e).delay; });
  CHECK(held.first >= millis{4'000});
  CHECK(held.second <= millis{6'000});
  // ... and never past the cap.
  CHECK(idem::verdict(outcome(Status::in_flight, millis{60'000}), p, 1, ~std::uint64_t{0}).delay == p.cap);
  // The same entropy gives the same wait (seeded runs reproduce).
  CHECK(idem::verdict(outcome(Status::in_flight, millis{4'000}), p, 1, 7).delay ==
        idem::verdict(outcome(Status::in_flight, millis{4'000}), p, 1, 7).delay);
}

TEST_CASE("verdict: max_attempts turns a requeue at that delivery into a dead letter that says so") {
  const idem::RetryPolicy p{.max_attempts = 5};
  CHECK(idem::verdict(thrown(std::runtime_error("boom")), p, 4).action == BrokerAction::requeue);
  const auto last = idem::verdict(thrown(std::runtime_error("boom")), p, 5);
  CHECK(last.action == BrokerAction::dead_letter);
  CHECK(last.reason == "gave up after 5 deliveries: boom");
  CHECK(idem::verdict(outcome(Status::executed), p, 9).action == BrokerAction::ack);  // only requeues
}

TEST_CASE("verdict: a policy whose cap is below its base is refused, naming the field") {
  CHECK_THROWS_AS(idem::detail::check_retry({.base = millis{5}, .cap = millis{1}}, "X::retry"), idem::invalid_options_error);
  CHECK_THROWS_WITH(idem::detail::check_retry({.base = millis{-1}}, "X::retry"), Catch::Contains("X::retry"));
  CHECK_NOTHROW(idem::detail::check_retry({}, "X::retry"));
}
