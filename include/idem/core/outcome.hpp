#pragma once
/// @file outcome.hpp What IdempotencyGuard::run decided, and which broker action follows.

#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>

#include "idem/core/error.hpp"
#include "idem/core/record.hpp"

namespace idem {

/// What happened to one delivery.
enum class Status : std::uint8_t {
  executed,           ///< the handler ran and its result was recorded
  duplicate,          ///< already completed: handler skipped, stored result replayed
  in_flight,          ///< another holder is live (or a failure backs off): handler skipped
  previously_failed,  ///< permanently failed before: handler skipped, stored error replayed
  stale,              ///< older than the entity's applied sequence (SequenceGate): handler skipped
  lease_lost,         ///< the handler ran but the key had been taken over: result not recorded
  mismatch,           ///< the key was first used with a different payload: handler skipped
};

/// What the consumer should tell its broker.
enum class BrokerAction : std::uint8_t {
  ack,          ///< done (or nothing to do): remove the message
  requeue,      ///< try again later (nack with requeue, or leave unacked), after retry_after
  dead_letter,  ///< will never succeed: move it aside for a human
};

/// The broker action for a status: executed/duplicate/stale/lease_lost -> ack, in_flight -> requeue,
/// previously_failed/mismatch -> dead_letter.
constexpr BrokerAction broker_action(Status s) noexcept {
  switch (s) {
    case Status::in_flight: return BrokerAction::requeue;
    case Status::previously_failed:
    case Status::mismatch: return BrokerAction::dead_letter;
    default: return BrokerAction::ack;
  }
}

/// The broker action for an exception from run(), run_async() or a batch item (null: ack). The
/// handler's own exceptions and store errors requeue (the failure policy and the store decide the
/// redelivery: in_flight while backing off, previously_failed once permanent); a result that ran
/// but could not be stored acks (the key is completed: it never runs again); a bad key
/// dead-letters (no redelivery can fix it). Agrees with error::retryable() for idem's errors.
inline BrokerAction action_of(const std::exception_ptr& e) noexcept {
  if (!e) return BrokerAction::ack;
  try {
    std::rethrow_exception(e);
  } catch (const result_not_stored_error&) {
    return BrokerAction::ack;
  } catch (const invalid_key_error&) {
    return BrokerAction::dead_letter;
  } catch (...) {
    return BrokerAction::requeue;
  }
}

/// Name of a status for logs and metrics.
constexpr std::string_view to_string(Status s) noexcept {
  constexpr std::array<std::string_view, 7> names{"executed", "duplicate",  "in_flight", "previously_failed",
                                                  "stale",    "lease_lost", "mismatch"};
  return detail::name_at(names, static_cast<std::size_t>(s));
}

/// Name of a broker action for logs.
constexpr std::string_view to_string(BrokerAction a) noexcept {
  constexpr std::array<std::string_view, 3> names{"ack", "requeue", "dead_letter"};
  return detail::name_at(names, static_cast<std::size_t>(a));
}

/// The result of IdempotencyGuard::run; T is the handler's return type (void allowed).
template <class T>
struct Outcome {
  /// The handler's result type, with void stored as std::monostate.
  using value_type = std::conditional_t<std::is_void_v<T>, std::monostate, T>;

  Status status = Status::in_flight;  ///< what happened
  std::optional<value_type> value;    ///< executed / lease_lost: handler's value; duplicate: replayed value
  std::string error;                  ///< previously_failed: the stored error text; result_unavailable: why
  bool result_unavailable = false;    ///< duplicate: the key completed without its result (value empty)
  std::uint64_t fence = 0;            ///< executed / lease_lost: the fencing token the handler saw
  std::uint32_t attempt = 0;          ///< times the key has been acquired (this run included)
  bool takeover = false;              ///< the run took over a lapsed lease
  bool from_cache = false;            ///< duplicate answered by the in-process cache, no store trip
  millis retry_after{0};              ///< in_flight: how long until a retry can acquire

  /// The broker action for this outcome.
  [[nodiscard]] constexpr BrokerAction action() const noexcept { return broker_action(status); }
  /// True when the handler ran in this call (executed or lease_lost).
  [[nodiscard]] constexpr bool handler_ran() const noexcept {
    return status == Status::executed || status == Status::lease_lost;
  }
};

}  // namespace idem
