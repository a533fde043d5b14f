#pragma once
// librdkafka's mock cluster for the outbox tests and the broker bench: brokers in this process, on
// loopback, that speak the Kafka protocol (idempotent producer included); and a reader that
// consumes a topic back from the beginning.

#include <librdkafka/rdkafka.h>
#include <librdkafka/rdkafka_mock.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace idem::test {

// The mock cluster lives inside a librdkafka handle of its own and dies with it.
class KafkaMockCluster {
public:
  explicit KafkaMockCluster(int brokers = 3) {
    rd_kafka_conf_t* conf = rd_kafka_conf_new();
    char err[512];
    if (rd_kafka_conf_set(conf, "test.mock.num.brokers", std::to_string(brokers).c_str(), err, sizeof err) !=
        RD_KAFKA_CONF_OK) {
      rd_kafka_conf_destroy(conf);
      throw std::runtime_error(std::string("mock cluster: ") + err);
    }
    rd_kafka_conf_set(conf, "log_level", "3", err, sizeof err);
    rk_ = rd_kafka_new(RD_KAFKA_PRODUCER, conf, err, sizeof err);
    if (!rk_) {
      rd_kafka_conf_destroy(conf);
      throw std::runtime_error(std::string("mock cluster: ") + err);
    }
    mc_ = rd_kafka_handle_mock_cluster(rk_);
    if (!mc_) throw std::runtime_error("librdkafka did not create the mock cluster");
    brokers_ = rd_kafka_mock_cluster_bootstraps(mc_);
    count_ = brokers;
  }
  ~KafkaMockCluster() { rd_kafka_destroy(rk_); }
  KafkaMockCluster(const KafkaMockCluster&) = delete;
  KafkaMockCluster& operator=(const KafkaMockCluster&) = delete;

  const std::string& brokers() const { return brokers_; }
  rd_kafka_mock_cluster_t* get() const { return mc_; }
  void create_topic(const std::string& topic, int partitions) {
    if (rd_kafka_mock_topic_create(mc_, topic.c_str(), partitions, count_ < 3 ? count_ : 3))
      throw std::runtime_error("mock cluster: cannot create topic " + topic);
  }
  // Every broker refuses connections (and drops the ones it has) until up().
  void down() {
    for (int b = 1; b <= count_; ++b) rd_kafka_mock_broker_set_down(mc_, b);
  }
  void up() {
    for (int b = 1; b <= count_; ++b) rd_kafka_mock_broker_set_up(mc_, b);
  }

private:
  rd_kafka_t* rk_ = nullptr;
  rd_kafka_mock_cluster_t* mc_ = nullptr;
  std::string brokers_;
  int count_ = 0;
};

struct KafkaRecord {
  std::int32_t partition = 0;
  std::int64_t offset = 0;
  std::string key, value;
  std::vector<std::pair<std::string, std::string>> headers;  // in order
  std::string header(const std::string& name) const {
    for (const auto& [n, v] : headers)
      if (n == name) return v;
    return {};
  }
};

// Reads every partition of `topic` from the beginning until `expected` records have arrived or
// `limit` has passed (then returns what it has), in offset order per partition; after the
// expected count it keeps reading a little, so an extra copy shows up too.
inline std::vector<KafkaRecord> consume_topic(const std::string& brokers, const std::string& topic, int partitions,
                                              std::size_t expected,
                                              std::chrono::milliseconds limit = std::chrono::seconds(20)) {
  rd_kafka_conf_t* conf = rd_kafka_conf_new();
  char err[512];
  rd_kafka_conf_set(conf, "bootstrap.servers", brokers.c_str(), err, sizeof err);
  rd_kafka_conf_set(conf, "group.id", ("idem-test-reader-" + topic).c_str(), err, sizeof err);
  rd_kafka_conf_set(conf, "enable.auto.commit", "false", err, sizeof err);
  rd_kafka_conf_set(conf, "log_level", "3", err, sizeof err);
  rd_kafka_t* rk = rd_kafka_new(RD_KAFKA_CONSUMER, conf, err, sizeof err);
  if (!rk) {
    rd_kafka_conf_destroy(conf);
    throw std::runtime_error(std::string("reader: ") + err);
  }
  rd_kafka_topic_partition_list_t* parts = rd_kafka_topic_partition_list_new(partitions);
  for (int p = 0; p < partitions; ++p)
    rd_kafka_topic_partition_list_add(parts, topic.c_str(), p)->offset = RD_KAFKA_OFFSET_BEGINNING;
  rd_kafka_assign(rk, parts);
  rd_kafka_topic_partition_list_destroy(parts);
  std::vector<KafkaRecord> out;
  auto end = std::chrono::steady_clock::now() + limit;
  bool draining = false;
  while (std::chrono::steady_clock::now() < end) {
    if (!draining && out.size() >= expected) {
      draining = true;
      end = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
    }
    rd_kafka_message_t* m = rd_kafka_consumer_poll(rk, 100);
    if (!m) continue;
    if (!m->err) {
      KafkaRecord r;
      r.partition = m->partition;
      r.offset = m->offset;
      if (m->key) r.key.assign(static_cast<const char*>(m->key), m->key_len);
      if (m->payload) r.value.assign(static_cast<const char*>(m->payload), m->len);
      rd_kafka_headers_t* h = nullptr;
      if (rd_kafka_message_headers(m, &h) == RD_KAFKA_RESP_ERR_NO_ERROR) {
        const char* name = nullptr;
        const void* value = nullptr;
        size_t size = 0;
        for (size_t i = 0; rd_kafka_header_get_all(h, i, &name, &value, &size) == RD_KAFKA_RESP_ERR_NO_ERROR; ++i)
          r.headers.emplace_back(name, value ? std::string(static_cast<const char*>(value), size) : std::string());
      }
      out.push_back(std::move(r));
    }
    rd_kafka_message_destroy(m);
  }
  rd_kafka_consumer_close(rk);
  rd_kafka_destroy(rk);
  return out;
}

}  // namespace idem::test
