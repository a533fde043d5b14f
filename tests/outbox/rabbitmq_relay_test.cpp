// The outbox end to end through RabbitMQ (a real rabbitmq-server of each case's own, which the
// outage case halts and resumes): relay_suite.hpp's cases, the downstream consumer deduplicating
// on the AMQP message_id.

#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "idem/outbox/rabbitmq_publisher.hpp"
#include "rabbitmq_support.hpp"
// Under sanitizers the outage case (a real node halted and resumed) runs in the dev build only.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define IDEM_RELAY_SKIP_OUTAGE
#endif
#include "relay_suite.hpp"

namespace {

using namespace std::chrono_literals;

struct RabbitMqRelayBroker {
  static constexpr const char* worker = "rabbitmq";
  std::unique_ptr<idem::test::RabbitBroker> broker = idem::test::RabbitBroker::start_private();

  std::string address() const { return std::to_string(broker->port()); }
  // A durable queue (it survives the outage); `partitions` is Kafka's.
  std::string destination(const std::string& name, int /*partitions*/) {
    const std::string q = name + "." + std::to_string(::getpid());
    idem::test::AmqpAdmin(broker->port()).declare_queue(q);
    return q;
  }
  std::unique_ptr<idem::OutboxPublisher> publisher() {
    return std::make_unique<idem::RabbitMqPublisher>(
        idem::RabbitMqPublisherOptions{.port = broker->port(), .timeout = 10s});
  }
  std::unique_ptr<idem::OutboxPublisher> outage_publisher() {
    return std::make_unique<idem::RabbitMqPublisher>(
        idem::RabbitMqPublisherOptions{.port = broker->port(), .timeout = 2s});
  }
  // Everything in the queue now: the relay has the broker's confirms for all it published.
  std::vector<outboxtest::Entry> read(const std::string& q, std::size_t /*expected*/) {
    std::vector<outboxtest::Entry> out;
    for (const auto& m : idem::test::AmqpAdmin(broker->port()).drain(q))
      out.push_back({.id = m.message_id, .key = m.header("idem-message-key"), .payload = m.body, .fields = {}});
    return out;
  }
  void down() { broker->halt(); }
  void up() { broker->resume(); }
  void remove(const std::string& q) { idem::test::AmqpAdmin(broker->port()).delete_queue(q); }
};

}  // namespace

IDEM_OUTBOX_RELAY_SUITE(RabbitMqRelayBroker, "RabbitMQ", "[rabbitmq]")
