// Outbox relay throughput per broker: N rows committed in the outbox of a fresh PostgresStore
// table, then drained by idem::OutboxRelay (run_once back to back) through the broker's publisher;
// prints the relay's messages/s, and the publisher's own (publish() in batches of 100, no database).
//
//   idem_bench_outbox_brokers --conninfo CI --broker kafka    [--kafka-brokers H:P | (mock cluster)]
//   idem_bench_outbox_brokers --conninfo CI --broker rabbitmq --amqp-port P
//   idem_bench_outbox_brokers --conninfo CI --broker redis    --redis-url redis://127.0.0.1:P
//   options: --rows N (20000) --batch B (relay batch, 256) --keys K (100) --payload BYTES (200)
//            --relays R (1: relays at once, each with its own publisher)
//            --kafka-config name=value (more librdkafka properties; repeatable, e.g. linger.ms=1)
//
// Output, one line each: "relay <msgs/s>" and "publish <msgs/s>" (scripts/bench-outbox parses them).
// Kafka without --kafka-brokers runs librdkafka's mock cluster (3 brokers) inside this process:
// it shares the CPU with the relay, so its numbers are a floor.

#include <amqp.h>
#include <amqp_tcp_socket.h>
#include <librdkafka/rdkafka.h>
#include <librdkafka/rdkafka_mock.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "idem/outbox/kafka_publisher.hpp"
#include "idem/outbox/outbox.hpp"
#include "idem/outbox/rabbitmq_publisher.hpp"

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

std::string arg(int argc, char** argv, const std::string& name, const std::string& dflt) {
  for (int i = 1; i + 1 < argc; ++i)
    if (argv[i] == name) return argv[i + 1];
  return dflt;
}

// librdkafka's mock cluster, living in a handle of its own.
struct KafkaMock {
  rd_kafka_t* rk = nullptr;
  std::string brokers;
  KafkaMock() {
    rd_kafka_conf_t* conf = rd_kafka_conf_new();
    char err[512];
    rd_kafka_conf_set(conf, "test.mock.num.brokers", "3", err, sizeof err);
    rd_kafka_conf_set(conf, "log_level", "3", err, sizeof err);
    rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, err, sizeof err);
    if (!rk) throw std::runtime_error(std::string("mock cluster: ") + err);
    brokers = rd_kafka_mock_cluster_bootstraps(rd_kafka_handle_mock_cluster(rk));
  }
  void topic(const std::string& name, int partitions) const {
    rd_kafka_mock_topic_create(rd_kafka_handle_mock_cluster(rk), name.c_str(), partitions, 3);
  }
  ~KafkaMock() { rd_kafka_destroy(rk); }
};

std::unique_ptr<idem::OutboxPublisher> make_publisher(const std::string& broker, int argc, char** argv,
                                                      const std::string& kafka_brokers) {
  if (broker == "kafka") {
    idem::KafkaPublisherOptions o{.brokers = kafka_brokers, .config = {{"log_level", "3"}}};
    for (int i = 1; i + 1 < argc; ++i)
      if (std::string(argv[i]) == "--kafka-config") {
        const std::string kv = argv[i + 1];
        const auto eq = kv.find('=');
        if (eq == std::string::npos) throw std::runtime_error("--kafka-config wants name=value");
        o.config.emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
      }
    return std::make_unique<idem::KafkaPublisher>(o);
  }
  if (broker == "rabbitmq")
    return std::make_unique<idem::RabbitMqPublisher>(
        idem::RabbitMqPublisherOptions{.port = std::stoi(arg(argc, argv, "--amqp-port", "5672"))});
  if (broker == "redis") {
    idem::RedisStreamsPublisherOptions o;
    o.redis.url = arg(argc, argv, "--redis-url", "redis://127.0.0.1:6379");
    return std::make_unique<idem::RedisStreamsPublisher>(o);
  }
  throw std::runtime_error("--broker must be kafka, rabbitmq or redis");
}

// A durable queue for the RabbitMQ runs (the default exchange routes to it by name).
void declare_queue(int port, const std::string& queue) {
  amqp_connection_state_t c = amqp_new_connection();
  amqp_socket_t* s = amqp_tcp_socket_new(c);
  if (!s || amqp_socket_open(s, "127.0.0.1", port) != AMQP_STATUS_OK) throw std::runtime_error("amqp connect");
  if (amqp_login(c, "/", 0, 131072, 0, AMQP_SASL_METHOD_PLAIN, "guest", "guest").reply_type != AMQP_RESPONSE_NORMAL)
    throw std::runtime_error("amqp login");
  amqp_channel_open(c, 1);
  amqp_queue_declare(c, 1, amqp_cstring_bytes(queue.c_str()), 0, 1, 0, 0, amqp_empty_table);
  if (amqp_get_rpc_reply(c).reply_type != AMQP_RESPONSE_NORMAL) throw std::runtime_error("queue.declare");
  amqp_queue_purge(c, 1, amqp_cstring_bytes(queue.c_str()));
  amqp_get_rpc_reply(c);
  amqp_channel_close(c, 1, AMQP_REPLY_SUCCESS);
  amqp_connection_close(c, AMQP_REPLY_SUCCESS);
  amqp_destroy_connection(c);
}
}  // namespace

