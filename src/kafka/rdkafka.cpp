// The consumer loop's pieces over librdkafka (rdkafka.hpp, internal).

#include "rdkafka.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <string>

namespace idem::kafka {

namespace {

PartitionList new_list(int size) {
  return {rd_kafka_topic_partition_list_new(size), &rd_kafka_topic_partition_list_destroy};
}

PartitionList one(const TopicPartition& tp) {
  PartitionList list = new_list(1);
  rd_kafka_topic_partition_list_add(list.get(), tp.topic.c_str(), tp.partition);
  return list;
}

void check(rd_kafka_error_t* e, std::string_view what) {
  if (!e) return;
  const rd_kafka_resp_err_t code = rd_kafka_error_code(e);
  const std::string text = fmt::format("{}: {}", what, rd_kafka_error_string(e));
  rd_kafka_error_destroy(e);
  throw kafka_error(text, code);
}

// The delivery report of one dead letter. Heap-held and shared with the report, so a report that
// arrives after write() gave up lands here and not in freed memory.
struct Ticket {
  std::atomic<int> err{RD_KAFKA_RESP_ERR__IN_PROGRESS};
};

extern "C" void idem_kafka_dead_letter_dr(rd_kafka_t*, const rd_kafka_message_t* m, void*) {
  auto* t = static_cast<std::shared_ptr<Ticket>*>(m->_private);
  if (!t) return;
  (*t)->err.store(m->err);
  delete t;
}

}  // namespace

PartitionList to_list(const std::vector<PartitionOffset>& offsets) {
  PartitionList list = new_list(static_cast<int>(offsets.size()));
  for (const PartitionOffset& po : offsets)
    rd_kafka_topic_partition_list_add(list.get(), po.topic.c_str(), po.partition)->offset = po.offset;
  return list;
}

void set_property(rd_kafka_conf_t* conf, const std::string& name, const std::string& value) {
  char err[512];
  if (rd_kafka_conf_set(conf, name.c_str(), value.c_str(), err, sizeof err) != RD_KAFKA_CONF_OK)
    throw invalid_options_error(fmt::format("kafka property {}={}: {}", name, value, err));
}

rd_kafka_t* new_group_consumer(const std::string& brokers, const std::string& group,
                               const std::map<std::string, std::string>& properties,
                               const std::vector<std::string>& topics,
                               void (*rebalance)(rd_kafka_t*, rd_kafka_resp_err_t, rd_kafka_topic_partition_list_t*, void*),
                               void (*commit)(rd_kafka_t*, rd_kafka_resp_err_t, rd_kafka_topic_partition_list_t*, void*),
                               void* opaque) {
  rd_kafka_conf_t* conf = rd_kafka_conf_new();
  try {
    set_property(conf, "bootstrap.servers", brokers);
    set_property(conf, "group.id", group);
    set_property(conf, "auto.offset.reset", "earliest");
    for (const auto& [k, v] : properties) set_property(conf, k, v);
    // Only the tracker's committable offsets are stored, and committed by their owner.
    set_property(conf, "enable.auto.commit", "false");
    set_property(conf, "enable.auto.offset.store", "false");
  } catch (...) {
    rd_kafka_conf_destroy(conf);
    throw;
  }
  rd_kafka_conf_set_rebalance_cb(conf, rebalance);
  rd_kafka_conf_set_offset_commit_cb(conf, commit);
  rd_kafka_conf_set_opaque(conf, opaque);
  char err[512];
  rd_kafka_t* rk = rd_kafka_new(RD_KAFKA_CONSUMER, conf, err, sizeof err);
  if (!rk) {
    rd_kafka_conf_destroy(conf);
    throw kafka_error(fmt::format("kafka consumer: {}", err), RD_KAFKA_RESP_ERR__INVALID_ARG, false);
  }
  rd_kafka_poll_set_consumer(rk);
  PartitionList list(rd_kafka_topic_partition_list_new(static_cast<int>(topics.size())),
                     &rd_kafka_topic_partition_list_destroy);
  for (const std::string& t : topics) rd_kafka_topic_partition_list_add(list.get(), t.c_str(), RD_KAFKA_PARTITION_UA);
  if (const auto e = rd_kafka_subscribe(rk, list.get())) {
    rd_kafka_destroy(rk);
    throw kafka_error(fmt::format("kafka subscribe: {}", rd_kafka_err2str(e)), e);
  }
  return rk;
}

RebalanceResult handle_rebalance(rd_kafka_t* rk, rd_kafka_resp_err_t err, rd_kafka_topic_partition_list_t* parts,
                                 OffsetTracker& tracker) {
  RebalanceResult r;
  r.assigned = err == RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS;
  for (int i = 0; i < parts->cnt; ++i) r.partitions.push_back({parts->elems[i].topic, parts->elems[i].partition});
  // rd_kafka_consumer_close() can serve a rebalance event after the group has terminated (a
  // revoke another member's join or leave queued just before): librdkafka 2.0.2 has then dropped
  // the assignment itself, rd_kafka_rebalance_protocol() returns NULL, and a call that goes
  // through the group's queue (assign, a sync commit) can fail or never return. Nothing is owned.
  const char* protocol = rd_kafka_consumer_closed(rk) ? nullptr : rd_kafka_rebalance_protocol(rk);
  if (!protocol) {
    r.closed = true;
    for (const TopicPartition& tp : r.partitions) tracker.revoke(tp.topic, tp.partition);
    return r;
  }
  const bool cooperative = std::strcmp(protocol, "COOPERATIVE") == 0;
  if (r.assigned) {
    for (const TopicPartition& tp : r.partitions) tracker.assign(tp.topic, tp.partition);
    if (cooperative)
      check(rd_kafka_incremental_assign(rk, parts), "incremental_assign");
    else if (const auto e = rd_kafka_assign(rk, parts))
      throw kafka_error(fmt::format("assign: {}", rd_kafka_err2str(e)), e);
    // A partition paused for a retry before it was revoked must not stay paused now that it is
    // back: it starts again from the committed offset.
    rd_kafka_resume_partitions(rk, parts);
    return r;
  }
  // Revoked, lost or an error. Commit what is settled while the partitions are still ours (not
  // when lost: the commit would be refused), then let go; later outcomes of these partitions'
  // messages are ignored by the tracker and their next owner redelivers them.
  r.lost = err != RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS || rd_kafka_assignment_lost(rk);
  for (const TopicPartition& tp : r.partitions)
    if (const auto next = tracker.revoke(tp.topic, tp.partition))
      r.committed.push_back({tp.topic, tp.partition, *next});
  if (!r.lost && !r.committed.empty()) r.commit_error = rd_kafka_commit(rk, to_list(r.committed).get(), /*async=*/0);
  if (r.lost) r.committed.clear();
  if (cooperative)
    check(rd_kafka_incremental_unassign(rk, parts), "incremental_unassign");
  else
    rd_kafka_assign(rk, nullptr);
  return r;
}

void CommitPacer::answered(rd_kafka_resp_err_t e, Clock::time_point now) {
  if (e == RD_KAFKA_RESP_ERR_NO_ERROR) {
    refused_ = 0;
    return;
  }
  // The group is rebalancing. librdkafka 2.0.2 answers a commit refused for the generation by
  // dropping the assignment and joining again, which starts one more rebalance: a loop committing
  // on every interval kept a cooperative group rebalancing for a minute (a commit during a
  // rebalance; librdkafka's own auto-commit waits for the steady state). Hold periodic commits
  // until the rebalance callback (which commits revoked partitions itself), or 2 s per refusal in
  // a row, at most 10 s.
  if (e == RD_KAFKA_RESP_ERR_ILLEGAL_GENERATION || e == RD_KAFKA_RESP_ERR_REBALANCE_IN_PROGRESS ||
      e == RD_KAFKA_RESP_ERR_UNKNOWN_MEMBER_ID) {
    refused_ = std::min(refused_ + 1, 5);
    hold_until_ = now + refused_ * std::chrono::seconds(2);
  }
}

std::size_t store_committables(rd_kafka_t* rk, const OffsetTracker& tracker) {
  const auto offsets = tracker.committables();
  if (offsets.empty()) return 0;
  PartitionList list = to_list(offsets);
  // A partition revoked meanwhile is refused on its own (its element's err): its next owner
  // redelivers what it had, and the guard answers duplicate.
  rd_kafka_offsets_store(rk, list.get());
  std::size_t stored = 0;
  for (int i = 0; i < list->cnt; ++i) stored += list->elems[i].err == RD_KAFKA_RESP_ERR_NO_ERROR;
  return stored;
}

void pause(rd_kafka_t* rk, const TopicPartition& tp, bool paused) {
  PartitionList list = one(tp);
  const auto e = paused ? rd_kafka_pause_partitions(rk, list.get()) : rd_kafka_resume_partitions(rk, list.get());
  const auto pe = e ? e : list->elems[0].err;
  if (pe)
    throw kafka_error(
        fmt::format("{} {}/{}: {}", paused ? "pause" : "resume", tp.topic, tp.partition, rd_kafka_err2str(pe)), pe);
}

void seek(rd_kafka_t* rk, const TopicPartition& tp, std::int64_t offset, int timeout_ms) {
  PartitionList list = one(tp);
  list->elems[0].offset = offset;
  check(rd_kafka_seek_partitions(rk, list.get(), timeout_ms), "seek");
  if (const auto e = list->elems[0].err)
    throw kafka_error(fmt::format("seek {}/{} to {}: {}", tp.topic, tp.partition, offset, rd_kafka_err2str(e)), e);
}

std::size_t append_headers(rd_kafka_message_t* m, std::vector<Header>& out) {
  rd_kafka_headers_t* h = nullptr;
  // NOENT: none; another error: headers librdkafka could not parse, read as none.
  if (rd_kafka_message_headers(m, &h) != RD_KAFKA_RESP_ERR_NO_ERROR || !h) return 0;
  const std::size_t before = out.size();
  const char* name = nullptr;
  const void* value = nullptr;
  std::size_t size = 0;
  for (std::size_t i = 0; rd_kafka_header_get_all(h, i, &name, &value, &size) == RD_KAFKA_RESP_ERR_NO_ERROR; ++i)
    out.push_back({name, value ? std::string_view(static_cast<const char*>(value), size) : std::string_view()});
  return out.size() - before;
}

std::optional<Timestamp> timestamp_of(const rd_kafka_message_t* m) {
  rd_kafka_timestamp_type_t type = RD_KAFKA_TIMESTAMP_NOT_AVAILABLE;
  const std::int64_t ms = rd_kafka_message_timestamp(m, &type);
  if (type == RD_KAFKA_TIMESTAMP_NOT_AVAILABLE || ms < 0) return std::nullopt;
  return Timestamp{
      .time = std::chrono::system_clock::time_point(std::chrono::milliseconds(ms)),
      .type = type == RD_KAFKA_TIMESTAMP_LOG_APPEND_TIME ? TimestampType::log_append_time : TimestampType::create_time};
}

DeadLetterProducer::DeadLetterProducer(const std::string& brokers,
                                       const std::map<std::string, std::string>& properties) {
  rd_kafka_conf_t* conf = rd_kafka_conf_new();
  try {
    set_property(conf, "bootstrap.servers", brokers);
    // No duplicate from librdkafka's own retries; the guard's key stops the others.
    set_property(conf, "enable.idempotence", "true");
    for (const auto& [k, v] : properties) set_property(conf, k, v);
  } catch (...) {
    rd_kafka_conf_destroy(conf);
    throw;
  }
  rd_kafka_conf_set_dr_msg_cb(conf, &idem_kafka_dead_letter_dr);
  char err[512];
  rk_ = rd_kafka_new(RD_KAFKA_PRODUCER, conf, err, sizeof err);
  if (!rk_) {
    rd_kafka_conf_destroy(conf);
    throw kafka_error(fmt::format("dead-letter producer: {}", err), RD_KAFKA_RESP_ERR__INVALID_ARG, false);
  }
}

DeadLetterProducer::~DeadLetterProducer() {
  rd_kafka_flush(rk_, 5'000);
  rd_kafka_destroy(rk_);
}

void DeadLetterProducer::write(const std::string& topic, const Message& m, std::string_view reason) {
  std::lock_guard lock(mu_);
  const std::string partition = std::to_string(m.partition), offset = std::to_string(m.offset);
  // The original headers first, in order (idem-outbox-id among them: a replay of the letter keeps
  // its key), then idem's: a reader taking the last header of a name gets idem's reason and origin.
  rd_kafka_headers_t* hdrs = rd_kafka_headers_new(m.headers.size() + 4);
  auto add = [hdrs](std::string_view name, std::string_view value) {
    rd_kafka_header_add(hdrs, name.data(), static_cast<ssize_t>(name.size()), value.data(),
                        static_cast<ssize_t>(value.size()));
  };
  for (const Header& h : m.headers) add(h.name, h.value);
  add("idem-reason", reason);
  add("idem-topic", m.topic);
  add("idem-partition", partition);
  add("idem-offset", offset);
  auto ticket = std::make_shared<Ticket>();
  auto* opaque = new std::shared_ptr<Ticket>(ticket);
  rd_kafka_resp_err_t e =
      rd_kafka_producev(rk_, RD_KAFKA_V_TOPIC(topic.c_str()), RD_KAFKA_V_KEY(m.key.data(), m.key.size()),
                        RD_KAFKA_V_VALUE(const_cast<char*>(m.value.data()), m.value.size()), RD_KAFKA_V_HEADERS(hdrs),
                        RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY), RD_KAFKA_V_OPAQUE(opaque), RD_KAFKA_V_END);
  if (e != RD_KAFKA_RESP_ERR_NO_ERROR) {
    rd_kafka_headers_destroy(hdrs);  // not queued: the headers stay ours, and no report will come
    delete opaque;
    throw kafka_error(fmt::format("dead letter to {}: {}", topic, rd_kafka_err2str(e)), e);
  }
  // The guard records the write only once this returns: wait until the broker acked it.
  e = rd_kafka_flush(rk_, 10'000);
  if (e == RD_KAFKA_RESP_ERR_NO_ERROR) e = static_cast<rd_kafka_resp_err_t>(ticket->err.load());
  if (e != RD_KAFKA_RESP_ERR_NO_ERROR)
    throw kafka_error(fmt::format("dead letter to {}: {}", topic, rd_kafka_err2str(e)), e);
}

}  // namespace idem::kafka
