#pragma once
/// @file observer.hpp Metrics hooks with no logging dependency, and a ready-made counting observer.

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

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

/// One store call the guard made (acquire, complete, fail, begin, commit, a batch's), as reported to
/// Observer::on_store_call: the time the store took to answer, and whether it answered or threw.
struct StoreCallEvent {
  std::string_view op;               ///< acquire, complete, fail, begin, commit, batch_acquire, batch_write
  std::chrono::nanoseconds latency;  ///< from the call to its answer (or its exception)
  bool ok;                           ///< false: the call threw (on_store_error says what)
};

/// A connection pool's state after a checkout or a return, as reported to Observer::on_pool.
struct PoolEvent {
  std::string_view pool;          ///< which pool: "postgres" (Redis has no pool)
  std::size_t in_use;             ///< connections checked out now
  std::size_t open;               ///< connections open now (in use + idle)
  std::size_t size;               ///< PoolOptions::size
  std::chrono::nanoseconds wait;  ///< a checkout: how long it waited for a connection; a return: 0
  bool exhausted;                 ///< the checkout waited PoolOptions::wait and gave up (timeout_error POOL)
};

/// One event of the outbox relay (OutboxRelay::set_observer), as reported to Observer::on_relay.
struct OutboxRelayEvent {
  /// What happened.
  enum class Kind : std::uint8_t {
    published,       ///< a batch of `rows` was published and marked sent
    publish_failed,  ///< the publisher refused a batch of `rows`; `error` says why; they back off
    error,           ///< a database error (the loop goes on after poll_interval); `error` says why
    purged,          ///< `rows` sent rows were deleted
    warning,         ///< something the operator should know (e.g. polling behind a transaction pooler); `error` says what
  };
  Kind kind = Kind::published;  ///< what happened
  std::size_t rows = 0;         ///< rows concerned
  std::string error;            ///< publish_failed, error: the message
};

/// A consumer source's backlog of one partition (Kafka) or queue / stream, reported by
/// idem::consume after each batch (Observer::on_source) for sources that count it.
struct SourceEvent {
  std::string_view source;     ///< the broker: kafka, rabbitmq, nats, redis_streams
  std::string_view partition;  ///< "topic/3", the queue, the stream
  std::size_t pending = 0;     ///< delivered to this consumer, not yet settled
  std::size_t held = 0;        ///< settled but not yet committable behind an unsettled earlier message
  bool rebalanced = false;     ///< the source's assignment changed since the last report
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
  /// The guard's store call answered or threw (lease and transactional modes, and run_batch).
  virtual void on_store_call(const StoreCallEvent& /*e*/) noexcept {}
  /// A store's connection pool after a checkout or a return (RedisStore, PostgresStore).
  virtual void on_pool(const PoolEvent& /*e*/) noexcept {}
  /// The outbox relay published, failed, purged or warned (OutboxRelay::set_observer).
  virtual void on_relay(const OutboxRelayEvent& /*e*/) noexcept {}
  /// idem::consume's source after a batch: one partition's or queue's backlog (see SourceEvent).
  virtual void on_source(const SourceEvent& /*e*/) noexcept {}
};

/// Hands every hook to each of several observers, in order: Prometheus metrics and logs together.
/// Thread-safe when they are; the list is fixed at construction.
class TeeObserver final : public Observer {
public:
  /// Forwards to every non-null observer of `to`.
  explicit TeeObserver(std::vector<std::shared_ptr<Observer>> to) : to_(std::move(to)) {
    std::erase(to_, nullptr);
  }
  /// Forwards to each.
  void on_outcome(const OutcomeEvent& e) noexcept override { each([&](Observer& o) { o.on_outcome(e); }); }
  /// Forwards to each.
  void on_store_error(std::string_view key, const std::exception& e) noexcept override {
    each([&](Observer& o) { o.on_store_error(key, e); });
  }
  /// Forwards to each.
  void on_lease_lost(std::string_view key, std::uint64_t fence) noexcept override {
    each([&](Observer& o) { o.on_lease_lost(key, fence); });
  }
  /// Forwards to each.
  void on_handler_error(std::string_view key, const std::exception_ptr& e) noexcept override {
    each([&](Observer& o) { o.on_handler_error(key, e); });
  }
  /// Forwards to each.
  void on_warning(std::string_view message) noexcept override { each([&](Observer& o) { o.on_warning(message); }); }
  /// Forwards to each.
  void on_lease_extended(std::string_view key, std::uint64_t fence) noexcept override {
    each([&](Observer& o) { o.on_lease_extended(key, fence); });
  }
  /// Forwards to each.
  void on_batch(std::size_t size) noexcept override { each([&](Observer& o) { o.on_batch(size); }); }
  /// Forwards to each.
  void on_store_call(const StoreCallEvent& e) noexcept override { each([&](Observer& o) { o.on_store_call(e); }); }
  /// Forwards to each.
  void on_pool(const PoolEvent& e) noexcept override { each([&](Observer& o) { o.on_pool(e); }); }
  /// Forwards to each.
  void on_relay(const OutboxRelayEvent& e) noexcept override { each([&](Observer& o) { o.on_relay(e); }); }
  /// Forwards to each.
  void on_source(const SourceEvent& e) noexcept override { each([&](Observer& o) { o.on_source(e); }); }

private:
  template <class F>
  void each(F&& f) noexcept {
    for (const auto& o : to_) f(*o);
  }
  std::vector<std::shared_ptr<Observer>> to_;
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
