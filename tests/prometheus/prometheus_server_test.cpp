// The operations kit against a real Prometheus server (Debian: prometheus): this program is the
// consumer — an IdempotencyGuard on a MemoryStore with idem::PrometheusObserver serving /metrics
// from prometheus-cpp's Exposer on a free loopback port — and it starts `prometheus`
// (tests/support/prometheus_server.hpp: a temp dir, a free port, a 1 s scrape of that exporter,
// docs/operations/idem-alerts.yml as its rule file). After a workload whose every count is known,
// it asks Prometheus's HTTP API, with the PromQL the alert rules and the dashboard
// (docs/operations/idem-dashboard.json) use, and checks the answers equal what the consumer
// produced; then that the alerts Prometheus evaluated are the expected ones.
// Prometheus is stopped by PID at the end, also when a check fails; a prometheus that cannot start
// fails the test.

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/core.h>

#include "idem/guard/guard.hpp"
#include "idem/memory/memory_store.hpp"
#include "idem/prometheus/observer.hpp"
#include "support/mini_json.hpp"
#include "support/prometheus_server.hpp"

using namespace std::chrono_literals;
using idem::test::PrometheusServer;
using idem_test::Json;

namespace {

using Clock = std::chrono::steady_clock;

// ---- files ----

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(fmt::format("cannot read {}", path));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// ---- the consumer's store, with faults where the workload asks for them ----

// A MemoryStore that fails as a remote store does, for keys named for it: "down-*" (the
// connection is refused on acquire), "corrupt-*" (the record cannot be decoded), "in-doubt-*" (the
// completion is applied, then its reply is lost). Every other call is the MemoryStore's own.
class FaultyStore {
public:
  explicit FaultyStore(idem::MemoryStore& inner) : inner_(&inner) {}
  idem::AcquireResult acquire(std::string_view key, const idem::AcquireParams& p) {
    if (key.starts_with("down-")) throw idem::connection_error("test: connection refused");
    if (key.starts_with("corrupt-")) throw idem::corrupt_record_error("test: record of key is undecodable");
    return inner_->acquire(key, p);
  }
  idem::WriteStatus complete(std::string_view key, const idem::Holder& h, std::string_view result, idem::millis d) {
    const auto st = inner_->complete(key, h, result, d);
    if (key.starts_with("in-doubt-")) throw idem::outcome_unknown_error("test: the completion's reply was lost");
    return st;
  }
  idem::WriteStatus fail(std::string_view key, const idem::Holder& h, const idem::FailParams& f) {
    return inner_->fail(key, h, f);
  }
  idem::WriteStatus extend(std::string_view key, const idem::Holder& h, idem::millis d) {
    return inner_->extend(key, h, d);
  }
  std::optional<idem::Record> inspect(std::string_view key) { return inner_->inspect(key); }

private:
  idem::MemoryStore* inner_;
};

idem::AcquireParams other_process(std::uint64_t token, idem::millis lease) {
  idem::AcquireParams p;
  p.lease = lease;
  p.retention = 1h;
  p.token = token;
  p.owner = "other-process";
  return p;
}

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// ---- the dashboard ----

struct DashboardQuery {
  std::string panel;  // the panel's title
  std::string expr;   // as in the file, Grafana variables unexpanded
};

void collect_panels(const Json& list, std::vector<const Json*>& out) {
  for (const Json& p : list.arr()) {
    out.push_back(&p);
    if (p.has("panels")) collect_panels(p["panels"], out);  // rows carry their panels when collapsed
  }
}

// Checks the dashboard's structure (what Grafana needs to import it) and returns its queries.
std::vector<DashboardQuery> dashboard_queries(const Json& dash) {
  std::vector<DashboardQuery> out;
  CHECK(!dash["title"].str().empty());
  CHECK(!dash["uid"].str().empty());
  CHECK(dash["schemaVersion"].num() >= 30);
  std::set<std::string> variables;
  for (const Json& v : dash["templating"]["list"].arr()) variables.insert(v["name"].str());
  CHECK(variables == std::set<std::string>{"datasource", "job", "store"});
  std::vector<const Json*> panels;
  collect_panels(dash["panels"], panels);
  std::set<double> ids;
  for (const Json* p : panels) {
    const std::string title = (*p)["title"].str();
    INFO("panel " << title);
    CHECK(ids.insert((*p)["id"].num()).second);
    const Json& g = (*p)["gridPos"];
    CHECK(g["x"].num() >= 0);
    CHECK(g["x"].num() + g["w"].num() <= 24);
    CHECK(g["h"].num() > 0);
    if ((*p)["type"].str() == "row") continue;
    CHECK((*p)["datasource"]["uid"].str() == "${datasource}");
    REQUIRE(!(*p)["targets"].arr().empty());
    std::set<std::string> refs;
    for (const Json& t : (*p)["targets"].arr()) {
      CHECK(refs.insert(t["refId"].str()).second);
      CHECK(t["datasource"]["uid"].str() == "${datasource}");
      REQUIRE(!t["expr"].str().empty());
      out.push_back({title, t["expr"].str()});
    }
  }
  return out;
}

// The expression as Grafana sends it with `job` and `store` selected and a 10-minute range (the
// whole life of the test's Prometheus: range panels count from its first, all-zero scrape).
std::string expand(std::string expr, const std::string& job, const std::string& store) {
  const std::vector<std::pair<std::string, std::string>> vars{
      {"$__rate_interval", "1m"}, {"$__range", "10m"}, {"$job", job}, {"$store", store}};
  for (const auto& [name, value] : vars)
    for (auto at = expr.find(name); at != std::string::npos; at = expr.find(name, at + value.size()))
      expr.replace(at, name.size(), value);
  return expr;
}

}  // namespace

TEST_CASE("a real Prometheus scraping the observer counts the workload exactly with the alert rules and the dashboard queries") {
  const std::string ops_dir = IDEM_OPERATIONS_DIR;
  const std::string job = "idem-consumer";  // the scrape job of the server below
  const std::string store_label = "orders";
  const auto test_deadline = Clock::now() + 60s;

  // ---- the consumer: an exporter on a free port, serving zeros from the start ----
  auto clock = std::make_shared<idem::ManualClock>();
  idem::MemoryStore store{{.clock = clock}};
  auto metrics = idem::PrometheusObserver::serve("127.0.0.1:0", {.store = store_label});
  REQUIRE(metrics->port() > 0);
  // A consumer source's first report, as idem::consume makes after each batch (the Kafka source
  // counts its backlog): its series exist from the first scrape, as the guard's do.
  metrics->on_source({.source = "kafka", .partition = "orders/0", .pending = 0, .held = 0, .rebalanced = false});

  // ---- the server ----
  PrometheusServer prom(IDEM_PROMETHEUS_SERVER,
                        {.target_port = metrics->port(), .job = job, .rule_file = ops_dir + "/idem-alerts.yml"});
  INFO("prometheus on 127.0.0.1:" << prom.port());

  // Waits until `ok()` holds, polling every 200 ms; fails with the server's log past the deadline.
  const auto wait_until = [&](const char* what, auto ok, std::chrono::seconds limit) {
    const auto deadline = std::min(Clock::now() + limit, test_deadline);
    std::string last_error;
    while (Clock::now() < deadline) {
      try {
        if (ok()) return;
      } catch (const std::exception& e) {
        last_error = e.what();
      }
      std::this_thread::sleep_for(200ms);
    }
    FAIL(fmt::format("timed out waiting for {} (last error: {}); prometheus log:\n{}", what,
                     last_error.empty() ? "none" : last_error, prom.log()));
  };

  // The first scrape, before any run: every series at 0, so increase() and rate() over a window
  // starting there count the workload exactly.
  const std::string sel = fmt::format("job=\"{}\",store=\"{}\"", job, store_label);
  wait_until("the first scrape", [&] {
    const auto up = prom.query(fmt::format("up{{job=\"{}\"}}", job));
    const auto n = prom.query(fmt::format("count(idem_outcomes_total{{{}}})", sel));
    return up.size() == 1 && up[0].value == 1 && n.size() == 1 && n[0].value == 7;
  }, 20s);

  // ---- the workload: every count below is known ----
  idem::IdempotencyGuard guard{store, {.lease = 60s, .retention = 1h, .observer = metrics}};
  // A rebalance and a backlog; nothing held, so IdemConsumerPartitionHeld stays quiet (its firing
  // is promtool's unit test).
  metrics->on_source({.source = "kafka", .partition = "orders/0", .pending = 2, .held = 0, .rebalanced = true});
  // 6 executed, then 4 duplicates of them.
  for (int i = 0; i < 6; ++i) CHECK(guard.run(fmt::format("o-{}", i), [] { return 1; }).status == idem::Status::executed);
  for (int i = 0; i < 4; ++i) CHECK(guard.run(fmt::format("o-{}", i), [] { return 1; }).status == idem::Status::duplicate);
  // 1 in_flight: another process holds the key.
  REQUIRE(store.acquire("held", other_process(11, 60s)).status == idem::AcquireStatus::acquired);
  CHECK(guard.run("held", [] { return 1; }).status == idem::Status::in_flight);
  // 1 takeover (executed: 7): another process held the key and its lease lapsed.
  REQUIRE(store.acquire("lapsed", other_process(12, 1s)).status == idem::AcquireStatus::acquired);
  clock->advance(2s);
  const auto took = guard.run("lapsed", [] { return 1; });
  CHECK(took.status == idem::Status::executed);
  CHECK(took.takeover);
  // 1 mismatch, after 1 executed (8).
  CHECK(guard.run("pay", "payload-a", [] { return 1; }).status == idem::Status::executed);
  CHECK(guard.run("pay", "payload-b", [] { return 1; }).status == idem::Status::mismatch);
  // Handler failures: 1 released and run again (executed: 9); 2 recorded, then permanent: 1
  // previously_failed. 3 handler errors, no outcome for them.
  CHECK_THROWS(guard.run("retry-me", []() -> int { throw std::runtime_error("handler failed"); }));
  CHECK(guard.run("retry-me", [] { return 1; }).status == idem::Status::executed);
  idem::IdempotencyGuard strict{store, {.lease = 60s, .retention = 1h,
                                        .failure = {.mode = idem::FailureMode::record, .max_attempts = 2, .backoff = 1s},
                                        .observer = metrics}};
  CHECK_THROWS(strict.run("flaky", []() -> int { throw std::runtime_error("handler failed"); }));
  clock->advance(2s);  // past the backoff
  CHECK_THROWS(strict.run("flaky", []() -> int { throw std::runtime_error("handler failed"); }));
  CHECK(strict.run("flaky", [] { return 1; }).status == idem::Status::previously_failed);
  // 1 batch of 4: 3 executed (12), 1 duplicate (5).
  const std::vector<idem::BatchItem> batch{{"b-1", ""}, {"b-2", ""}, {"b-3", ""}, {"o-0", ""}};
  const auto res = guard.run_batch(batch, [](const idem::BatchItem&) { return 1; });
  CHECK(res.outcomes[0].status == idem::Status::executed);
  CHECK(res.outcomes[3].status == idem::Status::duplicate);
  // 1 executed (13), then 1 duplicate (6) from the in-process cache.
  idem::IdempotencyGuard cached{store, {.lease = 60s, .retention = 1h, .cache_capacity = 16, .observer = metrics}};
  CHECK(cached.run("c-1", [] { return 1; }).status == idem::Status::executed);
  const auto hit = cached.run("c-1", [] { return 1; });
  CHECK(hit.status == idem::Status::duplicate);
  CHECK(hit.from_cache);
  // Store errors, each failing closed: a refused connection, an undecodable record, a completion
  // in doubt (its handler ran), a full store (after 1 executed there: 14).
  FaultyStore faulty_store{store};
  idem::IdempotencyGuard faulty{faulty_store, {.lease = 60s, .retention = 1h, .observer = metrics}};
  CHECK_THROWS_AS(faulty.run("down-1", [] { return 1; }), idem::connection_error);
  CHECK_THROWS_AS(faulty.run("corrupt-1", [] { return 1; }), idem::corrupt_record_error);
  CHECK_THROWS_AS(faulty.run("in-doubt-1", [] { return 1; }), idem::outcome_unknown_error);
  idem::MemoryStore full{{.shards = 1, .max_records = 1, .clock = clock}};
  idem::IdempotencyGuard small{full, {.lease = 60s, .retention = 1h, .observer = metrics}};
  CHECK(small.run("only", [] { return 1; }).status == idem::Status::executed);
  CHECK_THROWS_AS(small.run("one-too-many", [] { return 1; }), idem::capacity_error);
  // 1 lease lost through the heartbeat: the lease lapses on the store clock while the handler
  // runs, another process takes the key over, the keeper's next extension finds it gone.
  {
    idem::IdempotencyGuard beating{store, {.lease = 300ms, .retention = 1h, .heartbeat = true, .observer = metrics}};
    const auto lost = beating.run("beat-1", [&](const idem::Context& ctx) {
      std::this_thread::sleep_for(250ms);  // at least one extension (every 100 ms)
      clock->advance(10s);
      REQUIRE(store.acquire("beat-1", other_process(13, 60s)).status == idem::AcquireStatus::acquired);
      for (int i = 0; i < 300 && !ctx.stop.stop_requested(); ++i) std::this_thread::sleep_for(10ms);
      CHECK(ctx.stop.stop_requested());
      return 1;
    });
    CHECK(lost.status == idem::Status::lease_lost);
  }
  // 1 store advisory, as RedisClient reports an evicting maxmemory-policy it was told to accept
  // (the memory store has no configuration to warn about).
  metrics->on_warning("idem: maxmemory-policy allkeys-lru evicts idempotency records (accepted: unsafe_allow_eviction)");
  const double workload_end = unix_now();

  const std::map<std::string, double> outcomes{{"executed", 14},   {"duplicate", 6},         {"in_flight", 1},
                                               {"stale", 0},       {"previously_failed", 1}, {"lease_lost", 1},
                                               {"mismatch", 1}};
  const std::map<std::string, double> store_errors{{"connection_error", 1}, {"corrupt_record_error", 1},
                                                   {"outcome_unknown_error", 1}, {"capacity_error", 1}};
  double runs = 0;
  for (const auto& [status, n] : outcomes) runs += n;
  constexpr double errors_total = 4;

  // ---- a scrape that began after the workload: T, its timestamp, is when every query is asked
  // (no extrapolation past the last sample: increase() over a window from the zero scrape to T is
  // exact) ----
  double t = 0;
  wait_until("a scrape after the workload", [&] {
    const auto ts = prom.query(fmt::format("max(timestamp(idem_outcomes_total{{{}}}))", sel));
    if (ts.size() != 1 || ts[0].value <= workload_end) return false;
    t = ts[0].value;
    return true;
  }, 20s);
  INFO(fmt::format("queries at time={:.3f}", t));
  const auto at_t = [&](const std::string& promql) { return prom.query(promql, t); };
  const auto one = [&](const std::string& promql) {
    const auto r = at_t(promql);
    INFO(promql);
    REQUIRE(r.size() == 1);
    return r[0].value;
  };
  const auto by = [&](const std::string& promql, const std::string& label) {
    std::map<std::string, double> out;
    for (const auto& smp : at_t(promql)) out[smp.labels.at(label)] = smp.value;
    return out;
  };

  // ---- what the exporter served, as Prometheus stored it ----
  CHECK(by(fmt::format("sum by (status) (idem_outcomes_total{{{}}})", sel), "status") == outcomes);
  auto errors = by(fmt::format("sum by (type) (idem_store_errors_total{{{}}}) > 0", sel), "type");
  CHECK(errors == store_errors);
  CHECK(one(fmt::format("sum(idem_run_duration_seconds_count{{{},status=\"executed\"}})", sel)) == outcomes.at("executed"));
  CHECK(one(fmt::format("sum(idem_takeovers_total{{{}}})", sel)) == 1);
  CHECK(one(fmt::format("sum(idem_lease_lost_total{{{}}})", sel)) == 1);
  CHECK(one(fmt::format("sum(idem_handler_errors_total{{{}}})", sel)) == 3);
  CHECK(one(fmt::format("sum(idem_cache_hits_total{{{}}})", sel)) == 1);
  CHECK(one(fmt::format("sum(idem_store_warnings_total{{{}}})", sel)) == 1);
  CHECK(one(fmt::format("sum(idem_batch_size_count{{{}}})", sel)) == 1);
  CHECK(one(fmt::format("sum(idem_batch_size_sum{{{}}})", sel)) == 4);
  CHECK(one(fmt::format("sum(idem_heartbeat_extensions_total{{{}}})", sel)) >= 1);

  // ---- the alert rules, as Prometheus loaded them from docs/operations/idem-alerts.yml ----
  std::map<std::string, std::string> rules;  // alert -> PromQL
  wait_until("every rule evaluated, health ok", [&] {
    rules.clear();
    bool all_ok = true;
    const Json data = prom.api("/api/v1/rules");  // kept: a range-for over a temporary's member dangles
    for (const Json& g : data["groups"].arr())
      for (const Json& r : g["rules"].arr()) {
        if (r["type"].str() != "alerting") continue;
        rules[r["name"].str()] = r["query"].str();
        if (r["health"].str() != "ok") all_ok = false;
      }
    return all_ok && !rules.empty();
  }, 15s);
  // What each alert's expression gives at T: the count that set it off, or nothing (it is quiet).
  const std::map<std::string, double> firing_value{
      {"IdemLeaseLost", 1},      {"IdemOutcomeUnknown", 1}, {"IdemCorruptRecord", 1},
      {"IdemStoreErrors", errors_total},                   {"IdemTakeovers", 1},
      {"IdemStoreWarnings", 1},  {"IdemDeadLetters", outcomes.at("previously_failed") + outcomes.at("mismatch")}};
  // Quiet here: the latency alerts (below their thresholds), and the outbox relay's, whose series
  // come from the relay program's /metrics (their firing is promtool's unit test,
  // docs/operations/idem-alerts.test.yml; a real Prometheus scrapes the relay in relay_program_test).
  const std::set<std::string> quiet{"IdemRunLatencyHigh", "IdemStoreLatencyHigh", "IdemOutboxLag",
                                    "IdemOutboxPublishFailing", "IdemConsumerPartitionHeld"};
  std::set<std::string> names;
  for (const auto& [name, promql] : rules) names.insert(name);
  std::set<std::string> expected_names = quiet;
  for (const auto& [name, v] : firing_value) expected_names.insert(name);
  CHECK(names == expected_names);
  for (const auto& [name, promql] : rules) {
    INFO(name << ": " << promql);
    const auto r = at_t(promql);
    if (quiet.count(name)) {
      CHECK(r.empty());
      continue;
    }
    REQUIRE(r.size() == 1);
    CHECK(r[0].labels.at("job") == job);
    CHECK(r[0].labels.at("store") == store_label);
    CHECK(r[0].value == Approx(firing_value.at(name)).margin(1e-9));
  }
  CHECK(errors_total > 0.01 * runs);  // why IdemStoreErrors' ratio holds

  // ---- and Prometheus's own evaluation: the alerts without `for` fire, the others are pending ----
  const std::map<std::string, std::string> states{
      {"IdemLeaseLost", "firing"},     {"IdemOutcomeUnknown", "firing"}, {"IdemCorruptRecord", "firing"},
      {"IdemStoreWarnings", "firing"}, {"IdemDeadLetters", "firing"},    {"IdemStoreErrors", "pending"},
      {"IdemTakeovers", "pending"}};
  std::map<std::string, std::string> seen;
  wait_until("the expected alerts active", [&] {
    seen.clear();
    const Json data = prom.api("/api/v1/alerts");
    for (const Json& a : data["alerts"].arr()) {
      const auto& labels = a["labels"];
      if (labels["job"].str() != job || labels["store"].str() != store_label) return false;
      seen[labels["alertname"].str()] = a["state"].str();
    }
    return seen == states;
  }, 15s);
  CHECK(seen == states);

  // ---- the dashboard: valid JSON Grafana can import, every query answers at T ----
  const Json dash = idem_test::parse_json(read_file(ops_dir + "/idem-dashboard.json"));
  const auto queries = dashboard_queries(dash);
  std::string all_exprs;
  for (const auto& q : queries) all_exprs += q.expr + "\n";
  // Every metric the exporter serves has a panel.
  const Json metric_names = prom.api("/api/v1/label/__name__/values");
  std::set<std::string> families;
  for (const Json& name : metric_names.arr()) {
    const std::string& series = name.str();
    if (!series.starts_with("idem_")) continue;
    std::string family = series;  // a histogram's series name their family with a suffix
    for (const std::string_view suffix : {"_bucket", "_count", "_sum"})
      if (series.ends_with(suffix)) family = series.substr(0, series.size() - suffix.size());
    INFO("metric " << family);
    CHECK(all_exprs.find(family) != std::string::npos);
    families.insert(family);
  }
  // docs/operations.md's table; a new metric needs a panel (and a line there).
  CHECK(families == std::set<std::string>{"idem_outcomes_total", "idem_run_duration_seconds", "idem_store_errors_total",
                                          "idem_takeovers_total", "idem_lease_lost_total",
                                          "idem_heartbeat_extensions_total", "idem_batch_size", "idem_cache_hits_total",
                                          "idem_handler_errors_total", "idem_store_warnings_total",
                                          "idem_store_call_duration_seconds", "idem_store_call_failures_total",
                                          "idem_pool_connections_in_use", "idem_pool_connections_open",
                                          "idem_pool_connections_max", "idem_pool_wait_seconds", "idem_pool_exhausted_total",
                                          "idem_outbox_relay_published_total", "idem_outbox_relay_batches_total",
                                          "idem_outbox_relay_publish_failures_total", "idem_outbox_relay_errors_total",
                                          "idem_outbox_relay_purged_total", "idem_consumer_pending", "idem_consumer_held",
                                          "idem_consumer_rebalances_total", "idem_build_info"});
  // Served by the relay program's /metrics only (it reads the outbox table at each scrape): their
  // panel answers nothing here; relay_program_test has a real Prometheus scrape them.
  const auto relay_program_only = [](const std::string& expr) {
    return expr.find("idem_outbox_relay_backlog_rows") != std::string::npos ||
           expr.find("idem_outbox_relay_oldest_unsent_age_seconds") != std::string::npos;
  };
  // Exact answers of the panels that count (the dashboard's range: the test's whole run).
  const std::map<std::string, double> counting_panels{
      {"Lease losses", 1},
      {"Completions refused (lease_lost)", outcomes.at("lease_lost")},
      {"In-doubt store calls", 1},
      {"Undecodable records", 1},
      {"Takeovers", 1},
      {"Store advisories", 1},
      {"Dead-lettered runs", outcomes.at("previously_failed") + outcomes.at("mismatch")},
      {"Handler errors", 3},
      {"Store errors per run", errors_total / runs}};
  std::set<std::string> counted;
  for (const auto& q : queries) {
    const std::string promql = expand(q.expr, job, store_label);
    INFO("panel \"" << q.panel << "\": " << promql);
    const auto r = at_t(promql);
    if (relay_program_only(q.expr)) continue;
    CHECK(!r.empty());  // a wrong metric or label name answers nothing
    if (q.panel == "Outcomes in the time range") {
      std::map<std::string, double> got;
      for (const auto& smp : r) got[smp.labels.at("status")] = smp.value;
      CHECK(got == outcomes);
      counted.insert(q.panel);
    } else if (const auto it = counting_panels.find(q.panel); it != counting_panels.end() && q.expr.find("$__range") != std::string::npos) {
      REQUIRE(r.size() == 1);
      CHECK(r[0].value == Approx(it->second).margin(1e-9));
      counted.insert(q.panel);
    } else if (q.panel == "p99 run latency by status") {
      std::map<std::string, double> p99;
      for (const auto& smp : r) p99[smp.labels.at("status")] = smp.value;
      CHECK(p99.at("executed") < 10);      // fast handlers: IdemRunLatencyHigh stays quiet
      CHECK(p99.at("duplicate") < 0.25);   // one in-memory call: IdemStoreLatencyHigh stays quiet
      CHECK(p99.at("lease_lost") >= 0.25);  // that run slept 250 ms and more
    } else if (q.panel == "Runs / s") {
      REQUIRE(r.size() == 1);
      CHECK(r[0].value > 0);
    }
  }
  CHECK(counted.size() == counting_panels.size() + 1);
}
