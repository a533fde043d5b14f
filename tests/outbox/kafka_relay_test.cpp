// End to end through Kafka (librdkafka's mock cluster): handlers write outbox rows in their
// transaction on the PostgreSQL fixture server, idem::OutboxRelay publishes them with
// KafkaPublisher, and a downstream consumer deduplicating with idem (header idem-outbox-id)
// applies each message once, in order per key, even when a batch reached Kafka twice.

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "idem/outbox/kafka_publisher.hpp"
#include "idem/outbox/outbox.hpp"
#include "kafka_rabbitmq_relay_worker.hpp"
#include "kafka_support.hpp"
#include "postgres/pg_support.hpp"

using namespace std::chrono_literals;
using idem::test::consume_topic;
using idem::test::KafkaMockCluster;

namespace {

// A transactional PostgresStore with an outbox, on a table of its own.
struct Env {
  std::string table = "obk" + pgtest::random_hex(10);
  idem::PostgresStore store{idem::PostgresOptions{.conninfo = pgtest::conninfo(), .pool = {.size = 4}},
                            idem::PostgresStoreOptions{.schema = "idem_test",
                                                       .table = table,
                                                       .mode = idem::PostgresMode::transactional,
                                                       .outbox = true}};
  idem::IdempotencyGuard<idem::PostgresStore> guard{
      store, {.lease = 10s, .retention = 1h, .failure = {.mode = idem::FailureMode::release}}};

  idem::OutboxRelayOptions relay_options() const {
    idem::OutboxRelayOptions o;
    o.postgres.conninfo = pgtest::conninfo();
    o.schema = "idem_test";
    o.table = table;
    o.batch = 50;
    o.poll_interval = 100ms;
    o.backoff_initial = 20ms;
    o.backoff_max = 200ms;
    return o;
  }
  // Handler of incoming message `n`: one outbox message per handler, key `key-(n % keys)`, the
  // payload "key:index-within-key" so the consumer can check per-key order.
  void write(const std::string& topic, int n, int keys, const std::string& prefix = "key-") {
    const std::string key = prefix + std::to_string(n % keys);
    const std::string payload = key + ":" + std::to_string(n / keys);
    guard.run(prefix + "in-" + std::to_string(n), [&](const auto& ctx) { ctx.outbox().send(topic, key, payload); });
  }
};

// Throws after the real publish for the first `lose` batches: Kafka has the messages, the relay
// never learns it (a lost ack, a relay killed before it marked the rows), so they go again.
class AckLost final : public idem::OutboxPublisher {
public:
  AckLost(idem::OutboxPublisher& inner, int lose) : inner_(inner), lose_(lose) {}
  void publish(std::span<const idem::OutboxMessage> batch) override {
    inner_.publish(batch);
    if (lose_.fetch_sub(1) > 0) throw idem::publish_error("test: acknowledgement lost after a real publish");
  }
  std::string name() const override { return inner_.name(); }

private:
  idem::OutboxPublisher& inner_;
  std::atomic<int> lose_;
};

// A broker that takes `delay` per batch: each relay then holds its claim long enough for the
// other one to claim rows of its own, so both relays take part whatever the machine's load.
class Paced final : public idem::OutboxPublisher {
public:
  Paced(idem::OutboxPublisher& inner, std::chrono::milliseconds delay) : inner_(inner), delay_(delay) {}
  void publish(std::span<const idem::OutboxMessage> batch) override {
    inner_.publish(batch);
    std::this_thread::sleep_for(delay_);
  }
  std::string name() const override { return inner_.name(); }

private:
  idem::OutboxPublisher& inner_;
  std::chrono::milliseconds delay_;
};

// The downstream service: idem's guard on the outbox id; applied[id] counts the effects, and each
// key's indexes must come in order.
struct Downstream {
  idem::MemoryStore store;
  idem::IdempotencyGuard<idem::MemoryStore> guard{store, {.lease = 10s, .retention = 1h}};
  std::map<std::string, int> applied;
  std::map<std::string, int> next_index;
  int duplicates = 0, out_of_order = 0;

  void consume(const std::vector<idem::test::KafkaRecord>& records) {
    for (const auto& r : records) {
      const auto out = guard.run(r.header("idem-outbox-id"), [&](const idem::Context& ctx) {
        ++applied[std::string(ctx.key)];
        const auto colon = r.value.find(':');
        const int index = std::stoi(r.value.substr(colon + 1));
        if (index != next_index[r.key]) ++out_of_order;
        next_index[r.key] = index + 1;
      });
      if (out.status == idem::Status::duplicate) ++duplicates;
    }
  }
};

void drive(idem::OutboxRelay& relay, std::uint64_t rows, std::chrono::seconds limit = 60s) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (relay.stats().published < rows && std::chrono::steady_clock::now() < end)
    if (relay.run_once() == 0) std::this_thread::sleep_for(20ms);
}

}  // namespace

TEST_CASE("Kafka outbox end to end: committed rows once downstream, rolled back ones never, a re-sent batch deduplicated",
          "[kafka]") {
  KafkaMockCluster mc;
  const std::string topic = "outbox-e2e";
  mc.create_topic(topic, 3);
  Env env;
  const int n = 120, keys = 7;
  for (int i = 0; i < n; ++i) env.write(topic, i, keys);
  // A handler that fails after sending: its transaction rolls back, its message never exists.
  CHECK_THROWS(env.guard.run("in-rolled-back", [&](const auto& ctx) {
    ctx.outbox().send(topic, "key-0", "never:0");
    throw std::runtime_error("handler fails after send");
  }));

  idem::KafkaPublisher kafka({.brokers = mc.brokers(), .config = {{"log_level", "3"}}, .timeout = 10s});
  AckLost lossy(kafka, 2);  // the first two batches reach Kafka and are published again
  idem::OutboxRelay relay(lossy, env.relay_options());
  drive(relay, n);
  REQUIRE(relay.stats().published == n);
  CHECK(relay.stats().publish_failures == 2);

  const auto records = consume_topic(mc.brokers(), topic, 3, n + 100);  // the 2 lost batches: 100 copies
  CHECK(records.size() == n + 100);
  Downstream down;
  down.consume(records);
  CHECK(down.applied.size() == n);
  for (const auto& [id, times] : down.applied) CHECK(times == 1);
  CHECK(down.duplicates == 100);
  CHECK(down.out_of_order == 0);
  for (const auto& r : records) CHECK(r.value.rfind("never", 0) != 0);
}

TEST_CASE("Kafka outbox end to end: two relays at once send every row, in order per key", "[kafka]") {
  KafkaMockCluster mc;
  const std::string topic = "outbox-two";
  mc.create_topic(topic, 4);
  Env env;
  const int n = 400, keys = 10;
  for (int i = 0; i < n; ++i) env.write(topic, i, keys);

  idem::KafkaPublisher pa({.brokers = mc.brokers(), .config = {{"log_level", "3"}}, .timeout = 10s});
  idem::KafkaPublisher pb({.brokers = mc.brokers(), .config = {{"log_level", "3"}}, .timeout = 10s});
  auto opts = env.relay_options();
  opts.batch = 20;
  Paced slow_a(pa, 20ms), slow_b(pb, 20ms);
  idem::OutboxRelay ra(slow_a, opts), rb(slow_b, opts);
  ra.start();
  rb.start();
  const auto end = std::chrono::steady_clock::now() + 60s;
  while (ra.stats().published + rb.stats().published < n && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(20ms);
  ra.stop();
  rb.stop();
  CHECK(ra.stats().published + rb.stats().published == n);
  INFO("relay a published " << ra.stats().published << ", relay b " << rb.stats().published);
  CHECK(ra.stats().published > 0);
  CHECK(rb.stats().published > 0);

  const auto records = consume_topic(mc.brokers(), topic, 4, n);
  Downstream down;
  down.consume(records);
  CHECK(down.applied.size() == n);
  CHECK(down.duplicates == 0);
  CHECK(down.out_of_order == 0);
}

TEST_CASE("Kafka outbox end to end: brokers down -> rows wait, nothing lost, sent once the brokers are back",
          "[kafka]") {
  KafkaMockCluster mc;
  const std::string topic = "outbox-down";
  mc.create_topic(topic, 2);
  Env env;
  idem::KafkaPublisher kafka({.brokers = mc.brokers(), .config = {{"log_level", "0"}}, .timeout = 1s});
  idem::OutboxRelay relay(kafka, env.relay_options());
  const int n = 60, keys = 4;
  mc.down();
  for (int i = 0; i < n; ++i) env.write(topic, i, keys);
  for (int i = 0; i < 3; ++i) relay.run_once();  // each publish times out: the rows back off
  CHECK(relay.stats().published == 0);
  CHECK(relay.stats().publish_failures >= 1);

  mc.up();
  drive(relay, n);
  CHECK(relay.stats().published == n);
  const auto records = consume_topic(mc.brokers(), topic, 2, n);
  Downstream down;
  down.consume(records);
  CHECK(down.applied.size() == n);
  for (const auto& [id, times] : down.applied) CHECK(times == 1);
  CHECK(down.out_of_order == 0);
}

TEST_CASE("Kafka outbox end to end: a relay SIGKILLed between publish and mark-sent -> sent again with the same ids, "
          "applied once",
          "[kafka]") {
  KafkaMockCluster mc;
  const std::string topic = "outbox-kill";
  mc.create_topic(topic, 2);
  Env env;
  const int n = 40, keys = 4;
  for (int i = 0; i < n; ++i) env.write(topic, i, keys);
  // The worker's relay publishes all n rows (one batch), Kafka acknowledges them, and it is killed
  // before it marks them sent: the server rolls its claim back and the rows are unsent again.
  CHECK(idem::test::relay_killed_after_publish("kafka", pgtest::conninfo(), "idem_test", env.table, mc.brokers()) == n);

  idem::KafkaPublisher kafka({.brokers = mc.brokers(), .config = {{"log_level", "3"}}, .timeout = 10s});
  idem::OutboxRelay relay(kafka, env.relay_options());
  drive(relay, n);
  CHECK(relay.stats().published == n);
  const auto records = consume_topic(mc.brokers(), topic, 2, 2 * n);
  CHECK(records.size() == 2 * n);  // every message twice, with the same idem-outbox-id
  Downstream down;
  down.consume(records);
  CHECK(down.applied.size() == n);
  for (const auto& [id, times] : down.applied) CHECK(times == 1);
  CHECK(down.duplicates == n);
  CHECK(down.out_of_order == 0);
}
