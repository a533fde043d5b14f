#pragma once
/// @file prometheus/observer.hpp PrometheusObserver: the guard's Observer hooks as Prometheus metrics
/// (target idem::prometheus; docs/operations.md lists every metric and the alerts built on them).

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "idem/core/observer.hpp"

namespace prometheus {
class Registry;
}

namespace idem {

/// Options of a PrometheusObserver.
struct PrometheusOptions {
  /// Value of the `store` label on every series, so one registry can carry several guards
  /// ("redis", "postgres", "memory", or a name of yours).
  std::string store = "memory";
  /// Upper bounds (seconds) of the `idem_run_duration_seconds` buckets; empty = 0.5 ms .. 30 s.
  std::vector<double> latency_buckets;
  /// Upper bounds of the `idem_batch_size` buckets; empty = 1 .. 1000.
  std::vector<double> batch_buckets;
  /// Upper bounds (seconds) of the `idem_store_call_duration_seconds` buckets; empty = 0.1 ms .. 5 s.
  std::vector<double> store_call_buckets;
  /// The `program` label of `idem_build_info` (your service's name).
  std::string program = "idem";
};

/**
 * Observer that feeds Prometheus metrics: outcomes by status, run latency per status, store errors
 * by type, takeovers, lease losses, heartbeat extensions, batch sizes, cache hits, handler errors
 * and store warnings; store-call latency by call, connection pool use and waits, an embedded
 * outbox relay's counters, consumer sources' pending / held messages per partition and
 * rebalances, and `idem_build_info`; every series labelled with PrometheusOptions::store. Thread-safe (the
 * prometheus-cpp metrics are atomics); hand it to GuardOptions::observer as a shared_ptr.
 *
 * @code
 * auto metrics = std::make_shared<idem::PrometheusObserver>(registry, idem::PrometheusOptions{.store = "redis"});
 * // or its own /metrics endpoint: idem::PrometheusObserver::serve("0.0.0.0:9464", {.store = "redis"})
 * idem::IdempotencyGuard guard{store, {.observer = metrics}};
 * @endcode
 */
class PrometheusObserver : public Observer {
public:
  /// Registers idem's metric families in `registry` (the application's own; null throws
  /// invalid_options_error).
  explicit PrometheusObserver(std::shared_ptr<prometheus::Registry> registry, PrometheusOptions options = {});
  /// An observer with a registry of its own served at `http://<listen>/metrics` ("host:port";
  /// port 0 = any free port, see port()). Throws usage_error when it cannot listen.
  static std::shared_ptr<PrometheusObserver> serve(const std::string& listen, PrometheusOptions options = {});
  ~PrometheusObserver() override;                                   ///< Stops the exposer, if any.
  PrometheusObserver(const PrometheusObserver&) = delete;             ///< Owns its metric handles.
  PrometheusObserver& operator=(const PrometheusObserver&) = delete;  ///< Owns its metric handles.

  /// The registry the metrics live in.
  [[nodiscard]] const std::shared_ptr<prometheus::Registry>& registry() const noexcept;
  /// The port serve() listens on; 0 for an observer on the application's registry.
  [[nodiscard]] int port() const noexcept;

  /// Counts the outcome, observes its latency, counts a takeover or a cache hit.
  void on_outcome(const OutcomeEvent& e) noexcept override;
  /// Counts the error under its idem type (connection_error, timeout_error, ...).
  void on_store_error(std::string_view key, const std::exception& e) noexcept override;
  /// Counts a lease the keeper found lost.
  void on_lease_lost(std::string_view key, std::uint64_t fence) noexcept override;
  /// Counts a handler that threw.
  void on_handler_error(std::string_view key, const std::exception_ptr& e) noexcept override;
  /// Counts a store advisory.
  void on_warning(std::string_view message) noexcept override;
  /// Counts a heartbeat extension.
  void on_lease_extended(std::string_view key, std::uint64_t fence) noexcept override;
  /// Observes a batch's size.
  void on_batch(std::size_t size) noexcept override;
  /// Observes a store call's latency by call; counts it as failed when it threw.
  void on_store_call(const StoreCallEvent& e) noexcept override;
  /// Sets the pool's in-use / open / size gauges; observes a checkout's wait; counts an exhausted pool.
  void on_pool(const PoolEvent& e) noexcept override;
  /// Counts the outbox relay's published rows and batches, publish failures, errors and purges.
  void on_relay(const OutboxRelayEvent& e) noexcept override;
  /// Sets a consumer partition's pending and held gauges; counts a rebalance.
  void on_source(const SourceEvent& e) noexcept override;

private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The `type` label on_store_error gives `e`: the most derived idem error class it is, or "other".
[[nodiscard]] std::string_view store_error_type(const std::exception& e) noexcept;

}  // namespace idem
