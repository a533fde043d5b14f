#pragma once
/// @file outbox/publisher.hpp What the outbox relay hands a broker: idem::OutboxMessage, the
/// OutboxPublisher interface the Kafka, RabbitMQ and Redis Streams publishers implement, and
/// publish_error.

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "idem/core/error.hpp"

namespace idem {

/// One message a handler sent through the outbox, as the relay reads it back.
struct OutboxMessage {
  /// Stable id: derived from the incoming key and the message's index in its handler, so a re-run
  /// of the handler writes the same id. Publishers put it where a downstream consumer reads its
  /// idempotency key (Kafka header `idem-outbox-id`, AMQP `message_id`, the stream entry's `id` field).
  std::string id;
  std::string destination;  ///< topic, exchange/routing key or stream, as the handler named it
  std::string message_key;  ///< ordering key: rows of one key are published in the order written
  std::string payload;      ///< the body, bytes as given
  std::vector<std::pair<std::string, std::string>> headers;  ///< name/value pairs, in order
  std::int64_t sequence = 0;  ///< the row's position in the outbox (grows with every write)
  std::uint32_t attempts = 0;  ///< earlier publish attempts of this row that failed
};

/// A broker could not take a message (down, refused, timed out, confirm not received):
/// retryable() says whether the relay should try again after its backoff.
class publish_error : public error {
 public:
  /// Builds the error; the message names the broker, the destination and what to fix.
  publish_error(const std::string& what, bool retryable = true) : error(what, retryable) {}
};

/**
 * Publishes outbox messages to one broker. publish() returns only when the broker has every
 * message of the batch (acknowledged: Kafka delivery report, AMQP publisher confirm, XADD reply)
 * and throws publish_error otherwise; the relay then marks none of the batch sent and publishes it
 * again later with the same ids (downstream consumers deduplicate on the id). A batch holds at
 * most one message per message_key unless they are in outbox order. Called from one relay thread
 * at a time per publisher object.
 */
class OutboxPublisher {
 public:
  virtual ~OutboxPublisher() = default;  ///< Publishers are owned by the relay or the caller.
  /// Publishes every message of the batch or throws publish_error (nothing is known to be sent).
  virtual void publish(std::span<const OutboxMessage> batch) = 0;
  /// A short name for logs and metrics ("kafka", "rabbitmq", "redis-streams").
  [[nodiscard]] virtual std::string name() const = 0;
};

}  // namespace idem
