// KafkaPublisher against librdkafka's mock cluster (3 brokers in this process): a batch read back
// with its ids, keys, headers and per-key order; brokers down -> publish_error and nothing counted
// as sent, then recovery; the options it refuses.

#include <catch2/catch.hpp>

#include <chrono>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "idem/outbox/kafka_publisher.hpp"
#include "kafka_support.hpp"

using namespace std::chrono_literals;
using idem::test::KafkaMockCluster;
using idem::test::consume_topic;

namespace {

// `keys` keys, `per_key` messages each, interleaved in outbox order (as the relay claims them).
std::vector<idem::OutboxMessage> make_batch(const std::string& topic, int keys, int per_key, const std::string& tag) {
  std::vector<idem::OutboxMessage> out;
  std::int64_t seq = 0;
  for (int i = 0; i < per_key; ++i)
    for (int k = 0; k < keys; ++k) {
      idem::OutboxMessage m;
      m.message_key = "key-" + std::to_string(k);
      m.id = tag + ":" + m.message_key + ":" + std::to_string(i);
      m.destination = topic;
      m.payload = "payload " + std::to_string(i) + std::string("\0bin", 4);
      m.headers = {{"content-type", "text/plain"}, {"n", std::to_string(i)}};
      m.sequence = ++seq;
      out.push_back(std::move(m));
    }
  return out;
}

idem::KafkaPublisherOptions options_for(const KafkaMockCluster& mc, std::chrono::milliseconds timeout = 10s) {
  idem::KafkaPublisherOptions o;
  o.brokers = mc.brokers();
  o.timeout = timeout;
  o.config = {{"log_level", "3"}};  // the mock's refused connections are expected here: errors only
  return o;
}

}  // namespace

TEST_CASE("KafkaPublisher: a batch reaches the topic with ids, keys, headers and per-key order", "[kafka]") {
  KafkaMockCluster mc;
  mc.create_topic("orders", 4);
  idem::KafkaPublisher pub(options_for(mc));
  CHECK(pub.name() == "kafka");
  const auto batch = make_batch("orders", 5, 40, "b1");
  pub.publish(batch);
  pub.publish({});  // an empty batch is a no-op

  const auto records = consume_topic(mc.brokers(), "orders", 4, batch.size());
  REQUIRE(records.size() == batch.size());
  std::map<std::string, const idem::OutboxMessage*> by_id;
  for (const auto& m : batch) by_id[m.id] = &m;
  std::map<std::string, std::int32_t> partition_of_key;
  std::map<std::string, std::int64_t> last_seq_of_key;
  std::set<std::string> seen;
  for (const auto& r : records) {
    const std::string id = r.header("idem-outbox-id");
    REQUIRE(by_id.count(id) == 1);
    CHECK(seen.insert(id).second);
    const auto& m = *by_id[id];
    CHECK(r.key == m.message_key);
    CHECK(r.value == m.payload);
    REQUIRE(r.headers.size() == 3);
    CHECK(r.headers[0].first == "idem-outbox-id");
    CHECK(r.headers[1] == m.headers[0]);
    CHECK(r.headers[2] == m.headers[1]);
    // One key, one partition, and within it the outbox order.
    auto [it, fresh] = partition_of_key.emplace(m.message_key, r.partition);
    CHECK(it->second == r.partition);
    if (!fresh) CHECK(m.sequence > last_seq_of_key[m.message_key]);
    last_seq_of_key[m.message_key] = m.sequence;
  }
  CHECK(seen.size() == batch.size());
}

TEST_CASE("KafkaPublisher: brokers down -> publish_error (retryable), nothing sent, back up -> the batch goes",
          "[kafka]") {
  KafkaMockCluster mc;
  mc.create_topic("down", 2);
  idem::KafkaPublisher pub(options_for(mc, 2s));
  pub.publish(make_batch("down", 2, 2, "warm"));  // connected and with a producer id before the outage

  mc.down();
  const auto batch = make_batch("down", 3, 5, "outage");
  const auto t0 = std::chrono::steady_clock::now();
  bool thrown = false;
  try {
    pub.publish(batch);
  } catch (const idem::publish_error& e) {
    thrown = true;
    CHECK(e.retryable());
    CHECK(std::string(e.what()).find("not acknowledged") != std::string::npos);
  }
  CHECK(thrown);
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);  // bounded by the timeout (+ the purge's grace)

  mc.up();
  // The relay publishes the same batch again after its backoff: it must now go through.
  bool sent = false;
  for (int attempt = 0; attempt < 10 && !sent; ++attempt) {
    try {
      pub.publish(batch);
      sent = true;
    } catch (const idem::publish_error& e) {
      CHECK(e.retryable());
    }
  }
  REQUIRE(sent);
  const auto records = consume_topic(mc.brokers(), "down", 2, 4 + batch.size());
  std::set<std::string> ids;
  for (const auto& r : records) ids.insert(r.header("idem-outbox-id"));
  for (const auto& m : batch) CHECK(ids.count(m.id) == 1);
}

TEST_CASE("KafkaPublisher: no broker at the bootstrap address -> publish_error within the timeout", "[kafka]") {
  idem::KafkaPublisherOptions o;
  o.brokers = "127.0.0.1:1";  // nothing listens on port 1
  o.timeout = 1s;
  o.config = {{"log_level", "0"}};
  idem::KafkaPublisher pub(o);
  const auto t0 = std::chrono::steady_clock::now();
  REQUIRE_THROWS_AS(pub.publish(make_batch("nowhere", 1, 3, "x")), idem::publish_error);
  CHECK(std::chrono::steady_clock::now() - t0 < 8s);
}

TEST_CASE("KafkaPublisher: a topic name Kafka cannot hold -> publish_error, not retryable", "[kafka]") {
  KafkaMockCluster mc;
  idem::KafkaPublisher pub(options_for(mc));
  auto batch = make_batch("ok", 1, 1, "bad");
  batch[0].destination = "no spaces/or slashes";
  try {
    pub.publish(batch);
    FAIL("no publish_error");
  } catch (const idem::publish_error& e) {
    CHECK_FALSE(e.retryable());
  }
}

TEST_CASE("KafkaPublisher: a broker's permanent refusal -> publish_error, not retryable", "[kafka]") {
  KafkaMockCluster mc;
  mc.create_topic("big", 1);
  idem::KafkaPublisher pub(options_for(mc));
  pub.publish(make_batch("big", 1, 1, "first"));
  rd_kafka_mock_push_request_errors(mc.get(), 0 /* Produce */, 1, RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE);
  try {
    pub.publish(make_batch("big", 1, 1, "refused"));
    FAIL("no publish_error");
  } catch (const idem::publish_error& e) {
    CHECK_FALSE(e.retryable());
  }
  pub.publish(make_batch("big", 1, 1, "after"));  // the producer is still usable
}

TEST_CASE("KafkaPublisher: options that cannot work are refused at construction", "[kafka]") {
  auto with = [](auto change) {
    idem::KafkaPublisherOptions o;
    o.brokers = "127.0.0.1:9092";
    change(o);
    return o;
  };
  using idem::invalid_options_error;
  CHECK_THROWS_AS(idem::KafkaPublisher(with([](auto& o) { o.brokers.clear(); })), invalid_options_error);
  CHECK_THROWS_AS(idem::KafkaPublisher(with([](auto& o) { o.timeout = 0ms; })), invalid_options_error);
  CHECK_THROWS_AS(idem::KafkaPublisher(with([](auto& o) { o.config = {{"enable.idempotence", "false"}}; })),
                  invalid_options_error);
  CHECK_THROWS_AS(idem::KafkaPublisher(with([](auto& o) { o.config = {{"acks", "1"}}; })), invalid_options_error);
  CHECK_THROWS_AS(idem::KafkaPublisher(with([](auto& o) { o.config = {{"max.in.flight", "10"}}; })),
                  invalid_options_error);
  CHECK_THROWS_AS(idem::KafkaPublisher(with([](auto& o) { o.config = {{"message.timeout.ms", "60000"}}; })),
                  invalid_options_error);
  CHECK_THROWS_AS(idem::KafkaPublisher(with([](auto& o) { o.config = {{"no.such.property", "1"}}; })),
                  invalid_options_error);
  CHECK_NOTHROW(idem::KafkaPublisher(with([](auto& o) { o.config = {{"linger.ms", "1"}, {"acks", "all"}}; })));

  idem::KafkaPublisher a(with([](auto&) {}));
  idem::KafkaPublisher b(std::move(a));
  CHECK(b.options().brokers == "127.0.0.1:9092");
  CHECK_THROWS_AS(a.publish({}), idem::usage_error);  // NOLINT(bugprone-use-after-move): moved-from is defined
}
