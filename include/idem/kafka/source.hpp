#pragma once
/// @file kafka/source.hpp kafka::Source: Kafka as an idem::Source, so that idem::consume drives it
/// like NATS and RabbitMQ. It commits only settled offsets (OffsetTracker), requeues by pausing the
/// partition and seeking back, and writes dead letters with their original headers. docs/consuming.md.
// Compiled in src/kafka/source.cpp; no librdkafka type here (the pieces it shares with Consumer
// are internal: src/kafka/rdkafka.hpp).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/core/error.hpp"
#include "idem/core/options.hpp"
#include "idem/guard/consume.hpp"
#include "idem/guard/verdict.hpp"
#include "idem/kafka/consumer.hpp"
#include "idem/kafka/offset_tracker.hpp"
#include "idem/kafka/processor.hpp"

namespace idem::kafka {

/// Settings of a kafka::Source; checked at construction (invalid_options_error names the field).
struct SourceOptions {
  std::string brokers;              ///< bootstrap.servers (required)
  std::string group;                ///< group.id (required)
  std::vector<std::string> topics;  ///< the topics to subscribe to (at least one)
  /// More librdkafka consumer properties (session.timeout.ms, partition.assignment.strategy=
  /// cooperative-sticky, TLS, SASL...); enable.auto.commit and enable.auto.offset.store stay false.
  std::map<std::string, std::string> properties;
  std::string dead_letter_topic;  ///< where dead letters go; empty: "<the message's topic>.dlq"
  std::map<std::string, std::string> dead_letter_properties;  ///< more properties of the dead-letter producer
  std::size_t batch = 64;                   ///< the most messages one poll() returns, 1..100000
  millis poll_timeout{100};                 ///< how long poll() waits for a first message; > 0
  millis commit_interval{1'000};            ///< commit settled offsets at least this often; > 0
  std::size_t commit_every = 500;           ///< ...or once this many messages settled since the last commit; >= 1
  millis dead_letter_retry{1'000};          ///< a refused dead-letter write is retried (a requeue) after this; >= 0
  std::function<void(std::string_view)> log;  ///< warnings (errors, refused commits, rebalances); none by default
  /// Called on the driving thread after each rebalance event: assigned or not, how many partitions.
  std::function<void(bool assigned, std::size_t partitions)> on_rebalance;
};

/// Counters since construction (each read atomically: readable from any thread).
struct SourceStats {
  std::uint64_t polled = 0;                ///< messages poll() returned (redeliveries included)
  std::uint64_t acked = 0;                 ///< settled on ack
  std::uint64_t requeued = 0;              ///< requeue verdicts applied (their partition sought back)
  std::uint64_t dead_lettered = 0;         ///< dead letters written, then settled
  std::uint64_t dead_letter_failures = 0;  ///< dead-letter writes refused (the message is requeued)
  std::uint64_t skipped = 0;               ///< verdicts not applied: behind a requeue of their partition (they come again)
  std::uint64_t released = 0;              ///< messages of batches released unsettled (release())
  std::uint64_t rebalances = 0;            ///< rebalance events served
  std::uint64_t commits = 0;               ///< commits sent
  std::uint64_t commit_failures = 0;       ///< commits refused (their messages come again: duplicates)
};

/// One polled Kafka message, copied out of librdkafka's: a kafka::Source's message_type.
struct SourceMessage {
  std::string topic;                                         ///< the topic's name
  std::int32_t partition = 0;                                ///< the partition number
  std::int64_t offset = 0;                                   ///< the message's offset
  std::string key;                                           ///< the Kafka key (not the idempotency key)
  std::string value;                                         ///< the payload, binary-safe
  std::vector<std::pair<std::string, std::string>> headers;  ///< every header, in order; a name may repeat
  std::optional<Timestamp> timestamp;                        ///< its timestamp; nullopt when the broker gave none
  std::uint32_t attempt = 1;  ///< deliveries of this offset this source has seen (1 = the first)
};

/**
 * A Kafka consumer group member as an idem::Source: `idem::consume(source, guard, stop, handler)`.
 *
 * - poll(): up to `batch` messages (waiting up to `poll_timeout` for the first); serves
 *   rebalances, eager or cooperative (on revoke the settled offsets are committed first, then the
 *   partition's tracked offsets are forgotten). Every message is tracked in an OffsetTracker, and
 *   only settled offsets are committed (enable.auto.commit and enable.auto.offset.store are false).
 *   A batch left unsettled is released first.
 * - delivery(m): id "topic/partition@offset", key = the Kafka key, payload, every header,
 *   timestamp, attempt = how many times this source polled that offset.
 * - settle(verdicts): per partition in offset order, ack settles; dead_letter writes the message
 *   (key, value, headers, then `idem-reason`, `idem-topic`, `idem-partition`, `idem-offset`) to
 *   the dead-letter topic, waits for the broker's ack and settles (a refused write is a requeue
 *   after `dead_letter_retry`); requeue pauses the partition and, `delay` later (on a later poll),
 *   seeks it back to that message and resumes: the messages after it in the batch are not settled
 *   and come again (the guard answers duplicate for those that ran). Commits every
 *   `commit_interval` or `commit_every` settled messages.
 * - release(): the batch is dropped unsettled: each of its partitions is sought back to its
 *   first message of the batch (on the next poll).
 * - The destructor commits what is settled and closes the consumer (leaves the group).
 *
 * Threads: one thread drives a Source (poll, delivery, settle, release, destruction); stats(),
 * held(), pending() and tracker() may be read from any other thread. Not copyable, not movable.
 */
class Source {
 public:
  /// The messages poll() returns (idem::Source).
  using message_type = SourceMessage;

  /// Checks the options, creates the consumer and subscribes; throws invalid_options_error, kafka_error.
  explicit Source(SourceOptions options);
  ~Source();                                  ///< Commits what is settled, leaves the group, closes.
  Source(const Source&) = delete;             ///< Owns a client handle.
  Source& operator=(const Source&) = delete;  ///< Owns a client handle.

  /// The next messages (maybe none after `poll_timeout`); throws kafka_error on a fatal client error.
  std::vector<SourceMessage> poll();
  /// `m` as idem::consume sees it: views into `m`, valid while `m` lives.
  [[nodiscard]] Delivery delivery(const SourceMessage& m) const;
  /// Applies verdicts[i] to the last poll's message i (ack, requeue after delay, dead letter).
  void settle(std::span<const idem::Verdict> verdicts);
  /// Drops the last poll's batch unsettled: its partitions are sought back to it.
  void release();

  /// Counters so far.
  [[nodiscard]] SourceStats stats() const noexcept;
  /// Polled messages not settled yet, all partitions (OffsetTracker::pending()).
  [[nodiscard]] std::size_t pending() const;
  /// Polled messages of one partition not settled yet.
  [[nodiscard]] std::size_t pending(std::string_view topic, std::int32_t partition) const;
  /// Polled messages not committable yet, settled or not, all partitions (OffsetTracker::held()).
  [[nodiscard]] std::size_t held() const;
  /// Polled messages of one partition not committable yet: what a restart would redeliver.
  [[nodiscard]] std::size_t held(std::string_view topic, std::int32_t partition) const;
  /// Each owned partition's backlog (and once more, at 0, each just revoked), for idem::consume to
  /// report to the guard's observer (idem_consumer_pending / idem_consumer_held); the driving thread
  /// only; views valid until the next call.
  [[nodiscard]] std::vector<SourceEvent> backlog();
  /// The tracker of settled offsets (thread-safe: committables(), stats() for metrics).
  [[nodiscard]] const OffsetTracker& tracker() const noexcept;
  /// The options in force.
  [[nodiscard]] const SourceOptions& options() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem::kafka
