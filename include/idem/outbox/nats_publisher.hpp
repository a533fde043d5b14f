#pragma once
/// @file outbox/nats_publisher.hpp NatsPublisher: the outbox relay's publisher for NATS JetStream
/// (the outbox id in `Nats-Msg-Id`, so the server itself drops the relay's re-sends).

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "idem/core/record.hpp"
#include "idem/outbox/publisher.hpp"

namespace idem {

/// Options of a NatsPublisher; checked at construction (invalid_options_error names the field).
struct NatsPublisherOptions {
  std::string url = "nats://127.0.0.1:4222";  ///< the server (a comma-separated list for a cluster)
  std::string subject_prefix;                  ///< prepended to every message's destination to name its subject
  std::string expect_stream;                   ///< when set, a message stored by any other stream is refused
  millis timeout{5000};                        ///< connect and publish-acknowledgement timeout; > 0
};

/**
 * Publishes outbox messages with JetStream, one acknowledged publish per message, in batch order:
 * subject `subject_prefix + destination`, the payload as the body, the message's headers, then
 * `Nats-Msg-Id` = the outbox id and `Idem-Message-Key` = message_key (when set). A re-send of the
 * same id inside the stream's duplicate window (2 minutes by default: keep it above the relay's
 * worst retry delay) is acknowledged by the server as a duplicate and not stored again, so a batch
 * the relay publishes twice leaves each message in the stream once. Any failure (server down, no
 * stream for the subject, timeout) is a publish_error; the relay then publishes the batch again.
 * One connection, opened at the first publish and again after it is closed; one thread at a time.
 */
class NatsPublisher final : public OutboxPublisher {
 public:
  /// Checks the options (invalid_options_error); connects lazily, at the first publish.
  explicit NatsPublisher(NatsPublisherOptions options);
  ~NatsPublisher() override;                                ///< Closes the connection.
  NatsPublisher(const NatsPublisher&) = delete;             ///< Owns a connection.
  NatsPublisher& operator=(const NatsPublisher&) = delete;  ///< Owns a connection.

  /// Publishes every message of the batch, each acknowledged by JetStream; publish_error otherwise.
  void publish(std::span<const OutboxMessage> batch) override;
  /// "nats".
  [[nodiscard]] std::string name() const override { return "nats"; }
  /// Messages JetStream acknowledged as duplicates of an id it already held (re-sends it dropped).
  [[nodiscard]] std::uint64_t duplicates() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem
