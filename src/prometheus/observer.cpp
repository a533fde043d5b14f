// PrometheusObserver (include/idem/prometheus/observer.hpp) over prometheus-cpp.

#include "idem/prometheus/observer.hpp"

#include <array>
#include <stdexcept>

#include <fmt/format.h>
#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "idem/core/error.hpp"

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

  Impl(std::shared_ptr<prometheus::Registry> r, const PrometheusOptions& o) : registry(std::move(r)) {
    if (!registry) throw std::invalid_argument("idem: PrometheusObserver needs a registry");
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
  }
};

PrometheusObserver::PrometheusObserver(std::shared_ptr<prometheus::Registry> registry, PrometheusOptions options)
    : impl_(std::make_unique<Impl>(std::move(registry), options)) {}

std::shared_ptr<PrometheusObserver> PrometheusObserver::serve(const std::string& listen, PrometheusOptions options) {
  auto obs = std::make_shared<PrometheusObserver>(std::make_shared<prometheus::Registry>(), std::move(options));
  try {
    obs->impl_->exposer = std::make_unique<prometheus::Exposer>(listen);
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("idem: cannot serve metrics on {}: {}", listen, e.what()));
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

}  // namespace idem
