// The names docs/consuming.md's blocks use without declaring them (tests/docs/CMakeLists.txt).
#pragma once

#include <stop_token>
#include <string>
#include <string_view>

#include <librdkafka/rdkafka.h>

#include <idem/idem.hpp>
#include <idem/kafka/consumer.hpp>
#include <idem/kafka/source.hpp>
#include <idem/nats/consumer.hpp>
#include <idem/rabbitmq/consumer.hpp>

using namespace std::chrono_literals;

namespace docs {
struct WorkerPool {
  template <class F>
  void submit(F&& task) { task(); }
};
}  // namespace docs

extern idem::MemoryStore store;
extern idem::IdempotencyGuard<idem::MemoryStore> guard;
extern std::stop_token stop_token;
void apply(std::string_view payload);
void apply(std::string_view payload, std::uint64_t fence);
void apply(rd_kafka_message_t* m);
std::string key_of(rd_kafka_message_t* m);
std::string event_id_of(std::string_view value);
// The rebalance callback's arguments and the poll loop's state.
extern rd_kafka_t* rk;
extern rd_kafka_resp_err_t err;
extern rd_kafka_topic_partition_list_t* parts;
extern bool running;
extern docs::WorkerPool pool;
bool commit_due();
void commit(rd_kafka_t* rk, const std::vector<idem::kafka::PartitionOffset>& offsets);
