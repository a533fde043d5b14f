#pragma once
/// @file options.hpp GuardOptions and FailurePolicy, with their defaults and validation.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "idem/core/validate.hpp"
#include "idem/core/error.hpp"
#include "idem/core/observer.hpp"
#include "idem/core/record.hpp"

namespace idem {

using namespace std::chrono_literals;

/// What a handler exception does to the key.
enum class FailureMode : std::uint8_t {
  release,  ///< free the key at once: the broker's redelivery runs the handler again
  record,   ///< store `failed`; retry after an exponential backoff, permanent after max_attempts
};

/// How handler failures are recorded.
struct FailurePolicy {
  FailureMode mode = FailureMode::release;  ///< release (default) or record
  std::uint32_t max_attempts = 5;           ///< record: acquisitions before the failure is permanent; >= 1
  millis backoff{1'000};                    ///< record: wait after the first failure; doubles per attempt; >= 0
  millis max_backoff{300'000};              ///< record: ceiling of the doubling; >= backoff
};

/// Options of IdempotencyGuard. Every duration is in milliseconds.
struct GuardOptions {
  /// How long a holder owns a key before another delivery may take it over; > 0. Pick it above
  /// the handler's worst-case time, or turn on heartbeat.
  millis lease{30'000};
  /// How long completed/failed records are kept, so redeliveries within it are duplicates; >= lease.
  millis retention{std::chrono::hours{24}};
  /// What a handler exception does to the key.
  FailurePolicy failure{};
  /// Extend the lease every lease/3 while the handler runs, from one lease keeper thread per guard;
  /// fire the handler's stop token if the lease is lost.
  bool heartbeat = false;
  /// Poll an in-flight key with backoff for up to this long before answering in_flight (0 = answer at once).
  millis wait_for_in_flight{0};
  /// Capacity of the in-process cache of completed keys (0 = off). A hit costs no store round trip.
  std::size_t cache_capacity = 0;
  /// Longest accepted key in bytes; > 0.
  std::size_t max_key_bytes = detail::default_max_key_bytes;
  /// Owner id stored with each acquisition, for diagnostics; empty = "hostname:pid".
  std::string owner;
  /// Metrics hooks; null = none.
  std::shared_ptr<Observer> observer;
};

namespace detail {
/// "<hostname>:<pid>": the owner a guard records when GuardOptions::owner is empty (src/core/owner.cpp).
std::string default_owner();
inline void check_options(const GuardOptions& o) {
  check_lease(o.lease);
  check_retention(o.retention, o.lease);
  if (o.failure.max_attempts == 0)
    throw invalid_options_error("idem: failure.max_attempts is 0; it counts acquisitions, use 1 for no retry");
  if (o.failure.backoff < millis{0})
    throw invalid_options_error("idem: failure.backoff is negative; use 0 for an immediate retry");
  if (o.failure.max_backoff < o.failure.backoff)
    throw invalid_options_error("idem: failure.max_backoff is below failure.backoff; raise max_backoff");
  if (o.max_key_bytes == 0) throw invalid_options_error("idem: max_key_bytes is 0; keys need at least one byte");
  if (o.wait_for_in_flight < millis{0})
    throw invalid_options_error("idem: wait_for_in_flight is negative; use 0 to answer in_flight at once");
  if (o.heartbeat && o.lease < millis{3})
    throw invalid_options_error("idem: heartbeat needs a lease of at least 3 ms (it extends every lease/3)");
}
}  // namespace detail

}  // namespace idem
