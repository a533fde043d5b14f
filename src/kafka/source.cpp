// idem::kafka::Source (include/idem/kafka/source.hpp). One thread drives it: librdkafka's callbacks
// (rebalance, commit results) are served inside rd_kafka_consumer_poll() and
// rd_kafka_consumer_close(), which only poll() and the destructor call. The counters are atomics
// and the OffsetTracker has its own mutex, so metrics may read them from another thread.
//
// State per partition: the OffsetTracker (what is tracked and settled, epochs), `seeks` (a
// partition paused until it is sought back to a message: a requeue or a release) and `seen` (how
// many times each unsettled offset was polled: Delivery::attempt).

#include "idem/kafka/source.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <set>

#include "rdkafka.hpp"

namespace idem::kafka {

static_assert(idem::Source<Source>, "kafka::Source must model idem::Source (guard/consume.hpp)");

namespace {

using Clock = std::chrono::steady_clock;

// A partition paused until `due`, then sought back to `offset` and resumed.
struct PendingSeek {
  std::int64_t offset = 0;
  Clock::time_point due{};
};

// One message of the batch poll() handed out, as settle() and release() need it.
struct Entry {
  TopicPartition tp;
  std::int64_t offset = 0;
  Epoch epoch = 0;
  bool done = false;  // settled, dead-lettered, requeued or skipped: release() leaves it
};

struct Counters {
  std::atomic<std::uint64_t> polled{0}, acked{0}, requeued{0}, dead_lettered{0}, dead_letter_failures{0}, skipped{0},
      released{0}, rebalances{0}, commits{0}, commit_failures{0};
};

void check_options(const SourceOptions& o) {
  auto bad = [](std::string_view why) { throw invalid_options_error(fmt::format("kafka::SourceOptions: {}", why)); };
  if (o.brokers.empty()) bad("brokers is empty");
  if (o.group.empty()) bad("group is empty");
  if (o.topics.empty()) bad("no topic to subscribe to");
  for (const std::string& t : o.topics)
    if (t.empty()) bad("a topic name is empty");
  if (o.batch == 0 || o.batch > 100'000) bad(fmt::format("batch must be 1..100000 (is {})", o.batch));
  if (o.poll_timeout.count() <= 0) bad("poll_timeout must be > 0");
  if (o.commit_interval.count() <= 0) bad("commit_interval must be > 0");
  if (o.commit_every == 0) bad("commit_every must be >= 1");
  if (o.dead_letter_retry.count() < 0) bad("dead_letter_retry must be >= 0");
  for (const char* forced : {"enable.auto.commit", "enable.auto.offset.store"}) {
    const auto it = o.properties.find(forced);
    if (it != o.properties.end() && it->second != "false")
      bad(fmt::format("{} must stay false: only settled offsets may be committed", forced));
  }
}

int to_ms(Clock::duration d) {
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(d).count();
  return static_cast<int>(std::clamp<std::int64_t>(ms, 0, 60'000));
}

}  // namespace

struct Source::Impl {
  explicit Impl(SourceOptions o) : opts(std::move(o)) {
    check_options(opts);
    rk = new_group_consumer(opts.brokers, opts.group, opts.properties, opts.topics, &Impl::rebalance_cb,
                            &Impl::commit_cb, this);
  }

  ~Impl() {
    // What is settled is committed; the rest of a batch in hand comes again to the partition's
    // next owner, where the guard answers duplicate for what ran.
    try {
      last_committed.clear();  // an async commit of the same offsets may still be in flight, or refused
      commit(/*async=*/false);
    } catch (...) {
    }
    // Leaves the group: the revoke callback commits again (the same offsets) and lets go.
    rd_kafka_consumer_close(rk);
    rd_kafka_destroy(rk);
  }

  template <class... Args>
  void log(fmt::format_string<Args...> f, Args&&... args) noexcept {
    if (!opts.log) return;
    try {
      opts.log(fmt::format(f, std::forward<Args>(args)...));
    } catch (...) {
    }
  }

  // ---- poll ---------------------------------------------------------------------------------

  std::vector<SourceMessage> poll() {
    if (!batch.empty()) release();  // the previous batch was neither settled nor released
    if (fatal) throw kafka_error(fmt::format("kafka consumer: {}", *fatal), RD_KAFKA_RESP_ERR__FATAL, false);
    commit_if_due();
    const auto deadline = Clock::now() + opts.poll_timeout;
    for (;;) {
      seek_due();
      const auto now = Clock::now();
      int timeout = 0;
      if (polled.empty() && now < deadline) {
        auto wait = deadline - now;
        // Wake up for a partition due to be sought back meanwhile.
        for (const auto& [tp, s] : seeks) wait = std::min(wait, std::max(s.due - now, Clock::duration::zero()));
        timeout = to_ms(wait);
      }
      rd_kafka_message_t* m = rd_kafka_consumer_poll(rk, timeout);
      if (m) accept(m);
      if (fatal) {
        drop_polled();
        throw kafka_error(fmt::format("kafka consumer: {}", *fatal), RD_KAFKA_RESP_ERR__FATAL, false);
      }
      if (polled.size() >= opts.batch) break;
      if (!m && (!polled.empty() || Clock::now() >= deadline)) break;
    }
    std::vector<SourceMessage> out;
    out.swap(polled);
    batch.swap(polling);
    polling.clear();
    counters.polled.fetch_add(out.size());
    batch_messages = out;  // a copy: the caller's may be gone when settle() writes a dead letter
    return out;
  }

  void accept(rd_kafka_message_t* m) {
    struct Destroy {
      rd_kafka_message_t* m;
      ~Destroy() { rd_kafka_message_destroy(m); }
    } destroy{m};
    if (m->err) {
      if (m->err == RD_KAFKA_RESP_ERR__PARTITION_EOF) return;
      if (m->err == RD_KAFKA_RESP_ERR__FATAL) {
        char why[512];
        rd_kafka_fatal_error(rk, why, sizeof why);
        fatal = why;
        return;
      }
      // The rest is librdkafka saying what it does about a failure (it reconnects by itself).
      log("kafka: {}", rd_kafka_message_errstr(m));
      return;
    }
    TopicPartition tp{rd_kafka_topic_name(m->rkt), m->partition};
    // Fetched before its partition paused to be sought back: the seek delivers it again.
    if (seeks.count(tp)) return;
    const std::optional<Epoch> epoch = track(tp, m->offset);
    if (!epoch) return;
    SourceMessage s;
    s.topic = tp.topic;
    s.partition = tp.partition;
    s.offset = m->offset;
    if (m->key) s.key.assign(static_cast<const char*>(m->key), m->key_len);
    if (m->payload) s.value.assign(static_cast<const char*>(m->payload), m->len);
    std::vector<Header> hs;
    append_headers(m, hs);
    s.headers.reserve(hs.size());
    for (const Header& h : hs) s.headers.emplace_back(h.name, h.value);
    s.timestamp = timestamp_of(m);
    s.attempt = ++seen[tp][m->offset];
    polled.push_back(std::move(s));
    polling.push_back({.tp = std::move(tp), .offset = m->offset, .epoch = *epoch});
  }

  // The message's epoch, or nothing when it is not to be handed out.
  std::optional<Epoch> track(const TopicPartition& tp, std::int64_t offset) {
    try {
      return tracker.track(tp.topic, tp.partition, offset);
    } catch (const usage_error&) {
      // Not assigned (librdkafka filters those), or at or below an offset tracked already:
      // librdkafka went back by itself (an offset reset). Follow it, since skipping the message
      // while later ones settle would commit past it; below the committable offset it is settled.
      const auto committable = tracker.committable(tp.topic, tp.partition);
      if (!tracker.epoch(tp.topic, tp.partition) || (committable && offset < *committable)) return std::nullopt;
      log("kafka: {}/{} went back to {}: what was polled after it is polled again", tp.topic, tp.partition, offset);
      tracker.rewind(tp.topic, tp.partition, offset);
      drop_polled_from(tp, offset);
    }
    return tracker.track(tp.topic, tp.partition, offset);
  }

  // Forgets the messages of the batch being polled of `tp` from `offset` on (all when nullopt).
  void drop_polled_from(const TopicPartition& tp, std::optional<std::int64_t> offset) {
    std::size_t keep = 0;
    for (std::size_t i = 0; i < polling.size(); ++i) {
      if (polling[i].tp == tp && (!offset || polling[i].offset >= *offset)) continue;
      if (keep != i) {
        polling[keep] = std::move(polling[i]);
        polled[keep] = std::move(polled[i]);
      }
      ++keep;
    }
    polling.resize(keep);
    polled.resize(keep);
  }

  void drop_polled() {
    polling.clear();
    polled.clear();
  }

  // ---- requeues and releases: pause, then seek back and resume -------------------------------

  // Pauses `tp` and forgets what was tracked from `offset` on; a later poll seeks it back to
  // `offset` once `after` passed. An earlier pending seek of the partition stands.
  void seek_back(const TopicPartition& tp, std::int64_t offset, millis after) {
    if (seeks.count(tp)) return;
    try {
      tracker.rewind(tp.topic, tp.partition, offset);
    } catch (const usage_error& e) {
      // Revoked since (the next owner has it) or below what is committable (settled already).
      log("kafka: {}", e.what());
      return;
    }
    try {
      pause(rk, tp, true);
    } catch (const kafka_error& e) {
      log("kafka: {}", e.what());  // the seek below still brings the partition back to `offset`
    }
    seeks[tp] = {offset, Clock::now() + after};
  }

  // Resumes each due partition and seeks it back. In that order: librdkafka 2.0.2 may not fetch a
  // partition sought while paused until up to a second after its resume. The seek purges what was
  // fetched meanwhile (and librdkafka drops fetch replies older than it), and until it succeeds
  // the partition stays in `seeks`, whose messages accept() drops.
  void seek_due() {
    if (seeks.empty()) return;
    const auto now = Clock::now();
    for (auto it = seeks.begin(); it != seeks.end();) {
      const auto& [tp, s] = *it;
      if (s.due > now) {
        ++it;
        continue;
      }
      try {
        pause(rk, tp, false);
      } catch (const kafka_error& e) {
        log("kafka: {}", e.what());
      }
      try {
        seek(rk, tp, s.offset, 1'000);
      } catch (const kafka_error& e) {
        log("kafka: {}; trying again", e.what());
        it->second.due = now + millis{50};
        ++it;
        continue;
      }
      it = seeks.erase(it);
    }
  }

  // ---- settle / release ---------------------------------------------------------------------

  void settle(std::span<const idem::Verdict> verdicts) {
    if (verdicts.size() != batch.size())
      throw usage_error(fmt::format("kafka::Source::settle: {} verdicts for a batch of {} messages (settle once per poll)",
                                    verdicts.size(), batch.size()));
    std::set<TopicPartition> stopped;  // partitions sought back at a message of this batch
    for (std::size_t i = 0; i < batch.size(); ++i) {
      Entry& e = batch[i];
      if (e.done) continue;
      const idem::Verdict& v = verdicts[i];
      if (stopped.count(e.tp)) {
        // Behind a requeue of its partition: it comes again (a duplicate if it ran).
        e.done = true;
        counters.skipped.fetch_add(1);
        continue;
      }
      switch (v.action) {
        case BrokerAction::ack:
          mark_settled(e);
          counters.acked.fetch_add(1);
          break;
        case BrokerAction::dead_letter:
          if (dead_letter(i, v.reason)) {
            mark_settled(e);
            counters.dead_lettered.fetch_add(1);
          } else {
            counters.dead_letter_failures.fetch_add(1);
            requeue(e, opts.dead_letter_retry);
            stopped.insert(e.tp);
          }
          break;
        case BrokerAction::requeue:
          requeue(e, v.delay);
          stopped.insert(e.tp);
          break;
      }
      e.done = true;
    }
    batch.clear();
    batch_messages.clear();
    commit_if_due();
  }

  void mark_settled(const Entry& e) {
    if (tracker.settle(e.tp.topic, e.tp.partition, e.offset, e.epoch)) settled_since_commit++;
    forget_seen(e.tp, e.offset);
  }

  void requeue(const Entry& e, millis after) {
    counters.requeued.fetch_add(1);
    seek_back(e.tp, e.offset, after);
  }

  void forget_seen(const TopicPartition& tp, std::int64_t offset) {
    const auto it = seen.find(tp);
    if (it == seen.end()) return;
    it->second.erase(offset);
    if (it->second.empty()) seen.erase(it);
  }

  // Writes batch message i to the dead-letter topic; false when the broker did not take it.
  bool dead_letter(std::size_t i, const std::string& reason) {
    const SourceMessage& s = batch_messages.at(i);
    const std::string topic = opts.dead_letter_topic.empty() ? s.topic + ".dlq" : opts.dead_letter_topic;
    std::vector<Header> hs;
    hs.reserve(s.headers.size());
    for (const auto& [name, value] : s.headers) hs.push_back({name, value});
    const Message m{.topic = s.topic,
                    .partition = s.partition,
                    .offset = s.offset,
                    .key = s.key,
                    .value = s.value,
                    .headers = hs,
                    .timestamp = s.timestamp};
    try {
      producer().write(topic, m, reason);
      return true;
    } catch (const std::exception& e) {
      log("kafka: dead letter for {}/{}@{} not written, retried in {} ms: {}", s.topic, s.partition, s.offset,
          opts.dead_letter_retry.count(), e.what());
      return false;
    }
  }

  DeadLetterProducer& producer() {
    if (!dlq) dlq = std::make_unique<DeadLetterProducer>(opts.brokers, opts.dead_letter_properties);
    return *dlq;
  }

  void release() {
    std::set<TopicPartition> seen_tp;
    std::size_t n = 0;
    for (const Entry& e : batch) {
      if (e.done) continue;
      ++n;
      // The batch's first unsettled message of each partition (offsets ascend in a batch).
      if (!seen_tp.insert(e.tp).second) continue;
      seek_back(e.tp, e.offset, millis{0});
    }
    counters.released.fetch_add(n);
    batch.clear();
    batch_messages.clear();
  }

  // ---- commits ------------------------------------------------------------------------------

  void commit_if_due() {
    if (pacer.due(settled_since_commit, Clock::now())) commit(/*async=*/true);
  }

  void commit(bool async) {
    settled_since_commit = 0;
    pacer.sent(Clock::now());
    const auto offsets = tracker.committables();
    if (offsets.empty() || offsets == last_committed) return;
    if (store_committables(rk, tracker) == 0) return;
    // Commits what was stored; NO_OFFSET: nothing new since the last commit.
    const auto e = rd_kafka_commit(rk, nullptr, async ? 1 : 0);
    if (e == RD_KAFKA_RESP_ERR__NO_OFFSET) return;
    counters.commits.fetch_add(1);
    if (e != RD_KAFKA_RESP_ERR_NO_ERROR)
      commit_failed(e);
    else
      last_committed = offsets;
  }

  void commit_failed(rd_kafka_resp_err_t e) {
    // Not fatal: the offsets stay stored for the next commit; at worst the partition's next owner
    // redelivers settled messages, which the guard answers as duplicates.
    counters.commit_failures.fetch_add(1);
    last_committed.clear();
    pacer.answered(e, Clock::now());
    log("kafka: commit refused: {}", rd_kafka_err2str(e));
  }

  // ---- librdkafka's callbacks (C frames: nothing may be thrown through them) -----------------

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
      self->log("kafka: rebalance callback: {}", e.what());
    } catch (...) {
    }
  }

  // Inside rd_kafka_consumer_poll (poll()) or rd_kafka_consumer_close (the destructor).
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
    last_committed.clear();
    for (const TopicPartition& tp : r.partitions) {
      if (r.assigned) {
        assigned.insert(tp);
        gone.erase(tp);
      } else if (assigned.erase(tp) > 0) {
        gone.insert(tp);  // reported once more, at 0: its next owner reports it now
      }
    }
    for (const TopicPartition& tp : r.partitions) {
      // A partition starts over from its committed offset, unpaused (handle_rebalance resumes an
      // assigned one); what was polled of it in this poll belongs to the old assignment.
      seeks.erase(tp);
      seen.erase(tp);
      drop_polled_from(tp, std::nullopt);
    }
    if (opts.on_rebalance) opts.on_rebalance(r.assigned, r.partitions.size());
  }

  SourceOptions opts;
  rd_kafka_t* rk = nullptr;
  OffsetTracker tracker;
  Counters counters;
  std::optional<std::string> fatal;  // librdkafka's fatal error: the consumer is unusable

  std::vector<SourceMessage> polled;  // the batch being polled...
  std::vector<Entry> polling;         // ...and its entries
  std::vector<Entry> batch;           // the batch handed out, until settle() or release()
  std::vector<SourceMessage> batch_messages;  // its messages (dead letters are written from them)

  std::map<TopicPartition, PendingSeek> seeks;
  std::map<TopicPartition, std::map<std::int64_t, std::uint32_t>> seen;

  // backlog(): the partitions this source owns, those it just lost, and the names its last report
  // pointed into.
  std::set<TopicPartition> assigned, gone;
  std::vector<std::string> backlog_names;
  std::uint64_t reported_rebalances = 0;

  std::size_t settled_since_commit = 0;
  CommitPacer pacer{opts.commit_interval, opts.commit_every};
  std::vector<PartitionOffset> last_committed;
  std::unique_ptr<DeadLetterProducer> dlq;
};

Source::Source(SourceOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}

Source::~Source() = default;

std::vector<SourceMessage> Source::poll() { return impl_->poll(); }

Delivery Source::delivery(const SourceMessage& m) const {
  Delivery d;
  d.id = fmt::format("{}/{}@{}", m.topic, m.partition, m.offset);
  d.key = m.key;
  d.payload = m.value;
  d.headers.reserve(m.headers.size());
  for (const auto& [name, value] : m.headers) d.headers.emplace_back(name, value);
  if (m.timestamp) d.timestamp = m.timestamp->time;
  d.attempt = m.attempt;
  return d;
}

void Source::settle(std::span<const idem::Verdict> verdicts) { impl_->settle(verdicts); }

void Source::release() { impl_->release(); }

SourceStats Source::stats() const noexcept {
  const Counters& c = impl_->counters;
  return {.polled = c.polled.load(),
          .acked = c.acked.load(),
          .requeued = c.requeued.load(),
          .dead_lettered = c.dead_lettered.load(),
          .dead_letter_failures = c.dead_letter_failures.load(),
          .skipped = c.skipped.load(),
          .released = c.released.load(),
          .rebalances = c.rebalances.load(),
          .commits = c.commits.load(),
          .commit_failures = c.commit_failures.load()};
}

std::size_t Source::pending() const { return impl_->tracker.pending(); }

std::size_t Source::pending(std::string_view topic, std::int32_t partition) const {
  return impl_->tracker.pending(topic, partition);
}

std::size_t Source::held() const { return impl_->tracker.held(); }

std::size_t Source::held(std::string_view topic, std::int32_t partition) const {
  return impl_->tracker.held(topic, partition);
}

std::vector<SourceEvent> Source::backlog() {
  Impl& i = *impl_;
  const std::uint64_t rebalances = i.counters.rebalances.load();
  const bool rebalanced = rebalances != i.reported_rebalances;
  i.reported_rebalances = rebalances;
  i.backlog_names.clear();
  i.backlog_names.reserve(i.assigned.size() + i.gone.size());
  std::vector<SourceEvent> out;
  out.reserve(i.assigned.size() + i.gone.size());
  for (const auto* set : {&i.assigned, &i.gone})
    for (const TopicPartition& tp : *set) {
      i.backlog_names.push_back(fmt::format("{}/{}", tp.topic, tp.partition));
      std::size_t pending = 0, settled_held = 0;
      if (set == &i.assigned) {
        pending = i.tracker.pending(tp.topic, tp.partition);
        const std::size_t held = i.tracker.held(tp.topic, tp.partition);  // settled or not
        settled_held = held > pending ? held - pending : 0;
      }
      out.push_back({.source = "kafka", .partition = i.backlog_names.back(), .pending = pending, .held = settled_held,
                     .rebalanced = rebalanced && out.empty()});
    }
  i.gone.clear();
  if (out.empty() && rebalanced) out.push_back({.source = "kafka", .partition = "", .rebalanced = true});
  return out;
}

const OffsetTracker& Source::tracker() const noexcept { return impl_->tracker; }

const SourceOptions& Source::options() const noexcept { return impl_->opts; }

}  // namespace idem::kafka
