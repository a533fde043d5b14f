#pragma once
/// @file record.hpp The record every store keeps per key, and the inputs/outputs of its transitions.

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace idem {

/// Milliseconds, the unit of every lease, retention and backoff in idem.
using millis = std::chrono::milliseconds;

/// The state of a stored record (an absent record means never seen, or expired).
enum class State : std::uint8_t {
  in_progress = 1,  ///< a holder owns the key until lease_until
  completed = 2,    ///< the handler finished; result is replayed to duplicates
  failed = 3,       ///< the handler failed; retried after retry_at unless permanent
};

/// Identifies one acquisition: the fence (grows per acquire) and a random per-acquire token.
struct Holder {
  std::uint64_t fence = 0;  ///< generation of this key, +1 on every acquire; hand it to downstream writes
  std::uint64_t token = 0;  ///< random nonce; makes a holder unique even if the record was recreated
  friend bool operator==(const Holder&, const Holder&) = default;
};

/// What the store decided on acquire.
enum class AcquireStatus : std::uint8_t {
  acquired,           ///< the caller now holds the key (fresh, retry of a failure, or takeover)
  in_flight,          ///< another holder's lease is live, or a failure is backing off; retry_after says how long
  duplicate,          ///< already completed; payload holds the stored result
  previously_failed,  ///< permanently failed; payload holds the stored error
  mismatch,           ///< the key was first seen with another payload fingerprint; nothing changed
};

/// Inputs of acquire. The guard fills it; stores only read it.
struct AcquireParams {
  std::string_view fingerprint;  ///< payload hash fixed at first acquire; empty = not checked
  millis lease{30'000};          ///< how long the holder owns the key without a heartbeat
  millis retention{86'400'000};  ///< record lifetime from now (>= lease); extended on complete/fail
  std::uint64_t token = 0;       ///< random per-acquire nonce chosen by the caller (non-zero)
  std::string_view owner;        ///< diagnostics only: which process holds the key
};

/// The store's decision on acquire, with everything the caller needs in one round trip.
struct AcquireResult {
  AcquireStatus status = AcquireStatus::in_flight;  ///< the decision
  Holder holder;                 ///< acquired: the caller's holder (fence + token)
  bool takeover = false;         ///< acquired: a lapsed in_progress lease was taken over
  std::uint32_t attempts = 0;    ///< times the key has been acquired, this one included when acquired
  millis retry_after{0};         ///< in_flight: time left on the lease (or backoff) on the store clock
  std::string payload;           ///< duplicate: stored result (or why it is unavailable); previously_failed: stored error text
  bool result_unavailable = false;  ///< duplicate: completed without its result (complete_unavailable); payload says why
};

/// Whether a holder-checked write (complete, fail, extend) took effect.
enum class WriteStatus : std::uint8_t {
  ok,         ///< written
  lease_lost  ///< the caller no longer holds the key (taken over, released, expired); nothing written
};

/// Inputs of fail: release the key for an immediate retry, or record the failure.
struct FailParams {
  std::string_view error;        ///< error text stored with the record
  bool release = false;          ///< true: retry allowed at once (record kept, fence kept growing)
  bool permanent = false;        ///< record: no more retries; acquire answers previously_failed
  millis backoff{0};             ///< record, not permanent: acquire answers in_flight until now+backoff
  millis retention{86'400'000};  ///< record lifetime from now
};

/// A snapshot of a stored record, for diagnostics and the contract tests.
struct Record {
  State state = State::in_progress;  ///< current state
  Holder holder;                     ///< fence and token of the latest acquisition
  std::string owner;                 ///< owner of the latest acquisition
  std::int64_t lease_until_ms = 0;   ///< in_progress: lease end on the store clock (ms)
  std::int64_t retry_at_ms = 0;      ///< failed: earliest retry on the store clock (ms)
  std::uint32_t attempts = 0;        ///< times acquired
  bool permanent = false;            ///< failed: no retry allowed; completed: the result is unavailable (error says why)
  std::string fingerprint;           ///< payload hash fixed at first acquire, or empty
  std::string result;                ///< completed: encoded result
  std::string error;                 ///< failed: error text; completed without its result: why
};

namespace detail {
/// names[i], or "unknown" for a value outside the table (a damaged byte, a newer library's enum).
template <std::size_t N>
constexpr std::string_view name_at(const std::array<std::string_view, N>& names, std::size_t i) noexcept {
  return i < N ? names[i] : std::string_view("unknown");
}
}  // namespace detail

/// Name of a state for messages and logs.
constexpr std::string_view to_string(State s) noexcept {
  constexpr std::array<std::string_view, 4> names{"unknown", "in_progress", "completed", "failed"};
  return detail::name_at(names, static_cast<std::size_t>(s));
}

/// Name of an acquire status for messages and logs.
constexpr std::string_view to_string(AcquireStatus s) noexcept {
  constexpr std::array<std::string_view, 5> names{"acquired", "in_flight", "duplicate", "previously_failed",
                                                  "mismatch"};
  return detail::name_at(names, static_cast<std::size_t>(s));
}

}  // namespace idem
