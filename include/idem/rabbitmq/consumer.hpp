#pragma once
/// @file rabbitmq/consumer.hpp RabbitConsumer: a RabbitMQ queue consumer for IdempotencyGuard —
/// ack after the outcome, dead letters (with their reason) to the queue's dead-letter exchange,
/// delayed requeue through a TTL queue, prefetch, reconnection; an idem::Source for idem::consume.
/// docs/consuming.md has the table.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "idem/core/error.hpp"
#include "idem/core/outcome.hpp"
#include "idem/core/record.hpp"
#include "idem/detail/consume_loop.hpp"
#include "idem/guard/consume.hpp"
#include "idem/guard/verdict.hpp"

namespace idem {

/// Settings of a RabbitConsumer; checked at construction (invalid_options_error names the field).
struct RabbitConsumerOptions {
  /// `amqp://user:password@host:port/vhost` or `amqps://...` (TLS); when set, it replaces host and
  /// port (5672, or 5671 for amqps, when absent) and the user, password and vhost it has
  /// (percent-decoded: the vhost "/" is "%2f"), and amqps:// turns tls on. A malformed URL, or
  /// amqp:// with tls on, is an invalid_options_error.
  std::string url;
  std::string host = "127.0.0.1";  ///< the broker
  int port = 5672;                 ///< its AMQP port (a TLS listener is usually 5671)
  std::string vhost = "/";         ///< virtual host
  std::string user = "guest";      ///< login
  std::string password = "guest";  ///< password
  bool tls = false;           ///< TLS (rabbitmq-c's OpenSSL socket); amqps:// sets it
  /// PEM CA certificates the broker's certificate must chain to; empty: the system's default CA
  /// bundle (SSL_CERT_FILE, else OpenSSL's cert.pem). Must exist when set.
  std::string ca_file;
  std::string cert_file;       ///< PEM client certificate (chain) for mutual TLS; with key_file
  std::string key_file;        ///< its unencrypted PEM private key; with cert_file
  /// Check the broker's certificate against ca_file. A refused certificate is a connection_error
  /// that is not retryable (code "TLS"): run() throws it instead of reconnecting.
  bool verify_peer = true;
  /// Check that the certificate names `host` (its DNS names: to connect by IP address, the
  /// certificate needs the address as a DNS name too). A mismatch is refused as above.
  bool verify_hostname = true;
  std::string queue;               ///< the queue to consume (required)
  std::uint16_t prefetch = 50;     ///< unacked deliveries in flight (basic.qos), 1..65535
  /// poll() (idem::Source): the most deliveries one batch takes, 1..prefetch; 0 (default):
  /// min(32, prefetch).
  std::size_t batch = 0;
  /// poll(): how long it waits for the first delivery of a batch (the rest are those already
  /// received, never a longer wait); > 0.
  millis poll_wait{500};
  /// Declare the topology at construction: `queue` (durable) whose dead-letter exchange
  /// `<queue>.dlx` routes to `<queue>.dlq`, and the delay queue `<queue>.delay` whose expired
  /// messages go back to `queue`. Off when your deployment declares them (same names expected).
  bool declare = true;
  /// Requeue delays (idem::verdict). The cap is short by default: the delay queue expires messages
  /// from its head only, so one long delay holds back every shorter one queued behind it.
  RetryPolicy retry{.base = millis{50}, .cap = millis{1'000}};
  millis connect_timeout{5000};  ///< TCP connect and login
  int heartbeat_s = 30;       ///< AMQP heartbeat: a dead peer is noticed within about twice this
};

namespace detail {
struct RabbitOriginal;  // the properties as received (consumer.cpp): what settle()'s copies keep
}

/// The header a delayed requeue's copy carries: the delivery number (1 = the first) the copy's
/// first delivery is, so that RabbitConsumer::delivery(d).attempt counts requeues.
inline constexpr std::string_view rabbit_attempt_header = "idem-attempt";
/// The header a dead letter carries: why it was dead-lettered (idem::Verdict::reason).
inline constexpr std::string_view rabbit_reason_header = "idem-reason";

/// One delivery: what the handler needs, and what settle() needs to answer it.
struct RabbitDelivery {
  std::uint64_t tag = 0;       ///< the delivery tag (of the connection it came on)
  std::uint64_t connection = 0;  ///< which connection: a delivery of a closed one is not answered
  bool redelivered = false;    ///< the broker delivered it before (a consumer died, or a nack)
  std::string message_id;      ///< the AMQP message-id property: the idempotency key ("" when absent)
  std::string content_type;    ///< the content-type property
  std::string body;            ///< the body, binary-safe
  /// The AMQP `headers` table, in order, each value as text: strings and byte arrays as they are,
  /// integers as decimal text, booleans "1" / "0", floats and decimals as decimal text, a
  /// timestamp as its seconds since the epoch, void as "". Arrays and nested tables (the broker's
  /// `x-death`) are left out here; settle()'s copies keep them as they were.
  std::vector<std::pair<std::string, std::string>> headers;
  /// The AMQP `timestamp` property (whole seconds), when the publisher set it.
  std::optional<std::chrono::system_clock::time_point> timestamp;
  /// Every property and the headers as received, for the copies settle() publishes (a delayed
  /// requeue, a dead letter). Opaque; null in a delivery you built yourself (the copies then keep
  /// message_id, content_type and headers).
  std::shared_ptr<const detail::RabbitOriginal> original;

  /// The last value of header `name`, or null.
  [[nodiscard]] const std::string* header(std::string_view name) const noexcept {
    const std::string* found = nullptr;
    for (const auto& [k, v] : headers)
      if (k == name) found = &v;
    return found;
  }
};

/// What to do with one delivery.
struct RabbitDecision {
  BrokerAction action = BrokerAction::requeue;  ///< ack, requeue (after `delay`), dead_letter
  millis delay{0};                              ///< for requeue: how long until it is delivered again
  std::string reason;                           ///< for dead_letter: its `idem-reason` header (may be empty)
};

/// What a RabbitConsumer has done so far.
struct RabbitConsumerStats {
  std::uint64_t delivered = 0;      ///< deliveries received
  std::uint64_t redelivered = 0;    ///< of them, marked redelivered by the broker
  std::uint64_t acked = 0;          ///< acked
  std::uint64_t dead_lettered = 0;  ///< published to the dead-letter exchange (and acked)
  std::uint64_t requeued = 0;       ///< requeued (delayed through the delay queue, or nacked)
  std::uint64_t reconnects = 0;     ///< connections opened again after one was lost
  std::uint64_t released = 0;       ///< deliveries released unsettled (release()) and nacked back by the next poll()
};

/**
 * A consumer of one RabbitMQ queue for a handler behind IdempotencyGuard (rabbitmq-c), and an
 * idem::Source (`poll()`, `delivery()`, `settle(verdicts)`, `release()`) for idem::consume.
 * `next()` waits for a delivery; `settle()` answers it: ack; dead_letter — a copy (every property,
 * the headers, and `idem-reason` and `idem-queue`) published to the dead-letter exchange
 * `<queue>.dlx` with the delivery's routing key, then the original acked on the same channel
 * (basic.reject could not say why); or requeue after a delay — AMQP has no delayed nack, so a copy
 * (the same properties and headers, `idem-attempt` counting) goes to the TTL queue `<queue>.delay`
 * with that expiration and the original is acked. A crash between a copy and its ack leaves two
 * copies (the guard answers the second as a duplicate; a dead letter may be in the dead-letter
 * queue twice); with a zero delay a requeue is a plain nack. Nothing is acked before its outcome
 * is known. A lost connection or channel is thrown as a retryable connection_error; the next call
 * reconnects, and the broker redelivers whatever was unacked (the guard answers duplicates). A
 * refused login or TLS certificate is a connection_error that is not retryable. `run()` is the
 * loop. One thread per consumer; stats() may be read from any thread.
 */
class RabbitConsumer {
public:
  /// Checks the options, connects, declares the topology when asked, starts consuming.
  explicit RabbitConsumer(RabbitConsumerOptions options);
  ~RabbitConsumer();                                         ///< Closes the connection (unacked deliveries go back).
  RabbitConsumer(const RabbitConsumer&) = delete;            ///< Owns a connection.
  RabbitConsumer& operator=(const RabbitConsumer&) = delete;  ///< Owns a connection.

  /// The deliveries poll() returns (idem::Source).
  using message_type = RabbitDelivery;

  /// The next delivery, or nullopt after `wait` without one.
  std::optional<RabbitDelivery> next(millis wait);
  /// Answers `d` (nothing when its connection has closed meanwhile: the broker requeued it).
  void settle(const RabbitDelivery& d, const RabbitDecision& decision);

  /// The next batch (idem::Source): waits up to `poll_wait` for a first delivery, then takes those
  /// already received, up to `batch`; empty after poll_wait without one. A batch left unsettled
  /// (or released) is nacked back to the queue first, when its connection is still open.
  std::vector<RabbitDelivery> poll();
  /// `d` as idem::consume sees it: id = the delivery tag, key = message_id, payload = body, the
  /// headers and timestamp; attempt = the `idem-attempt` header of a delayed requeue's copy (else
  /// 1), plus the quorum queue's `x-delivery-count` when present, else plus 1 when redelivered.
  static Delivery delivery(const RabbitDelivery& d);
  /// Applies verdicts[i] to the polled batch's delivery i (idem::Source): ack, requeue after
  /// `delay`, dead letter with `reason`. A count that is not the batch's is a usage_error; a
  /// connection error is thrown after the batch is dropped (the broker redelivers what was not
  /// answered).
  void settle(std::span<const Verdict> verdicts);
  /// Drops the polled batch unsettled (idem::Source): its deliveries stay unacked until the next
  /// poll() nacks them back to the queue (requeue), or until the connection closes; either way
  /// the broker redelivers them, and nothing is held past the next poll().
  void release() noexcept;

  /// The decision for a guard's outcome (idem::verdict under options().retry): its broker action;
  /// a requeue waits its retry_after, jittered, at most retry.cap.
  template <class Outcome>
  RabbitDecision decide(const Outcome& out) const {
    Verdict v = verdict(out, options().retry);
    return {v.action, v.delay, std::move(v.reason)};
  }
  /// The decision for a run that threw (idem::verdict under options().retry): a store error waits a
  /// jittered backoff, the handler's exception a jittered retry.base (the guard's failure policy
  /// counts the attempts); a bad key is a dead letter.
  RabbitDecision decide(const std::exception_ptr& e) const;

  /// Until `stop`: next(), `handle(const RabbitDelivery&) -> RabbitDecision`, settle(). A lost
  /// connection backs off up to 1 s and reconnects; other errors (a refused login or TLS
  /// certificate among them) are thrown.
  template <class Handle>
  void run(std::stop_token stop, Handle&& handle) {
    detail::consume_loop(
        stop,
        [&] {
          if (auto d = next(millis{100})) settle(*d, handle(*d));
        },
        [] {});
  }

  /// Counters so far (any thread may read them).
  [[nodiscard]] RabbitConsumerStats stats() const noexcept;
  /// The options in force.
  [[nodiscard]] const RabbitConsumerOptions& options() const noexcept;

private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem
