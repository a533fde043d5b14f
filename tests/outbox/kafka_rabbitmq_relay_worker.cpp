// The process kafka_relay_test and rabbitmq_relay_test spawn and SIGKILL: one relay batch whose
// publisher, once the broker has acknowledged the batch, writes a marker file and hangs, so the
// test kills the relay between publish and mark-sent.
//
//   idem_outbox_broker_worker kafka    CONNINFO SCHEMA TABLE BROKERS   MARKER
//   idem_outbox_broker_worker rabbitmq CONNINFO SCHEMA TABLE AMQP_PORT MARKER

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

}  // namespace

int main(int argc, char** argv) try {
  if (argc != 7) {
    std::fprintf(stderr, "usage: idem_outbox_broker_worker kafka|rabbitmq CONNINFO SCHEMA TABLE BROKERS|AMQP_PORT MARKER\n");
    return 2;
  }
  const std::string broker = argv[1];
  std::unique_ptr<idem::OutboxPublisher> pub;
#if IDEM_WORKER_KAFKA
  if (broker == "kafka")
    pub = std::make_unique<idem::KafkaPublisher>(
        idem::KafkaPublisherOptions{.brokers = argv[5], .config = {{"log_level", "3"}}});
#endif
#if IDEM_WORKER_RABBITMQ
  if (broker == "rabbitmq")
    pub = std::make_unique<idem::RabbitMqPublisher>(idem::RabbitMqPublisherOptions{.port = std::stoi(argv[5])});
#endif
  if (!pub) {
    std::fprintf(stderr, "idem_outbox_broker_worker: %s publisher not built\n", broker.c_str());
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
  std::fprintf(stderr, "idem_outbox_broker_worker: %s\n", e.what());
  return 1;
}
