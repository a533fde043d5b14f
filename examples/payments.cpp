// payments: duplicated, reordered payment events -> exact account balances in PostgreSQL.
//
// The reference scenario. A producer emits, per account, a history of payments
// (event id, account id, per-account sequence 1..N, debit or credit, amount, and the account's
// balance after it). A simulated at-least-once broker delivers them shuffled, about 20% of them
// twice or more, to a few worker threads. Each worker applies an event with
//
//   * PostgresStore in transactional mode: the idempotency record commits in the same transaction
//     as the business writes (balance update + ledger row), so an event's effect happens once;
//   * PostgresSequenceStore + idem::run_sequenced: the account's sequence advances in that same
//     transaction. Payments are deltas, so the sequence is *contiguous*: event n runs only after
//     n-1 committed (an early event is requeued), and an event at or below the applied sequence
//     (a duplicate) is acked as stale without running;
//   * the transactional outbox (docs/outbox.md): the handler also sends a "balance changed" event
//     with ctx.outbox().send(...), written in the same transaction, so it exists if and only if
//     the payment committed; an idem::OutboxRelay on a thread publishes it (to a Redis Stream with
//     --redis, else to an in-process publisher that stands in for your broker), with a stable id
//     that downstream consumers deduplicate on.
//
// Expected result, checked exactly at the end: every account's balance equals the balance_after of
// its last event (= the sum of its credits minus its debits), its ledger holds each of its events
// once, and its applied sequence is its last event's. The handler also checks, inside the
// transaction, that the balance it produces equals the event's balance_after, which proves the
// events of each account were applied in order. Every event's "balance changed" message is
// published (at least once, one id per event), in the account's order.
//
//   idem_payments --conninfo "host=127.0.0.1 port=5432 dbname=postgres" [--conninfo-file PATH]
//                 [--accounts 20] [--events 20] [--workers 4] [--duplicate-percent 20] [--seed 0]
//                 [--schema payments_example] [--redis redis://127.0.0.1:6379]
//
// The schema is dropped and recreated at start (it is the example's own). Exit status 0 = every
// check passed.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <queue>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <libpq-fe.h>

#include "idem/idem.hpp"
#include "idem/outbox/outbox.hpp"
#include "idem/postgres.hpp"

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

// ---- the events -------------------------------------------------------------------------------

enum class Kind { credit, debit };

struct PaymentEvent {
  std::string event_id;         // stable id of the event: the idempotency key
  std::string account;          // the entity whose order matters
  std::uint64_t seq = 0;        // position in the account's history, 1..N, contiguous
  Kind kind = Kind::credit;
  std::int64_t amount = 0;      // cents, > 0
  std::int64_t balance_after = 0;  // the account's balance once this event is applied
};

std::int64_t delta(const PaymentEvent& e) { return e.kind == Kind::credit ? e.amount : -e.amount; }

// Per account: credits and debits that never overdraw, starting from 0.
std::vector<PaymentEvent> produce(int accounts, int events, std::mt19937_64& rng) {
  std::vector<PaymentEvent> out;
  int id = 0;
  for (int a = 0; a < accounts; ++a) {
    char name[32];
    std::snprintf(name, sizeof name, "acct-%03d", a);
    std::int64_t balance = 0;
    for (int n = 1; n <= events; ++n) {
      PaymentEvent e;
      char eid[32];
      std::snprintf(eid, sizeof eid, "evt-%06d", id++);
      e.event_id = eid;
      e.account = name;
      e.seq = static_cast<std::uint64_t>(n);
      e.amount = std::uniform_int_distribution<std::int64_t>(1, 10'000)(rng);
      e.kind = (balance >= e.amount && rng() % 3 == 0) ? Kind::debit : Kind::credit;
      balance += delta(e);
      e.balance_after = balance;
      out.push_back(std::move(e));
    }
  }
  return out;
}

// ---- a simulated at-least-once broker (replace with your consumer: Kafka, RabbitMQ, ...) ------

struct Delivery {
  Clock::time_point due;
  std::size_t event;  // index into the event list
  bool operator>(const Delivery& o) const { return due > o.due; }
};

class Broker {
public:
  void publish(std::size_t event, Clock::duration delay = {}) {
    std::lock_guard lock(mu_);
    q_.push({Clock::now() + delay, event});
    ++pending_;
  }
  // Next due delivery; false once every delivery was acked or dead-lettered.
  bool next(Delivery& out) {
    std::unique_lock lock(mu_);
    for (;;) {
      if (pending_ == 0) return false;
      if (!q_.empty() && q_.top().due <= Clock::now()) {
        out = q_.top();
        q_.pop();
        return true;
      }
      lock.unlock();
      std::this_thread::sleep_for(1ms);
      lock.lock();
    }
  }
  void ack() { settle(); }
  void dead_letter() { settle(); }
  void requeue(const Delivery& d, Clock::duration after) {
    std::lock_guard lock(mu_);
    q_.push({Clock::now() + after, d.event});
  }

private:
  void settle() {
    std::lock_guard lock(mu_);
    --pending_;
  }
  std::mutex mu_;
  std::priority_queue<Delivery, std::vector<Delivery>, std::greater<>> q_;
  std::size_t pending_ = 0;
};

// ---- command line ---------------------------------------------------------------------------

// ---- a stand-in broker for the outbox (replace with RedisStreamsPublisher, Kafka, RabbitMQ) -----

// Keeps what it is given, in order. A real publisher returns once the broker acknowledged the batch.
class MemoryPublisher final : public idem::OutboxPublisher {
public:
  void publish(std::span<const idem::OutboxMessage> batch) override {
    std::lock_guard lock(mu_);
    for (const auto& m : batch) got_.push_back(m);
  }
  [[nodiscard]] std::string name() const override { return "memory"; }
  std::vector<idem::OutboxMessage> messages() {
    std::lock_guard lock(mu_);
    return got_;
  }

private:
  std::mutex mu_;
  std::vector<idem::OutboxMessage> got_;
};

struct Args {
  std::string conninfo;
  std::string redis;  // empty: the in-process publisher
  std::string schema = "payments_example";
  int accounts = 20, events = 20, workers = 4, duplicate_percent = 20;
  std::uint64_t seed = 0;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "idem_payments: %s\nusage: idem_payments --conninfo STR | --conninfo-file PATH [--accounts N] "
               "[--events N] [--workers N] [--duplicate-percent P] [--seed S] [--schema NAME] [--redis URL]\n",
               why);
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) usage(("missing value of " + k).c_str());
    const std::string v = argv[++i];
    auto num = [&](int lo, int hi) {
      const int n = std::atoi(v.c_str());
      if (n < lo || n > hi) usage((k + " must be " + std::to_string(lo) + ".." + std::to_string(hi)).c_str());
      return n;
    };
    if (k == "--conninfo") {
      a.conninfo = v;
    } else if (k == "--conninfo-file") {
      std::ifstream in(v);
      if (!in || !std::getline(in, a.conninfo) || a.conninfo.empty()) usage(("no conninfo in " + v).c_str());
    } else if (k == "--accounts") {
      a.accounts = num(1, 10'000);
    } else if (k == "--events") {
      a.events = num(1, 100'000);
    } else if (k == "--workers") {
      a.workers = num(1, 64);
    } else if (k == "--duplicate-percent") {
      a.duplicate_percent = num(0, 100);
    } else if (k == "--seed") {
      a.seed = std::strtoull(v.c_str(), nullptr, 10);
    } else if (k == "--schema") {
      a.schema = v;
    } else if (k == "--redis") {
      a.redis = v;
    } else {
      usage(("unknown option " + k).c_str());
    }
  }
  if (a.conninfo.empty()) usage("give --conninfo or --conninfo-file");
  // It is interpolated into SQL (and dropped at start): a plain lower-case identifier only.
  const bool ident = !a.schema.empty() && a.schema.size() <= 63 && a.schema.rfind("pg_", 0) != 0 &&
                     (a.schema[0] == '_' || (a.schema[0] >= 'a' && a.schema[0] <= 'z')) &&
                     std::all_of(a.schema.begin(), a.schema.end(), [](char c) {
                       return c == '_' || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9');
                     });
  if (!ident || a.schema == "public" || a.schema == "idem") usage("--schema must be [a-z_][a-z0-9_]*, the example's own");
  return a;
}

// The example's own libpq calls (setup and the final check), outside idem.
using RawResult = std::unique_ptr<PGresult, decltype(&PQclear)>;

RawResult query(PGconn* c, const std::string& sql) {
  RawResult r(PQexec(c, sql.c_str()), &PQclear);
  const auto st = PQresultStatus(r.get());
  if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK)
    throw std::runtime_error("query failed: " + sql + ": " + PQresultErrorMessage(r.get()));
  return r;
}

