#pragma once
/// @file outbox/redis_streams_publisher.hpp RedisStreamsPublisher: the outbox relay's publisher
/// for Redis Streams (XADD, the outbox id in the entry's `id` field).

#include <cstddef>
#include <memory>
#include <span>
#include <string>

#include "idem/outbox/publisher.hpp"
#include "idem/redis/options.hpp"

namespace idem {

/// Options of a RedisStreamsPublisher.
struct RedisStreamsPublisherOptions {
  /// The server: `url` (redis://, rediss://, unix://, redis-sentinel://, redis-cluster://) or the
  /// fields, connected as the stores connect (TLS and its checks, AUTH, SELECT,
  /// Sentinel); on a cluster each XADD goes to its stream's master, one at a time.
  RedisOptions redis;
  /// Prepended to every message's destination to name its stream ("" = the destination as is).
  std::string stream_prefix;
  /// > 0: trim each stream to about this many entries (XADD MAXLEN ~ n); 0 = never trim.
  std::size_t maxlen = 0;
};

/**
 * Publishes outbox messages with XADD, one entry per message, the whole batch in one pipeline:
 * fields `id` (the outbox id: a downstream consumer's idempotency key), `key` (message_key),
 * `payload`, then each header as `h:<name>` / value. publish() returns once Redis answered every
 * XADD; any error (server down, timeout, an error reply) is a publish_error and the relay
 * publishes the batch again later: entries of a failed batch may be in the stream twice, with
 * the same `id`. One connection (a cluster: one per master), reconnected on demand; one thread at
 * a time (the relay's).
 */
class RedisStreamsPublisher final : public OutboxPublisher {
 public:
  /// Checks the options (invalid_options_error); connects lazily, at the first publish (a cluster: now, to map its slots).
  explicit RedisStreamsPublisher(RedisStreamsPublisherOptions options);
  ~RedisStreamsPublisher() override;                                 ///< Closes the connection.
  RedisStreamsPublisher(const RedisStreamsPublisher&) = delete;             ///< Owns a connection.
  RedisStreamsPublisher& operator=(const RedisStreamsPublisher&) = delete;  ///< Owns a connection.

  /// XADDs every message of the batch in one pipeline; publish_error unless Redis took them all.
  void publish(std::span<const OutboxMessage> batch) override;
  /// "redis-streams".
  [[nodiscard]] std::string name() const override { return "redis-streams"; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem
