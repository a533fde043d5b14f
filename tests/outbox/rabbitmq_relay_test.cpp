// End to end through RabbitMQ (a real rabbitmq-server of the test's own): handlers write outbox
// rows in their transaction on the PostgreSQL fixture server, idem::OutboxRelay publishes them with
// RabbitMqPublisher, and a downstream consumer deduplicating with idem (AMQP message_id) applies
// each message once, in order per key, even when a batch reached the queue twice.

#include <catch2/catch.hpp>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "idem/outbox/outbox.hpp"
#include "idem/outbox/rabbitmq_publisher.hpp"
#include "postgres/pg_support.hpp"
#include "kafka_rabbitmq_relay_worker.hpp"
#include "rabbitmq_support.hpp"

using namespace std::chrono_literals;
using idem::test::AmqpAdmin;
using idem::test::AmqpMessage;
using idem::test::RabbitBroker;

namespace {

// A transactional PostgresStore with an outbox, on a table of its own.
struct Env {
  std::string table = "obr" + pgtest::random_hex(10);
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
  // Handler of incoming message `n`: one outbox message, key `key-(n % keys)`, payload
  // "key:index-within-key" so the consumer can check per-key order.
  void write(const std::string& destination, int n, int keys, const std::string& prefix = "key-") {
    const std::string key = prefix + std::to_string(n % keys);
    const std::string payload = key + ":" + std::to_string(n / keys);
    guard.run(prefix + "in-" + std::to_string(n), [&](const auto& ctx) { ctx.outbox().send(destination, key, payload); });
  }
};

// Throws after the real publish for the first `lose` batches: the queue has the messages, the
// relay never learns it (a lost confirm, a relay killed before it marked the rows), so they go again.
class AckLost final : public idem::OutboxPublisher {
public:
  AckLost(idem::OutboxPublisher& inner, int lose) : inner_(inner), lose_(lose) {}
  void publish(std::span<const idem::OutboxMessage> batch) override {
    inner_.publish(batch);
    if (lose_.fetch_sub(1) > 0) throw idem::publish_error("test: confirm lost after a real publish");
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

// The downstream service: idem's guard on message_id; applied[id] counts the effects, and each
// key's indexes must come in order.
struct Downstream {
  idem::MemoryStore store;
  idem::IdempotencyGuard<idem::MemoryStore> guard{store, {.lease = 10s, .retention = 1h}};
  std::map<std::string, int> applied;
  std::map<std::string, int> next_index;
  int duplicates = 0, out_of_order = 0;

  void consume(const std::vector<AmqpMessage>& messages) {
    for (const auto& m : messages) {
      const auto out = guard.run(m.message_id, [&](const idem::Context& ctx) {
        ++applied[std::string(ctx.key)];
        const int index = std::stoi(m.body.substr(m.body.find(':') + 1));
        const std::string key = m.header("idem-message-key");
        if (index != next_index[key]) ++out_of_order;
        next_index[key] = index + 1;
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

std::string unique(const std::string& base) { return base + "." + std::to_string(::getpid()); }

}  // namespace

TEST_CASE("RabbitMQ outbox end to end: rows once downstream, rolled back ones never, re-sent batches deduplicated, "
          "two relays at once, a relay SIGKILLed after publish",
          "[rabbitmq]") {
  auto broker = RabbitBroker::start_private();
  AmqpAdmin admin(broker->port());
  const std::string q = unique("outbox.e2e");
  admin.declare_queue(q);
  Env env;
  const int n = 120, keys = 7;
  for (int i = 0; i < n; ++i) env.write(q, i, keys);
  CHECK_THROWS(env.guard.run("in-rolled-back", [&](const auto& ctx) {
    ctx.outbox().send(q, "key-0", "never:0");
    throw std::runtime_error("handler fails after send");
  }));

  std::map<std::string, int> next_after_first;
  {  // one relay whose first two batches are confirmed but not recorded
    idem::RabbitMqPublisher rabbit({.port = broker->port(), .timeout = 10s});
    AckLost lossy(rabbit, 2);
    idem::OutboxRelay relay(lossy, env.relay_options());
    drive(relay, n);
    REQUIRE(relay.stats().published == n);
    CHECK(relay.stats().publish_failures == 2);
    const auto got = admin.drain(q);
    CHECK(got.size() > static_cast<std::size_t>(n));  // the re-sent copies are in the queue too
    Downstream down;
    down.consume(got);
    CHECK(down.applied.size() == n);
    for (const auto& [id, times] : down.applied) CHECK(times == 1);
    CHECK(down.duplicates == static_cast<int>(got.size()) - n);
    CHECK(down.out_of_order == 0);
    for (const auto& m : got) CHECK(m.body.rfind("never", 0) != 0);
    next_after_first = down.next_index;
  }
  {  // then two relays at once, on the rows written next
    for (int i = n; i < 4 * n; ++i) env.write(q, i, keys);
    idem::RabbitMqPublisher pa({.port = broker->port(), .timeout = 10s});
    idem::RabbitMqPublisher pb({.port = broker->port(), .timeout = 10s});
    auto opts = env.relay_options();
    opts.batch = 20;
    Paced slow_a(pa, 20ms), slow_b(pb, 20ms);
    idem::OutboxRelay ra(slow_a, opts), rb(slow_b, opts);
    ra.start();
    rb.start();
    const auto end = std::chrono::steady_clock::now() + 60s;
    while (ra.stats().published + rb.stats().published < 3 * n && std::chrono::steady_clock::now() < end)
      std::this_thread::sleep_for(20ms);
    ra.stop();
    rb.stop();
    CHECK(ra.stats().published + rb.stats().published == 3 * n);
    INFO("relay a published " << ra.stats().published << ", relay b " << rb.stats().published);
    CHECK(ra.stats().published > 0);
    CHECK(rb.stats().published > 0);
    const auto got = admin.drain(q);
    CHECK(got.size() == 3 * n);
    Downstream down;
    down.next_index = next_after_first;  // each key goes on where the first part left it
    down.consume(got);
    CHECK(down.applied.size() == 3 * n);
    CHECK(down.out_of_order == 0);
  }
  {  // then a relay SIGKILLed between publish (confirmed) and mark-sent: its claim rolls back, the
     // rows go again with the same message_id, and the consumer applies each once
    const int m = 40;
    for (int i = 0; i < m; ++i) env.write(q, i, keys, "crash-");
    CHECK(idem::test::relay_killed_after_publish("rabbitmq", pgtest::conninfo(), "idem_test", env.table,
                                                 std::to_string(broker->port())) == m);
    idem::RabbitMqPublisher rabbit({.port = broker->port(), .timeout = 10s});
    idem::OutboxRelay relay(rabbit, env.relay_options());
    drive(relay, m);
    CHECK(relay.stats().published == m);
    const auto got = admin.drain(q);
    CHECK(got.size() == 2 * m);
    Downstream down;
    down.consume(got);
    CHECK(down.applied.size() == m);
    for (const auto& [id, times] : down.applied) CHECK(times == 1);
    CHECK(down.duplicates == m);
    CHECK(down.out_of_order == 0);
  }
  admin.delete_queue(q);
}

TEST_CASE("RabbitMQ outbox end to end: broker down -> rows wait, nothing lost, sent once it is back", "[rabbitmq]") {
  auto broker = RabbitBroker::start_private();
  const std::string q = unique("outbox.down");
  AmqpAdmin(broker->port()).declare_queue(q);  // durable: survives the outage
  Env env;
  idem::RabbitMqPublisher rabbit({.port = broker->port(), .timeout = 2s});
  idem::OutboxRelay relay(rabbit, env.relay_options());
  const int n = 60, keys = 4;
  broker->halt();
  for (int i = 0; i < n; ++i) env.write(q, i, keys);
  for (int i = 0; i < 3; ++i) {
    relay.run_once();  // each publish fails to connect: the rows back off
    std::this_thread::sleep_for(50ms);
  }
  CHECK(relay.stats().published == 0);
  CHECK(relay.stats().publish_failures >= 1);

  broker->resume();
  drive(relay, n);
  CHECK(relay.stats().published == n);
  AmqpAdmin admin(broker->port());
  const auto got = admin.drain(q);
  Downstream down;
  down.consume(got);
  CHECK(down.applied.size() == n);
  for (const auto& [id, times] : down.applied) CHECK(times == 1);
  CHECK(down.out_of_order == 0);
  admin.delete_queue(q);
}
