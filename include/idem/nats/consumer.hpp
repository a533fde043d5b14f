#pragma once
/// @file nats/consumer.hpp NatsConsumer: a JetStream pull consumer for IdempotencyGuard — fetch a
/// batch, keep it alive with InProgress while it is handled, then Ack, NakWithDelay or dead-letter
/// and Term each message per its outcome. docs/nats.md has the table.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "idem/core/error.hpp"
#include "idem/core/outcome.hpp"
#include "idem/detail/consume_loop.hpp"
#include "idem/guard/consume.hpp"
#include "idem/guard/verdict.hpp"

namespace idem {

/// One JetStream message as fetched, copied out of the client library's message.
struct NatsMessage {
  std::string subject;                                       ///< the subject it was published on
  std::string data;                                          ///< the payload, bytes as published
  std::vector<std::pair<std::string, std::string>> headers;  ///< name/value pairs (a repeated name repeats)
  std::uint64_t stream_sequence = 0;                         ///< its sequence in the stream (stable across redeliveries)
  std::uint64_t delivered = 0;                               ///< how many times JetStream has delivered it (this one included)
  /// The first value of header `name`, or null when it has none.
  [[nodiscard]] const std::string* header(std::string_view name) const noexcept {
    for (const auto& [k, v] : headers)
      if (k == name) return &v;
    return nullptr;
  }
};

/// What to do with one message, and why (the dead letter's reason header).
struct NatsDecision {
  BrokerAction action = BrokerAction::requeue;  ///< ack, requeue (NakWithDelay), dead_letter (publish + Term)
  std::string reason;                           ///< for a dead letter: what went wrong
  millis delay{0};                              ///< for a requeue: redeliver after this (idem::verdict's wait)
};

/// Settings of a NatsConsumer; checked at construction (invalid_options_error names the field).
struct NatsConsumerOptions {
  std::string url = "nats://127.0.0.1:4222";  ///< the server (a comma-separated list for a cluster)
  std::string stream;                          ///< the stream to read (required)
  std::string durable;                         ///< the durable consumer's name, shared by every instance (required)
  std::string subject;                         ///< the consumer's filter subject (required; wildcards allowed)
  std::size_t batch = 16;                      ///< messages per fetch, 1..1000
  millis fetch_wait{500};                      ///< how long a fetch waits for messages; > 0
  millis ack_wait{30'000};                     ///< the durable's AckWait when created here; keep it >= the guard's lease
  std::int64_t max_deliver = -1;               ///< the durable's MaxDeliver when created here (-1: unlimited)
  millis in_progress_every{0};                 ///< InProgress interval while a batch is handled (0: a third of AckWait)
  std::string dead_letter;                     ///< the dead-letter subject (default: `idem.dlq.<stream>`)
  bool dead_letter_jetstream = true;           ///< publish dead letters through JetStream (stored before the Term)
  bool create_consumer = true;                 ///< create (or update) the durable at construction
  bool create_stream = false;                  ///< create the stream (file storage, `stream_subjects`) when missing
  std::vector<std::string> stream_subjects;    ///< the subjects of a stream created here (default: {subject})
  millis timeout{5000};                        ///< connect, JetStream API and AckSync timeout; > 0
};

/// What a NatsConsumer has done so far.
struct NatsConsumerStats {
  std::uint64_t fetched = 0;        ///< messages fetched (redeliveries included)
  std::uint64_t acked = 0;          ///< messages acked
  std::uint64_t nacked = 0;         ///< messages handed back with NakWithDelay (requeue)
  std::uint64_t dead_lettered = 0;  ///< messages published to the dead-letter subject and Term'd
  std::uint64_t in_progress = 0;    ///< InProgress signals sent for messages still being handled
  std::uint64_t reconnects = 0;     ///< connections opened again after the old one was closed
};

/**
 * One instance of a JetStream durable pull consumer, for a handler behind IdempotencyGuard. `poll()`
 * fetches up to `batch` messages (waiting up to `fetch_wait`); from then until `settle()` a keeper
 * thread sends InProgress for every unsettled one every `in_progress_every`, so a slow handler (or
 * a long batch) is not redelivered mid-run. `settle()` applies one decision per message: ack
 * (AckSync), requeue (NakWithDelay: the decision's delay; a message at its
 * last delivery is dead-lettered instead, since JetStream would drop it silently), dead_letter
 * (published to `dead_letter` with headers saying why and where from, then Term, so it is never
 * redelivered). `decide()` maps the guard's outcome or exception to a decision; `run()` is the loop.
 *
 * Nothing is acked before its outcome is known: a crash leaves the batch to be redelivered after
 * AckWait, and the guard answers duplicate for what had completed. Connection errors are thrown as
 * connection_error (retryable); the client reconnects by itself, and `poll()` opens a new
 * connection if it was closed. Instances of one durable may run in several threads or processes;
 * one instance is used by one thread at a time (its keeper thread is internal).
 */
class NatsConsumer {
public:
  /// Checks the options, connects, creates the stream and durable when asked, and binds to the
  /// durable (connection_error; store_error when JetStream refuses, e.g. no such stream).
  explicit NatsConsumer(NatsConsumerOptions options);
  ~NatsConsumer();                                      ///< Stops the keeper, closes the connection.
  NatsConsumer(const NatsConsumer&) = delete;             ///< Owns a connection.
  NatsConsumer& operator=(const NatsConsumer&) = delete;  ///< Owns a connection.

