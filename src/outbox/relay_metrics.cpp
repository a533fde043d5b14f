// idem-outbox-relay's /metrics: see relay_metrics.hpp and docs/relay.md (the metric names).

#include "relay_metrics.hpp"

#include <fmt/format.h>
#include <libpq-fe.h>
#include <prometheus/collectable.h>
#include <prometheus/exposer.h>
#include <prometheus/metric_family.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include "idem/core/version.hpp"

namespace idem::relay_program {

namespace {

std::string quote_ident(const std::string& s) {
  std::string q = "\"";
  for (const char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

struct Backlog {
  double rows = 0;
  double oldest_age_seconds = 0;
};

// A session of its own (the relay's two are busy on its thread), opened at the first scrape and
// again after a failure; each scrape runs one statement on it, under a mutex.
class BacklogQuery {
 public:
  explicit BacklogQuery(const MetricsSource& s)
      : conninfo_(s.conninfo),
        pooler_(s.transaction_pooler),
        sql_(
            "SELECT count(*), coalesce(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint - min(created_at), "
            "0) "
            "FROM " +
            quote_ident(s.schema) + "." + quote_ident(s.table + "_outbox") + " WHERE sent_at IS NULL") {}
  ~BacklogQuery() { close(); }
  BacklogQuery(const BacklogQuery&) = delete;
  BacklogQuery& operator=(const BacklogQuery&) = delete;

  // nullopt when the database cannot answer (down, no outbox table yet): the gauges are left out.
  std::optional<Backlog> read() {
    std::lock_guard lock(mu_);
    if (!conn_ && !open()) return std::nullopt;
    PGresult* r = PQexec(conn_, sql_.c_str());
    std::optional<Backlog> out;
    if (PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1) {
      out = Backlog{std::strtod(PQgetvalue(r, 0, 0), nullptr), std::strtod(PQgetvalue(r, 0, 1), nullptr) / 1000.0};
      if (out->oldest_age_seconds < 0) out->oldest_age_seconds = 0;  // clocks of two sessions: never negative
    }
    PQclear(r);
    if (!out && PQstatus(conn_) != CONNECTION_OK) close();
    return out;
  }

 private:
  bool open() {
    // connect_timeout first, so a connect_timeout in the conninfo wins over this default.
    const char* const keys[] = {"connect_timeout", "application_name", "dbname", nullptr};
    const char* const values[] = {"5", "idem-outbox-relay-metrics", conninfo_.c_str(), nullptr};
    conn_ = PQconnectdbParams(keys, values, /*expand_dbname=*/1);
    if (PQstatus(conn_) != CONNECTION_OK) {
      close();
      return false;
    }
    if (!pooler_) PQclear(PQexec(conn_, "SET statement_timeout = 5000"));
    return true;
  }
  void close() {
    if (conn_) PQfinish(conn_);
    conn_ = nullptr;
  }

  std::string conninfo_;
  bool pooler_;
  std::string sql_;
  std::mutex mu_;
  PGconn* conn_ = nullptr;
};

prometheus::MetricFamily family(std::string name, std::string help, prometheus::MetricType type) {
  prometheus::MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = type;
  return f;
}

class Collector final : public prometheus::Collectable {
 public:
  Collector(const OutboxRelay& relay, const MetricsSource& s)
      : relay_(relay), labels_{{"publisher", s.publisher}, {"outbox", s.schema + "." + s.table}}, backlog_(s) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> out;
    const auto counter = [&](const char* name, const char* help, std::uint64_t v) {
      auto f = family(name, help, prometheus::MetricType::Counter);
      prometheus::ClientMetric m;
      m.label = labels_;
      m.counter.value = static_cast<double>(v);
      f.metric.push_back(std::move(m));
      out.push_back(std::move(f));
    };
    const auto gauge = [&](const char* name, const char* help, double v,
                           std::vector<prometheus::ClientMetric::Label> l) {
      auto f = family(name, help, prometheus::MetricType::Gauge);
      prometheus::ClientMetric m;
      m.label = std::move(l);
      m.gauge.value = v;
      f.metric.push_back(std::move(m));
      out.push_back(std::move(f));
    };
    const OutboxRelayStats s = relay_.stats();
    counter("idem_outbox_relay_published_total", "Outbox rows published and marked sent", s.published);
    counter("idem_outbox_relay_batches_total", "Batches published", s.batches);
    counter("idem_outbox_relay_publish_failures_total",
            "Batches the publisher refused (their rows back off and are published again)", s.publish_failures);
    counter("idem_outbox_relay_errors_total", "Claims or marks that failed on the database (retried)", s.errors);
    counter("idem_outbox_relay_held_back_total", "Claimed rows held back behind an earlier unsent row of their key",
            s.held_back);
    counter("idem_outbox_relay_purged_total", "Sent rows deleted after the retention", s.purged);
    counter("idem_outbox_relay_notifications_total", "Wake-ups by the outbox's NOTIFY", s.notifications);
    if (const auto b = backlog_.read()) {
      gauge("idem_outbox_relay_backlog_rows", "Unsent rows in the outbox (due or backing off), at scrape time", b->rows,
            labels_);
      gauge("idem_outbox_relay_oldest_unsent_age_seconds",
            "Age of the oldest unsent row at scrape time (0 when there is none)", b->oldest_age_seconds, labels_);
    } else {
      ++backlog_failures_;
    }
    counter("idem_outbox_relay_backlog_query_failures_total",
            "Scrapes whose backlog query failed (database down, no outbox table yet): the backlog gauges were left out",
            backlog_failures_.load());
    gauge("idem_build_info", "idem's version (always 1)", 1,
          {{"version", std::string(idem::version_string)}, {"program", "idem-outbox-relay"}});
    return out;
  }

 private:
  const OutboxRelay& relay_;
  std::vector<prometheus::ClientMetric::Label> labels_;
  mutable BacklogQuery backlog_;
  mutable std::atomic<std::uint64_t> backlog_failures_{0};
};

}  // namespace

struct RelayMetrics::Impl {
  std::shared_ptr<Collector> collector;
  std::unique_ptr<prometheus::Exposer> exposer;
};

RelayMetrics::RelayMetrics(const std::string& listen, const OutboxRelay& relay, MetricsSource source)
    : impl_(std::make_unique<Impl>()) {
  impl_->collector = std::make_shared<Collector>(relay, source);
  try {
    impl_->exposer = std::make_unique<prometheus::Exposer>(listen, /*num_threads=*/1);
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("cannot serve /metrics on {}: {}", listen, e.what()));
  }
  impl_->exposer->RegisterCollectable(impl_->collector);
}

RelayMetrics::~RelayMetrics() = default;

int RelayMetrics::port() const {
  const auto ports = impl_->exposer->GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

}  // namespace idem::relay_program
