#pragma once
/// @file admin.hpp What the operator's tools see of a store (RedisAdmin, PostgresAdmin, the `idem`
/// command): a record with its clock and size, list filters, release answers, counts and findings.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "idem/core/record.hpp"

namespace idem {

/// One record as an operator sees it: the Record plus what only the store knows about it.
struct AdminRecord {
  std::string key;                ///< the idempotency key (without the store's prefix)
  Record record;                  ///< fields as stored
  std::int64_t now_ms = 0;        ///< the store clock when it was read: lease and retry times compare with it
  std::int64_t expires_in_ms = -1;  ///< time left until the record disappears; -1 = no expiry
  std::size_t bytes = 0;          ///< stored size of the value (Redis) or the row (PostgreSQL)
};

/// How long ago an in_progress lease or a failed record's backoff ended (negative = still running);
/// 0 for a completed record. This is how "stuck" is measured: nothing stores when a run started.
[[nodiscard]] constexpr std::int64_t overdue_ms(const AdminRecord& r) noexcept {
  switch (r.record.state) {
    case State::in_progress: return r.now_ms - r.record.lease_until_ms;
    case State::failed: return r.now_ms - r.record.retry_at_ms;
    default: return 0;
  }
}

/// What `list` selects.
struct ListFilter {
  std::optional<State> state;    ///< only this state; none = every state, in_progress and failed first
  std::optional<millis> older_than;  ///< only records overdue_ms() >= this (in_progress, failed)
  std::size_t limit = 0;         ///< stop after this many; 0 = all
  std::size_t page = 1000;       ///< records read per round trip (SCAN COUNT, rows per page)
};

/// The answer of a fenced release.
enum class ReleaseStatus : std::uint8_t {
  released,        ///< the record is now failed, retryable at once, with its fence and no holder
  not_found,       ///< no live record under the key
  fence_mismatch,  ///< the record's fence is not the one given: someone acquired it since
  completed,       ///< completed records are never released (their effect happened)
  live,            ///< an in_progress lease that has not lapsed; refused without `force`
};

/// What release() found and did.
struct ReleaseResult {
  ReleaseStatus status = ReleaseStatus::not_found;  ///< the decision
  std::uint64_t fence = 0;                          ///< the record's fence when it was decided
  State state = State::in_progress;                 ///< its state then
};

/// Counts of one store, read by a full pass (Redis) or one aggregate query (PostgreSQL).
struct AdminStats {
  std::array<std::uint64_t, 4> by_state{};  ///< indexed by State (0 unused)
  std::uint64_t records = 0;                ///< live records
  std::uint64_t bytes = 0;                  ///< their stored size
  std::uint64_t lapsed = 0;                 ///< in_progress records whose lease has ended (stuck)
  std::optional<std::int64_t> most_overdue_ms;  ///< largest overdue_ms() of an in_progress record
  std::uint64_t expired_rows = 0;           ///< PostgreSQL: expired rows waiting for purge
};

/// How serious a doctor finding is; any `error` makes `idem doctor` exit non-zero.
enum class Severity : std::uint8_t {
  ok,       ///< checked and fine
  info,     ///< worth knowing, no threat
  warning,  ///< weakens the guarantee in some failure, or could not be checked
  error,    ///< the guarantee does not hold as configured
};

/// One doctor check's result.
struct Finding {
  Severity severity = Severity::ok;  ///< how serious
  std::string check;                 ///< short name ("maxmemory-policy")
  std::string message;               ///< what was found
  std::string fix;                   ///< what to do; empty when nothing
};

/// Name of a severity for output.
constexpr std::string_view to_string(Severity s) noexcept {
  constexpr std::array<std::string_view, 4> names{"ok", "info", "warning", "error"};
  return detail::name_at(names, static_cast<std::size_t>(s));
}

}  // namespace idem
