#pragma once
/// @file outbox/rabbitmq_publisher.hpp idem::RabbitMqPublisher: the outbox relay's publisher for
/// RabbitMQ (AMQP 0-9-1 publisher confirms, rabbitmq-c). Link idem::outbox_rabbitmq.

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "idem/core/record.hpp"
#include "idem/outbox/publisher.hpp"

namespace idem {

/// Settings of a RabbitMqPublisher; checked by its constructor (invalid_options_error).
struct RabbitMqPublisherOptions {
  /// Broker host name or address.
  std::string host = "127.0.0.1";
  /// AMQP port, 1..65535.
  int port = 5672;
  /// Virtual host.
  std::string vhost = "/";
  /// User of the PLAIN login.
  std::string user = "guest";
  /// Password of the PLAIN login (never quoted in a message).
  std::string password = "guest";
  /// Bound on connecting (TCP connect, login, channel open) and, separately, on one publish()'s
  /// sends and the wait for all its confirms; > 0.
  millis timeout{30'000};
  /// Name of the AMQP header that carries OutboxMessage::message_key (not set when the key is empty).
  std::string key_header = "idem-message-key";
};

/**
 * Publishes outbox messages to RabbitMQ over one AMQP connection in confirm mode.
 *
 * OutboxMessage::destination is `"exchange/routing_key"`, split at the first '/' (exchange names
 * cannot hold one; a routing key can): `"orders/eu.created"` goes to exchange `orders` with
 * routing key `eu.created`. A destination without '/' is a routing key on the default exchange,
 * i.e. a queue name (`"payments"`); `"/payments"` says the same explicitly.
 *
 * Each message is published persistent (delivery_mode 2) and mandatory, with `message_id` = the
 * outbox id (what a downstream idem consumer deduplicates on), the message's headers as AMQP
 * string headers and message_key in the header named by key_header. publish() returns once the
 * broker has confirmed (basic.ack) every message of the batch. A message the broker returns
 * (basic.return: no queue bound for its routing key) or nacks, a missing exchange, a broken
 * connection or no confirm within options.timeout throws publish_error: retryable, since a queue
 * declared or a broker back later lets the same batch through (the message says what to check).
 * A broken connection is reopened by the next publish(). Destinations AMQP cannot carry (names
 * over 255 bytes) throw a publish_error that is not retryable.
 *
 * Thread-safe: publish() calls are serialised by a mutex (the relay makes one at a time).
 * Move-only; a moved-from publisher throws usage_error.
 */
class RabbitMqPublisher final : public OutboxPublisher {
public:
  /// Checks the options; connects at the first publish(), so a broker down at startup is a
  /// retryable publish_error there, not a failed construction.
  explicit RabbitMqPublisher(RabbitMqPublisherOptions options);
  ~RabbitMqPublisher() override;  ///< Closes the connection.
  RabbitMqPublisher(RabbitMqPublisher&&) noexcept;             ///< Takes over the connection.
  RabbitMqPublisher& operator=(RabbitMqPublisher&&) noexcept;  ///< Takes over the connection.
  RabbitMqPublisher(const RabbitMqPublisher&) = delete;             ///< One connection, one owner.
  RabbitMqPublisher& operator=(const RabbitMqPublisher&) = delete;  ///< One connection, one owner.

  /// Publishes the batch and waits for every confirm; publish_error otherwise.
  void publish(std::span<const OutboxMessage> batch) override;
  /// "rabbitmq".
  [[nodiscard]] std::string name() const override { return "rabbitmq"; }
  /// The options in force.
  [[nodiscard]] const RabbitMqPublisherOptions& options() const;
  /// Connections opened so far (the first and every reconnection after a broken one).
  [[nodiscard]] std::uint64_t connections() const;

private:
  class Impl;  // rabbitmq-c stays out of this header
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem
