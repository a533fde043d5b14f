#pragma once
/// @file outbox/kafka_publisher.hpp idem::KafkaPublisher: the outbox relay's publisher for Kafka
/// (librdkafka idempotent producer). Link idem::outbox_kafka.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "idem/core/record.hpp"
#include "idem/outbox/publisher.hpp"

namespace idem {

/// Settings of a KafkaPublisher; checked by its constructor (invalid_options_error).
struct KafkaPublisherOptions {
  /// librdkafka `bootstrap.servers`: "host:port[,host:port...]"; required.
  std::string brokers;
  /// More librdkafka producer properties (name, value), applied after idem's own (which include
  /// linger.ms=0: a batch is complete when publish() gets it). They may tune anything
  /// (compression.type, security.protocol, sasl.*, ...) except what ordering and acknowledgement
  /// depend on: enable.idempotence=false, an acks other than all/-1,
  /// max.in.flight.requests.per.connection above 5 and transactional.id are refused.
  std::vector<std::pair<std::string, std::string>> config;
  /// Bound on one publish(): from the first produce to the last delivery report; > 0. Also set
  /// as librdkafka's `message.timeout.ms` unless config sets that (at most this value).
  millis timeout{30'000};
  /// librdkafka `client.id`, as the brokers log it.
  std::string client_id = "idem-outbox";
};

/**
 * Publishes outbox messages to Kafka through one librdkafka idempotent producer
 * (`enable.idempotence=true`, `acks=all`): the destination is the topic, message_key the Kafka
 * key (so one key's messages land in one partition, in order: the idempotent producer keeps
 * order across its own retries), the outbox id the header `idem-outbox-id`, followed by the
 * message's own headers. publish() returns once every message of the batch has a successful
 * delivery report (written to all in-sync replicas); otherwise, or after options.timeout, it
 * withdraws whatever is still queued and throws publish_error, retryable unless the broker
 * refused a message for good (too large, invalid topic name). A message withdrawn while in
 * flight may still have been written: the relay publishes it again with the same id, and
 * downstream consumers deduplicate on it.
 *
 * Thread-safe: publish() calls are serialised by a mutex (the relay makes one at a time).
 * Move-only; a moved-from publisher throws usage_error.
 */
class KafkaPublisher final : public OutboxPublisher {
public:
  /// Checks the options and creates the producer (connections are made lazily, so an unreachable
  /// cluster shows up in publish(), not here). invalid_options_error names the offending setting.
  explicit KafkaPublisher(KafkaPublisherOptions options);
  ~KafkaPublisher() override;  ///< Withdraws anything still queued and destroys the producer.
  KafkaPublisher(KafkaPublisher&&) noexcept;             ///< Takes over the producer.
  KafkaPublisher& operator=(KafkaPublisher&&) noexcept;  ///< Takes over the producer.
  KafkaPublisher(const KafkaPublisher&) = delete;             ///< One producer, one owner.
  KafkaPublisher& operator=(const KafkaPublisher&) = delete;  ///< One producer, one owner.

  /// Produces the batch and waits for every delivery report; publish_error otherwise.
  void publish(std::span<const OutboxMessage> batch) override;
  /// "kafka".
  [[nodiscard]] std::string name() const override { return "kafka"; }
  /// The options in force.
  [[nodiscard]] const KafkaPublisherOptions& options() const;

private:
  class Impl;  // librdkafka stays out of this header
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem
