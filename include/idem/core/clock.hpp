#pragma once
/// @file clock.hpp Clocks for the in-process store: a monotonic default and a manual one for tests.

#include <atomic>
#include <chrono>
#include <cstdint>

#include "idem/core/record.hpp"

namespace idem {

/// Source of "now" in milliseconds for MemoryStore; the store's clock in the sense of invariant 4.
class Clock {
public:
  virtual ~Clock() = default;
  /// Current time in milliseconds on this clock's own epoch.
  [[nodiscard]] virtual std::int64_t now_ms() const noexcept = 0;
};

/// Monotonic clock (std::chrono::steady_clock): immune to wall-clock jumps. The default.
class SteadyClock final : public Clock {
public:
  /// Milliseconds since an arbitrary fixed point.
  [[nodiscard]] std::int64_t now_ms() const noexcept override {
    return std::chrono::duration_cast<millis>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
};

/// A clock that moves only when told to; thread-safe. For tests of leases and expiry.
class ManualClock final : public Clock {
public:
  /// Starts at start_ms.
  explicit ManualClock(std::int64_t start_ms = 1'000'000) noexcept : now_(start_ms) {}
  /// The current manual time.
  [[nodiscard]] std::int64_t now_ms() const noexcept override { return now_.load(std::memory_order_acquire); }
  /// Moves time forward by d.
  void advance(millis d) noexcept { now_.fetch_add(d.count(), std::memory_order_acq_rel); }

private:
  std::atomic<std::int64_t> now_;
};

}  // namespace idem
