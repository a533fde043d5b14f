#pragma once
// The consumer loop's pieces over librdkafka: rebalance, offsets, retries, dead letters, a polled
// message's headers and timestamp. Internal to idem::kafka (not installed: no public header names
// a librdkafka type); src/kafka/consumer.cpp and the tests (tests/kafka/mock_cluster.hpp) use it.
// Guide: docs/consuming.md. Compiled in src/kafka/rdkafka.cpp.

#include <librdkafka/rdkafka.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "idem/core/error.hpp"
#include "idem/kafka/consumer.hpp"
#include "idem/kafka/offset_tracker.hpp"
#include "idem/kafka/processor.hpp"

namespace idem::kafka {

/// A topic and a partition.
struct TopicPartition {
  std::string topic;           ///< The topic's name.
  std::int32_t partition = 0;  ///< The partition number.
  /// Ordered by topic, then partition, so that it keys a std::map.
  friend auto operator<=>(const TopicPartition&, const TopicPartition&) = default;
};

/// Owns an rd_kafka_topic_partition_list_t.
using PartitionList =
    std::unique_ptr<rd_kafka_topic_partition_list_t, decltype(&rd_kafka_topic_partition_list_destroy)>;

/// A partition list of these offsets, for rd_kafka_commit or rd_kafka_offsets_store.
PartitionList to_list(const std::vector<PartitionOffset>& offsets);

/// Sets one librdkafka property; throws invalid_options_error with librdkafka's reason.
void set_property(rd_kafka_conf_t* conf, const std::string& name, const std::string& value);

/// A subscribed group consumer committing only what its owner stores: bootstrap.servers, group.id,
/// auto.offset.reset=earliest, then `properties`, then auto commit and offset store forced off;
/// `rebalance` and `commit` called with `opaque`. Throws invalid_options_error, kafka_error.
rd_kafka_t* new_group_consumer(const std::string& brokers, const std::string& group,
                               const std::map<std::string, std::string>& properties,
                               const std::vector<std::string>& topics,
                               void (*rebalance)(rd_kafka_t*, rd_kafka_resp_err_t, rd_kafka_topic_partition_list_t*, void*),
                               void (*commit)(rd_kafka_t*, rd_kafka_resp_err_t, rd_kafka_topic_partition_list_t*, void*),
                               void* opaque);

/// What handle_rebalance did.
struct RebalanceResult {
  bool assigned = false;                   ///< Partitions were assigned (else revoked, lost or an error).
  bool lost = false;                       ///< Revoked as lost: nothing could be committed.
  bool closed = false;                     ///< Served after the consumer closed: only the tracker was changed.
  std::vector<TopicPartition> partitions;  ///< The partitions of the event.
  std::vector<PartitionOffset> committed;  ///< Revoked: the settled offsets committed before letting go.
  rd_kafka_resp_err_t commit_error = RD_KAFKA_RESP_ERR_NO_ERROR;  ///< That commit's answer.
};

/// The rebalance callback's work, eager or cooperative: tracker, commit of settled offsets, (un)assign.
RebalanceResult handle_rebalance(rd_kafka_t* rk, rd_kafka_resp_err_t err, rd_kafka_topic_partition_list_t* parts,
                                 OffsetTracker& tracker);

/// rd_kafka_offsets_store of the tracker's committables; returns how many were stored.
std::size_t store_committables(rd_kafka_t* rk, const OffsetTracker& tracker);

/// Pauses (or resumes) one partition's fetching; throws kafka_error.
void pause(rd_kafka_t* rk, const TopicPartition& tp, bool paused);

/// Seeks a paused partition back to `offset`, so that resuming it redelivers from there; throws kafka_error.
void seek(rd_kafka_t* rk, const TopicPartition& tp, std::int64_t offset, int timeout_ms);

/// Appends the message's headers to `out`, in order, as views into it (valid until it is destroyed);
/// returns how many. A null value reads as empty; headers librdkafka cannot parse read as none.
std::size_t append_headers(rd_kafka_message_t* m, std::vector<Header>& out);

/// The message's timestamp and its type; nullopt when the broker gave none.
std::optional<Timestamp> timestamp_of(const rd_kafka_message_t* m);

/// When a consumer loop commits what it stored: after `every` settled messages or `interval`, and
/// not while its group rebalances after a commit was refused for the generation. Poll thread only.
class CommitPacer {
 public:
  using Clock = std::chrono::steady_clock;  ///< The pacer's clock.
  /// Commits every `interval` or every `every` settled messages, whichever comes first.
  CommitPacer(std::chrono::milliseconds interval, std::size_t every) : interval_(interval), every_(every) {}
  /// A periodic commit is due now, `settled` messages after the last one.
  bool due(std::size_t settled, Clock::time_point now) const {
    return now >= hold_until_ && (settled >= every_ || now - last_ >= interval_);
  }
  /// A commit is being sent (or found nothing to send) now.
  void sent(Clock::time_point now) { last_ = now; }
  /// A commit's answer, from rd_kafka_commit or the commit callback.
  void answered(rd_kafka_resp_err_t e, Clock::time_point now);
  /// A rebalance callback came: the rebalance a refused commit waits for has reached this member.
  void rebalanced() { hold_until_ = {}; }

 private:
  std::chrono::milliseconds interval_;
  std::size_t every_;
  Clock::time_point last_ = Clock::now();
  Clock::time_point hold_until_{};
  int refused_ = 0;  // commits refused for the generation in a row
};

/// A producer that writes dead letters and waits for the broker's ack; thread-safe.
class DeadLetterProducer {
 public:
  /// `properties`: more librdkafka properties for the producer (TLS, SASL...).
  DeadLetterProducer(const std::string& brokers, const std::map<std::string, std::string>& properties);
  ~DeadLetterProducer();
  DeadLetterProducer(const DeadLetterProducer&) = delete;             ///< Owns a client handle.
  DeadLetterProducer& operator=(const DeadLetterProducer&) = delete;  ///< Owns a client handle.
  /// Writes `m` to `topic`: its key, value and headers, then `idem-reason` and its origin
  /// (`idem-topic`, `idem-partition`, `idem-offset`) as headers; returns once acked, else throws kafka_error.
  void write(const std::string& topic, const Message& m, std::string_view reason);

 private:
  std::mutex mu_;  // one write at a time: each waits for its own delivery report
  rd_kafka_t* rk_ = nullptr;
};

}  // namespace idem::kafka
