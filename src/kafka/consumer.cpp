// idem::kafka::Consumer (include/idem/kafka/consumer.hpp). Threads: run() is the poll thread; it
// alone calls librdkafka's consumer (poll, rebalance, pause, seek, commit). Workers take one
// partition's queued messages at a time, run them through the Processor, settle them in the
// OffsetTracker, and ask the poll thread for a retry (pause, rewind, seek back) through `retries`.

#include "idem/kafka/consumer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

#include "rdkafka.hpp"

namespace idem::kafka {

namespace {

using Clock = std::chrono::steady_clock;

struct Queued {
  rd_kafka_message_t* msg;
  Epoch epoch;  // the partition's epoch when it was tracked
};

// One partition's work, shared between the poll thread and the workers under Impl::mu.
struct Lane {
  std::deque<Queued> queue;
  bool busy = false;     // a worker runs a batch of it: one at a time keeps the partition's order
  bool blocked = false;  // a retry was asked: nothing more runs until the poll thread rewinds
};

// One partition's fetch state, poll thread only.
struct Fetch {
  bool full = false;                         // paused: too many queued messages
  std::optional<std::int64_t> retry_offset;  // paused: seek back here at retry_due, then resume
  Clock::time_point retry_due{};
};

struct RetryRequest {
  TopicPartition tp;
  std::int64_t offset;
  Epoch epoch;
  millis after;
};

struct Counters {
  std::atomic<std::uint64_t> polled{0}, executed{0}, duplicates{0}, requeued{0}, handler_errors{0}, dead_lettered{0},
      dead_letters_earlier{0}, dead_letter_failures{0}, dropped_revoked{0}, dropped_rewound{0}, rebalances{0},
      commits{0}, commit_failures{0};
};

void check_options(const ConsumerOptions& o) {
  auto bad = [](std::string_view why) { throw invalid_options_error(fmt::format("ConsumerOptions: {}", why)); };
  if (o.brokers.empty()) bad("brokers is empty");
  if (o.group.empty()) bad("group is empty");
  if (o.topics.empty()) bad("no topic to subscribe to");
  if (o.batch == 0 || o.workers == 0 || o.max_queued == 0 || o.commit_every == 0)
    bad("batch, workers, max_queued and commit_every must be >= 1");
  if (o.min_retry.count() < 0 || o.max_retry < o.min_retry) bad("need 0 <= min_retry <= max_retry");
  if (o.poll_timeout.count() <= 0 || o.commit_interval.count() <= 0)
    bad("poll_timeout and commit_interval must be > 0");
  for (const char* forced : {"enable.auto.commit", "enable.auto.offset.store"}) {
    const auto it = o.properties.find(forced);
    if (it != o.properties.end() && it->second != "false")
      bad(fmt::format("{} must stay false: only settled offsets may be committed", forced));
  }
}

}  // namespace

struct Consumer::Impl {
  Impl(ConsumerOptions o, Processor& p) : opts(std::move(o)), processor(p) {
    check_options(opts);
    rk = new_group_consumer(opts.brokers, opts.group, opts.properties, opts.topics, &Impl::rebalance_cb,
                            &Impl::commit_cb, this);
  }

  ~Impl() {
    drop_all();
    // run() closed it; if run() never ran or threw, a close here could serve a rebalance into a
    // half-destroyed consumer, and nothing settled is lost without it (the next owner redelivers).
    rd_kafka_destroy_flags(rk, RD_KAFKA_DESTROY_F_NO_CONSUMER_CLOSE);
  }

  template <class... Args>
  void log(fmt::format_string<Args...> f, Args&&... args) {
    if (opts.log) opts.log(fmt::format(f, std::forward<Args>(args)...));
  }

  // ---- poll thread -------------------------------------------------------------------------

  void run() {
    if (ran.exchange(true)) throw usage_error("Consumer::run: called twice");
    std::vector<std::thread> threads;
    for (std::size_t i = 0; i < opts.workers; ++i) threads.emplace_back([this] { work(); });
    try {
      while (!stopping.load()) {
        start_retries();
        resume_due();
        if (rd_kafka_message_t* m = rd_kafka_consumer_poll(rk, static_cast<int>(opts.poll_timeout.count()))) accept(m);
        if (pacer.due(settled_since_commit.load(), Clock::now())) commit(/*async=*/true);
      }
    } catch (...) {
      stop_workers(threads);
      throw;
    }
    stop_workers(threads);
    commit(/*async=*/false);
    // Leaves the group: the revoke callback commits again (the same offsets) and lets go.
    rd_kafka_consumer_close(rk);
  }

  void stop_workers(std::vector<std::thread>& threads) {
    {
      std::lock_guard lock(mu);
      workers_stop = true;
    }
    cv.notify_all();
    for (auto& t : threads) t.join();
    drop_all();
  }

  void accept(rd_kafka_message_t* m) {
    if (m->err) {
      // Partition EOF is information; the rest is librdkafka telling what it does about it.
      if (m->err != RD_KAFKA_RESP_ERR__PARTITION_EOF) log("kafka: {}", rd_kafka_message_errstr(m));
      rd_kafka_message_destroy(m);
      return;
    }
    TopicPartition tp{rd_kafka_topic_name(m->rkt), m->partition};
    Fetch& f = fetch[tp];
    // Fetched before the partition paused for a retry: the seek back delivers it again.
    if (f.retry_offset) {
      rd_kafka_message_destroy(m);
      return;
    }
    std::optional<Epoch> epoch = track(tp, m->offset);
    if (!epoch) {
      rd_kafka_message_destroy(m);
      return;
    }
    counters.polled.fetch_add(1);
    std::size_t queued = 0;
    {
      std::lock_guard lock(mu);
      Lane& lane = lanes[tp];
      // Behind a requested retry: tracked in the epoch the rewind ends, so it is forgotten there.
      if (lane.blocked) {
        rd_kafka_message_destroy(m);
        return;
      }
      lane.queue.push_back({m, *epoch});
      queued = lane.queue.size();
    }
    cv.notify_one();
    // Pausing loses nothing: librdkafka drops what it fetched beyond the last message handed out
    // and fetches from there on resume.
    if (queued >= opts.max_queued && !f.full) set_paused(tp, f, [&] { f.full = true; });
  }

  // The message's epoch, or nothing when it is not to be run here.
  std::optional<Epoch> track(const TopicPartition& tp, std::int64_t offset) {
    try {
      return tracker.track(tp.topic, tp.partition, offset);
    } catch (const usage_error&) {
      // Not assigned (librdkafka filters those), or at or below an offset tracked already:
      // librdkafka went back (an offset reset, a seek not made here). Follow it, since skipping
      // the message while later ones settle would commit past it; below the committable offset
      // it is settled already.
      const auto committable = tracker.committable(tp.topic, tp.partition);
      if (!tracker.epoch(tp.topic, tp.partition) || (committable && offset < *committable)) return std::nullopt;
      log("kafka: {}/{} went back to {}: what was polled after it is polled again", tp.topic, tp.partition, offset);
      tracker.rewind(tp.topic, tp.partition, offset);
      std::lock_guard lock(mu);
      Lane& lane = lanes[tp];
      counters.dropped_rewound.fetch_add(lane.queue.size());
      drop(lane);
      lane.blocked = false;
    }
    return tracker.track(tp.topic, tp.partition, offset);
  }

  // Pauses or resumes tp so that it is paused exactly while full or waiting for a retry.
  template <class Change>
  void set_paused(const TopicPartition& tp, Fetch& f, Change change) {
    const bool before = f.full || f.retry_offset;
    change();
    const bool after = f.full || f.retry_offset;
    if (before == after) return;
    try {
      pause(rk, tp, after);
    } catch (const kafka_error& e) {
      log("kafka: {}", e.what());
    }
  }

  // Retries asked by workers: pause the partition, forget what was tracked from the message on.
  void start_retries() {
    std::vector<RetryRequest> asked;
    {
      std::lock_guard lock(mu);
      asked.swap(retries);
    }
    for (RetryRequest& r : asked) {
      // Revoked, re-assigned or rewound since: that cleared the lane already, and what it holds
      // now belongs to the new epoch.
      const auto current = tracker.epoch(r.tp.topic, r.tp.partition);
      if (!current || *current != r.epoch) continue;
      Fetch& f = fetch[r.tp];
      set_paused(r.tp, f, [&] {
        f.retry_offset = r.offset;
        f.retry_due = Clock::now() + std::clamp(r.after, opts.min_retry, opts.max_retry);
      });
      try {
        tracker.rewind(r.tp.topic, r.tp.partition, r.offset);
      } catch (const usage_error& e) {
        log("kafka: {}", e.what());
      }
      std::lock_guard lock(mu);
      Lane& lane = lanes[r.tp];
      counters.dropped_rewound.fetch_add(lane.queue.size());
      drop(lane);
      lane.blocked = false;
    }
    // Lanes that drained below half of max_queued fetch again.
    for (auto& [tp, f] : fetch) {
      if (!f.full) continue;
      std::size_t queued = 0;
      {
        std::lock_guard lock(mu);
        queued = lanes[tp].queue.size();
      }
      if (queued <= opts.max_queued / 2) set_paused(tp, f, [&f] { f.full = false; });
    }
  }

  // Seeks back to each due retry's message and resumes its partition.
  void resume_due() {
    const auto now = Clock::now();
    for (auto& [tp, f] : fetch) {
      if (!f.retry_offset || f.retry_due > now) continue;
      try {
        seek(rk, tp, *f.retry_offset, 1'000);
      } catch (const kafka_error& e) {
        log("kafka: {}; trying again", e.what());
        f.retry_due = now + opts.min_retry;
        continue;
      }
      set_paused(tp, f, [&f] {
        f.retry_offset.reset();
        f.full = false;
      });
    }
  }

  void commit(bool async) {
    settled_since_commit.store(0);
    pacer.sent(Clock::now());
    if (store_committables(rk, tracker) == 0) return;
    // Commits what was stored; NO_OFFSET: nothing new since the last commit.
    const auto e = rd_kafka_commit(rk, nullptr, async ? 1 : 0);
    if (e == RD_KAFKA_RESP_ERR__NO_OFFSET) return;
    counters.commits.fetch_add(1);
    if (e != RD_KAFKA_RESP_ERR_NO_ERROR) commit_failed(e);
  }

  void commit_failed(rd_kafka_resp_err_t e) {
    // Not fatal: the offsets stay stored for the next commit; at worst the partition's next owner
    // redelivers settled messages, which the guard answers as duplicates.
    counters.commit_failures.fetch_add(1);
    pacer.answered(e, Clock::now());
    log("kafka: commit refused: {}", rd_kafka_err2str(e));
  }

  // librdkafka's callbacks are C frames: nothing may be thrown through them.
  static void commit_cb(rd_kafka_t*, rd_kafka_resp_err_t err, rd_kafka_topic_partition_list_t*, void* opaque) noexcept {
    try {
      auto* self = static_cast<Impl*>(opaque);
      if (err == RD_KAFKA_RESP_ERR_NO_ERROR)
        self->pacer.answered(err, Clock::now());
      else if (err != RD_KAFKA_RESP_ERR__NO_OFFSET)
        self->commit_failed(err);
    } catch (...) {
    }
  }

  static void rebalance_cb(rd_kafka_t*, rd_kafka_resp_err_t err, rd_kafka_topic_partition_list_t* parts,
                           void* opaque) noexcept {
    auto* self = static_cast<Impl*>(opaque);
    try {
      self->on_rebalance(err, parts);
    } catch (const std::exception& e) {
      try {
        self->log("kafka: rebalance callback: {}", e.what());
      } catch (...) {
      }
    } catch (...) {
    }
  }

  // Runs inside rd_kafka_consumer_poll (or close), on the poll thread, while workers run batches.
  void on_rebalance(rd_kafka_resp_err_t err, rd_kafka_topic_partition_list_t* parts) {
    counters.rebalances.fetch_add(1);
    pacer.rebalanced();
    RebalanceResult r;
    try {
      r = handle_rebalance(rk, err, parts, tracker);
    } catch (const kafka_error& e) {
      log("kafka: rebalance: {}", e.what());
      r.assigned = err == RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS;
      for (int i = 0; i < parts->cnt; ++i) r.partitions.push_back({parts->elems[i].topic, parts->elems[i].partition});
    }
    if (r.commit_error != RD_KAFKA_RESP_ERR_NO_ERROR) commit_failed(r.commit_error);
    log("kafka: {} {} partition(s){}", r.assigned ? "assigned" : (r.lost ? "lost" : "revoked"), r.partitions.size(),
        r.closed ? " (group already closed)" : "");
    for (const TopicPartition& tp : r.partitions) {
      fetch.erase(tp);  // a partition comes back unpaused, from its committed offset
      std::lock_guard lock(mu);
      Lane& lane = lanes[tp];
      // Polled and not run: the partition's owner from now on gets them from the committed offset.
      counters.dropped_revoked.fetch_add(lane.queue.size());
      drop(lane);
      lane.blocked = false;
    }
    if (opts.on_rebalance) opts.on_rebalance(r.assigned, r.partitions.size());
  }

  // ---- workers -----------------------------------------------------------------------------

  void work() {
    for (;;) {
      TopicPartition tp;
      std::vector<Queued> batch;
      {
        std::unique_lock lock(mu);
        std::map<TopicPartition, Lane>::iterator it;
        cv.wait(lock, [&] { return workers_stop || (it = next_lane()) != lanes.end(); });
        if (workers_stop) return;
        tp = it->first;
        Lane& lane = it->second;
        lane.busy = true;
        last_lane = tp;
        while (!lane.queue.empty() && batch.size() < opts.batch) {
          batch.push_back(lane.queue.front());
          lane.queue.pop_front();
        }
      }
      try {
        run_batch(tp, batch);
      } catch (const std::exception& e) {
        // Its messages stay unsettled: the partition's commits wait, and a restart redelivers them.
        log("kafka: batch of {}/{} abandoned: {}", tp.topic, tp.partition, e.what());
      } catch (...) {
        log("kafka: batch of {}/{} abandoned: unknown exception", tp.topic, tp.partition);
      }
      for (const Queued& q : batch) rd_kafka_message_destroy(q.msg);
      {
        std::lock_guard lock(mu);
        lanes[tp].busy = false;
      }
      cv.notify_all();
    }
  }

  // The lane after the last one taken that has work and no worker: round robin, so that a busy
  // partition does not starve the others. Under mu.
  std::map<TopicPartition, Lane>::iterator next_lane() {
    auto ready = [](const Lane& l) { return !l.busy && !l.blocked && !l.queue.empty(); };
    for (auto it = lanes.upper_bound(last_lane); it != lanes.end(); ++it)
      if (ready(it->second)) return it;
    for (auto it = lanes.begin(); it != lanes.end() && it->first <= last_lane; ++it)
      if (ready(it->second)) return it;
    return lanes.end();
  }

  void run_batch(const TopicPartition& tp, std::vector<Queued>& batch) {
    // Revoked or rewound since they were polled: their partition's owner polls them again.
    const auto current = tracker.epoch(tp.topic, tp.partition);
    std::vector<Message> messages;
    std::vector<Epoch> epochs;
    std::vector<Header> headers;  // every message's, in batch order: views into the librdkafka messages
    std::vector<std::size_t> header_counts;
    for (const Queued& q : batch) {
      if (!current || q.epoch != *current) {
        counters.dropped_revoked.fetch_add(1);
        continue;
      }
      messages.push_back({.topic = tp.topic,
                          .partition = tp.partition,
                          .offset = q.msg->offset,
                          .key = {static_cast<const char*>(q.msg->key), q.msg->key_len},
                          .value = {static_cast<const char*>(q.msg->payload), q.msg->len},
                          .timestamp = timestamp_of(q.msg)});
      header_counts.push_back(append_headers(q.msg, headers));
      epochs.push_back(q.epoch);
    }
    if (messages.empty()) return;
    // Spans taken once `headers` no longer grows.
    std::size_t first = 0;
    for (std::size_t i = 0; i < messages.size(); ++i) {
      messages[i].headers = std::span<const Header>(headers).subspan(first, header_counts[i]);
      first += header_counts[i];
    }
    std::vector<Verdict> verdicts(messages.size());
    try {
      processor.process(messages, verdicts);
    } catch (...) {
      // A Processor should not throw; if it does, nothing is known: retry the whole batch.
      log("kafka: the processor threw: the batch is retried");
      const millis wait = idem::verdict(std::current_exception()).delay;
      for (Verdict& v : verdicts) v = {.action = BrokerAction::requeue, .retry_after = wait};
    }
    // Counted before settling: the handlers after a retry in this batch ran too.
    for (const Verdict& v : verdicts) count(v);
    for (std::size_t i = 0; i < messages.size(); ++i) {
      const Message& m = messages[i];
      const Verdict& v = verdicts[i];
      std::optional<millis> wait;
      switch (v.action) {
        case BrokerAction::ack:
          break;
        case BrokerAction::requeue:
          wait = v.retry_after;
          break;
        case BrokerAction::dead_letter:
          wait = dead_letter(m, v);
          break;
      }
      if (!wait) {
        if (tracker.settle(m.topic, m.partition, m.offset, epochs[i])) settled_since_commit.fetch_add(1);
        continue;
      }
      // Kafka has no per-message nack: the partition goes back to this message. Those after it in
      // the batch ran already; the seek back redelivers them, and the guard answers duplicate.
      counters.requeued.fetch_add(1);
      // in_flight is the normal wait for another holder; a failed dead letter said so already.
      if (v.action == BrokerAction::requeue && !v.status)
        log("kafka: {}/{}@{} retried: {}", m.topic, m.partition, m.offset, v.reason);
      if (tracker.retry(m.topic, m.partition, m.offset, epochs[i])) {
        std::lock_guard lock(mu);
        // Checked again under mu: the poll thread changes an epoch before it clears the lane
        // under mu, so a lane is never blocked for an epoch that is over.
        if (tracker.epoch(m.topic, m.partition) != epochs[i]) return;
        Lane& lane = lanes[tp];
        lane.blocked = true;
        counters.dropped_rewound.fetch_add(lane.queue.size());
        drop(lane);
        retries.push_back({tp, m.offset, epochs[i], *wait});
      }
      return;
    }
  }

  void count(const Verdict& v) {
    if (v.handler_failed) counters.handler_errors.fetch_add(1);
    if (v.status == Status::executed) counters.executed.fetch_add(1);
    if (v.status == Status::duplicate) counters.duplicates.fetch_add(1);
    if (v.status == Status::lease_lost) log("kafka: lease lost: a handler outlived its lease");
  }

  // Nothing once the dead letter exists (written now or by an earlier delivery); else the wait
  // before the message is tried again.
  std::optional<millis> dead_letter(const Message& m, const Verdict& v) {
    const std::string topic = opts.dead_letter_topic.empty() ? std::string(m.topic) + ".dlq" : opts.dead_letter_topic;
    const DeadLetterResult r = processor.dead_letter(v.dead_letter_key, [&] { producer().write(topic, m, v.reason); });
    if (r.written) {
      (r.earlier ? counters.dead_letters_earlier : counters.dead_lettered).fetch_add(1);
      return std::nullopt;
    }
    counters.dead_letter_failures.fetch_add(1);
    log("kafka: dead letter for {}/{}@{} not written: {}", m.topic, m.partition, m.offset, r.error);
    return r.retry_after;
  }

  DeadLetterProducer& producer() {
    std::lock_guard lock(dlq_mu);
    if (!dlq) dlq = std::make_unique<DeadLetterProducer>(opts.brokers, opts.dead_letter_properties);
    return *dlq;
  }

  // Under mu (or with no worker left).
  void drop(Lane& lane) {
    for (const Queued& q : lane.queue) rd_kafka_message_destroy(q.msg);
    lane.queue.clear();
  }
  void drop_all() {
    std::lock_guard lock(mu);
    for (auto& [tp, lane] : lanes) drop(lane);
  }

  ConsumerOptions opts;
  Processor& processor;
  rd_kafka_t* rk = nullptr;
  OffsetTracker tracker;
  Counters counters;
  std::atomic<bool> stopping{false};
  std::atomic<bool> ran{false};
  std::atomic<std::size_t> settled_since_commit{0};
  CommitPacer pacer{opts.commit_interval, opts.commit_every};  // poll thread
  std::map<TopicPartition, Fetch> fetch;         // poll thread

  std::mutex mu;  // guards what follows
  std::condition_variable cv;
  std::map<TopicPartition, Lane> lanes;
  std::vector<RetryRequest> retries;
  TopicPartition last_lane;
  bool workers_stop = false;

  std::mutex dlq_mu;
  std::unique_ptr<DeadLetterProducer> dlq;
};

Consumer::Consumer(ConsumerOptions options, Processor& processor)
    : impl_(std::make_unique<Impl>(std::move(options), processor)) {}

Consumer::~Consumer() = default;

void Consumer::run() { impl_->run(); }

void Consumer::stop() noexcept { impl_->stopping.store(true); }

ConsumerStats Consumer::stats() const {
  const Counters& c = impl_->counters;
  return {
      c.polled.load(),          c.executed.load(),        c.duplicates.load(),           c.requeued.load(),
      c.handler_errors.load(),  c.dead_lettered.load(),   c.dead_letters_earlier.load(), c.dead_letter_failures.load(),
      c.dropped_revoked.load(), c.dropped_rewound.load(), c.rebalances.load(),           c.commits.load(),
      c.commit_failures.load()};
}

const OffsetTracker& Consumer::tracker() const noexcept { return impl_->tracker; }

}  // namespace idem::kafka
