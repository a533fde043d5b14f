// PrometheusObserver end to end: a workload whose every count is known, on a MemoryStore with a
// manual clock, then a real HTTP scrape of /metrics from the observer's own exposer.

#include <catch2/catch.hpp>
#include <prometheus/registry.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "idem/core/version.hpp"
#include "idem/guard/consume.hpp"
#include "idem/guard/guard.hpp"
#include "idem/memory/memory_store.hpp"
#include "idem/prometheus/observer.hpp"
#include "support/http_get.hpp"

using namespace std::chrono_literals;

namespace {

// The body of GET /metrics on 127.0.0.1:port; throws unless the answer is 200.
std::string scrape(int port) {
  const auto r = idem::test::http_get(port, "/metrics");
  if (r.status != 200) throw std::runtime_error(fmt::format("GET /metrics answered {}: {}", r.status, r.body.substr(0, 200)));
  return r.body;
}

// "name{b="2",a="1"}" as "name{a="1",b="2"}": the exposition format leaves label order open.
std::string canonical(const std::string& series) {
  const auto open = series.find('{');
  if (open == std::string::npos) return series;
  std::vector<std::string> labels;
  std::string cur;
  bool quoted = false;
  for (std::size_t i = open + 1; i + 1 < series.size(); ++i) {
    const char c = series[i];
    if (c == '"') quoted = !quoted;
    if (c == ',' && !quoted) {
      labels.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) labels.push_back(cur);
  std::sort(labels.begin(), labels.end());
  std::string out = series.substr(0, open + 1);
  for (std::size_t i = 0; i < labels.size(); ++i) out += (i ? "," : "") + labels[i];
  return out + "}";
}

// Every sample line, "name{labels}" (labels sorted) -> value.
std::map<std::string, double> samples(const std::string& text) {
  std::map<std::string, double> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const auto sp = line.rfind(' ');
    out[canonical(line.substr(0, sp))] = std::stod(line.substr(sp + 1));
  }
  return out;
}

double value(const std::map<std::string, double>& m, const std::string& series) {
  const auto it = m.find(series);
  if (it == m.end()) FAIL("no series " << series);
  return it->second;
}

idem::AcquireParams params(std::uint64_t token, idem::millis lease) {
  idem::AcquireParams p;
  p.lease = lease;
  p.retention = 1h;
  p.token = token;
  p.owner = "other-process";
  return p;
}

}  // namespace

TEST_CASE("PrometheusObserver exposes exact counts of a known workload on /metrics") {
  auto clock = std::make_shared<idem::ManualClock>();
  idem::MemoryStore store{{.clock = clock}};
  auto metrics = idem::PrometheusObserver::serve("127.0.0.1:0", {.store = "memory"});
  REQUIRE(metrics->port() > 0);
  idem::IdempotencyGuard guard{store, {.lease = 60s, .retention = 1h, .observer = metrics}};

  // 5 executed, then 3 duplicates of them.
  for (int i = 0; i < 5; ++i) guard.run("k" + std::to_string(i), [] { return 1; });
  for (int i = 0; i < 3; ++i) CHECK(guard.run("k" + std::to_string(i), [] { return 1; }).status == idem::Status::duplicate);
  // 1 in_flight: another process holds k5.
  REQUIRE(store.acquire("k5", params(11, 60s)).status == idem::AcquireStatus::acquired);
  CHECK(guard.run("k5", [] { return 1; }).status == idem::Status::in_flight);
  // 1 takeover (an executed run): another process held k6 and its lease lapsed.
  REQUIRE(store.acquire("k6", params(12, 1s)).status == idem::AcquireStatus::acquired);
  clock->advance(2s);
  auto took = guard.run("k6", [] { return 1; });
  CHECK(took.status == idem::Status::executed);
  CHECK(took.takeover);
  // 1 mismatch (after 1 executed).
  guard.run("k7", "payload-a", [] { return 1; });
  CHECK(guard.run("k7", "payload-b", [] { return 1; }).status == idem::Status::mismatch);
  // 1 handler error: no outcome.
  CHECK_THROWS(guard.run("k8", []() -> int { throw std::runtime_error("boom"); }));
  // 1 batch of 4: 3 executed and 1 duplicate (k0).
  const std::vector<idem::BatchItem> batch{{"b1", ""}, {"b2", ""}, {"b3", ""}, {"k0", ""}};
  auto res = guard.run_batch(batch, [](const idem::BatchItem&) { return 1; });
  CHECK(res.outcomes[3].status == idem::Status::duplicate);
  // 1 store error (capacity_error) from a full store, after 1 executed there.
  idem::MemoryStore full{{.shards = 1, .max_records = 1, .clock = clock}};
  idem::IdempotencyGuard small{full, {.lease = 60s, .retention = 1h, .observer = metrics}};
  small.run("only", [] { return 1; });
  CHECK_THROWS_AS(small.run("one-too-many", [] { return 1; }), idem::capacity_error);
  // 1 lease lost through the heartbeat: the lease lapses on the store clock while the handler
  // runs, another process takes the key over, the keeper's next extension finds it gone.
  {
    idem::IdempotencyGuard beating{store, {.lease = 300ms, .retention = 1h, .heartbeat = true, .observer = metrics}};
    auto lost = beating.run("k9", [&](const idem::Context& ctx) {
      std::this_thread::sleep_for(250ms);  // at least one extension (every 100 ms)
      clock->advance(10s);
      REQUIRE(store.acquire("k9", params(13, 60s)).status == idem::AcquireStatus::acquired);
      for (int i = 0; i < 300 && !ctx.stop.stop_requested(); ++i) std::this_thread::sleep_for(10ms);
      CHECK(ctx.stop.stop_requested());
      return 1;
    });
    CHECK(lost.status == idem::Status::lease_lost);
  }

  const std::string body = scrape(metrics->port());
  // For a human look at the exposition (docs/operations.md's excerpt): IDEM_METRICS_DUMP=file.
  if (const char* dump = std::getenv("IDEM_METRICS_DUMP")) std::ofstream(dump) << body;
  const auto m = samples(body);
  const std::string s = "store=\"memory\"";
  CHECK(value(m, "idem_outcomes_total{status=\"executed\"," + s + "}") == 11);  // 5 + takeover + k7 + 3 + only
  CHECK(value(m, "idem_outcomes_total{status=\"duplicate\"," + s + "}") == 4);
  CHECK(value(m, "idem_outcomes_total{status=\"in_flight\"," + s + "}") == 1);
  CHECK(value(m, "idem_outcomes_total{status=\"mismatch\"," + s + "}") == 1);
  CHECK(value(m, "idem_outcomes_total{status=\"lease_lost\"," + s + "}") == 1);
  CHECK(value(m, "idem_outcomes_total{status=\"previously_failed\"," + s + "}") == 0);
  CHECK(value(m, "idem_outcomes_total{status=\"stale\"," + s + "}") == 0);
  CHECK(value(m, "idem_run_duration_seconds_count{status=\"executed\"," + s + "}") == 11);
  CHECK(value(m, "idem_run_duration_seconds_count{status=\"duplicate\"," + s + "}") == 4);
  CHECK(value(m, "idem_run_duration_seconds_bucket{le=\"+Inf\",status=\"duplicate\"," + s + "}") == 4);
  // The lease_lost run slept >= 250 ms: not in the 0.25 s bucket's neighbours below it.
  CHECK(value(m, "idem_run_duration_seconds_bucket{le=\"0.1\",status=\"lease_lost\"," + s + "}") == 0);
  CHECK(value(m, "idem_takeovers_total{" + s + "}") == 1);
  CHECK(value(m, "idem_handler_errors_total{" + s + "}") == 1);
  CHECK(value(m, "idem_store_errors_total{" + s + ",type=\"capacity_error\"}") == 1);
  CHECK(value(m, "idem_store_errors_total{" + s + ",type=\"connection_error\"}") == 0);
  CHECK(value(m, "idem_lease_lost_total{" + s + "}") == 1);
  CHECK(value(m, "idem_heartbeat_extensions_total{" + s + "}") >= 1);
  CHECK(value(m, "idem_batch_size_count{" + s + "}") == 1);
  CHECK(value(m, "idem_batch_size_sum{" + s + "}") == 4);
  CHECK(value(m, "idem_batch_size_bucket{le=\"2\"," + s + "}") == 0);
  CHECK(value(m, "idem_batch_size_bucket{le=\"5\"," + s + "}") == 1);
}

