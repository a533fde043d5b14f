#pragma once
/// @file observer.hpp Metrics hooks with no logging dependency, and a ready-made counting observer.

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string_view>

#include "idem/core/outcome.hpp"

namespace idem {

/// One finished run, as reported to Observer::on_outcome.
struct OutcomeEvent {
  std::string_view key;              ///< the idempotency key
  Status status;                     ///< the outcome
  std::chrono::nanoseconds latency;  ///< wall time of run(), handler included
  std::uint32_t attempt;             ///< times acquired
  bool takeover;                     ///< the run took over a lapsed lease
  bool from_cache;                   ///< answered by the in-process cache
};

/// Hooks called by the guard; override what you need. Calls come from the running thread (and the
/// lease keeper thread for on_lease_lost), must not throw, and must be thread-safe.
class Observer {
public:
  virtual ~Observer() = default;
  /// A run finished with an outcome.
  virtual void on_outcome(const OutcomeEvent&) noexcept {}
  /// A store call failed; the guard rethrows after this (the handler did not run, or ran unrecorded).
  virtual void on_store_error(std::string_view /*key*/, const std::exception&) noexcept {}
  /// The lease keeper found the lease taken over (or unreachable for a whole lease); the stop token fires.
  virtual void on_lease_lost(std::string_view /*key*/, std::uint64_t /*fence*/) noexcept {}
  /// The handler threw; the failure policy was applied before the rethrow.
  virtual void on_handler_error(std::string_view /*key*/, const std::exception_ptr&) noexcept {}
  /// A store advisory (for example a Redis eviction policy that can drop idempotency keys).
  virtual void on_warning(std::string_view /*message*/) noexcept {}
  /// The heartbeat extended a live holder's lease: from the lease keeper thread (run), or the run's executor (run_async).
  virtual void on_lease_extended(std::string_view /*key*/, std::uint64_t /*fence*/) noexcept {}
  /// run_batch started on `size` items (before any of them is decided).
  virtual void on_batch(std::size_t /*size*/) noexcept {}
};

/// Observer that counts outcomes and sums latencies with atomics; read with count()/total_latency().
class CountingObserver : public Observer {
public:
  /// Counts the outcome and adds its latency.
  void on_outcome(const OutcomeEvent& e) noexcept override {
    counts_[static_cast<std::size_t>(e.status)].fetch_add(1, std::memory_order_relaxed);
    nanos_.fetch_add(static_cast<std::uint64_t>(e.latency.count()), std::memory_order_relaxed);
    if (e.takeover) takeovers_.fetch_add(1, std::memory_order_relaxed);
    if (e.from_cache) cache_hits_.fetch_add(1, std::memory_order_relaxed);
  }
  /// Counts store errors.
  void on_store_error(std::string_view, const std::exception&) noexcept override {
    store_errors_.fetch_add(1, std::memory_order_relaxed);
  }
  /// Counts handler errors.
  void on_handler_error(std::string_view, const std::exception_ptr&) noexcept override {
    handler_errors_.fetch_add(1, std::memory_order_relaxed);
  }
  /// How many runs ended with status s.
  [[nodiscard]] std::uint64_t count(Status s) const noexcept {
    return counts_[static_cast<std::size_t>(s)].load(std::memory_order_relaxed);
  }
  /// Runs that took over a lapsed lease.
  [[nodiscard]] std::uint64_t takeovers() const noexcept { return takeovers_.load(std::memory_order_relaxed); }
  /// Duplicates answered by the in-process cache.
  [[nodiscard]] std::uint64_t cache_hits() const noexcept { return cache_hits_.load(std::memory_order_relaxed); }
  /// Store calls that threw.
  [[nodiscard]] std::uint64_t store_errors() const noexcept { return store_errors_.load(std::memory_order_relaxed); }
  /// Handlers that threw.
  [[nodiscard]] std::uint64_t handler_errors() const noexcept { return handler_errors_.load(std::memory_order_relaxed); }
  /// Sum of all run latencies.
  [[nodiscard]] std::chrono::nanoseconds total_latency() const noexcept {
    return std::chrono::nanoseconds(static_cast<std::int64_t>(nanos_.load(std::memory_order_relaxed)));
  }

private:
  std::array<std::atomic<std::uint64_t>, 7> counts_{};
  std::atomic<std::uint64_t> nanos_{0}, takeovers_{0}, cache_hits_{0}, store_errors_{0}, handler_errors_{0};
};

}  // namespace idem