int main(int argc, char** argv) try {
  const std::string conninfo = arg(argc, argv, "--conninfo", "");
  const std::string broker = arg(argc, argv, "--broker", "kafka");
  const int rows = std::stoi(arg(argc, argv, "--rows", "20000"));
  const auto batch = static_cast<std::size_t>(std::stoul(arg(argc, argv, "--batch", "256")));
  const int keys = std::stoi(arg(argc, argv, "--keys", "100"));
  const auto payload_size = static_cast<std::size_t>(std::stoul(arg(argc, argv, "--payload", "200")));
  const int relays = std::stoi(arg(argc, argv, "--relays", "1"));
  if (conninfo.empty() || rows < 1 || keys < 1 || relays < 1) {
    std::fprintf(stderr, "usage: idem_bench_outbox_brokers --conninfo CI --broker kafka|rabbitmq|redis [--rows N] ...\n");
    return 2;
  }

  const std::string destination = "idem-bench-" + std::to_string(::getpid());
  std::unique_ptr<KafkaMock> mock;
  std::string kafka_brokers = arg(argc, argv, "--kafka-brokers", "");
  if (broker == "kafka" && kafka_brokers.empty()) {
    mock = std::make_unique<KafkaMock>();
    mock->topic(destination, 6);
    kafka_brokers = mock->brokers;
  }
  if (broker == "rabbitmq") declare_queue(std::stoi(arg(argc, argv, "--amqp-port", "5672")), destination);

  const std::string payload(payload_size, 'p');
  // 1. The publisher alone: publish() in batches of 100.
  {
    auto pub = make_publisher(broker, argc, argv, kafka_brokers);
    std::vector<idem::OutboxMessage> msgs(100);
    const int total = rows;
    const auto t0 = Clock::now();
    for (int sent = 0; sent < total; sent += 100) {
      for (int i = 0; i < 100; ++i) {
        auto& m = msgs[static_cast<std::size_t>(i)];
        m.id = "pub-" + std::to_string(sent + i);
        m.destination = destination;
        m.message_key = "key-" + std::to_string((sent + i) % keys);
        m.payload = payload;
        m.sequence = sent + i + 1;
      }
      pub->publish(msgs);
    }
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    std::printf("publish %.0f\n", total / secs);
  }

  // 2. Through the relay: rows committed first (a handler sends 500 each), then drained.
  const std::string table = "bench_ob_" + std::to_string(::getpid());
  idem::PostgresStore store{idem::PostgresOptions{.conninfo = conninfo, .pool = {.size = 2}},
                            idem::PostgresStoreOptions{.schema = "idem_bench",
                                                       .table = table,
                                                       .mode = idem::PostgresMode::transactional,
                                                       .outbox = true}};
  idem::IdempotencyGuard<idem::PostgresStore> guard{store, {.lease = 60s, .retention = 1h}};
  const auto fill0 = Clock::now();
  for (int done = 0, h = 0; done < rows; ++h) {
    const int n = std::min(500, rows - done);
    guard.run("fill-" + std::to_string(h), [&](const auto& ctx) {
      for (int i = 0; i < n; ++i) ctx.outbox().send(destination, "key-" + std::to_string((done + i) % keys), payload);
    });
    done += n;
  }
  const double fill_secs = std::chrono::duration<double>(Clock::now() - fill0).count();

  idem::OutboxRelayOptions ro;
  ro.postgres.conninfo = conninfo;
  ro.schema = "idem_bench";
  ro.table = table;
  ro.batch = batch;
  ro.retention = 1h;
  std::vector<std::unique_ptr<idem::OutboxPublisher>> pubs;
  std::vector<std::unique_ptr<idem::OutboxRelay>> rs;
  for (int r = 0; r < relays; ++r) {
    pubs.push_back(make_publisher(broker, argc, argv, kafka_brokers));
    rs.push_back(std::make_unique<idem::OutboxRelay>(*pubs.back(), ro));
    rs.back()->migrate();
  }
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (auto& relay : rs)
    threads.emplace_back([&relay, &rs, rows] {
      auto total = [&] {
        std::uint64_t s = 0;
        for (auto& x : rs) s += x->stats().published;
        return s;
      };
      const auto end = Clock::now() + 600s;
      while (total() < static_cast<std::uint64_t>(rows) && Clock::now() < end)
        if (relay->run_once() == 0) std::this_thread::sleep_for(1ms);
    });
  for (auto& t : threads) t.join();
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  std::uint64_t published = 0, failures = 0;
  for (auto& x : rs) {
    published += x->stats().published;
    failures += x->stats().publish_failures;
  }
  std::printf("relay %.0f\n", static_cast<double>(published) / secs);
  std::fprintf(stderr, "%s: %llu rows (filled in %.2f s) relayed in %.2f s by %d relay(s), batch %zu, %llu failed batches%s\n",
               broker.c_str(), static_cast<unsigned long long>(published), fill_secs, secs, relays, batch,
               static_cast<unsigned long long>(failures), mock ? ", in-process Kafka mock cluster" : "");
  return published == static_cast<std::uint64_t>(rows) ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "idem_bench_outbox_brokers: %s\n", e.what());
  return 1;
}
