#pragma once
/// @file kafka/consumer.hpp Consumer: a Kafka consumer loop with exactly-once effects through a Processor.
// Guide and failure modes: docs/consuming.md. Compiled in src/kafka/consumer.cpp; no librdkafka
// type here (the loop's librdkafka pieces are internal: src/kafka/rdkafka.hpp).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "idem/core/error.hpp"
#include "idem/core/options.hpp"
#include "idem/kafka/offset_tracker.hpp"
#include "idem/kafka/processor.hpp"

namespace idem::kafka {

/// librdkafka refused a call or a write; code() is its rd_kafka_resp_err_t, as an int.
class kafka_error : public error {
 public:
  /// Builds it from librdkafka's code; retryable unless the code says the request can never succeed.
  kafka_error(const std::string& what, int code, bool retryable = true) : error(what, retryable), code_(code) {}
  /// librdkafka's error code (an rd_kafka_resp_err_t value: compare it with RD_KAFKA_RESP_ERR_*).
  [[nodiscard]] int code() const noexcept { return code_; }

 private:
  int code_;
};

/// What a Consumer connects to and how it paces itself.
struct ConsumerOptions {
  /// bootstrap.servers.
  std::string brokers;
  /// group.id.
  std::string group;
  /// Topics to subscribe to.
  std::vector<std::string> topics;
  /// Where dead letters go; empty: "<the message's topic>.dlq".
  std::string dead_letter_topic;
  /// More librdkafka consumer properties (session.timeout.ms, partition.assignment.strategy...).
  std::map<std::string, std::string> properties;
  /// More librdkafka properties for the dead-letter producer (TLS, SASL...).
  std::map<std::string, std::string> dead_letter_properties;
  /// Messages of one partition run together, through one guard.run_batch.
  std::size_t batch = 64;
  /// Threads running batches; one partition runs on one of them at a time.
  std::size_t workers = 4;
  /// Polled, not yet run messages of one partition above which it is paused.
  std::size_t max_queued = 256;
  /// The longest a poll waits: the latency of retries and commits.
  millis poll_timeout{100};
  /// Commit settled offsets this often...
  millis commit_interval{1'000};
  /// ...or after this many settled messages.
  std::size_t commit_every = 500;
  /// The shortest pause of a partition before seeking back to a message to retry.
  millis min_retry{50};
  /// The longest such pause: an in_flight holder's whole remaining lease is usually far too long.
  millis max_retry{1'000};
  /// Where warnings go (errors, refused commits, rebalances), called from any thread; none by default.
  std::function<void(std::string_view)> log;
  /// Called on the poll thread after each rebalance event: assigned or not, how many partitions.
  std::function<void(bool assigned, std::size_t partitions)> on_rebalance;
};

/// Counters since construction.
struct ConsumerStats {
  std::uint64_t polled = 0;                ///< Messages tracked for running.
  std::uint64_t executed = 0;              ///< Handler ran and its result was recorded.
  std::uint64_t duplicates = 0;            ///< Answered from the store: already done.
  std::uint64_t requeued = 0;              ///< Retries: in_flight, handler or store errors, failed dead letters.
  std::uint64_t handler_errors = 0;        ///< The handler threw.
  std::uint64_t dead_lettered = 0;         ///< Dead letters written.
  std::uint64_t dead_letters_earlier = 0;  ///< Dead letters found written by an earlier delivery.
  std::uint64_t dead_letter_failures = 0;  ///< Dead-letter writes that failed (the message is retried).
  std::uint64_t dropped_revoked = 0;       ///< Polled, not run, partition revoked: its next owner gets them.
  std::uint64_t dropped_rewound = 0;       ///< Polled, not run, behind a retry's seek back: polled again.
  std::uint64_t rebalances = 0;            ///< Rebalance callbacks served.
  std::uint64_t commits = 0;               ///< Commits sent.
  std::uint64_t commit_failures = 0;       ///< Commits refused (their messages are redelivered: duplicates).
};

/// A consumer loop committing only settled offsets, retrying by partition, dead-lettering once.
// It polls, runs each partition's messages through the Processor on worker threads, and commits
// only what is settled (OffsetTracker). A message that must wait (in_flight, a handler error, a
// store error) pauses its own partition, which is sought back to it after the wait and resumed,
// while the other partitions and the poll go on: a slow handler never delays the poll, so the
// group never evicts the consumer for it. A message to dead-letter is written once (keyed in the
// Processor's guard), then settled. On a rebalance, eager or cooperative, settled offsets are
// committed before letting go and the polled, unrun messages of revoked partitions are dropped
// (their next owner gets them). enable.auto.commit and enable.auto.offset.store stay false.
class Consumer {
 public:
  /// Connects and subscribes; `processor` must outlive the Consumer. Throws invalid_options_error, kafka_error.
  Consumer(ConsumerOptions options, Processor& processor);
  ~Consumer();
  Consumer(const Consumer&) = delete;             ///< Owns a client handle and threads.
  Consumer& operator=(const Consumer&) = delete;  ///< Owns a client handle and threads.

  /// Runs the loop until stop(); then commits what is settled and leaves the group. Once per Consumer.
  void run();
  /// Makes run() return soon; callable from any thread or a signal handler.
  void stop() noexcept;
  /// Counters since construction.
  [[nodiscard]] ConsumerStats stats() const;
  /// The tracker of settled offsets (pending(), held() for metrics).
  [[nodiscard]] const OffsetTracker& tracker() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem::kafka