TEST_CASE("PrometheusObserver's errors are idem errors") {
  // core/error.hpp: every error idem's libraries throw derives from idem::error.
  CHECK_THROWS_AS(idem::PrometheusObserver(nullptr), idem::invalid_options_error);
  auto first = idem::PrometheusObserver::serve("127.0.0.1:0", {.store = "memory"});
  const std::string taken = fmt::format("127.0.0.1:{}", first->port());
  CHECK_THROWS_AS(idem::PrometheusObserver::serve(taken, {.store = "memory"}), idem::usage_error);
}

TEST_CASE("PrometheusObserver registers in the application's registry") {
  auto registry = std::make_shared<prometheus::Registry>();
  auto metrics = std::make_shared<idem::PrometheusObserver>(registry, idem::PrometheusOptions{.store = "redis"});
  CHECK(metrics->port() == 0);
  idem::MemoryStore store;
  idem::IdempotencyGuard guard{store, {.observer = metrics}};
  guard.run("a", [] {});
  guard.run("a", [] {});
  std::map<std::string, double> seen;
  for (const auto& family : registry->Collect())
    for (const auto& metric : family.metric)
      if (family.name == "idem_outcomes_total")
        for (const auto& label : metric.label)
          if (label.name == "status") seen[label.value] = metric.counter.value;
  CHECK(seen["executed"] == 1);
  CHECK(seen["duplicate"] == 1);
  CHECK(idem::store_error_type(idem::timeout_error("t")) == "timeout_error");
  CHECK(idem::store_error_type(std::runtime_error("x")) == "other");
}

namespace {

// A source of three messages on two "partitions" that counts its backlog, as a Kafka source does.
struct CountingSource {
  using message_type = std::string;
  std::vector<std::string> queue{"m1", "m2", "m3"};
  std::size_t settled = 0;
  bool first_report = true;
  std::vector<std::string> poll() { return std::exchange(queue, {}); }
  idem::Delivery delivery(const std::string& m) const { return {.id = m, .key = m, .payload = "p"}; }
  void settle(std::span<const idem::Verdict> v) { settled += v.size(); }
  void release() {}
  std::vector<idem::SourceEvent> backlog() {
    const bool rebalanced = std::exchange(first_report, false);
    return {{.source = "kafka", .partition = "orders/0", .pending = 3 - settled, .held = 2, .rebalanced = rebalanced},
            {.source = "kafka", .partition = "orders/1", .pending = 0, .held = 0, .rebalanced = false}};
  }
};

}  // namespace

TEST_CASE("PrometheusObserver: store calls by call, a consumer's backlog, an embedded relay, pools, build info") {
  auto metrics = idem::PrometheusObserver::serve("127.0.0.1:0", {.store = "memory", .program = "payments"});
  auto counting = std::make_shared<idem::CountingObserver>();
  // The tee: metrics and a second observer (logs, in a service) hear the same runs.
  auto tee = std::make_shared<idem::TeeObserver>(std::vector<std::shared_ptr<idem::Observer>>{metrics, counting, nullptr});
  idem::MemoryStore store;
  idem::IdempotencyGuard guard{store, {.lease = 60s, .retention = 1h, .observer = tee}};
  guard.run("a", [] { return 1; });
  guard.run("b", [] { return 1; });
  guard.run("a", [] { return 1; });  // duplicate: one acquire, no completion
  CHECK_THROWS(guard.run("c", []() -> int { throw std::runtime_error("boom"); }));  // acquire + fail
  CHECK(counting->count(idem::Status::executed) == 2);
  CHECK(counting->count(idem::Status::duplicate) == 1);

  CountingSource source;
  auto handler = [](const idem::Delivery&) { return 1; };
  const auto r = idem::consume_batch(source, guard, handler);
  CHECK(r.acked == 3);

  tee->on_relay({.kind = idem::OutboxRelayEvent::Kind::published, .rows = 7});
  tee->on_relay({.kind = idem::OutboxRelayEvent::Kind::published, .rows = 3});
  tee->on_relay({.kind = idem::OutboxRelayEvent::Kind::publish_failed, .rows = 2, .error = "broker down"});
  tee->on_pool({.pool = "redis", .in_use = 3, .open = 4, .size = 8, .wait = 20ms, .exhausted = false});
  tee->on_pool({.pool = "redis", .in_use = 8, .open = 8, .size = 8, .wait = 1s, .exhausted = true});
  tee->on_pool({.pool = "elsewhere", .in_use = 1, .open = 1, .size = 1, .wait = {}, .exhausted = false});  // no series

  const auto m = samples(scrape(metrics->port()));
  const std::string s = "store=\"memory\"";
  CHECK(value(m, "idem_store_call_duration_seconds_count{op=\"acquire\"," + s + "}") == 4);
  CHECK(value(m, "idem_store_call_duration_seconds_count{op=\"complete\"," + s + "}") == 2);
  CHECK(value(m, "idem_store_call_duration_seconds_count{op=\"fail\"," + s + "}") == 1);
  CHECK(value(m, "idem_store_call_failures_total{op=\"acquire\"," + s + "}") == 0);
  // The batch: one batch_acquire and one batch_write on a store with a batch path, else one call per item.
  CHECK(value(m, "idem_store_call_duration_seconds_count{op=\"batch_acquire\"," + s + "}") +
            value(m, "idem_store_call_duration_seconds_count{op=\"acquire\"," + s + "}") >=
        5);
  CHECK(value(m, "idem_consumer_pending{partition=\"orders/0\",source=\"kafka\"," + s + "}") == 0);
  CHECK(value(m, "idem_consumer_held{partition=\"orders/0\",source=\"kafka\"," + s + "}") == 2);
  CHECK(value(m, "idem_consumer_held{partition=\"orders/1\",source=\"kafka\"," + s + "}") == 0);
  CHECK(value(m, "idem_consumer_rebalances_total{source=\"kafka\"," + s + "}") == 1);
  CHECK(value(m, "idem_outbox_relay_published_total{" + s + "}") == 10);
  CHECK(value(m, "idem_outbox_relay_batches_total{" + s + "}") == 2);
  CHECK(value(m, "idem_outbox_relay_publish_failures_total{" + s + "}") == 1);
  CHECK(value(m, "idem_pool_connections_in_use{pool=\"redis\"," + s + "}") == 8);
  CHECK(value(m, "idem_pool_connections_max{pool=\"redis\"," + s + "}") == 8);
  CHECK(value(m, "idem_pool_wait_seconds_count{pool=\"redis\"," + s + "}") == 2);
  CHECK(value(m, "idem_pool_exhausted_total{pool=\"redis\"," + s + "}") == 1);
  CHECK(value(m, "idem_pool_wait_seconds_count{pool=\"postgres\"," + s + "}") == 0);
  CHECK(m.count("idem_pool_connections_in_use{pool=\"elsewhere\"," + s + "}") == 0);
  CHECK(value(m, fmt::format("idem_build_info{{program=\"payments\",{},version=\"{}\"}}", s, idem::version_string)) == 1);
}
