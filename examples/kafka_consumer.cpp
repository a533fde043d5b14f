// kafka_consumer: a starting template for a Kafka consumer with exactly-once effects
// (librdkafka C API + IdempotencyGuard). Copy KafkaConsumer and put your logic in apply(), at
// "YOUR LOGIC GOES HERE".
//
//   idem_kafka_consumer --brokers HOST:PORT --topic payments --group payments-svc [--dlq payments.dlq]
//   idem_kafka_consumer --mock [--events 1500] [--dup-percent 20] [--partitions 4]
//
// --mock is the self-test run by CTest: it starts librdkafka's built-in mock cluster (3 brokers),
// produces payment events with duplicates (some on another partition, as a retrying producer
// would), runs one consumer, makes a second one join the group mid-run (a rebalance while the
// first holds a polled, unprocessed batch, which it must drop), and checks that every payment was
// applied exactly once, that the poison event (published twice; its first dead-letter write refused
// by the mock) is in the dead-letter topic exactly once, and that the committed offsets reached
// the end of every partition.
//
// How offsets work here (the part to keep when you adapt it):
//  * enable.auto.commit=false and enable.auto.offset.store=false: an offset is *stored* only once
//    the outcome of its message is known and says "ack" (executed, duplicate, stale, lease_lost) or
//    the message was written to the dead-letter topic (a write keyed in the guard too, so that a
//    redelivery does not write it again); stored offsets are *committed* every
//    commit_every acks / commit_interval, in the revoke callback, and at shutdown.
//  * Each poll batch goes through guard.run_batch: the handlers run in poll order (on a store with
//    a batch path, the acquisitions of the batch take one call) and every message gets the outcome
//    guard.run would give it. Then each partition's messages are settled in offset order: the
//    settled prefix (acked, or written to the dead-letter topic) has its offset stored; the first
//    message to retry (in_flight: another consumer holds the key; a handler exception; a store
//    error) pauses the partition, and after retry_after the consumer seeks back to it and resumes
//    (Kafka has no per-message nack), so nothing after it is committed before it is done. The
//    messages after it in that batch ran already: the seek back redelivers them as duplicates. So
//    within a partition a later message's effect can happen before an earlier one's retry. The
//    keys of a batch are claimed together: a consumer that dies mid-batch leaves them claimed
//    until their lease lapses, and the partition's next owner waits (in_flight) until then.
//  * Rebalance: on revoke, commit what is done and drop what was polled but not processed for the
//    revoked partitions; the new owner starts from the committed offset. Whatever was processed
//    but not committed is redelivered there and answered as a Duplicate by the guard.
//
// The guard runs on idem::MemoryStore: per-process, so it only dedupes what this process sees
// (the two consumers of --mock share it because they live in one process). With more than one
// process, construct the guard on idem::RedisStore or idem::PostgresStore instead (see the
// `Guard` alias below); nothing else changes.

#include <librdkafka/rdkafka.h>
#include <librdkafka/rdkafka_mock.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "idem/idem.hpp"

using namespace std::chrono_literals;
using SteadyClock = std::chrono::steady_clock;

namespace {

// Swap the store here: idem::IdempotencyGuard<idem::RedisStore> (shared by all consumer processes,
// include "idem/redis.hpp", link idem::redis) or idem::PostgresStore in transactional mode
// (the ledger write then goes through ctx.tx and commits with the completion).
using Store = idem::MemoryStore;
using Guard = idem::IdempotencyGuard<Store>;

std::atomic<bool> g_stop{false};
const SteadyClock::time_point g_started = SteadyClock::now();
double uptime() { return std::chrono::duration<double>(SteadyClock::now() - g_started).count(); }
extern "C" void on_signal(int) { g_stop.store(true); }

// --- the business side: a payment event and the ledger it changes ---------------------------

struct Payment {
  std::string id;  // the producer's event id: the idempotency key (not topic/partition/offset,
                   // which differ between a message and its re-published duplicate)
  std::string account;
  long amount = 0;
};

std::string encode_payment(const Payment& p) { return p.id + ";" + p.account + ";" + std::to_string(p.amount); }

std::optional<Payment> parse_payment(std::string_view s) {
  const auto a = s.find(';');
  const auto b = a == std::string_view::npos ? a : s.find(';', a + 1);
  if (b == std::string_view::npos || a == 0 || b == a + 1) return std::nullopt;
  Payment p{std::string(s.substr(0, a)), std::string(s.substr(a + 1, b - a - 1)), 0};
  const std::string amount(s.substr(b + 1));
  char* end = nullptr;
  p.amount = std::strtol(amount.c_str(), &end, 10);
  if (amount.empty() || *end != '\0') return std::nullopt;
  return p;
}

// Stands in for your database. apply() is the effect that must happen once per payment.
class Ledger {
public:
  void apply(const Payment& p) {
    if (p.amount == 0) throw std::runtime_error("payment " + p.id + " rejected: amount is zero");
    std::lock_guard lock(mu_);
    balances_[p.account] += p.amount;
    ++applied_[p.id];
    ++total_;
  }
  long total_applied() const {
    std::lock_guard lock(mu_);
    return total_;
  }
  std::unordered_map<std::string, long> balances() const {
    std::lock_guard lock(mu_);
    return balances_;
  }
  int times_applied(const std::string& id) const {
    std::lock_guard lock(mu_);
    auto it = applied_.find(id);
    return it == applied_.end() ? 0 : it->second;
  }

private:
  mutable std::mutex mu_;
  std::unordered_map<std::string, long> balances_;
  std::unordered_map<std::string, int> applied_;
  long total_ = 0;
};

// --- the consumer template --------------------------------------------------------------------

struct Settings {
  std::string brokers;
  std::string topic = "payments";
  std::string group = "payments-svc";
  std::string dlq_topic;  // empty = <topic>.dlq
  std::string client_id = "idem-consumer";
  int batch = 64;  // messages polled before processing them (tune with latency)
  // How long to wait for a batch to fill (0 = process whatever is queued at once). Longer
  // batches amortise commits; a rebalance can then arrive while a batch is being collected.
  idem::millis batch_linger{0};
  int commit_every = 200;               // commit stored offsets after this many acks ...
  idem::millis commit_interval{1'000};  // ... or this long, whichever comes first
  idem::millis min_retry{50};           // floor of the pause before seeking back to a requeued message
  // Ceiling of that pause. An in_flight outcome's retry_after is the holder's whole remaining
  // lease (30 s here), but most holders finish far sooner and the retry then answers Duplicate;
  // the whole partition waits meanwhile. (GuardOptions::wait_for_in_flight is the other knob.)
  idem::millis max_retry{1'000};
  idem::millis handler_delay{0};             // --mock only: simulated work per message
  // SELF-TEST KNOB (--mock only; leave it null in a service). When the flag reads 1, the consumer
  // holds its next polled batch unprocessed until the group revokes its partitions (bounded), so
  // that the drop-after-revoke path of process() runs on every self-test instead of by luck.
  // It sets the flag to 2 while holding and 3 once done.
  std::atomic<int>* selftest_hold_batch = nullptr;
  std::map<std::string, std::string> extra;  // more librdkafka properties
};

struct Stats {
  std::atomic<long> delivered{0}, executed{0}, duplicates{0}, stale{0}, requeued{0}, handler_errors{0},
      dead_lettered{0}, dead_letters_deduped{0}, dead_letter_failures{0}, dropped_after_revoke{0}, rebalances{0},
      commits{0}, commit_failures{0};
};

using PartitionList =
    std::unique_ptr<rd_kafka_topic_partition_list_t, decltype(&rd_kafka_topic_partition_list_destroy)>;
PartitionList make_list(int size) {
  return {rd_kafka_topic_partition_list_new(size), &rd_kafka_topic_partition_list_destroy};
}

void set_conf(rd_kafka_conf_t* conf, const std::string& name, const std::string& value) {
  char err[512];
  if (rd_kafka_conf_set(conf, name.c_str(), value.c_str(), err, sizeof err) != RD_KAFKA_CONF_OK)
    throw std::runtime_error("kafka config " + name + "=" + value + ": " + err);
}

class KafkaConsumer {
public:
  /// Called after each stored offset (partition, next offset); --mock uses it to know when all is done.
  using AckHook = std::function<void(std::int32_t, std::int64_t)>;
  /// Called at the end of each rebalance callback: (assigned, partitions in the event); --mock uses it
  /// to change the group's membership only while the group is settled.
  using RebalanceHook = std::function<void(bool, int)>;

  KafkaConsumer(Settings s, Guard& guard, Ledger& ledger, Stats& stats, AckHook on_ack = {},
                RebalanceHook on_rebalance = {})
      : s_(std::move(s)),
        guard_(guard),
        dlq_guard_(guard.store(), dead_letter_options(guard.options())),
        ledger_(ledger),
        stats_(stats),
        on_ack_(std::move(on_ack)),
        on_rebalance_(std::move(on_rebalance)) {
    if (s_.dlq_topic.empty()) s_.dlq_topic = s_.topic + ".dlq";
    rd_kafka_conf_t* conf = rd_kafka_conf_new();
    set_conf(conf, "bootstrap.servers", s_.brokers);
    set_conf(conf, "group.id", s_.group);
    set_conf(conf, "client.id", s_.client_id);
    // The two settings this template is about: nothing is committed that has no known outcome.
    set_conf(conf, "enable.auto.commit", "false");
    set_conf(conf, "enable.auto.offset.store", "false");
    set_conf(conf, "auto.offset.reset", "earliest");
    // TUNE: max.poll.interval.ms must exceed your slowest batch (batch x worst handler time), or the
    // group evicts this consumer mid-batch; session.timeout.ms / heartbeat.interval.ms decide how
    // fast a dead consumer's partitions move. partition.assignment.strategy=cooperative-sticky
    // moves only the partitions that change owner (the rebalance callback handles both protocols).
    set_conf(conf, "max.poll.interval.ms", "300000");
    for (const auto& [k, v] : s_.extra) set_conf(conf, k, v);
    rd_kafka_conf_set_rebalance_cb(conf, &KafkaConsumer::rebalance_cb);
    rd_kafka_conf_set_offset_commit_cb(conf, &KafkaConsumer::commit_cb);
    rd_kafka_conf_set_opaque(conf, this);
    char err[512];
    rk_ = rd_kafka_new(RD_KAFKA_CONSUMER, conf, err, sizeof err);
    if (!rk_) {
      rd_kafka_conf_destroy(conf);
      throw std::runtime_error(std::string("kafka consumer: ") + err);
    }
    rd_kafka_poll_set_consumer(rk_);
    auto topics = make_list(1);
    rd_kafka_topic_partition_list_add(topics.get(), s_.topic.c_str(), RD_KAFKA_PARTITION_UA);
    if (auto e = rd_kafka_subscribe(rk_, topics.get()))
      throw std::runtime_error(std::string("kafka subscribe: ") + rd_kafka_err2str(e));
  }
  KafkaConsumer(const KafkaConsumer&) = delete;
  KafkaConsumer& operator=(const KafkaConsumer&) = delete;
  ~KafkaConsumer() {
    if (rk_) rd_kafka_destroy(rk_);
    if (dlq_) rd_kafka_destroy(dlq_);
  }

  /// The consumer loop: poll a batch, process it, commit; until keep_going() says no or a signal.
  /// Then commits what is done and leaves the group.
  void run(const std::function<bool()>& keep_going) {
    std::vector<Polled> batch;
    batch.reserve(static_cast<std::size_t>(s_.batch));
    while (!g_stop.load() && keep_going()) {
      resume_due_retries();
      batch.clear();
      const auto linger_end = SteadyClock::now() + s_.batch_linger;
      for (int i = 0; i < s_.batch; ++i) {
        // A rebalance callback runs inside this poll (which then returns no message, ending the
        // batch); messages already taken for the revoked partitions are dropped by process().
        const auto left = std::chrono::duration_cast<idem::millis>(linger_end - SteadyClock::now()).count();
        rd_kafka_message_t* m = rd_kafka_consumer_poll(rk_, i == 0 ? 100 : static_cast<int>(std::max<long>(0, left)));
        if (!m) break;
        batch.push_back({m, m->err ? 0 : epoch_of(m->partition)});
      }
      if (s_.selftest_hold_batch) selftest_hold_until_revoke(batch);
      process(batch);
      for (auto& p : batch) rd_kafka_message_destroy(p.msg);
      if (uncommitted_ > 0 &&
          (uncommitted_ >= s_.commit_every || SteadyClock::now() - last_commit_ >= s_.commit_interval))
        commit(/*async=*/true);
    }
    commit(/*async=*/false);
    rd_kafka_consumer_close(rk_);  // leaves the group: revoke callback, then its partitions move
  }

private:
  struct Polled {
    rd_kafka_message_t* msg;
    std::uint64_t epoch;  // the partition's assignment epoch when the message was polled
  };
  struct PartitionState {
    bool owned = false;
    std::uint64_t epoch = 0;                   // bumped on every assign / revoke / seek of the partition
    std::optional<std::int64_t> retry_offset;  // paused: seek back here at retry_due, then resume
    SteadyClock::time_point retry_due{};
  };

  // SELF-TEST ONLY (see Settings::selftest_hold_batch): a service never waits like this. Polling
  // goes on meanwhile (it serves the rebalance callback and heartbeats); whatever it returns joins
  // the held batch, with the epoch of its partition at that moment, as a normal poll would.
  void selftest_hold_until_revoke(std::vector<Polled>& batch) {
    const bool has_message = std::any_of(batch.begin(), batch.end(), [](const Polled& p) { return !p.msg->err; });
    int requested = 1;
    if (!has_message || !s_.selftest_hold_batch->compare_exchange_strong(requested, 2)) return;
    const long seen = revokes_;
    const auto give_up = SteadyClock::now() + 20s;  // the self-test then fails on "dropped after revoke"
    while (revokes_ == seen && !g_stop.load() && SteadyClock::now() < give_up) {
      if (rd_kafka_message_t* m = rd_kafka_consumer_poll(rk_, 100))
        batch.push_back({m, m->err ? 0 : epoch_of(m->partition)});
    }
    std::fprintf(stderr, "[%s] %.2fs self-test: held %zu polled messages through %s\n", s_.client_id.c_str(),
                 uptime(), batch.size(), revokes_ == seen ? "NO revoke (gave up)" : "a revoke");
    s_.selftest_hold_batch->store(3);
  }

  std::uint64_t epoch_of(std::int32_t partition) {
    auto it = parts_.find(partition);
    return it == parts_.end() ? 0 : it->second.epoch;
  }

  // ---- YOUR LOGIC GOES HERE. It runs at most once per payment id (see docs/guarantees.md for the
  // crash window between the effect and the completion; ctx.fence can fence downstream writes).
  // The value returned is recorded and replayed to duplicates (out.value).
  long apply(const Payment& pay, const idem::Context& ctx) {
    if (s_.handler_delay > idem::millis{0}) std::this_thread::sleep_for(s_.handler_delay);
    ledger_.apply(pay);
    return static_cast<long>(ctx.fence);
  }

  static std::string_view value_of(const rd_kafka_message_t* m) {
    return {static_cast<const char*>(m->payload), m->len};
  }

  // One poll batch: guard.run_batch over its payments, then each partition settled in offset order.
  void process(const std::vector<Polled>& batch) {
    struct Message {
      const rd_kafka_message_t* msg;
      std::optional<Payment> pay;  // nothing: unparsable, dead-lettered without running
      std::size_t item = 0;        // its index in `items` (when pay)
    };
    std::vector<Message> todo;
    for (const Polled& p : batch) {
      const rd_kafka_message_t* m = p.msg;
      if (m->err) {
        if (m->err != RD_KAFKA_RESP_ERR__PARTITION_EOF)
          std::fprintf(stderr, "[%s] consumer error: %s\n", s_.client_id.c_str(), rd_kafka_message_errstr(m));
        continue;
      }
      auto it = parts_.find(m->partition);
      if (it == parts_.end() || !it->second.owned || it->second.epoch != p.epoch) {
        // Revoked (or sought back) after this message was polled: drop it. Its offset was not
        // stored, so whoever owns the partition now receives it again from the committed offset.
        stats_.dropped_after_revoke.fetch_add(1);
        continue;
      }
      if (it->second.retry_offset) continue;  // the partition waits to seek back before this message
      stats_.delivered.fetch_add(1);
      todo.push_back({m, parse_payment(value_of(m))});
    }
    std::vector<idem::BatchItem> items;  // key = the payment id; the whole value is fingerprinted
    std::vector<const Payment*> pays;    // pays[k] is the payment of items[k]
    for (Message& t : todo) {
      if (!t.pay) continue;
      t.item = items.size();
      items.push_back({t.pay->id, value_of(t.msg)});
      pays.push_back(&*t.pay);
    }

    std::optional<idem::BatchOutcome<long>> res;
    std::exception_ptr batch_error;  // the batch as a whole failed: nothing ran
    if (!items.empty()) {
      try {
        res = guard_.run_batch(items, [&](const idem::BatchItem& item, const idem::Context& ctx) {
          return apply(*pays[static_cast<std::size_t>(&item - items.data())], ctx);  // item is items[k] itself
        });
      } catch (...) {
        batch_error = std::current_exception();
      }
    }

    // Per partition, in offset order: the settled prefix is stored, the first retry stops it.
    struct Prefix {
      const rd_kafka_message_t* last = nullptr;  // its offset + 1 is stored
      int messages = 0;
    };
    std::map<std::int32_t, Prefix> settled;
    for (const Message& t : todo) {
      const rd_kafka_message_t* m = t.msg;
      if (parts_[m->partition].retry_offset) continue;  // after a retry in this batch: redelivered by the seek back
      std::optional<idem::millis> retry;
      if (!t.pay)  // can never succeed: straight to the dead-letter topic, keyed on the message's coordinates
        retry = dead_letter(m, s_.topic + "/" + std::to_string(m->partition) + "@" + std::to_string(m->offset),
                            "unparsable payload");
      else if (!res)
        retry = pause_after(batch_error, t.pay->id);
      else
        retry = settle(*res, t.item, m, *t.pay);
      if (retry) {
        retry_later(m, *retry);
        continue;
      }
      Prefix& prefix = settled[m->partition];
      prefix.last = m;
      ++prefix.messages;
    }
    for (const auto& [partition, prefix] : settled) store_offset(prefix.last, prefix.messages);
  }

  // Message m's run in the batch: nothing (settled: acked or dead-lettered) or the pause before
  // seeking back to it.
  std::optional<idem::millis> settle(const idem::BatchOutcome<long>& res, std::size_t k, const rd_kafka_message_t* m,
                                     const Payment& pay) {
    if (!res.errors[k]) {
      const idem::Outcome<long>& out = res.outcomes[k];
      switch (out.status) {
        case idem::Status::executed: stats_.executed.fetch_add(1); break;
        case idem::Status::duplicate: stats_.duplicates.fetch_add(1); break;
        case idem::Status::stale: stats_.stale.fetch_add(1); break;
        case idem::Status::lease_lost:  // the handler ran but another holder took the key over: ack, and alert
          std::fprintf(stderr, "[%s] lease lost on %s: the handler outlived its lease\n", s_.client_id.c_str(),
                       pay.id.c_str());
          break;
        default: break;
      }
    }
    // Broker action per outcome:
    //   executed / duplicate / stale / lease_lost -> ack = its offset may be stored (commit follows)
    //   in_flight, an exception                   -> pause, seek back after the pause, resume
    //   previously_failed / mismatch              -> write to the dead-letter topic, then ack
    switch (res.action(k)) {
      case idem::BrokerAction::ack: return std::nullopt;
      case idem::BrokerAction::requeue:
        if (res.errors[k]) return pause_after(res.errors[k], pay.id);
        return std::min(res.outcomes[k].retry_after, s_.max_retry);
      case idem::BrokerAction::dead_letter: {
        // Keyed on the payload too: each distinct payload reusing an id is its own dead letter.
        const idem::Outcome<long>& out = res.outcomes[k];
        std::string why = out.status == idem::Status::mismatch ? "payload differs from the first delivery of this id"
                                                               : "failed permanently: " + out.error;
        if (res.errors[k]) {  // no redelivery can help (a bad key): idem::action_of said so
          try {
            std::rethrow_exception(res.errors[k]);
          } catch (const std::exception& x) {
            why = x.what();
          }
        }
        return dead_letter(m, pay.id + ":" + idem::fingerprint(value_of(m)), why);
      }
    }
    return s_.max_retry;
  }

  // The pause before retrying a message whose run threw.
  idem::millis pause_after(const std::exception_ptr& e, const std::string& id) {
    try {
      std::rethrow_exception(e);
    } catch (const idem::error& x) {
      // The store failed (retryable) or a record cannot be read (not retryable: investigate).
      // Either way the handler did not run to a recorded end: never store the offset.
      std::fprintf(stderr, "[%s] idem error on %s: %s\n", s_.client_id.c_str(), id.c_str(), x.what());
      return x.retryable() ? idem::millis{1'000} : idem::millis{30'000};
    } catch (...) {
      // The handler threw: the guard recorded it per its failure policy (retry with backoff, then
      // previously_failed -> dead letter). Retry the message after a short pause.
      stats_.handler_errors.fetch_add(1);
      return s_.min_retry;
    }
  }

  // Stores the offset after m, the last of `acked` messages of its partition that are done.
  void store_offset(const rd_kafka_message_t* m, int acked) {
    auto list = make_list(1);
    rd_kafka_topic_partition_list_add(list.get(), rd_kafka_topic_name(m->rkt), m->partition)->offset = m->offset + 1;
    // Fails only if the partition was revoked meanwhile; the new owner then redelivers it (a Duplicate).
    if (rd_kafka_offsets_store(rk_, list.get()) != RD_KAFKA_RESP_ERR_NO_ERROR) return;
    uncommitted_ += acked;
    if (on_ack_) on_ack_(m->partition, m->offset + 1);
  }

  // Kafka has no per-message nack: stop the partition at this message and come back to it.
  void retry_later(const rd_kafka_message_t* m, idem::millis after) {
    stats_.requeued.fetch_add(1);
    PartitionState& ps = parts_[m->partition];
    ps.retry_offset = m->offset;
    ps.retry_due = SteadyClock::now() + std::max(after, s_.min_retry);
    auto list = make_list(1);
    rd_kafka_topic_partition_list_add(list.get(), rd_kafka_topic_name(m->rkt), m->partition);
    rd_kafka_pause_partitions(rk_, list.get());
  }

  void resume_due_retries() {
    const auto now = SteadyClock::now();
    for (auto& [partition, ps] : parts_) {
      if (!ps.owned || !ps.retry_offset || ps.retry_due > now) continue;
      auto list = make_list(1);
      rd_kafka_topic_partition_list_add(list.get(), s_.topic.c_str(), partition)->offset = *ps.retry_offset;
      rd_kafka_error_t* err = rd_kafka_seek_partitions(rk_, list.get(), 5'000);
      if (err || list->elems[0].err) {
        if (err) rd_kafka_error_destroy(err);
        ps.retry_due = now + s_.min_retry;  // try the seek again shortly; stay paused meanwhile
        continue;
      }
      rd_kafka_resume_partitions(rk_, list.get());
      ps.retry_offset.reset();
      ++ps.epoch;  // anything polled before the seek is outdated
    }
  }

  // The dead-letter write goes through the guard under its own key ("dlq:" + key), because storing
  // the offset after it is no guarantee: the commit can be refused (a rebalance) and the partition's
  // next owner then redelivers the message, which ends up here again; without the key it would be
  // dead-lettered twice. With it, that redelivery answers Duplicate and only stores the offset.
  // (Left open, as for any effect: the DLQ write acked but the store down before the completion.)
  // Returns nothing once the dead letter is written (now or by an earlier delivery): the message
  // is then settled; otherwise the pause before retrying the message.
  std::optional<idem::millis> dead_letter(const rd_kafka_message_t* m, const std::string& key,
                                          const std::string& reason) {
    try {
      auto out = dlq_guard_.run("dlq:" + key, [&] { write_dead_letter(m, reason); });
      switch (out.action()) {
        case idem::BrokerAction::ack:  // executed: written now; duplicate: by an earlier delivery
          (out.status == idem::Status::duplicate ? stats_.dead_letters_deduped : stats_.dead_lettered).fetch_add(1);
          return std::nullopt;
        case idem::BrokerAction::requeue:  // another consumer is writing it right now
          return std::min(out.retry_after, s_.max_retry);
        case idem::BrokerAction::dead_letter:  // not with FailureMode::release and no fingerprint
          break;
      }
      std::fprintf(stderr, "[%s] dead-letter key %s: %s\n", s_.client_id.c_str(), key.c_str(),
                   std::string(idem::to_string(out.status)).c_str());
      return idem::millis{30'000};
    } catch (const std::exception& e) {
      // The write failed (the key is released: see dead_letter_options) or the store did: either
      // way nothing is stored, and the message comes back here after the pause.
      stats_.dead_letter_failures.fetch_add(1);
      std::fprintf(stderr, "[%s] dead letter for %s not written (%s); retrying the message later\n",
                   s_.client_id.c_str(), key.c_str(), e.what());
      return idem::millis{1'000};
    }
  }


  // The guard for dead-letter writes: the consumer's options, but a failed write must release its
  // key at once so the retry can write it. The consumer's own policy (record: backoff, then
  // permanent after max_attempts) would answer in_flight meanwhile and finally previously_failed,
  // i.e. a dead letter that is never written.
  static idem::GuardOptions dead_letter_options(idem::GuardOptions o) {
    o.failure = {.mode = idem::FailureMode::release};
    return o;
  }

  // Writes the message to the dead-letter topic and waits for the broker's ack (flush), so that the
  // guard records the write only once it is durable; throws if it is not.
  void write_dead_letter(const rd_kafka_message_t* m, const std::string& reason) {
    if (!dlq_) {
      rd_kafka_conf_t* conf = rd_kafka_conf_new();
      set_conf(conf, "bootstrap.servers", s_.brokers);
      set_conf(conf, "enable.idempotence", "true");
      rd_kafka_conf_set_dr_msg_cb(conf, [](rd_kafka_t*, const rd_kafka_message_t* dm, void* opaque) {
        static_cast<KafkaConsumer*>(opaque)->dlq_err_ = dm->err;
      });
      rd_kafka_conf_set_opaque(conf, this);
      char err[512];
      dlq_ = rd_kafka_new(RD_KAFKA_PRODUCER, conf, err, sizeof err);
      if (!dlq_) {
        rd_kafka_conf_destroy(conf);
        throw std::runtime_error(std::string("kafka dlq producer: ") + err);
      }
    }
    dlq_err_ = RD_KAFKA_RESP_ERR__IN_PROGRESS;
    rd_kafka_resp_err_t e =
        rd_kafka_producev(dlq_, RD_KAFKA_V_TOPIC(s_.dlq_topic.c_str()), RD_KAFKA_V_KEY(m->key, m->key_len),
                          RD_KAFKA_V_VALUE(m->payload, m->len),
                          RD_KAFKA_V_HEADER("idem-reason", reason.data(), static_cast<ssize_t>(reason.size())),
                          RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY), RD_KAFKA_V_END);
    if (e == RD_KAFKA_RESP_ERR_NO_ERROR) e = rd_kafka_flush(dlq_, 10'000);
    if (e == RD_KAFKA_RESP_ERR_NO_ERROR) e = dlq_err_.load();
    if (e != RD_KAFKA_RESP_ERR_NO_ERROR) throw std::runtime_error(std::string("dlq write: ") + rd_kafka_err2str(e));
  }

  void commit(bool async) {
    // Commits the offsets stored so far (NO_OFFSET = nothing new to commit).
    const rd_kafka_resp_err_t e = rd_kafka_commit(rk_, nullptr, async ? 1 : 0);
    if (e != RD_KAFKA_RESP_ERR_NO_ERROR && e != RD_KAFKA_RESP_ERR__NO_OFFSET) {
      stats_.commit_failures.fetch_add(1);
      std::fprintf(stderr, "[%s] commit failed: %s\n", s_.client_id.c_str(), rd_kafka_err2str(e));
    } else {
      stats_.commits.fetch_add(1);
    }
    uncommitted_ = 0;
    last_commit_ = SteadyClock::now();
  }

  static void commit_cb(rd_kafka_t*, rd_kafka_resp_err_t err, rd_kafka_topic_partition_list_t*, void* opaque) {
    // Async commit errors are not fatal: the offsets stay stored and the next commit carries them;
    // at worst a rebalance redelivers messages that were done, and the guard answers Duplicate.
    if (err != RD_KAFKA_RESP_ERR_NO_ERROR && err != RD_KAFKA_RESP_ERR__NO_OFFSET) {
      auto* self = static_cast<KafkaConsumer*>(opaque);
      self->stats_.commit_failures.fetch_add(1);
      std::fprintf(stderr, "[%s] async commit: %s\n", self->s_.client_id.c_str(), rd_kafka_err2str(err));
    }
  }

  static void rebalance_cb(rd_kafka_t*, rd_kafka_resp_err_t err, rd_kafka_topic_partition_list_t* parts, void* opaque) {
    static_cast<KafkaConsumer*>(opaque)->on_rebalance(err, parts);
  }

  // Runs inside rd_kafka_consumer_poll on the consumer thread, possibly while a batch is half done.
  void on_rebalance(rd_kafka_resp_err_t err, rd_kafka_topic_partition_list_t* parts) {
    stats_.rebalances.fetch_add(1);
    std::string names;
    for (int i = 0; i < parts->cnt; ++i) names += (i ? "," : "") + std::to_string(parts->elems[i].partition);
    // rd_kafka_consumer_close() can serve a rebalance event *after* the consumer group has
    // terminated: a revoke queued by a rebalance that another member started (its join or
    // LeaveGroup) just before this consumer began to close. librdkafka (seen with 2.0.2) has then
    // dropped the assignment itself and shut the group's ops queue down: rd_kafka_rebalance_protocol()
    // returns NULL (strcmp on it was a SIGSEGV), and every call that round-trips through that queue
    // (rd_kafka_assign, a sync rd_kafka_commit) fails or, if its request was purged, never returns.
    // Nothing is owned any more: forget the partitions and call nothing else. (Served *just before*
    // the group terminates, librdkafka itself can still hang or abort: run_mock avoids closing a
    // consumer while its group rebalances; a service should do the same where it can.)
    const char* protocol = rd_kafka_consumer_closed(rk_) ? nullptr : rd_kafka_rebalance_protocol(rk_);
    std::fprintf(stderr, "[%s] %.2fs %s partitions [%s]%s\n", s_.client_id.c_str(), uptime(),
                 err == RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS ? "assigned" : "revoked", names.c_str(),
                 protocol ? "" : " (group already closed)");
    if (!protocol) {
      ++revokes_;
      for (auto& [partition, ps] : parts_) {
        ps.owned = false;
        ++ps.epoch;
        ps.retry_offset.reset();
      }
      if (on_rebalance_) on_rebalance_(false, 0);
      return;
    }
    const bool cooperative = std::strcmp(protocol, "COOPERATIVE") == 0;
    if (err == RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS) {
      for (int i = 0; i < parts->cnt; ++i) {
        PartitionState& ps = parts_[parts->elems[i].partition];
        ps.owned = true;
        ++ps.epoch;
        ps.retry_offset.reset();  // a fresh assignment starts from the committed offset anyway
      }
      if (cooperative) {
        if (rd_kafka_error_t* e = rd_kafka_incremental_assign(rk_, parts)) rd_kafka_error_destroy(e);
      } else {
        rd_kafka_assign(rk_, parts);
      }
      // A partition paused for a retry before it was revoked must not stay paused once it is back.
      rd_kafka_resume_partitions(rk_, parts);
      if (on_rebalance_) on_rebalance_(true, parts->cnt);
      return;
    }
    // Revoked (or lost, or an error): commit what is done while we still own the partitions —
    // unless the assignment is already lost (session timed out), when the commit would be
    // refused — then forget the rest: process() drops the polled messages of these partitions.
    // (librdkafka's mock cluster refuses commits while the group rebalances — real brokers accept
    // them from the old generation — so --mock logs "rebalance in progress" here: the next owner
    // then redelivers those messages and the guard answers Duplicate.)
    if (err == RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS && !rd_kafka_assignment_lost(rk_)) commit(/*async=*/false);
    ++revokes_;
    for (int i = 0; i < parts->cnt; ++i) {
      PartitionState& ps = parts_[parts->elems[i].partition];
      ps.owned = false;
      ++ps.epoch;
      ps.retry_offset.reset();
    }
    if (cooperative) {
      if (rd_kafka_error_t* e = rd_kafka_incremental_unassign(rk_, parts)) rd_kafka_error_destroy(e);
    } else {
      rd_kafka_assign(rk_, nullptr);
    }
    if (on_rebalance_) on_rebalance_(false, parts->cnt);
  }

  Settings s_;
  Guard& guard_;
  Guard dlq_guard_;  // same store, its own failure policy: see dead_letter_options()
  Ledger& ledger_;
  Stats& stats_;
  AckHook on_ack_;
  RebalanceHook on_rebalance_;
  rd_kafka_t* rk_ = nullptr;
  rd_kafka_t* dlq_ = nullptr;
  std::atomic<rd_kafka_resp_err_t> dlq_err_{RD_KAFKA_RESP_ERR_NO_ERROR};  // set by the DLQ producer's delivery report
  std::map<std::int32_t, PartitionState> parts_;                          // touched only on the consumer thread
  int uncommitted_ = 0;
  long revokes_ = 0;  // revoke callbacks served so far (consumer thread only)
  SteadyClock::time_point last_commit_ = SteadyClock::now();
};

// --- command line -------------------------------------------------------------------------------

std::string arg(int argc, char** argv, const char* name, const std::string& dflt) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == name) return argv[i + 1];
  return dflt;
}
bool flag(int argc, char** argv, const char* name) {
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == name) return true;
  return false;
}

// TUNE: lease above the handler's worst case (or heartbeat = true); retention above the longest
// redelivery horizon (consumer lag, replays from the DLQ); failure policy: how many attempts a
// failing payment gets before it is dead-lettered.
idem::GuardOptions guard_options(std::shared_ptr<idem::Observer> obs, idem::millis backoff) {
  idem::GuardOptions o;
  o.lease = 30s;
  o.retention = std::chrono::hours{24 * 7};
  o.failure = {.mode = idem::FailureMode::record, .max_attempts = 3, .backoff = backoff, .max_backoff = 60s};
  o.observer = std::move(obs);
  return o;
}

int run_real(int argc, char** argv) {
  Settings s;
  s.brokers = arg(argc, argv, "--brokers", "");
  s.topic = arg(argc, argv, "--topic", s.topic);
  s.group = arg(argc, argv, "--group", s.group);
  s.dlq_topic = arg(argc, argv, "--dlq", "");
  if (s.brokers.empty()) {
    std::fprintf(stderr,
                 "usage: idem_kafka_consumer --brokers HOST:PORT [--topic T] [--group G] [--dlq T]\n"
                 "       idem_kafka_consumer --mock [--events N] [--dup-percent P] [--partitions N]\n");
    return 2;
  }
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  Store store;
  Guard guard(store, guard_options(nullptr, 1s));
  Ledger ledger;
  Stats stats;
  KafkaConsumer consumer(s, guard, ledger, stats);
  consumer.run([] { return true; });
  std::printf("executed %ld, duplicates %ld, dead-lettered %ld\n", stats.executed.load(), stats.duplicates.load(),
              stats.dead_lettered.load());
  return 0;
}

// --- the --mock self-test -----------------------------------------------------------------------

int run_mock(int argc, char** argv) {
  const int events = std::stoi(arg(argc, argv, "--events", "1500"));
  const int dup_percent = std::stoi(arg(argc, argv, "--dup-percent", "20"));
  const int partitions = std::stoi(arg(argc, argv, "--partitions", "4"));
  const auto time_limit = std::chrono::seconds(std::stoi(arg(argc, argv, "--time-limit", "45")));
  if (events < 10 || dup_percent < 0 || dup_percent > 100 || partitions < 2) {
    std::fprintf(stderr, "--mock needs --events >= 10, --dup-percent 0..100, --partitions >= 2\n");
    return 2;
  }
  const std::string topic = "payments";
  const auto t0 = SteadyClock::now();

  // The mock cluster lives inside this producer handle and dies with it.
  char err[512];
  rd_kafka_conf_t* pconf = rd_kafka_conf_new();
  set_conf(pconf, "test.mock.num.brokers", "3");
  set_conf(pconf, "linger.ms", "5");
  set_conf(pconf, "enable.idempotence", "true");
  std::atomic<long> delivery_errors{0};
  rd_kafka_conf_set_dr_msg_cb(pconf, [](rd_kafka_t*, const rd_kafka_message_t* m, void* opaque) {
    if (m->err) static_cast<std::atomic<long>*>(opaque)->fetch_add(1);
  });
  rd_kafka_conf_set_opaque(pconf, &delivery_errors);
  rd_kafka_t* producer = rd_kafka_new(RD_KAFKA_PRODUCER, pconf, err, sizeof err);
  if (!producer) {
    std::fprintf(stderr, "mock producer: %s\n", err);
    return 1;
  }
  rd_kafka_mock_cluster_t* mc = rd_kafka_handle_mock_cluster(producer);
  if (!mc) {
    std::fprintf(stderr, "librdkafka did not create the mock cluster\n");
    rd_kafka_destroy(producer);
    return 1;
  }
  const std::string bootstraps = rd_kafka_mock_cluster_bootstraps(mc);
  rd_kafka_mock_topic_create(mc, topic.c_str(), partitions, 3);
  rd_kafka_mock_topic_create(mc, (topic + ".dlq").c_str(), 1, 3);

  // Payments: 40 accounts, amounts 1..999; one poison payment (amount 0: the ledger rejects it).
  // dup-percent of them are published twice: half on the same partition later, half on another
  // partition, as a producer retrying after a timeout against a changed partitioner would.
  std::mt19937 rng(2026);
  std::vector<Payment> pays;
  std::unordered_map<std::string, long> expected;
  for (int i = 0; i < events; ++i) {
    Payment p{"pay-" + std::to_string(i), "acct-" + std::to_string(rng() % 40), 1 + static_cast<long>(rng() % 999)};
    if (i == events / 2)
      p.amount = 0;
    else
      expected[p.account] += p.amount;
    pays.push_back(std::move(p));
  }
  struct Out {
    std::size_t pay;
    std::int32_t partition;
  };
  std::vector<Out> outbox;
  for (std::size_t i = 0; i < pays.size(); ++i) {
    const auto home =
        static_cast<std::int32_t>(std::hash<std::string>{}(pays[i].account) % static_cast<std::size_t>(partitions));
    outbox.push_back({i, home});
    if (pays[i].amount == 0) {
      // The poison always twice, on two partitions: both copies end up dead-lettered and the
      // second must find its dead letter already written (the topic must hold exactly one).
      outbox.push_back({i, static_cast<std::int32_t>((home + 1) % partitions)});
      continue;
    }
    if (static_cast<int>(rng() % 100) < dup_percent) {
      const bool elsewhere = rng() % 2 == 0;
      outbox.push_back({i, elsewhere ? static_cast<std::int32_t>((home + 1) % partitions) : home});
    }
  }
  std::shuffle(outbox.begin(), outbox.end(), rng);
  for (const Out& o : outbox) {
    const std::string value = encode_payment(pays[o.pay]);
    const std::string& key = pays[o.pay].account;
    rd_kafka_resp_err_t e;
    while ((e = rd_kafka_producev(
                producer, RD_KAFKA_V_TOPIC(topic.c_str()), RD_KAFKA_V_PARTITION(o.partition),
                RD_KAFKA_V_KEY(key.data(), key.size()), RD_KAFKA_V_VALUE(const_cast<char*>(value.data()), value.size()),
                RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY), RD_KAFKA_V_END)) == RD_KAFKA_RESP_ERR__QUEUE_FULL)
      rd_kafka_poll(producer, 10);
    if (e) {
      std::fprintf(stderr, "produce: %s\n", rd_kafka_err2str(e));
      rd_kafka_destroy(producer);
      return 1;
    }
  }
  if (rd_kafka_flush(producer, 15'000) != RD_KAFKA_RESP_ERR_NO_ERROR || delivery_errors.load() != 0) {
    std::fprintf(stderr, "mock produce did not complete (%ld delivery errors)\n", delivery_errors.load());
    rd_kafka_destroy(producer);
    return 1;
  }
  std::vector<std::int64_t> end_offsets(static_cast<std::size_t>(partitions), 0);
  for (int p = 0; p < partitions; ++p) {
    std::int64_t lo = 0, hi = 0;
    if (rd_kafka_query_watermark_offsets(producer, topic.c_str(), p, &lo, &hi, 5'000) != RD_KAFKA_RESP_ERR_NO_ERROR) {
      std::fprintf(stderr, "watermarks of partition %d unavailable\n", p);
      rd_kafka_destroy(producer);
      return 1;
    }
    end_offsets[static_cast<std::size_t>(p)] = hi;
  }

  std::fprintf(stderr, "[mock] %.2fs produced %zu messages\n", uptime(), outbox.size());
  // The first dead-letter write is refused (from here on only the DLQ producer sends Produce,
  // ApiKey 0): its guard run must end with the key released, so that a retry writes it.
  rd_kafka_mock_push_request_errors(mc, 0, 1, RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE);

  // Shared by both consumers (one process): see the note on MemoryStore at the top.
  Store store;
  auto obs = std::make_shared<idem::CountingObserver>();
  Guard guard(store, guard_options(obs, 20ms));
  Ledger ledger;
  Stats stats;
  std::mutex progress_mu;
  std::vector<std::int64_t> acked_to(static_cast<std::size_t>(partitions), 0);
  auto on_ack = [&](std::int32_t p, std::int64_t next) {
    std::lock_guard lock(progress_mu);
    auto& a = acked_to[static_cast<std::size_t>(p)];
    a = std::max(a, next);
  };
  auto all_acked = [&] {
    std::lock_guard lock(progress_mu);
    return acked_to == end_offsets;
  };
  // Committed offsets, read back from the group coordinator with a separate handle.
  rd_kafka_conf_t* vconf = rd_kafka_conf_new();
  set_conf(vconf, "bootstrap.servers", bootstraps);
  set_conf(vconf, "group.id", "idem-kafka-mock");
  rd_kafka_t* verifier = rd_kafka_new(RD_KAFKA_CONSUMER, vconf, err, sizeof err);
  if (!verifier) {
    rd_kafka_conf_destroy(vconf);
    std::fprintf(stderr, "verifier: %s\n", err);
    rd_kafka_destroy(producer);
    return 1;
  }
  auto committed_at_end = [&](bool report) {
    auto list = make_list(partitions);
    for (int p = 0; p < partitions; ++p) rd_kafka_topic_partition_list_add(list.get(), topic.c_str(), p);
    if (rd_kafka_committed(verifier, list.get(), 5'000) != RD_KAFKA_RESP_ERR_NO_ERROR) return false;
    bool ok = true;
    for (int p = 0; p < partitions; ++p) {
      if (list->elems[p].offset == end_offsets[static_cast<std::size_t>(p)]) continue;
      ok = false;
      if (report)
        std::fprintf(stderr, "partition %d: committed %lld, end %lld\n", p,
                     static_cast<long long>(list->elems[p].offset),
                     static_cast<long long>(end_offsets[static_cast<std::size_t>(p)]));
    }
    return ok;
  };
  // 0 = run, 1 = consumer-b stops, 2 = both stop. Membership changes one at a time, each on a
  // settled group (see the shutdown below).
  std::atomic<int> stop_level{0};
  // What each consumer holds, from its rebalance callback: [0] consumer-a, [1] consumer-b.
  struct Membership {
    std::atomic<bool> holding{false};  // the last callback was an assignment
    std::atomic<int> partitions{0};    // partitions in that assignment
    std::atomic<SteadyClock::rep> changed{0};  // when (SteadyClock ticks)
  };
  Membership members[2];
  std::atomic<bool> timed_out{false};

  Settings s;
  s.brokers = bootstraps;
  s.topic = topic;
  s.group = "idem-kafka-mock";
  s.batch = 32;
  s.commit_every = 100;
  s.handler_delay = 1ms;  // so that the second consumer joins while the first is busy
  // The mock waits session.timeout.ms - 1 s for members to rejoin a rebalance: keep it short here.
  s.extra = {
      {"session.timeout.ms", "3000"}, {"heartbeat.interval.ms", "250"}, {"topic.metadata.refresh.interval.ms", "1000"}};

  std::vector<std::thread> threads;
  std::atomic<long> failures{0};
  // consumer-a's self-test knob (Settings::selftest_hold_batch): 1 asked, 2 holding, 3 done.
  std::atomic<int> hold_batch{0};
  auto start_consumer = [&](const char* name, int stops_at, std::atomic<int>* hold) {
    Settings mine = s;
    mine.client_id = name;
    mine.selftest_hold_batch = hold;
    Membership* m = &members[threads.size()];
    threads.emplace_back([&, mine, stops_at, m] {
      try {
        KafkaConsumer c(mine, guard, ledger, stats, on_ack, [m](bool assigned, int n) {
          m->partitions.store(assigned ? n : 0);
          m->holding.store(assigned);
          m->changed.store(SteadyClock::now().time_since_epoch().count());
        });
        c.run([&] { return stop_level.load() < stops_at; });
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[%s] fatal: %s\n", mine.client_id.c_str(), e.what());
        failures.fetch_add(1);
      }
    });
  };

  start_consumer("consumer-a", 2, &hold_batch);
  const long join_at = static_cast<long>(events) / 4;
  bool joined = false, committed_ok = false;
  SteadyClock::time_point hold_asked{}, joined_at{}, applied_at{}, committed_at{};
  auto next_check = SteadyClock::now();
  while (failures.load() == 0) {
    const auto now = SteadyClock::now();
    if (hold_asked == SteadyClock::time_point{} && ledger.total_applied() >= join_at) {
      hold_batch.store(1);
      hold_asked = now;
    }
    // consumer-b joins the group once consumer-a holds a polled, unprocessed batch: the rebalance
    // then revokes partitions under that batch for sure, not only when the timing happens to allow.
    // If consumer-a never gets to hold one, it joins anyway and the run fails on the drop count.
    if (!joined && hold_asked != SteadyClock::time_point{} && (hold_batch.load() >= 2 || now - hold_asked > 5s)) {
      int asked = 1;
      hold_batch.compare_exchange_strong(asked, 0);  // not holding yet: too late, cancel
      start_consumer("consumer-b", 1, nullptr);
      joined = true;
      joined_at = now;
    }
    // Done when every payment is applied, every message acked, and the group's committed offsets
    // (read from the coordinator) reached the end of every partition — while both still consume,
    // so the periodic commits, not a lucky final one, are what is checked.
    if (joined && ledger.total_applied() >= events - 1 && all_acked()) {
      if (applied_at == SteadyClock::time_point{}) applied_at = now;
      if (now >= next_check) {
        next_check = now + 300ms;
        if (committed_at_end(false)) {
          committed_ok = true;
          committed_at = now;
          break;
        }
      }
    }
    if (now - t0 > time_limit) {
      timed_out.store(true);
      committed_at_end(true);
      break;
    }
    std::this_thread::sleep_for(10ms);
  }
  // Shutdown: one membership change at a time, each on a settled group, the mock cluster (inside
  // `producer`) stopped last. Closing a consumer while its group rebalances is what librdkafka
  // 2.0.2 (Debian 12) gets wrong: if consumer-a starts closing while the rebalance that consumer-b's
  // LeaveGroup started is still reaching it, close() serves that queued revoke around the moment
  // the group terminates. Served after it, rd_kafka_rebalance_protocol() returns NULL (handled in
  // on_rebalance; it was the SIGSEGV in strcmp seen right after "[consumer-b] revoked"); served
  // just before it, the callback's rd_kafka_assign(NULL) can hang for ever (its request purged with
  // the group's queue) or librdkafka aborts ("rd_kafka_cgrp_terminated: assert:
  // !rd_kafka_assignment_in_progress"). Heavy CPU load (CI, TSan) widens that window. So
  // consumer-b leaves only once both consumers hold an assignment, and consumer-a closes only once
  // it owns every partition again; that take-over is checked as well.
  // Settled = the condition holds and no member's assignment changed for a second (a rebalance
  // reaches every member within a couple of heartbeats, 250 ms here).
  auto quiet = [&] {
    const auto last = SteadyClock::time_point(SteadyClock::duration(
        std::max(members[0].changed.load(), members[1].changed.load())));
    return SteadyClock::now() - last >= 1s;
  };
  auto wait_for = [&](const std::function<bool()>& ready, std::chrono::seconds limit) {
    const auto until = SteadyClock::now() + limit;
    while (!(ready() && quiet())) {
      if (failures.load() != 0 || SteadyClock::now() > until) return false;
      std::this_thread::sleep_for(10ms);
    }
    return true;
  };
  const bool settled_before_leave =
      !joined || wait_for([&] { return members[0].holding.load() && members[1].holding.load(); }, 20s);
  stop_level.store(1);
  if (threads.size() > 1) threads[1].join();
  const bool took_over = wait_for(
      [&] { return members[0].holding.load() && members[0].partitions.load() == partitions; }, 20s);
  stop_level.store(2);
  threads[0].join();
  if (!settled_before_leave) std::fprintf(stderr, "[mock] group not settled before consumer-b left\n");
  if (!took_over) std::fprintf(stderr, "[mock] consumer-a did not take over all partitions\n");
  if (committed_ok && !committed_at_end(true)) committed_ok = false;  // final commits never go backwards
  rd_kafka_consumer_close(verifier);
  rd_kafka_destroy(verifier);

  std::int64_t dlq_lo = 0, dlq_hi = 0;
  rd_kafka_query_watermark_offsets(producer, (topic + ".dlq").c_str(), 0, &dlq_lo, &dlq_hi, 5'000);
  rd_kafka_destroy(producer);
  rd_kafka_wait_destroyed(5'000);

  long once = 0, twice = 0, never = 0;
  for (std::size_t i = 0; i < pays.size(); ++i) {
    if (pays[i].amount == 0) continue;
    const int n = ledger.times_applied(pays[i].id);
    once += n == 1;
    twice += n > 1;
    never += n == 0;
  }
  const bool poison_skipped = ledger.times_applied(pays[static_cast<std::size_t>(events / 2)].id) == 0;
  const bool balances_ok = ledger.balances() == expected;
  const double secs = std::chrono::duration<double>(SteadyClock::now() - t0).count();

  std::printf("idem kafka_consumer --mock: %d payments, %zu messages, %d partitions, 3 mock brokers\n", events,
              outbox.size(), partitions);
  std::printf("  %-34s %8ld\n", "deliveries processed", stats.delivered.load());
  std::printf("  %-34s %8ld\n", "executed", stats.executed.load());
  std::printf("  %-34s %8ld\n", "duplicates suppressed", stats.duplicates.load());
  std::printf("  %-34s %8ld\n", "requeued (seek back)", stats.requeued.load());
  std::printf("  %-34s %8ld\n", "handler errors (poison retries)", stats.handler_errors.load());
  std::printf("  %-34s %8ld\n", "dead-lettered", stats.dead_lettered.load());
  std::printf("  %-34s %8ld\n", "dead letters already written", stats.dead_letters_deduped.load());
  std::printf("  %-34s %8ld\n", "dead-letter writes failed (retried)", stats.dead_letter_failures.load());
  std::printf("  %-34s %8ld\n", "dropped after revoke", stats.dropped_after_revoke.load());
  std::printf("  %-34s %8ld\n", "rebalance callbacks", stats.rebalances.load());
  std::printf("  %-34s %8ld\n", "commits refused (redelivered later)", stats.commit_failures.load());
  std::printf("  %-34s %8s\n", "second consumer joined", joined ? "yes" : "NO");
  std::printf("  %-34s %8s\n", "first held a batch through it", hold_batch.load() == 3 ? "yes" : "NO");
  std::printf("  %-34s %8s\n", "first took over after it left", took_over ? "yes" : "NO");
  auto at = [&](SteadyClock::time_point t) {
    return t == SteadyClock::time_point{} ? -1.0 : std::chrono::duration<double>(t - t0).count();
  };
  std::printf("  %-34s %8.2f\n", "  ... at second", at(joined_at));
  std::printf("  %-34s %8.2f\n", "all effects applied at second", at(applied_at));
  std::printf("  %-34s %8.2f\n", "all offsets committed at second", at(committed_at));
  std::printf("  %-34s %8lld\n", "dead-letter topic messages", static_cast<long long>(dlq_hi - dlq_lo));
  std::printf("  %-34s %8.2f\n", "wall seconds", secs);
  std::printf("  effects applied once: %ld of %d (twice or more: %ld, never: %ld); balances %s; committed offsets %s\n",
              once, events - 1, twice, never, balances_ok ? "exact" : "WRONG", committed_ok ? "at end" : "NOT AT END");
  const bool ok = failures.load() == 0 && !timed_out.load() && joined && once == events - 1 && twice == 0 &&
                  never == 0 && balances_ok && committed_ok && poison_skipped && dlq_hi - dlq_lo == 1 &&
                  took_over && stats.rebalances.load() >= 3 && hold_batch.load() == 3 &&
                  stats.dropped_after_revoke.load() > 0 && stats.dead_letters_deduped.load() >= 1 &&
                  stats.dead_letter_failures.load() >= 1;
  if (timed_out.load()) std::printf("  TIMED OUT after %lld s\n", static_cast<long long>(time_limit.count()));
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return flag(argc, argv, "--mock") ? run_mock(argc, argv) : run_real(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "idem_kafka_consumer: %s\n", e.what());
    return 1;
  }
}
