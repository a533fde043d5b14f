// The relay the outbox tests spawn and SIGKILL (outboxtest::relay_killed_after_publish,
// outbox_support.hpp): one relay batch whose publisher, once the broker has acknowledged the batch,
// writes a marker file (the batch size) and hangs, so the test kills the relay between publish and
// mark-sent. The publisher is chosen by the first argument; Kafka and RabbitMQ exist when their
// publisher targets were built (IDEM_WORKER_KAFKA, IDEM_WORKER_RABBITMQ).
//
//   idem_outbox_worker redis    CONNINFO SCHEMA TABLE REDIS_PORT MARKER
//   idem_outbox_worker kafka    CONNINFO SCHEMA TABLE BROKERS    MARKER
//   idem_outbox_worker rabbitmq CONNINFO SCHEMA TABLE AMQP_PORT  MARKER

#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include "idem/outbox/outbox.hpp"
#if IDEM_WORKER_KAFKA
#include "idem/outbox/kafka_publisher.hpp"
#endif
#if IDEM_WORKER_RABBITMQ
#include "idem/outbox/rabbitmq_publisher.hpp"
#endif

namespace {

class HangAfterPublish final : public idem::OutboxPublisher {
public:
  HangAfterPublish(idem::OutboxPublisher& inner, std::string marker) : inner_(inner), marker_(std::move(marker)) {}
  void publish(std::span<const idem::OutboxMessage> batch) override {
    inner_.publish(batch);
    std::ofstream(marker_) << batch.size() << "\n";
    std::this_thread::sleep_for(std::chrono::minutes(5));
  }
  [[nodiscard]] std::string name() const override { return "hang-after-" + inner_.name(); }

private:
  idem::OutboxPublisher& inner_;
  std::string marker_;
};

std::unique_ptr<idem::OutboxPublisher> make_publisher(const std::string& kind, const std::string& address) {
  if (kind == "redis") {
    idem::RedisOptions ro;
    ro.port = std::stoi(address);
    return std::make_unique<idem::RedisStreamsPublisher>(idem::RedisStreamsPublisherOptions{.redis = ro});
  }
#if IDEM_WORKER_KAFKA
  if (kind == "kafka")
    return std::make_unique<idem::KafkaPublisher>(
        idem::KafkaPublisherOptions{.brokers = address, .config = {{"log_level", "3"}}});
#endif
#if IDEM_WORKER_RABBITMQ
  if (kind == "rabbitmq")
    return std::make_unique<idem::RabbitMqPublisher>(idem::RabbitMqPublisherOptions{.port = std::stoi(address)});
#endif
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc != 7) {
    std::fprintf(stderr, "usage: idem_outbox_worker redis|kafka|rabbitmq CONNINFO SCHEMA TABLE ADDRESS MARKER\n");
    return 2;
  }
  auto pub = make_publisher(argv[1], argv[5]);
  if (!pub) {
    std::fprintf(stderr, "idem_outbox_worker: no %s publisher in this build\n", argv[1]);
    return 2;
  }
  HangAfterPublish hang{*pub, argv[6]};
  idem::OutboxRelayOptions o;
  o.postgres.conninfo = argv[2];
  o.schema = argv[3];
  o.table = argv[4];
  idem::OutboxRelay relay{hang, o};
  relay.run_once();
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "idem_outbox_worker: %s\n", e.what());
  return 1;
}