void exec(PGconn* c, const std::string& sql) { query(c, sql); }

}  // namespace

int main(int argc, char** argv) try {
  const Args args = parse(argc, argv);
  std::mt19937_64 rng(args.seed);
  const std::vector<PaymentEvent> events = produce(args.accounts, args.events, rng);

  // ---- the business schema: balances and a ledger (a real service has these already) ---------
  const std::string S = args.schema;  // a fixed identifier of ours; never interpolate user input
  {
    PGconn* c = PQconnectdb(args.conninfo.c_str());
    if (PQstatus(c) != CONNECTION_OK) {
      std::fprintf(stderr, "idem_payments: cannot connect: %s", PQerrorMessage(c));
      PQfinish(c);
      return 1;
    }
    PQsetNoticeProcessor(c, [](void*, const char*) {}, nullptr);
    exec(c, "DROP SCHEMA IF EXISTS " + S + " CASCADE");
    exec(c, "CREATE SCHEMA " + S);
    exec(c, "CREATE TABLE " + S + ".accounts (id text PRIMARY KEY, balance bigint NOT NULL DEFAULT 0)");
    // One row per applied event: the primary key makes a double effect impossible to miss.
    exec(c, "CREATE TABLE " + S + ".ledger (event_id text PRIMARY KEY, account text NOT NULL, "
            "seq bigint NOT NULL, amount bigint NOT NULL)");
    PQfinish(c);
  }

  // ---- idem: the guard's store (transactional mode) and the per-account sequences -------------
  // TUNE: pool.size >= workers + 1 (a transaction holds a session; the sequence store's first
  // use migrates on another); lock_timeout is how long a redelivery waits for a live holder's
  // row before answering in_flight; lease = how long a stuck transaction may hold an event.
  idem::PostgresStore store{{.conninfo = args.conninfo, .pool = {.size = static_cast<std::size_t>(args.workers) + 2}},
                            {.schema = S, .table = "idem_records", .mode = idem::PostgresMode::transactional,
                             .outbox = true}};  // migrate() also creates idem_records_outbox
  // The sequence store shares the store's client: one pool, the same server by construction.
  idem::PostgresSequenceStore seqs{store, {.schema = S, .table = "account_sequences"}};
  // release: a failed handler frees the event for its redelivery (nothing of it committed).
  idem::IdempotencyGuard<idem::PostgresStore> guard{
      store, {.lease = 30s, .retention = 24h, .failure = {.mode = idem::FailureMode::release}}};
  // Payments are deltas: contiguous sequences, so an early event waits for its predecessor.
  const idem::SequenceGateOptions ordering{.contiguous = true, .first = 1, .gap_retry_after = idem::millis{5}};

  // ---- publish: every event once, ~duplicate_percent of them again, all shuffled --------------
  Broker broker;
  {
    std::vector<std::size_t> order;
    for (std::size_t i = 0; i < events.size(); ++i) {
      order.push_back(i);
      if (static_cast<int>(rng() % 100) < args.duplicate_percent) order.push_back(i);
      if (static_cast<int>(rng() % 100) < args.duplicate_percent / 4) order.push_back(i);
    }
    std::shuffle(order.begin(), order.end(), rng);
    for (std::size_t i : order) broker.publish(i);
  }

  std::atomic<long> deliveries{0}, executed{0}, duplicates{0}, stale{0}, gaps{0}, in_flight{0}, retried{0},
      dead{0}, handler_runs{0};
  const auto deadline = Clock::now() + 300s;
  constexpr idem::millis max_redelivery_delay{1'000};
  std::atomic<bool> timed_out{false};

  // ---- the consumer loop: copy this shape into your service ----------------------------------
  auto worker = [&] {
    Delivery d;
    while (broker.next(d)) {
      if (Clock::now() > deadline) {  // a safety net for the demo, not part of the pattern
        timed_out = true;
        broker.dead_letter();
        continue;
      }
      ++deliveries;
      const PaymentEvent& ev = events[d.event];
      try {
        auto out = idem::run_sequenced(
            guard, seqs, ordering, {.key = ev.event_id, .entity = ev.account, .seq = ev.seq},
            [&](const idem::IdempotencyGuard<idem::PostgresStore>::context_type& ctx) -> std::int64_t {
              // YOUR LOGIC: business writes go through ctx.tx, so they commit with the record and
              // the sequence advance, or not at all.
              ++handler_runs;
              idem::PostgresResult r = ctx.tx->exec("INSERT INTO " + S + ".accounts AS a (id, balance) VALUES ($1, $2) "
                                              "ON CONFLICT (id) DO UPDATE SET balance = a.balance + EXCLUDED.balance "
                                              "RETURNING balance",
                                              ev.account, delta(ev));
              const std::int64_t balance = std::stoll(std::string(r.get(0, 0)));
              if (balance != ev.balance_after)  // rolls back; never expected to happen
                throw std::logic_error("event " + ev.event_id + " produced balance " + std::to_string(balance) +
                                       ", expected " + std::to_string(ev.balance_after));
              ctx.tx->exec("INSERT INTO " + S + ".ledger (event_id, account, seq, amount) VALUES ($1, $2, $3, $4)",
                           ev.event_id, ev.account, ev.seq, delta(ev));
              // The event for the rest of the system, keyed by account (published in account order).
              // Written in this transaction: it exists iff the payment committed; its id is stable
              // across re-runs, so downstream consumers deduplicate on it.
              ctx.outbox().send("payments.balance_changed", ev.account,
                                "{\"event\":\"" + ev.event_id + "\",\"account\":\"" + ev.account +
                                    "\",\"seq\":" + std::to_string(ev.seq) + ",\"balance\":" + std::to_string(balance) + "}",
                                {{"type", "BalanceChanged"}});
              return balance;  // recorded; a duplicate replays it
            });
        // Outcome -> broker action.
        switch (out.status) {
          case idem::Status::executed: ++executed; break;
          case idem::Status::duplicate: ++duplicates; break;
          case idem::Status::stale: ++stale; break;
          case idem::Status::in_flight: out.gap ? ++gaps : ++in_flight; break;
          default: break;
        }
        switch (out.action()) {
          case idem::BrokerAction::ack: broker.ack(); break;
          case idem::BrokerAction::requeue:  // gap (predecessor missing) or a live holder
            // TUNE: the redelivery delay. A row another transaction has locked answers in_flight
            // with the whole lease as retry_after (the store cannot see how far that transaction
            // is); it usually commits within milliseconds, so come back sooner than that and find
            // it completed (duplicate) or, if it rolled back, free.
            broker.requeue(d, std::clamp(out.retry_after, idem::millis{1}, max_redelivery_delay));
            break;
          case idem::BrokerAction::dead_letter:  // previously_failed / mismatch: a human looks
            ++dead;
            broker.dead_letter();
            break;
        }
      } catch (const idem::outcome_unknown_error&) {
        // The commit's fate is unknown: redeliver; the record says whether it committed.
        ++retried;
        broker.requeue(d, 50ms);
      } catch (const idem::error& e) {
        if (!e.retryable()) {  // a bug or a misconfiguration: stop the line
          std::fprintf(stderr, "idem_payments: %s\n", e.what());
          ++dead;
          broker.dead_letter();
          continue;
        }
        ++retried;  // store down, timeout, serialization failure: nothing committed, try again
        broker.requeue(d, 50ms);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "idem_payments: handler failed: %s\n", e.what());
        ++dead;
        broker.dead_letter();
      }
    }
  };

  // ---- the outbox relay: its own thread here; or the idem-outbox-relay program -----------------
  MemoryPublisher memory;
  std::unique_ptr<idem::OutboxPublisher> redis_pub;
  if (!args.redis.empty())
    redis_pub = std::make_unique<idem::RedisStreamsPublisher>(idem::RedisStreamsPublisherOptions{.redis = {.url = args.redis}});
  // TUNE: batch (rows per publish), poll_interval (the fallback when a NOTIFY is missed),
  // retention (how long sent rows stay for inspection).
  idem::OutboxRelay relay{redis_pub ? *redis_pub : static_cast<idem::OutboxPublisher&>(memory),
                          {.postgres = {.conninfo = args.conninfo}, .schema = S, .table = "idem_records"}};
  relay.start();

  const auto started = Clock::now();
  std::vector<std::thread> pool;
  for (int i = 0; i < args.workers; ++i) pool.emplace_back(worker);
  for (auto& t : pool) t.join();
  const double secs = std::chrono::duration<double>(Clock::now() - started).count();
  // Drain what is left, then stop the relay (a service keeps it running).
  relay.stop();
  while (relay.run_once() > 0) {
  }

  // ---- check every balance exactly -------------------------------------------------------------
  std::map<std::string, const PaymentEvent*> last_of;
  std::map<std::string, long> count_of;
  for (const auto& e : events) {
    last_of[e.account] = &e;  // events are produced in sequence order per account
    ++count_of[e.account];
  }
  int wrong = 0;
  long ledger_rows = 0, double_effects = 0, lost = 0;
  {
    PGconn* c = PQconnectdb(args.conninfo.c_str());
    if (PQstatus(c) != CONNECTION_OK) throw std::runtime_error(PQerrorMessage(c));
    const RawResult bal = query(c, "SELECT a.id, a.balance, (SELECT count(*) FROM " + S +
                                       ".ledger l WHERE l.account = a.id) FROM " + S + ".accounts a ORDER BY a.id");
    std::map<std::string, std::pair<std::int64_t, long>> got;
    for (int r = 0; r < PQntuples(bal.get()); ++r)
      got[PQgetvalue(bal.get(), r, 0)] = {std::stoll(PQgetvalue(bal.get(), r, 1)), std::stol(PQgetvalue(bal.get(), r, 2))};
    PQfinish(c);
    std::printf("%-10s %14s %14s %8s %8s %6s\n", "account", "expected", "balance", "events", "applied", "seq");
    for (const auto& [acct, last] : last_of) {
      const auto it = got.find(acct);
      const std::int64_t balance = it == got.end() ? 0 : it->second.first;
      const long applied = it == got.end() ? 0 : it->second.second;
      const auto seq = seqs.last_applied(acct);
      const bool ok = balance == last->balance_after && applied == count_of[acct] && seq == last->seq;
      if (!ok) ++wrong;
      ledger_rows += applied;
      lost += std::max(0L, count_of[acct] - applied);
      double_effects += std::max(0L, applied - count_of[acct]);
      std::printf("%-10s %11lld.%02lld %11lld.%02lld %8ld %8ld %6llu%s\n", acct.c_str(),
                  static_cast<long long>(last->balance_after / 100), static_cast<long long>(last->balance_after % 100),
                  static_cast<long long>(balance / 100), static_cast<long long>(balance % 100), count_of[acct],
                  applied, static_cast<unsigned long long>(seq.value_or(0)), ok ? "" : "   <-- WRONG");
    }
  }

  std::printf("events: %zu, deliveries: %ld, executed: %ld, duplicates: %ld, stale (acked): %ld, "
              "gaps requeued: %ld, in flight requeued: %ld, errors retried: %ld, dead-lettered: %ld, %.2f s\n",
              events.size(), deliveries.load(), executed.load(), duplicates.load(), stale.load(), gaps.load(),
              in_flight.load(), retried.load(), dead.load(), secs);
  std::printf("double effects: %ld\nlost messages: %ld\n", double_effects, lost);

  // ---- the outbox: every event's message published, in each account's order ------------------
  bool outbox_ok = true;
  const auto st = relay.stats();
  if (!redis_pub) {
    const auto published = memory.messages();
    std::map<std::string, long> per_id;
    std::map<std::string, std::uint64_t> last_seq;
    for (const auto& m : published) {
      if (++per_id[m.id] > 1) continue;  // at least once: a repeat carries the same id
      const auto at = m.payload.find("\"seq\":");
      const std::uint64_t seq = std::stoull(m.payload.substr(at + 6));
      if (seq <= last_seq[m.message_key]) outbox_ok = false;  // out of the account's order
      last_seq[m.message_key] = seq;
    }
    outbox_ok = outbox_ok && per_id.size() == events.size();
    std::printf("outbox: %zu messages published (%llu batches), %zu distinct ids, per-account order %s\n",
                published.size(), static_cast<unsigned long long>(st.batches), per_id.size(),
                outbox_ok ? "kept" : "BROKEN");
  } else {
    outbox_ok = st.published >= events.size();
    std::printf("outbox: %llu messages published to the Redis stream payments.balance_changed (%llu batches)\n",
                static_cast<unsigned long long>(st.published), static_cast<unsigned long long>(st.batches));
  }
  const bool pass = wrong == 0 && dead == 0 && !timed_out && executed == static_cast<long>(events.size()) &&
                    ledger_rows == static_cast<long>(events.size()) && outbox_ok;
  std::printf("%s: %d account(s) wrong\n", pass ? "PASS" : "FAIL", wrong);
  return pass ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "idem_payments: %s\n", e.what());
  return 1;
}
