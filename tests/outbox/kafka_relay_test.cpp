// The outbox end to end through Kafka (librdkafka's mock cluster): relay_suite.hpp's cases, the
// downstream consumer deduplicating on the header idem-outbox-id.

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "idem/outbox/kafka_publisher.hpp"
#include "kafka_support.hpp"
#include "relay_suite.hpp"

namespace {

using namespace std::chrono_literals;

struct KafkaRelayBroker {
  static constexpr const char* worker = "kafka";
  idem::test::KafkaMockCluster mc;
  std::map<std::string, int> partitions;

  std::string address() const { return mc.brokers(); }
  std::string destination(const std::string& name, int parts) {
    mc.create_topic(name, parts);
    partitions[name] = parts;
    return name;
  }
  std::unique_ptr<idem::OutboxPublisher> publisher() {
    return std::make_unique<idem::KafkaPublisher>(
        idem::KafkaPublisherOptions{.brokers = mc.brokers(), .config = {{"log_level", "3"}}, .timeout = 10s});
  }
  std::unique_ptr<idem::OutboxPublisher> outage_publisher() {
    return std::make_unique<idem::KafkaPublisher>(
        idem::KafkaPublisherOptions{.brokers = mc.brokers(), .config = {{"log_level", "0"}}, .timeout = 1s});
  }
  // Every partition from the beginning, until `expected` records (and a little more, so an extra
  // copy shows up too).
  std::vector<outboxtest::Entry> read(const std::string& topic, std::size_t expected) {
    std::vector<outboxtest::Entry> out;
    for (const auto& r : idem::test::consume_topic(mc.brokers(), topic, partitions.at(topic), expected))
      out.push_back({.id = r.header("idem-outbox-id"), .key = r.key, .payload = r.value, .fields = {}});
    return out;
  }
  void down() { mc.down(); }
  void up() { mc.up(); }
  void remove(const std::string&) {}  // the mock cluster dies with the case
};

}  // namespace

IDEM_OUTBOX_RELAY_SUITE(KafkaRelayBroker, "Kafka", "[kafka]")
