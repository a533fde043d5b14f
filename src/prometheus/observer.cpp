// PrometheusObserver (include/idem/prometheus/observer.hpp) over prometheus-cpp.

#include "idem/prometheus/observer.hpp"

#include <array>
#include <stdexcept>

#include <fmt/format.h>
#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "idem/core/error.hpp"
#include "idem/core/version.hpp"

namespace idem {

namespace {

constexpr std::size_t status_count = 7;
constexpr std::array<Status, status_count> all_statuses{Status::executed,   Status::duplicate, Status::in_flight,
                                                        Status::previously_failed, Status::stale,
                                                        Status::lease_lost, Status::mismatch};
constexpr std::array<std::string_view, 11> error_types{
    "corrupt_record_error", "outcome_unknown_error", "durability_error", "capacity_error",
    "timeout_error",        "connection_error",      "store_error",      "result_not_stored_error",
    "codec_error",          "usage_error",           "other"};

// The guard's store calls (StoreCallEvent::op); another name is counted as "other".
constexpr std::array<std::string_view, 8> store_ops{"acquire",       "complete",    "fail",  "begin", "commit",
                                                     "batch_acquire", "batch_write", "other"};
constexpr std::array<std::string_view, 2> pool_kinds{"redis", "postgres"};

template <std::size_t N>
std::size_t index_of(const std::array<std::string_view, N>& names, std::string_view name) {
  for (std::size_t i = 0; i + 1 < N; ++i)
    if (names[i] == name) return i;
  return N - 1;
}

std::vector<double> or_default(std::vector<double> b, std::vector<double> dflt) { return b.empty() ? dflt : b; }

}  // namespace

std::string_view store_error_type(const std::exception& e) noexcept {
  // Most derived first: a durability_error is also a store_error, and the alert wants the former.
  if (dynamic_cast<const corrupt_record_error*>(&e)) return error_types[0];
  if (dynamic_cast<const outcome_unknown_error*>(&e)) return error_types[1];
  if (dynamic_cast<const durability_error*>(&e)) return error_types[2];
  if (dynamic_cast<const capacity_error*>(&e)) return error_types[3];
  if (dynamic_cast<const timeout_error*>(&e)) return error_types[4];
  if (dynamic_cast<const connection_error*>(&e)) return error_types[5];
  if (dynamic_cast<const store_error*>(&e)) return error_types[6];
  if (dynamic_cast<const result_not_stored_error*>(&e)) return error_types[7];
  if (dynamic_cast<const codec_error*>(&e)) return error_types[8];
  if (dynamic_cast<const usage_error*>(&e)) return error_types[9];
  return error_types[10];
}

struct PrometheusObserver::Impl {
  std::shared_ptr<prometheus::Registry> registry;
  std::unique_ptr<prometheus::Exposer> exposer;
  int port = 0;
  // Handles are looked up once here, so a hook is an atomic add and never a map lookup or an allocation.
  std::array<prometheus::Counter*, status_count> outcomes{};
  std::array<prometheus::Histogram*, status_count> latency{};
  std::array<prometheus::Counter*, error_types.size()> store_errors{};
  prometheus::Counter* takeovers = nullptr;
  prometheus::Counter* lease_lost = nullptr;
  prometheus::Counter* extensions = nullptr;
  prometheus::Counter* cache_hits = nullptr;
  prometheus::Counter* handler_errors = nullptr;
  prometheus::Counter* warnings = nullptr;
  prometheus::Histogram* batch_size = nullptr;
  std::array<prometheus::Histogram*, store_ops.size()> call_latency{};
  std::array<prometheus::Counter*, store_ops.size()> call_failures{};
  struct PoolMetrics {
    prometheus::Gauge* in_use = nullptr;
    prometheus::Gauge* open = nullptr;
    prometheus::Gauge* size = nullptr;
    prometheus::Histogram* wait = nullptr;
    prometheus::Counter* exhausted = nullptr;
  };
  std::array<PoolMetrics, pool_kinds.size()> pools{};
  prometheus::Counter* relay_published = nullptr;
  prometheus::Counter* relay_batches = nullptr;
  prometheus::Counter* relay_publish_failures = nullptr;
  prometheus::Counter* relay_errors = nullptr;
  prometheus::Counter* relay_purged = nullptr;
  prometheus::Family<prometheus::Gauge>* consumer_pending = nullptr;
  prometheus::Family<prometheus::Gauge>* consumer_held = nullptr;
  prometheus::Family<prometheus::Counter>* consumer_rebalances = nullptr;