  /// The messages poll() returns (idem::Source).
  using message_type = NatsMessage;

  /// The next messages (may be empty after `fetch_wait`); a batch left unsettled is released first.
  std::vector<NatsMessage> poll();
  /// `m` as idem::consume sees it: key = its `Nats-Msg-Id` (the outbox's id when the relay sent
  /// it), id = its stream sequence, attempt = its delivery count, every header.
  static Delivery delivery(const NatsMessage& m);
  /// Applies verdicts[i] to the polled batch's message i (idem::Source): ack, NakWithDelay(delay),
  /// or dead letter with the reason.
  void settle(std::span<const Verdict> verdicts);
  /// Drops the polled batch unsettled: no more InProgress, JetStream redelivers it after AckWait.
  void release() noexcept;
  /// Applies decisions[i] to the polled batch's message i; throws on a connection error (what was
  /// not settled is redelivered after AckWait).
  void settle(std::span<const NatsDecision> decisions);

  /// The decision for a guard's outcome (idem::verdict under `retry`): its broker action; in_flight
  /// waits the outcome's retry_after, jittered; previously_failed or mismatch becomes a dead letter
  /// that says why.
  template <class Outcome>
  static NatsDecision decide(const Outcome& out, const RetryPolicy& retry = {}) {
    Verdict v = verdict(out, retry);
    return {v.action, std::move(v.reason), v.delay};
  }
  /// The decision for a run that threw (idem::verdict under `retry`): a store error requeues after
  /// a jittered backoff, the handler's exception after a jittered `retry.base` (its redelivery
  /// retries under the guard's failure policy); a bad key is a dead letter.
  static NatsDecision decide(const std::exception_ptr& e, const RetryPolicy& retry = {});

  /// Until `stop`: poll, `handle(const NatsMessage&) -> NatsDecision` per message, settle. A
  /// retryable error (the server down) backs off up to 1 s and polls again; another is thrown
  /// (the batch released).
  template <class Handle>
  void run(std::stop_token stop, Handle&& handle) {
    detail::consume_loop(
        stop,
        [&] {
          try {
            const std::vector<NatsMessage> messages = poll();
            std::vector<NatsDecision> decisions;
            decisions.reserve(messages.size());
            for (const NatsMessage& m : messages) decisions.push_back(handle(m));
            settle(decisions);
          } catch (const error&) {
            throw;  // consume_loop releases the batch (on_error) and backs off or rethrows
          } catch (...) {
            release();  // the handler's own exception: its batch is not kept alive after it
            throw;
          }
        },
        [&] { release(); });
  }

  /// Counters so far.
  [[nodiscard]] NatsConsumerStats stats() const noexcept;
  /// The options in force (defaults filled in).
  [[nodiscard]] const NatsConsumerOptions& options() const noexcept;

private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem
