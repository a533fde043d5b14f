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
  /// `amqp://user:password@host:port/vhost` or `amqps://...` (TLS); when set, it replaces host and
  /// port (5672, or 5671 for amqps, when absent) and the user, password and vhost it has
  /// (percent-decoded: the vhost "/" is "%2f"), and amqps:// turns tls on. A malformed URL, or
  /// amqp:// with tls on, is an invalid_options_error.
  std::string url;
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
  /// TLS (rabbitmq-c's OpenSSL socket); amqps:// sets it. A TLS listener is usually port 5671.
  bool tls = false;
  /// PEM CA certificates the broker's certificate must chain to; empty: the system's default CA
  /// bundle (SSL_CERT_FILE, else OpenSSL's cert.pem). Must exist when set.
  std::string ca_file;
  /// PEM client certificate (chain) for mutual TLS; set together with key_file.
  std::string cert_file;
  /// Unencrypted PEM private key of cert_file; set together with cert_file.
  std::string key_file;
  /// Check the broker's certificate against ca_file; a refused one is a publish_error that is not
  /// retryable.
  bool verify_peer = true;
  /// Check that the certificate names `host` (its DNS names: to connect by IP address, the
  /// certificate needs the address as a DNS name too); a mismatch is refused as above.
  bool verify_hostname = true;
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
 * over 255 bytes) and a TLS certificate the options refuse (wrong CA, wrong host name: the message
 * says "TLS certificate verification failed") throw a publish_error that is not retryable.
 *
 * Thread-safe: publish() calls are serialised by a mutex (the relay makes one at a time).
 * Move-only; a moved-from publisher throws usage_error.
 */
class RabbitMqPublisher final : public OutboxPublisher {
public:
  /// Checks the options (the url parsed, the TLS files loaded); connects at the first publish(),
  /// so a broker down at startup is a retryable publish_error there, not a failed construction.
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
