#pragma once
/// @file redis/streams_consumer.hpp StreamsConsumer: a Redis Streams consumer group read for
/// IdempotencyGuard — XREADGROUP, entries of dead consumers taken over with XAUTOCLAIM, XACK after
/// the outcome, dead letters written and acked in one step. docs/consuming.md has the table.

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
#include "idem/redis/options.hpp"

namespace idem {

/// One stream entry as read: its id and its field/value pairs, in order.
struct StreamEntry {
  std::string id;                                           ///< the entry id ("1700000000000-0")
  std::vector<std::pair<std::string, std::string>> fields;  ///< field, value, as XADD wrote them
  /// The value of `name`, or null when the entry has no such field.
  [[nodiscard]] const std::string* field(std::string_view name) const noexcept {
    for (const auto& [k, v] : fields)
      if (k == name) return &v;
    return nullptr;
  }
};

/// What to do with one entry, and why (the dead letter's `error` field).
struct StreamDecision {
  BrokerAction action = BrokerAction::requeue;  ///< ack, requeue (leave it pending), dead_letter
  std::string reason;                           ///< for a dead letter: what went wrong
};

/// Settings of a StreamsConsumer; checked at construction (invalid_options_error names the field).
struct StreamsConsumerOptions {
  RedisOptions redis;        ///< the stream's server: redis://, rediss://, unix://, redis-sentinel://, redis-cluster://
  std::string stream;        ///< the stream key (required)
  std::string group;         ///< the consumer group (required)
  std::string consumer;      ///< this consumer's name in the group (required, unique per live consumer)
  std::size_t count = 32;    ///< entries per read, 1..10000
  millis block{1000};        ///< how long a read waits for new entries; below redis.command_timeout
  millis claim_idle{30000};  ///< entries pending this long (their consumer died) are taken over; keep it >= the guard's lease
  std::string dead_letter;   ///< the dead-letter stream (default `<stream>:dlq`; on a cluster, in the stream's slot: `{<stream>}:dlq` unless the name has a hash tag)
  bool create_group = true;  ///< create the group (at the stream's start, MKSTREAM) when missing
};

/// What a StreamsConsumer has done so far.
struct StreamsConsumerStats {
  std::uint64_t read = 0;           ///< entries read new (XREADGROUP)
  std::uint64_t resumed = 0;        ///< entries this name had read before (a previous run) and not acked
  std::uint64_t claimed = 0;        ///< entries taken over from a consumer gone quiet (XAUTOCLAIM)
  std::uint64_t acked = 0;          ///< entries acked
  std::uint64_t dead_lettered = 0;  ///< entries moved to the dead-letter stream (and acked)
  std::uint64_t left_pending = 0;   ///< entries left pending for a later retry (requeue)
};

/**
 * One consumer of a Redis Streams consumer group, for a handler behind IdempotencyGuard. `poll()`
 * returns the next entries: at first what this consumer name read before and never acked (a
 * restart resumes them at once), then those any consumer left pending for longer than
 * `claim_idle` (XAUTOCLAIM: it crashed, or its handler outlived the lease), else new ones
 * (XREADGROUP, waiting up to `block`). `settle()` applies one decision per entry: ack (one XACK for the read),
 * dead_letter (XADD to the dead-letter stream and XACK in one script, so a crash between them
 * cannot write a letter twice), requeue (left pending: XAUTOCLAIM brings it back after
 * `claim_idle`, and the guard then answers duplicate, or takes over a lapsed lease). `decide()`
 * maps the guard's outcome or exception to a decision; `run()` is the loop.
 *
 * Nothing is acked before its outcome is known, so a crash anywhere loses no entry. Connection
 * errors close the connection and are thrown (retryable); `run()` backs off and reconnects. One
 * thread per consumer (not thread-safe); run several consumers for parallelism.
 */
class StreamsConsumer {
public:
  /// Checks the options, connects, and creates the group when asked (connection_error, store_error).
  explicit StreamsConsumer(StreamsConsumerOptions options);
  ~StreamsConsumer();                                          ///< Closes the connection.
  StreamsConsumer(const StreamsConsumer&) = delete;            ///< Owns a connection.
  StreamsConsumer& operator=(const StreamsConsumer&) = delete;  ///< Owns a connection.

  /// The entries poll() returns (idem::Source).
  using message_type = StreamEntry;

  /// The next entries: taken over from dead consumers first, else new (may be empty after `block`).
  std::vector<StreamEntry> poll();
  /// `e` as idem::consume sees it: key = its `id` field (the outbox's id when the relay wrote it),
  /// payload = its `payload` field, every field as a header (key any field with ConsumeOptions::key_of).
  static Delivery delivery(const StreamEntry& e);
  /// Applies verdicts[i] to the last polled batch's entry i (idem::Source): ack, dead letter, or
  /// left pending (a requeue's delay is claim_idle). Throws as settle(entries, decisions).
  void settle(std::span<const Verdict> verdicts);
  /// Forgets the polled batch unsettled (idem::Source): its entries stay pending and are taken over
  /// after claim_idle.
  void release() noexcept;
  /// Applies decisions[i] to entries[i] (dead letters first, then one XACK); throws on a store error
  /// (the entries stay pending and come back).
  void settle(std::span<const StreamEntry> entries, std::span<const StreamDecision> decisions);

  /// The decision for a guard's outcome (idem::verdict): its broker action; a previously_failed or
  /// mismatch answer becomes a dead letter that says why. A requeue leaves the entry pending: its
  /// wait is claim_idle, not a delay.
  template <class Outcome>
  static StreamDecision decide(const Outcome& out) {
    Verdict v = verdict(out);
    return {v.action, std::move(v.reason)};
  }
  /// The decision for a run that threw: idem::action_of (a store error or the handler's exception
  /// leaves the entry pending; its redelivery retries it under the guard's failure policy).
  static StreamDecision decide(const std::exception_ptr& e);

  /// Until `stop`: poll, `handle(const StreamEntry&) -> StreamDecision` per entry, settle. A
  /// retryable error (the stream's server down) backs off up to 1 s and reconnects; another is
  /// thrown. The handler's own exceptions are its decision's business (catch them, or use decide()).
  template <class Handle>
  void run(std::stop_token stop, Handle&& handle) {
    detail::consume_loop(
        stop,
        [&] {
          const std::vector<StreamEntry> entries = poll();
          std::vector<StreamDecision> decisions;
          decisions.reserve(entries.size());
          for (const StreamEntry& e : entries) decisions.push_back(handle(e));
          settle(entries, decisions);
        },
        [] {});
  }

  /// Counters so far.
  [[nodiscard]] StreamsConsumerStats stats() const noexcept;
  /// The options in force (defaults filled in).
  [[nodiscard]] const StreamsConsumerOptions& options() const noexcept;

private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem
