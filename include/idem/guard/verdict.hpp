#pragma once
/// @file guard/verdict.hpp What a consumer tells its broker (or an HTTP endpoint its client) about
/// one message: one policy for every consumer component and idem::http (docs/consuming.md).

#include <algorithm>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <string_view>

#include "idem/core/error.hpp"
#include "idem/core/outcome.hpp"
#include "idem/detail/failure.hpp"
#include "idem/detail/random.hpp"

namespace idem {

/// How long a requeued message waits. Waits have full jitter (a uniform time in [0, wait]) so that
/// consumers that failed together (a store outage) do not all retry at the same instant.
struct RetryPolicy {
  millis base{1'000};              ///< a failure's wait at its first delivery; doubles per delivery after it
  millis cap{30'000};              ///< the longest wait (and the wait after a record the store cannot read)
  bool jitter = true;              ///< full jitter; false: the computed wait itself (tests, tools)
  std::uint32_t max_attempts = 0;  ///< dead-letter a message requeued at this delivery (0: never)
};

/// What to do with one message.
struct Verdict {
  BrokerAction action = BrokerAction::ack;  ///< ack, requeue (after delay) or dead_letter
  millis delay{0};                          ///< requeue: redeliver after this
  std::string reason;                       ///< dead_letter: why (its reason header); requeue after an error: the error
  std::optional<Status> status;             ///< the guard's answer, when the run gave one
  bool handler_failed = false;              ///< the handler threw (the guard recorded it per its failure policy)
};

/// The reason a dead letter gives for a status that dead-letters (previously_failed: `error` is
/// the stored failure), the same text on every broker.
inline std::string dead_letter_reason(Status s, std::string_view error = {}) {
  switch (s) {
    case Status::previously_failed:
      return error.empty() ? std::string("failed permanently") : "failed permanently: " + std::string(error);
    case Status::mismatch: return "the key was reused with a different payload";
    default: return std::string(to_string(s));
  }
}

namespace detail {

// Refuses a policy that cannot work (invalid_options_error naming `field`).
inline void check_retry(const RetryPolicy& p, std::string_view field) {
  if (p.base.count() < 0 || p.cap < p.base)
    throw invalid_options_error("idem: " + std::string(field) + ": cap (" + std::to_string(p.cap.count()) +
                                " ms) must be at least base (" + std::to_string(p.base.count()) + " ms), both >= 0");
}

// A requeue past max_attempts becomes a dead letter that says so.
inline Verdict limited(Verdict v, const RetryPolicy& p, std::uint32_t attempt) {
  if (v.action == BrokerAction::requeue && p.max_attempts > 0 && attempt >= p.max_attempts) {
    v.action = BrokerAction::dead_letter;
    v.reason = "gave up after " + std::to_string(attempt) + " deliveries" + (v.reason.empty() ? "" : ": " + v.reason);
    v.delay = millis{0};
  }
  return v;
}

}  // namespace detail

/// The verdict for a guard's outcome at delivery `attempt` (1 = the first, where the broker counts
/// them): executed, duplicate, stale and lease_lost ack; in_flight requeues after its retry_after
/// (the live holder's lease, or the failure backoff) plus up to half of it again (or up to `base`
/// when it is 0), at most `cap`; previously_failed and mismatch dead-letter with their reason.
template <class Outcome>
Verdict verdict(const Outcome& out, const RetryPolicy& p = {}, std::uint32_t attempt = 1,
                std::uint64_t entropy = detail::random_token()) {
  Verdict v{.action = out.action(), .status = out.status};
  if (v.action == BrokerAction::dead_letter) v.reason = dead_letter_reason(out.status, out.error);
  if (out.status == Status::in_flight) {
    const millis spread = out.retry_after.count() > 0 ? out.retry_after / 2 : p.base;
    v.delay = std::min(out.retry_after + detail::jittered(spread, p.jitter, entropy), p.cap);
  }
  return detail::limited(std::move(v), p, attempt);
}

/// The verdict for a run that threw (idem::action_of), at delivery `attempt`: a result that ran but
/// could not be stored acks; a key no redelivery can fix dead-letters; the handler's exception
/// requeues after a jittered `base` (the guard's failure policy decides its next run); a store
/// error requeues after the jittered exponential backoff, or a jittered `cap` when a retry cannot
/// help soon (an unreadable record). `reason` is the exception's message.
inline Verdict verdict(const std::exception_ptr& e, const RetryPolicy& p = {}, std::uint32_t attempt = 1,
                       std::uint64_t entropy = detail::random_token()) {
  // The reason is the text the failure policy records for the same exception.
  Verdict v{.action = action_of(e), .reason = detail::describe(e), .handler_failed = true};
  millis wait = p.base;
  try {
    std::rethrow_exception(e);
  } catch (const error& x) {
    v.handler_failed = x.from_handler();
    if (!x.from_handler()) wait = x.retryable() ? detail::doubled(p.base, p.cap, attempt) : p.cap;
  } catch (...) {
  }
  if (v.action == BrokerAction::requeue) v.delay = detail::jittered(std::min(wait, p.cap), p.jitter, entropy);
  return detail::limited(std::move(v), p, attempt);
}

}  // namespace idem