  Impl(std::shared_ptr<prometheus::Registry> r, const PrometheusOptions& o) : registry(std::move(r)) {
    if (!registry) throw invalid_options_error("idem: PrometheusObserver needs a registry");
    const prometheus::Labels store{{"store", o.store}};
    auto& outcome_family = prometheus::BuildCounter()
                               .Name("idem_outcomes_total")
                               .Help("Guard runs by outcome status")
                               .Labels(store)
                               .Register(*registry);
    auto& latency_family = prometheus::BuildHistogram()
                               .Name("idem_run_duration_seconds")
                               .Help("Wall time of one guard run, handler included, by outcome status")
                               .Labels(store)
                               .Register(*registry);
    const auto latency_buckets =
        or_default(o.latency_buckets, {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30});
    for (std::size_t i = 0; i < status_count; ++i) {
      const std::string status(to_string(all_statuses[i]));
      outcomes[i] = &outcome_family.Add({{"status", status}});
      latency[i] = &latency_family.Add({{"status", status}}, latency_buckets);
    }
    auto& error_family = prometheus::BuildCounter()
                             .Name("idem_store_errors_total")
                             .Help("Store calls that failed (the guard failed closed), by idem error type")
                             .Labels(store)
                             .Register(*registry);
    for (std::size_t i = 0; i < error_types.size(); ++i)
      store_errors[i] = &error_family.Add({{"type", std::string(error_types[i])}});
    auto counter = [&](const char* name, const char* help) {
      return &prometheus::BuildCounter().Name(name).Help(help).Labels(store).Register(*registry).Add({});
    };
    takeovers = counter("idem_takeovers_total", "Runs that took over a lapsed lease (a holder died or stalled)");
    lease_lost = counter("idem_lease_lost_total",
                         "Leases the heartbeat found taken over or unreachable for a whole lease");
    extensions = counter("idem_heartbeat_extensions_total", "Leases extended by the heartbeat");
    cache_hits = counter("idem_cache_hits_total", "Duplicates answered by the in-process cache");
    handler_errors = counter("idem_handler_errors_total", "Handlers that threw");
    warnings = counter("idem_store_warnings_total", "Store advisories (e.g. an eviction policy)");
    batch_size = &prometheus::BuildHistogram()
                      .Name("idem_batch_size")
                      .Help("Items per run_batch call")
                      .Labels(store)
                      .Register(*registry)
                      .Add({}, or_default(o.batch_buckets, {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000}));

    auto& call_family = prometheus::BuildHistogram()
                            .Name("idem_store_call_duration_seconds")
                            .Help("Time the store took to answer one guard call, by call (acquire, complete, batch_acquire...)")
                            .Labels(store)
                            .Register(*registry);
    auto& call_failure_family = prometheus::BuildCounter()
                                    .Name("idem_store_call_failures_total")
                                    .Help("Guard store calls that threw, by call (idem_store_errors_total says of what type)")
                                    .Labels(store)
                                    .Register(*registry);
    const auto call_buckets =
        or_default(o.store_call_buckets, {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5});
    for (std::size_t i = 0; i < store_ops.size(); ++i) {
      call_latency[i] = &call_family.Add({{"op", std::string(store_ops[i])}}, call_buckets);
      call_failures[i] = &call_failure_family.Add({{"op", std::string(store_ops[i])}});
    }

    auto& in_use_family = prometheus::BuildGauge()
                              .Name("idem_pool_connections_in_use")
                              .Help("Store connections checked out, at the pool's last checkout or return")
                              .Labels(store)
                              .Register(*registry);
    auto& open_family = prometheus::BuildGauge()
                            .Name("idem_pool_connections_open")
                            .Help("Store connections open (in use and idle)")
                            .Labels(store)
                            .Register(*registry);
    auto& size_family = prometheus::BuildGauge()
                            .Name("idem_pool_connections_max")
                            .Help("The pool's size (PoolOptions::size)")
                            .Labels(store)
                            .Register(*registry);
    auto& wait_family = prometheus::BuildHistogram()
                            .Name("idem_pool_wait_seconds")
                            .Help("Checkouts that found every connection busy: how long they waited")
                            .Labels(store)
                            .Register(*registry);
    auto& exhausted_family = prometheus::BuildCounter()
                                 .Name("idem_pool_exhausted_total")
                                 .Help("Checkouts that waited pool.wait and gave up (timeout_error POOL)")
                                 .Labels(store)
                                 .Register(*registry);
    for (std::size_t i = 0; i < pool_kinds.size(); ++i) {
      const prometheus::Labels pool{{"pool", std::string(pool_kinds[i])}};
      pools[i] = {&in_use_family.Add(pool), &open_family.Add(pool), &size_family.Add(pool),
                  &wait_family.Add(pool, prometheus::Histogram::BucketBoundaries{0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5}),
                  &exhausted_family.Add(pool)};
    }

    relay_published = counter("idem_outbox_relay_published_total", "Outbox rows published and marked sent");
    relay_batches = counter("idem_outbox_relay_batches_total", "Outbox batches published");
    relay_publish_failures =
        counter("idem_outbox_relay_publish_failures_total", "Outbox batches the publisher refused (their rows back off)");
    relay_errors = counter("idem_outbox_relay_errors_total", "Outbox claims or marks that failed on the database (retried)");
    relay_purged = counter("idem_outbox_relay_purged_total", "Sent outbox rows deleted after the retention");

    consumer_pending = &prometheus::BuildGauge()
                            .Name("idem_consumer_pending")
                            .Help("Messages delivered to this consumer and not yet settled, per partition or queue")
                            .Labels(store)
                            .Register(*registry);
    consumer_held = &prometheus::BuildGauge()
                         .Name("idem_consumer_held")
                         .Help("Settled messages not yet committable behind an unsettled earlier one, per partition")
                         .Labels(store)
                         .Register(*registry);
    consumer_rebalances = &prometheus::BuildCounter()
                               .Name("idem_consumer_rebalances_total")
                               .Help("Assignments of a consumer source that changed (a rebalance)")
                               .Labels(store)
                               .Register(*registry);

    prometheus::BuildGauge()
        .Name("idem_build_info")
        .Help("idem's version (always 1)")
        .Labels(store)
        .Register(*registry)
        .Add({{"version", std::string(idem::version_string)}, {"program", o.program}})
        .Set(1);
  }
};

PrometheusObserver::PrometheusObserver(std::shared_ptr<prometheus::Registry> registry, PrometheusOptions options)
    : impl_(std::make_unique<Impl>(std::move(registry), options)) {}

std::shared_ptr<PrometheusObserver> PrometheusObserver::serve(const std::string& listen, PrometheusOptions options) {
  auto obs = std::make_shared<PrometheusObserver>(std::make_shared<prometheus::Registry>(), std::move(options));
  try {
    obs->impl_->exposer = std::make_unique<prometheus::Exposer>(listen);
  } catch (const std::exception& e) {
    // A bad or busy address: the caller's to change (usage_error is still a std::runtime_error).
    throw usage_error(fmt::format("idem: cannot serve metrics on {}: {}", listen, e.what()));
  }
  obs->impl_->exposer->RegisterCollectable(obs->impl_->registry);
  const auto ports = obs->impl_->exposer->GetListeningPorts();
  obs->impl_->port = ports.empty() ? 0 : ports.front();
  return obs;
}

PrometheusObserver::~PrometheusObserver() = default;

const std::shared_ptr<prometheus::Registry>& PrometheusObserver::registry() const noexcept { return impl_->registry; }
int PrometheusObserver::port() const noexcept { return impl_->port; }

void PrometheusObserver::on_outcome(const OutcomeEvent& e) noexcept {
  const auto i = static_cast<std::size_t>(e.status);
  if (i >= status_count) return;
  impl_->outcomes[i]->Increment();
  impl_->latency[i]->Observe(std::chrono::duration<double>(e.latency).count());
  if (e.takeover) impl_->takeovers->Increment();
  if (e.from_cache) impl_->cache_hits->Increment();
}

void PrometheusObserver::on_store_error(std::string_view, const std::exception& e) noexcept {
  const std::string_view type = store_error_type(e);
  for (std::size_t i = 0; i < error_types.size(); ++i)
    if (error_types[i] == type) impl_->store_errors[i]->Increment();
}

void PrometheusObserver::on_lease_lost(std::string_view, std::uint64_t) noexcept { impl_->lease_lost->Increment(); }
void PrometheusObserver::on_handler_error(std::string_view, const std::exception_ptr&) noexcept {
  impl_->handler_errors->Increment();
}
void PrometheusObserver::on_warning(std::string_view) noexcept { impl_->warnings->Increment(); }
void PrometheusObserver::on_lease_extended(std::string_view, std::uint64_t) noexcept { impl_->extensions->Increment(); }
void PrometheusObserver::on_batch(std::size_t size) noexcept {
  impl_->batch_size->Observe(static_cast<double>(size));
}

void PrometheusObserver::on_store_call(const StoreCallEvent& e) noexcept {
  const std::size_t i = index_of(store_ops, e.op);
  impl_->call_latency[i]->Observe(std::chrono::duration<double>(e.latency).count());
  if (!e.ok) impl_->call_failures[i]->Increment();
}

void PrometheusObserver::on_pool(const PoolEvent& e) noexcept {
  std::size_t i = 0;
  while (i < pool_kinds.size() && pool_kinds[i] != e.pool) ++i;
  if (i == pool_kinds.size()) return;  // a pool idem does not know of: no series for it
  const auto& p = impl_->pools[i];
  p.in_use->Set(static_cast<double>(e.in_use));
  p.open->Set(static_cast<double>(e.open));
  p.size->Set(static_cast<double>(e.size));
  if (e.wait.count() > 0) p.wait->Observe(std::chrono::duration<double>(e.wait).count());
  if (e.exhausted) p.exhausted->Increment();
}

void PrometheusObserver::on_relay(const OutboxRelayEvent& e) noexcept {
  switch (e.kind) {
    case OutboxRelayEvent::Kind::published:
      impl_->relay_published->Increment(static_cast<double>(e.rows));
      impl_->relay_batches->Increment();
      break;
    case OutboxRelayEvent::Kind::publish_failed: impl_->relay_publish_failures->Increment(); break;
    case OutboxRelayEvent::Kind::error: impl_->relay_errors->Increment(); break;
    case OutboxRelayEvent::Kind::purged: impl_->relay_purged->Increment(static_cast<double>(e.rows)); break;
    case OutboxRelayEvent::Kind::warning: impl_->warnings->Increment(); break;
  }
}

void PrometheusObserver::on_source(const SourceEvent& e) noexcept {
  try {
    // Family::Add finds the series of these labels (creating it once): a lookup under the
    // family's lock, once per partition per batch.
    const prometheus::Labels labels{{"source", std::string(e.source)}, {"partition", std::string(e.partition)}};
    impl_->consumer_pending->Add(labels).Set(static_cast<double>(e.pending));
    impl_->consumer_held->Add(labels).Set(static_cast<double>(e.held));
    // The counter exists from a source's first report, at 0, so increase() sees its first rebalance.
    auto& rebalances = impl_->consumer_rebalances->Add({{"source", std::string(e.source)}});
    if (e.rebalanced) rebalances.Increment();
  } catch (...) {
    // Out of memory: this report is lost, the next one sets the gauges.
  }
}

}  // namespace idem
