// redis_streams_consumer: a starting template for a Redis Streams consumer-group consumer with
// exactly-once effects (hiredis for the stream, idem::RedisStore for the idempotency records).
// Copy StreamConsumer and put your logic in StreamConsumer::apply().
//
//   idem_redis_streams_consumer --redis redis://127.0.0.1:6379 [--stream payments] [--group payments]
//                               [--consumer NAME] [--count 32] [--lease-ms 30000] [--batch]
//   idem_redis_streams_consumer --selftest --redis URL [--events 2000] [--consumers 3] [--batch]
//
// --selftest publishes payment events (about 20% duplicates, a poison event that always throws,
// and a few entries a "crashed" consumer read and claimed but never finished) into a fresh stream,
// runs --consumers consumers (threads, one hiredis connection each, one shared guard), and checks
// that every payment was applied exactly once, the poison event was dead-lettered, the crashed
// consumer's entries were recovered with XAUTOCLAIM, and nothing is left pending.
//
// Delivery model. XREADGROUP hands each entry to one consumer and keeps it in the group's pending
// entries list (PEL) until XACK. A consumer that dies leaves its entries pending; XAUTOCLAIM lets a
// live consumer take over entries idle for longer than min-idle-time. So the stream is
// at-least-once, and the guard turns that into exactly-once effects.
//
// Broker action per outcome (the part to keep):
//   executed            -> XACK
//   duplicate           -> XACK (the stored result is in out.value if you need to reply again)
//   stale               -> XACK (SequenceGate: an older event of an entity already moved on)
//   lease_lost          -> XACK and alert: the handler ran but another holder had taken the key
//                          over (the handler outlived the lease: raise the lease or enable heartbeat)
//   in_flight           -> leave it pending (no XACK): another consumer holds the key; XAUTOCLAIM
//                          brings it back after min-idle (= the lease) and it then answers
//                          duplicate, or takes over a crashed holder's lapsed lease
//   previously_failed   -> dead-letter: XADD <stream>:dlq (with the error) then XACK
//   mismatch            -> dead-letter: the event id was reused with a different payload
//   handler exception   -> leave it pending; the failure policy decides: `record` with
//                          max_attempts turns it into previously_failed (dead-letter) at the end
//   idem::store_error   -> leave it pending, back off, carry on: the guard failed closed (the
//                          handler did not run; or it ran and its completion is unconfirmed,
//                          then the redelivery answers duplicate, or takes the key over after
//                          the lease if the completion was lost)
// Never XACK before the outcome is known: an XACK followed by a crash loses the message.
//
// What to tune:
//   lease (--lease-ms)  above the handler's worst case (or GuardOptions::heartbeat = true); it is
//                       also XAUTOCLAIM's min-idle-time here, so redelivery after a crash waits
//                       about one lease, and a claim never races a live holder's lease.
//   retention           longer than the stream's redelivery horizon (how long an entry can stay
//                       pending, plus how long producers may re-publish): a duplicate arriving
//                       after retention runs again.
//   COUNT (--count)     entries per XREADGROUP; the XACK of a read is one round trip (and with
//                       --batch so are its acquisitions).
//   failure policy      release (retry at once on the next delivery) or record (bounded retries
//                       with backoff, then previously_failed -> dead-letter).
//   MAXLEN              trim the stream (XADD MAXLEN ~ N, or XTRIM) only below entries that are
//                       acked: a trimmed pending entry is gone (XAUTOCLAIM reports it deleted).
//
// Batches (--batch). By default each entry goes through guard.run: one acquire and one complete
// round trip per message. --batch hands each XREADGROUP / XAUTOCLAIM read to guard.run_batch
// instead: the acquisitions of the whole read take one round trip, the handlers run in entry
// order, and each completion is sent as soon as its handler returns (the answers are read once, at
// the end). Everything else is guard.run's: the failure policy, fingerprints, heartbeat, observer,
// and one outcome per entry, mapped to the broker action by the same table. What differs: the
// keys of a read are claimed together, so an entry holds its lease while it waits for the
// handlers before it (keep the lease above COUNT x the handler's worst case, or turn heartbeat
// on), and a consumer that dies mid-read leaves every key of the read claimed until its lease
// lapses (their redeliveries answer in_flight until then; guard.run leaves one); an event id
// twice in one read runs once, the repeat answering duplicate.
//
// The Redis server behind RedisStore must not evict keys (maxmemory-policy noeviction, RedisStore
// warns otherwise) and should persist (appendonly yes; appendfsync always if a lost completion
// after a server crash must not re-run an effect). See docs/redis.md and docs/choosing.md.

#include <hiredis/hiredis.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
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
#include "idem/redis.hpp"

using namespace std::chrono_literals;
using SteadyClock = std::chrono::steady_clock;

namespace {

std::atomic<bool> g_stop{false};
extern "C" void on_signal(int) { g_stop.store(true); }

// --- the business side: replace with your own -------------------------------------------------

struct Payment {
  std::string event_id;  // stable id set by the producer: the idempotency key
  std::string account;
  long amount = 0;       // cents; credit > 0, debit < 0
};

// The effect. In the template it is an in-process ledger; in a service it is the write to your
// database / the call to your payment provider. Hand ctx.fence downstream when the downstream can
// reject stale writers (a fenced write refuses a holder whose lease was taken over).
class Ledger {
public:
  void apply(const Payment& p, std::uint64_t /*fence*/) {
    if (p.account == "poison") throw std::runtime_error("account 'poison' is closed");
    std::lock_guard lk(mu_);
    balances_[p.account] += p.amount;
    ++applied_[p.event_id];
  }
  std::map<std::string, long> balances() const {
    std::lock_guard lk(mu_);
    return balances_;
  }
  std::unordered_map<std::string, int> applied() const {
    std::lock_guard lk(mu_);
    return applied_;
  }

private:
  mutable std::mutex mu_;
  std::map<std::string, long> balances_;
  std::unordered_map<std::string, int> applied_;
};

// --- hiredis helpers ------------------------------------------------------------------------------

struct ReplyFree {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyFree>;

std::string str(const redisReply* r) {
  if (r && (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS)) return {r->str, r->len};
  if (r && r->type == REDIS_REPLY_INTEGER) return std::to_string(r->integer);
  return {};
}

// One hiredis connection that reconnects on demand. Errors are exceptions.
class StreamConnection {
public:
  explicit StreamConnection(idem::RedisOptions o) : o_(std::move(o)) {}
  ~StreamConnection() { drop(); }
  StreamConnection(const StreamConnection&) = delete;
  StreamConnection& operator=(const StreamConnection&) = delete;

  Reply cmd(const std::vector<std::string>& args) {
    connect();
    std::vector<const char*> argv;
    std::vector<size_t> lens;
    for (const auto& a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    auto* r = static_cast<redisReply*>(redisCommandArgv(c_, static_cast<int>(argv.size()), argv.data(), lens.data()));
    if (r == nullptr) {
      const std::string e = c_->errstr;
      drop();
      throw std::runtime_error("redis: " + e);
    }
    Reply rep(r);
    if (rep->type == REDIS_REPLY_ERROR) throw std::runtime_error("redis: " + std::string(rep->str, rep->len));
    return rep;
  }

private:
  void connect() {
    if (c_) return;
    const auto ms = [](idem::millis m) {
      return timeval{static_cast<time_t>(m.count() / 1000), static_cast<suseconds_t>((m.count() % 1000) * 1000)};
    };
    c_ = o_.unix_socket.empty() ? redisConnectWithTimeout(o_.host.c_str(), o_.port, ms(o_.connect_timeout))
                                : redisConnectUnixWithTimeout(o_.unix_socket.c_str(), ms(o_.connect_timeout));
    if (c_ == nullptr || c_->err) {
      const std::string e = c_ ? c_->errstr : "out of memory";
      drop();
      throw std::runtime_error("redis connect: " + e);
    }
    // BLOCK waits up to block_ms on the server: the socket timeout must be longer.
    redisSetTimeout(c_, ms(o_.command_timeout + idem::millis{2000}));
    if (!o_.password.empty()) {
      if (o_.user.empty()) cmd({"AUTH", o_.password});
      else cmd({"AUTH", o_.user, o_.password});
    }
    if (o_.db != 0) cmd({"SELECT", std::to_string(o_.db)});
  }
  void drop() {
    if (c_) redisFree(c_);
    c_ = nullptr;
  }
  idem::RedisOptions o_;
  redisContext* c_ = nullptr;
};

struct Entry {
  std::string id;  // stream entry id ("1700000000000-0")
  std::map<std::string, std::string> fields;
};

// The entries of one XREADGROUP stream reply or of XAUTOCLAIM's second element.
std::vector<Entry> parse_entries(const redisReply* list) {
  std::vector<Entry> out;
  if (list == nullptr || list->type != REDIS_REPLY_ARRAY) return out;
  for (size_t i = 0; i < list->elements; ++i) {
    const redisReply* e = list->element[i];
    if (e->type != REDIS_REPLY_ARRAY || e->elements < 2) continue;
    Entry en{str(e->element[0]), {}};
    const redisReply* f = e->element[1];
    if (f->type == REDIS_REPLY_ARRAY)
      for (size_t k = 0; k + 1 < f->elements; k += 2) en.fields[str(f->element[k])] = str(f->element[k + 1]);
    out.push_back(std::move(en));
  }
  return out;
}

// --- the consumer -------------------------------------------------------------------------------

struct ConsumerConfig {
  std::string stream = "payments";
  std::string group = "payments";
  std::string consumer;  // unique per process, and the same after a restart (so it rereads its PEL)
  int count = 32;        // entries per XREADGROUP
  int block_ms = 1000;   // XREADGROUP BLOCK
  idem::millis claim_every{1000};
  bool batch = false;
};

struct Counters {
  std::atomic<long> deliveries{0}, executed{0}, duplicates{0}, stale{0}, in_flight{0}, dead_lettered{0},
      lease_lost{0}, handler_errors{0}, store_errors{0}, claimed{0};
};

class StreamConsumer {
public:
  StreamConsumer(idem::RedisOptions redis, idem::IdempotencyGuard<idem::RedisStore>& guard, ConsumerConfig cfg,
                 Ledger& ledger, Counters& counters)
      : conn_(std::move(redis)), guard_(guard), cfg_(std::move(cfg)), ledger_(ledger), n_(counters) {}

  // Runs until g_stop (or `until` says stop). Redis errors back off and retry: nothing is acked
  // without a known outcome, so an error only delays.
  template <class Until>
  void run(Until until) {
    std::string own = "0";  // first our own pending entries: what a previous run of this consumer read
    bool own_done = false;
    std::string cursor = "0-0";
    auto last_claim = SteadyClock::now() - 1h;
    idem::millis pause{50};
    while (!g_stop && !until()) {
      try {
        if (!own_done) {
          auto rep = conn_.cmd({"XREADGROUP", "GROUP", cfg_.group, cfg_.consumer, "COUNT", std::to_string(cfg_.count),
                                "STREAMS", cfg_.stream, own});
          auto es = first_stream(rep.get());
          if (es.empty()) own_done = true;
          else {
            own = es.back().id;
            handle_batch(es);
          }
          continue;
        }
        // Entries of crashed (or stuck) consumers, idle for longer than the lease.
        if (SteadyClock::now() - last_claim >= cfg_.claim_every) {
          last_claim = SteadyClock::now();
          auto rep = conn_.cmd({"XAUTOCLAIM", cfg_.stream, cfg_.group, cfg_.consumer,
                                std::to_string(guard_.options().lease.count()), cursor, "COUNT",
                                std::to_string(cfg_.count)});
          if (rep->type == REDIS_REPLY_ARRAY && rep->elements >= 2) {
            cursor = str(rep->element[0]);  // "0-0" when the scan wrapped around
            auto es = parse_entries(rep->element[1]);
            if (!es.empty()) {
              n_.claimed += static_cast<long>(es.size());
              handle_batch(es);
              if (cursor != "0-0") last_claim = SteadyClock::now() - 1h;  // more to claim: go on
              continue;
            }
          }
        }
        auto rep = conn_.cmd({"XREADGROUP", "GROUP", cfg_.group, cfg_.consumer, "COUNT", std::to_string(cfg_.count),
                              "BLOCK", std::to_string(cfg_.block_ms), "STREAMS", cfg_.stream, ">"});
        handle_batch(first_stream(rep.get()));
        pause = idem::millis{50};
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[%s] %s; retrying in %lld ms\n", cfg_.consumer.c_str(), e.what(),
                     static_cast<long long>(pause.count()));
        std::this_thread::sleep_for(pause);
        pause = std::min(pause * 2, idem::millis{2000});
      }
    }
  }

private:
  enum class Action { ack, leave, dead_letter };

  static std::vector<Entry> first_stream(const redisReply* rep) {
    if (rep == nullptr || rep->type != REDIS_REPLY_ARRAY || rep->elements == 0) return {};
    const redisReply* s = rep->element[0];
    return s->type == REDIS_REPLY_ARRAY && s->elements >= 2 ? parse_entries(s->element[1]) : std::vector<Entry>{};
  }

  static std::optional<Payment> parse(const Entry& e) {
    auto get = [&](const char* k) -> const std::string* {
      auto it = e.fields.find(k);
      return it == e.fields.end() ? nullptr : &it->second;
    };
    const std::string *id = get("event_id"), *acc = get("account"), *amt = get("amount");
    if (!id || !acc || !amt || id->empty()) return std::nullopt;
    char* end = nullptr;
    const long amount = std::strtol(amt->c_str(), &end, 10);
    if (end == amt->c_str() || *end != '\0') return std::nullopt;
    return Payment{*id, *acc, amount};
  }

  // The broker action of an outcome (Outcome::action: the table of the header comment) in this
  // consumer's terms: requeue is "leave it pending", its redelivery retries it.
  static Action to_action(idem::BrokerAction a) {
    switch (a) {
      case idem::BrokerAction::ack: return Action::ack;
      case idem::BrokerAction::dead_letter: return Action::dead_letter;
      default: return Action::leave;
    }
  }

  Action action_for(const idem::Outcome<std::string>& out, const std::string& key, std::string& reason) {
    switch (out.status) {
      case idem::Status::executed: ++n_.executed; break;
      case idem::Status::duplicate: ++n_.duplicates; break;
      case idem::Status::stale: ++n_.stale; break;
      case idem::Status::lease_lost:
        ++n_.lease_lost;
        std::fprintf(stderr, "[%s] ALERT: %s ran after its lease was taken over; raise the lease\n",
                     cfg_.consumer.c_str(), key.c_str());
        break;
      case idem::Status::in_flight: ++n_.in_flight; break;
      case idem::Status::previously_failed: reason = out.error; break;
      case idem::Status::mismatch: reason = "event id reused with a different payload"; break;
    }
    return to_action(out.action());
  }

  // A run that ended in an exception: idem::action_of decides (a store error or the handler's
  // exception leaves the entry pending, and its redelivery retries it).
  Action on_error(const std::exception_ptr& e, std::string& reason) {
    try {
      std::rethrow_exception(e);
    } catch (const idem::store_error& ex) {
      ++n_.store_errors;  // failed closed: not run, or not recorded (a redelivery takes it over)
      std::fprintf(stderr, "[%s] store: %s\n", cfg_.consumer.c_str(), ex.what());
      back_off_ = true;
    } catch (const std::exception& ex) {
      ++n_.handler_errors;  // recorded per the failure policy: record ends in previously_failed -> DLQ
      reason = ex.what();
    } catch (...) {
      ++n_.handler_errors;
    }
    return to_action(idem::action_of(e));
  }

  void handle_batch(const std::vector<Entry>& entries) {
    if (entries.empty()) return;
    n_.deliveries += static_cast<long>(entries.size());
    std::vector<Action> actions(entries.size(), Action::leave);
    std::vector<std::string> reasons(entries.size());
    if (cfg_.batch) decide_batch(entries, actions, reasons);
    else
      for (size_t i = 0; i < entries.size(); ++i) actions[i] = decide_one(entries[i], reasons[i]);
    finish(entries, actions, reasons);
    if (back_off_) {  // the store failed: give it a moment before the next read
      back_off_ = false;
      std::this_thread::sleep_for(100ms);
    }
  }

  // ---- YOUR LOGIC HERE: the effect of one event (ctx.fence for fenced downstream writes). The
  // result is recorded and replayed to duplicates as out.value.
  std::string apply(const Payment& p, const idem::Context& ctx) {
    ledger_.apply(p, ctx.fence);
    return "applied";
  }

  // What the guard fingerprints: a reused event id with a different body answers mismatch.
  static std::string fingerprinted(const Payment& p) { return p.account + "|" + std::to_string(p.amount); }

  // Per-message path: guard.run does acquire, handler, complete (or fail).
  Action decide_one(const Entry& e, std::string& reason) {
    const auto p = parse(e);
    if (!p) {
      reason = "unparseable entry";
      return Action::dead_letter;
    }
    try {
      auto out = guard_.run(p->event_id, fingerprinted(*p), [&](const idem::Context& ctx) { return apply(*p, ctx); });
      return action_for(out, p->event_id, reason);
    } catch (...) {
      return on_error(std::current_exception(), reason);
    }
  }

  // Batch path (--batch): guard.run_batch over the whole read, one outcome (or error) per entry.
  void decide_batch(const std::vector<Entry>& entries, std::vector<Action>& actions,
                    std::vector<std::string>& reasons) {
    std::vector<Payment> ps;  // the parseable entries: ps[k] is entries[at[k]]
    std::vector<size_t> at;
    for (size_t i = 0; i < entries.size(); ++i) {
      if (auto p = parse(entries[i])) {
        ps.push_back(std::move(*p));
        at.push_back(i);
      } else {
        actions[i] = Action::dead_letter;
        reasons[i] = "unparseable entry";
      }
    }
    std::vector<std::string> payloads;
    for (const Payment& p : ps) payloads.push_back(fingerprinted(p));
    std::vector<idem::BatchItem> items;  // views into ps and payloads, which no longer change
    for (size_t k = 0; k < ps.size(); ++k) items.push_back({ps[k].event_id, payloads[k]});
    try {
      auto res = guard_.run_batch(items, [&](const idem::BatchItem& item, const idem::Context& ctx) {
        return apply(ps[static_cast<size_t>(&item - items.data())], ctx);  // item is items[k] itself
      });
      for (size_t k = 0; k < items.size(); ++k) {
        const size_t i = at[k];
        actions[i] = res.errors[k] ? on_error(res.errors[k], reasons[i]) : action_for(res.outcomes[k], ps[k].event_id, reasons[i]);
      }
    } catch (...) {
      std::string ignored;
      on_error(std::current_exception(), ignored);  // the read's acquisitions failed: nothing ran, all stay pending
    }
  }

  // Dead-letter first, then one XACK for everything that is done. A crash between the two only
  // causes a redelivery, which answers duplicate / previously_failed again.
  void finish(const std::vector<Entry>& entries, const std::vector<Action>& actions,
              const std::vector<std::string>& reasons) {
    std::vector<std::string> ack{"XACK", cfg_.stream, cfg_.group};
    for (size_t i = 0; i < entries.size(); ++i) {
      if (actions[i] == Action::leave) continue;
      if (actions[i] == Action::dead_letter) {
        std::vector<std::string> x{"XADD", cfg_.stream + ":dlq", "*", "source_id", entries[i].id, "error", reasons[i]};
        for (const auto& [k, v] : entries[i].fields) {
          x.push_back(k);
          x.push_back(v);
        }
        conn_.cmd(x);  // throws: not acked, redelivered, dead-lettered again (the DLQ is at-least-once)
        ++n_.dead_lettered;
      }
      ack.push_back(entries[i].id);
    }
    if (ack.size() > 3) conn_.cmd(ack);
  }

  StreamConnection conn_;
  idem::IdempotencyGuard<idem::RedisStore>& guard_;
  ConsumerConfig cfg_;
  Ledger& ledger_;
  Counters& n_;
  bool back_off_ = false;  // a store error in this read
};

// --- command line ------------------------------------------------------------------------------

const char* opt(int argc, char** argv, const char* name, const char* def) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  return def;
}
bool flag(int argc, char** argv, const char* name) {
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return true;
  return false;
}

void ensure_group(StreamConnection& c, const ConsumerConfig& cfg) {
  try {
    c.cmd({"XGROUP", "CREATE", cfg.stream, cfg.group, "0", "MKSTREAM"});
  } catch (const std::runtime_error& e) {
    if (std::string(e.what()).find("BUSYGROUP") == std::string::npos) throw;  // exists already: fine
  }
}

void print(const Counters& n) {
  std::printf("deliveries %ld, executed %ld, duplicates %ld, stale %ld, in_flight %ld, dead-lettered %ld, "
              "lease_lost %ld, handler errors %ld, store errors %ld, claimed %ld\n",
              n.deliveries.load(), n.executed.load(), n.duplicates.load(), n.stale.load(), n.in_flight.load(),
              n.dead_lettered.load(), n.lease_lost.load(), n.handler_errors.load(), n.store_errors.load(),
              n.claimed.load());
}

int run_real(int argc, char** argv) {
  idem::RedisOptions ro = idem::parse_redis_url(opt(argc, argv, "--redis", "redis://127.0.0.1:6379"));
  idem::RedisStore store(ro);
  idem::GuardOptions go;
  go.lease = idem::millis{std::atol(opt(argc, argv, "--lease-ms", "30000"))};
  go.retention = 24h;
  go.failure = {.mode = idem::FailureMode::record, .max_attempts = 5, .backoff = 1s, .max_backoff = 60s};
  idem::IdempotencyGuard guard(store, go);
  ConsumerConfig cfg;
  cfg.stream = opt(argc, argv, "--stream", "payments");
  cfg.group = opt(argc, argv, "--group", "payments");
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  cfg.consumer = opt(argc, argv, "--consumer", host);  // stable across restarts of this instance
  cfg.count = std::atoi(opt(argc, argv, "--count", "32"));
  cfg.claim_every = std::max(idem::millis{200}, go.lease / 4);
  cfg.batch = flag(argc, argv, "--batch");
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  StreamConnection c(ro);
  ensure_group(c, cfg);
  Ledger ledger;
  Counters n;
  StreamConsumer consumer(ro, guard, cfg, ledger, n);
  consumer.run([] { return false; });
  print(n);
  return 0;
}

// --- self test --------------------------------------------------------------------------------------

int run_selftest(int argc, char** argv) {
  const idem::RedisOptions ro = idem::parse_redis_url(opt(argc, argv, "--redis", "redis://127.0.0.1:6379"));
  const int events = std::max(10, std::atoi(opt(argc, argv, "--events", "2000")));
  const int consumers = std::max(1, std::atoi(opt(argc, argv, "--consumers", "3")));
  const bool batch = flag(argc, argv, "--batch");
  const std::string tag = std::to_string(::getpid()) + "-" + std::to_string(std::random_device{}() % 100000);
  ConsumerConfig base;
  base.stream = "selftest:payments:" + tag;
  base.group = "payments";
  base.block_ms = 100;
  base.claim_every = 200ms;
  base.batch = batch;

  idem::RedisOptions store_opts = ro;
  store_opts.key_prefix = "idem:selftest:" + tag + ":";
  idem::RedisStore store(store_opts);
  idem::GuardOptions go;
  go.lease = 1s;  // short, so the "crashed" consumer's entries come back quickly
  go.retention = 10min;
  go.failure = {.mode = idem::FailureMode::record, .max_attempts = 2, .backoff = 0ms, .max_backoff = 0ms};
  idem::IdempotencyGuard guard(store, go);

  StreamConnection c(ro);
  ensure_group(c, base);
  // Events: unique ids, ~20% published twice, shuffled; one poison event.
  std::mt19937_64 rng(std::random_device{}());
  std::vector<Payment> ps;
  std::map<std::string, long> expected;
  for (int i = 0; i < events; ++i) {
    Payment p{"ev-" + std::to_string(i), "acct-" + std::to_string(rng() % 20), static_cast<long>(rng() % 10000) - 3000};
    expected[p.account] += p.amount;
    ps.push_back(p);
  }
  std::vector<Payment> order = ps;
  for (int i = 0; i < events / 5; ++i) order.push_back(ps[rng() % ps.size()]);
  order.push_back({"ev-poison", "poison", 1});
  std::shuffle(order.begin(), order.end(), rng);
  for (const auto& p : order)
    c.cmd({"XADD", base.stream, "*", "event_id", p.event_id, "account", p.account, "amount", std::to_string(p.amount)});

  // A consumer that crashes: it reads a few entries, claims the keys of the first two and dies
  // (never completes, never acks). XAUTOCLAIM hands them over after the lease; the takeover runs.
  {
    auto rep = c.cmd({"XREADGROUP", "GROUP", base.group, "crashed", "COUNT", "5", "STREAMS", base.stream, ">"});
    int k = 0;
    if (rep->type == REDIS_REPLY_ARRAY && rep->elements > 0)
      for (const auto& e : parse_entries(rep->element[0]->element[1])) {
        if (k++ >= 2) break;
        idem::AcquireParams ap;
        ap.lease = go.lease;
        ap.retention = go.retention;
        ap.token = 42;
        store.acquire(e.fields.at("event_id"), ap);
      }
  }

  Ledger ledger;
  Counters n;
  const auto deadline = SteadyClock::now() + 120s;
  auto drained = [&] {
    auto rep = c.cmd({"XPENDING", base.stream, base.group});
    const long pending = rep->element[0]->integer;
    auto info = c.cmd({"XINFO", "GROUPS", base.stream});
    std::string last_delivered;
    for (size_t i = 0; i + 1 < info->element[0]->elements; i += 2)
      if (str(info->element[0]->element[i]) == "last-delivered-id") last_delivered = str(info->element[0]->element[i + 1]);
    auto sinfo = c.cmd({"XINFO", "STREAM", base.stream});
    std::string last;
    for (size_t i = 0; i + 1 < sinfo->elements; i += 2)
      if (str(sinfo->element[i]) == "last-generated-id") last = str(sinfo->element[i + 1]);
    return pending == 0 && last_delivered == last;
  };
  std::atomic<bool> done{false};
  std::vector<std::thread> threads;
  for (int i = 0; i < consumers; ++i) {
    ConsumerConfig cfg = base;
    cfg.consumer = "consumer-" + std::to_string(i);
    threads.emplace_back([&, cfg] {
      StreamConsumer sc(ro, guard, cfg, ledger, n);
      sc.run([&] { return done.load() || SteadyClock::now() > deadline; });
    });
  }
  while (SteadyClock::now() < deadline && !g_stop) {
    std::this_thread::sleep_for(100ms);
    if (drained()) break;
  }
  done = true;
  for (auto& t : threads) t.join();

  print(n);
  int bad = 0;
  const auto applied = ledger.applied();
  for (const auto& p : ps) {
    auto it = applied.find(p.event_id);
    const int times = it == applied.end() ? 0 : it->second;
    if (times != 1) {
      if (++bad <= 10) std::fprintf(stderr, "FAIL: %s applied %d times\n", p.event_id.c_str(), times);
    }
  }
  auto balances = ledger.balances();
  for (const auto& [acct, want] : expected)
    if (balances[acct] != want) {
      ++bad;
      std::fprintf(stderr, "FAIL: %s balance %ld, expected %ld\n", acct.c_str(), balances[acct], want);
    }
  const long long dlq = c.cmd({"XLEN", base.stream + ":dlq"})->integer;
  if (dlq != 1) {
    ++bad;
    std::fprintf(stderr, "FAIL: %lld entries dead-lettered, expected 1 (the poison event)\n", dlq);
  }
  if (!drained()) {
    ++bad;
    std::fprintf(stderr, "FAIL: entries still pending or undelivered\n");
  }
  if (n.claimed.load() == 0) {
    ++bad;
    std::fprintf(stderr, "FAIL: the crashed consumer's entries were not claimed\n");
  }
  c.cmd({"DEL", base.stream, base.stream + ":dlq"});
  std::printf("selftest (%s): %d events, %zu published, %s\n",
              batch ? "guard.run_batch per read" : "per-message guard.run", events, order.size(),
              bad == 0 ? "PASS: every payment applied exactly once" : "FAIL");
  return bad == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return flag(argc, argv, "--selftest") ? run_selftest(argc, argv) : run_real(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "idem_redis_streams_consumer: %s\n", e.what());
    return 1;
  }
}
