// Chaos run: exactly-once effects on top of at-least-once delivery, measured.
//
//   idem_chaos [--large] [--events N] [--setups abcdefgijklm] [--seed S]   the driver (IDEM_CHAOS_LARGE=1 = --large)
//   idem_chaos worker SETUP REDIS_PORT CONNINFO CONSUMER STATS_FILE    one consumer (exec'ed by the driver)
//
// The driver starts its own redis-server (AOF, appendfsync always, so the stream, the consumer
// group and the idempotency records survive a SIGKILL of the server) and its own PostgreSQL
// cluster (tests/postgres/pg_cluster.sh). For each setup it publishes payment events — unique
// event ids, about 20% published twice, shuffled — into a Redis Stream consumer group while 4
// consumer processes (fork+exec of this binary, reading through idem::StreamsConsumer) handle them; every 100-300 ms it SIGKILLs a random
// consumer and starts it again; once per setup it SIGKILLs and restarts Redis, and restarts
// PostgreSQL — or, in (d), (e), (j) and (k), which run on a replicated pair of their own, fails it
// over three times (see (j)). Every business transaction appends the event id to an `effects` table without any
// uniqueness, so "double" and "lost" are counted from what was applied, not inferred:
//   (a) PostgresStore transactional mode: balance UPDATE + effects INSERT through ctx.tx;
//   (b) RedisStore + a PostgreSQL transaction that INSERTs the event id into applied_events
//       ON CONFLICT DO NOTHING and skips the update when it did nothing;
//   (c) RedisStore + a plain autocommit UPDATE (one statement that also appends the effect row);
//   (d) TieredStore: a second redis-server WITHOUT persistence answers duplicates, PostgreSQL
//       transactional mode is the truth (balance UPDATE + effects INSERT through ctx.tx); that
//       Redis is SIGKILLed and restarted empty several times per run (IDEM_CHAOS_FAST_PORT); on a
//       replicated PostgreSQL pair failed over three times, as (j);
//   (e) as (a), and the handler also sends a "balance changed" message through the transactional
//       outbox (ctx.outbox().send); two `relay` processes (OutboxRelay + RedisStreamsPublisher)
//       publish it to the stream chaos:e:out, read by two downstream consumers (RedisStore keyed on
//       the outbox id + applied_events ON CONFLICT DO NOTHING); relays and downstream consumers
//       are SIGKILLed and restarted too, and the relays follow the pair's failovers (as (j)).
//       Counted: each event's effect downstream (double 0, lost 0). Half the events of the other
//       setups (eight processes, two hops);
//   (f) as (b), on AsyncRedisStore's blocking calls: each consumer's records go through one
//       multiplexed, pipelined connection (an io thread per consumer), killed and restarted alike;
//       four threads per consumer handle a read's deliveries at once, so their acquisitions and
//       completions go out auto-batched (coalesced into shared script calls, counted);
//   (g) as (b), but each read (XREADGROUP / XAUTOCLAIM, up to 32 entries) goes through
//       IdempotencyGuard::run_batch (one acquisition round trip, each completion sent as its handler
//       returns), with the heartbeat on (a read's last entry waits for the handlers before it);
//   (h) as (c), through run_batch as (g): not in the default set (--setups h), it reports what
//       batches do to the double effects of a non-idempotent effect;
//   (i) as (f), the records on a Redis Cluster of its own (3 masters, a replica each, AsyncRedisStore
//       from a redis-cluster:// URL, min_replica_acks 1, auto-batched per slot): at 30% of the
//       deliveries a master is SIGKILLed, its replica takes over, and the old master comes back as a
//       replica, all while consumers are killed and restarted (IDEM_CHAOS_CLUSTER_URL);
//   (j) as (a) on a replicated PostgreSQL pair (tests/postgres/pg_pair.sh, synchronous replication,
//       one multi-host conninfo with target_session_attrs=read-write): at 25%, 50% and 75% of the
//       deliveries the primary is SIGKILLed, the standby promoted and a new standby attached
//       (pg_basebackup -R) in the dead one's place; IDEM_CHAOS_PG_ASYNC=1 runs the pair with
//       asynchronous replication instead and reports, without failing on them, what is lost;
//   (k) as (j), PostgresStore in lease mode: the claim and completion are short transactions of
//       their own, the handler's business transaction dedupes with applied_events ON CONFLICT.
//   (l) SqliteStore transactional mode on one file the four consumer processes share (no
//       server: the file is the truth; IDEM_CHAOS_SQLITE_PATH): balance UPDATE + effects INSERT
//       through ctx.tx, killed anywhere — mid-handler, mid-commit, between claim and handler. No
//       PostgreSQL restart (nothing of it is on PostgreSQL); synchronous=NORMAL, which loses
//       nothing at a process crash (only a power cut, not injected here);
//   (m) as (l), SqliteStore in lease mode with a plain business transaction of its own (BEGIN
//       IMMEDIATE, UPDATE + INSERT, COMMIT on another connection): a crash between that commit
//       and the completion runs the event again after the lease. Like (c), its double effects are
//       the lease-mode window, counted and reported, not failed on (docs/sqlite.md).
// Exit status 1 when (a), (b), (d), (e), (f), (g), (i), (j), (k) or (l) has a double effect, a lost message or a wrong balance, when
// any setup loses a message, or when a run does not finish in its time bound.
//
// The driver is single-threaded: it forks (to exec) only from one thread.

#include <utility>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <libpq-fe.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "idem/asio/redis_store.hpp"
#include <boost/asio/io_context.hpp>
#include "idem/idem.hpp"
#include "idem/postgres.hpp"
#include "idem/redis.hpp"
#include "idem/redis/streams_consumer.hpp"
#include "idem/tiered.hpp"
#include "idem/outbox/outbox.hpp"
#ifdef IDEM_CHAOS_SQLITE
#include <sqlite3.h>

#include "idem/sqlite.hpp"
#endif
#include "redis_cluster.hpp"
#include "redis_server.hpp"
#include "worker_io.hpp"

#ifndef IDEM_PG_CLUSTER_SCRIPT
#error "IDEM_PG_CLUSTER_SCRIPT must point at tests/postgres/pg_cluster.sh"
#endif

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kAccounts = 100;
constexpr int kConsumers = 4;
constexpr auto kLease = 2000ms;  // guard lease = XAUTOCLAIM min-idle
const char* const kGroup = "payments";

std::atomic<bool> g_stop{false};
extern "C" void on_signal(int) { g_stop = true; }

// ---------------------------------------------------------------------------------------------
// hiredis: one connection, reconnecting on demand; errors are exceptions.

struct ReplyFree {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyFree>;

class Redis {
public:
  explicit Redis(int port) : port_(port) {}
  ~Redis() { drop(); }
  Redis(const Redis&) = delete;
  Redis& operator=(const Redis&) = delete;

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
      std::string e = c_->errstr;
      drop();
      throw std::runtime_error("redis: " + e);
    }
    Reply rep(r);
    if (rep->type == REDIS_REPLY_ERROR) throw std::runtime_error("redis: " + std::string(rep->str, rep->len));
    return rep;
  }

  // Pipelined commands; throws (after dropping the connection) if any reply is missing or an error.
  void pipeline(const std::vector<std::vector<std::string>>& cmds) {
    connect();
    for (const auto& args : cmds) {
      std::vector<const char*> argv;
      std::vector<size_t> lens;
      for (const auto& a : args) {
        argv.push_back(a.data());
        lens.push_back(a.size());
      }
      redisAppendCommandArgv(c_, static_cast<int>(argv.size()), argv.data(), lens.data());
    }
    std::string err;
    for (size_t i = 0; i < cmds.size(); ++i) {
      void* r = nullptr;
      if (redisGetReply(c_, &r) != REDIS_OK || r == nullptr) {
        std::string e = c_->errstr;
        drop();
        throw std::runtime_error("redis: " + e);
      }
      Reply rep(static_cast<redisReply*>(r));
      if (rep->type == REDIS_REPLY_ERROR && err.empty()) err.assign(rep->str, rep->len);
    }
    if (!err.empty()) throw std::runtime_error("redis: " + err);
  }

  void drop() {
    if (c_) redisFree(c_);
    c_ = nullptr;
  }

private:
  void connect() {
    if (c_) return;
    timeval tv{1, 0};
    c_ = redisConnectWithTimeout("127.0.0.1", port_, tv);
    if (c_ == nullptr || c_->err) {
      std::string e = c_ ? c_->errstr : "alloc";
      drop();
      throw std::runtime_error("redis connect: " + e);
    }
    timeval ct{3, 0};
    redisSetTimeout(c_, ct);
  }
  int port_;
  redisContext* c_ = nullptr;
};

std::string str(const redisReply* r) {
  if (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS) return {r->str, r->len};
  if (r->type == REDIS_REPLY_INTEGER) return std::to_string(r->integer);
  return {};
}

// ---------------------------------------------------------------------------------------------
// libpq: a plain connection for the business writes of (b)/(c) and for the driver's checks.

struct business_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The rows of one of the driver's own statements.
class SqlResult {
public:
  explicit SqlResult(PGresult* r) : r_(r, &PQclear) {}
  int rows() const { return PQntuples(r_.get()); }
  std::string_view get(int row, int col) const { return PQgetvalue(r_.get(), row, col); }
  std::uint64_t affected() const { return std::strtoull(PQcmdTuples(r_.get()), nullptr, 10); }
  PGresult* native() const { return r_.get(); }

private:
  std::unique_ptr<PGresult, decltype(&PQclear)> r_;
};

class Pg {
public:
  explicit Pg(std::string conninfo) : ci_(std::move(conninfo)) {}
  ~Pg() { drop(); }
  Pg(const Pg&) = delete;
  Pg& operator=(const Pg&) = delete;

  // Runs one statement; any failure drops the connection (an open transaction dies with it).
  SqlResult exec(const std::string& sql, const std::vector<std::string>& params = {}) {
    connect();
    std::vector<const char*> vals;
    for (const auto& p : params) vals.push_back(p.c_str());
    SqlResult r(PQexecParams(c_, sql.c_str(), static_cast<int>(vals.size()), nullptr, vals.data(), nullptr,
                             nullptr, 0));
    const auto st = r.native() ? PQresultStatus(r.native()) : PGRES_FATAL_ERROR;
    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) {
      std::string e = PQerrorMessage(c_);
      drop();
      throw business_error("postgres: " + e);
    }
    return r;
  }
  void drop() {
    if (c_) PQfinish(c_);
    c_ = nullptr;
  }

private:
  void connect() {
    if (c_ && PQstatus(c_) == CONNECTION_OK) return;
    drop();
    c_ = PQconnectdb(ci_.c_str());
    if (PQstatus(c_) != CONNECTION_OK) {
      std::string e = PQerrorMessage(c_);
      drop();
      throw business_error("postgres connect: " + e);
    }
  }
  std::string ci_;
  PGconn* c_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// The worker: one consumer process.

struct Entry {
  std::string id;  // stream entry id
  std::string event, account, amount;
};

// One entry as StreamsConsumer read it, in the worker's terms.
Entry to_entry(const idem::StreamEntry& s) {
  Entry en;
  en.id = s.id;
  for (const auto& [name, val] : s.fields) {
    if (name == "e") en.event = val;
    else if (name == "a") en.account = val;
    else if (name == "m") en.amount = val;
    // (e): an outbox message as RedisStreamsPublisher writes it: its id is the idempotency key.
    else if (name == "id") en.event = val;
    else if (name == "key") en.account = val;
    else if (name == "payload") en.amount = val;
  }
  return en;
}

class Stats {
public:
  explicit Stats(const std::string& path) : fd_(::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644)) {}
  ~Stats() {
    if (fd_ >= 0) ::close(fd_);
  }
  Stats(const Stats&) = delete;
  Stats& operator=(const Stats&) = delete;
  // One fixed-size line per event, written at once: a SIGKILL loses nothing written before it.
  void note(char c) {
    const char line[2] = {c, '\n'};
    if (fd_ >= 0 && ::write(fd_, line, 2) != 2) {
    }
  }

private:
  int fd_;
};

char status_char(idem::Status s) {
  switch (s) {
    case idem::Status::executed: return 'X';
    case idem::Status::duplicate: return 'U';
    case idem::Status::in_flight: return 'I';
    case idem::Status::previously_failed: return 'F';
    case idem::Status::stale: return 'S';
    case idem::Status::lease_lost: return 'L';
    case idem::Status::mismatch: return 'M';
  }
  return '?';
}

int worker_main(int argc, char** argv) {
  if (argc < 7) {
    std::fprintf(stderr, "usage: idem_chaos worker SETUP REDIS_PORT CONNINFO CONSUMER STATS_FILE\n");
    return 2;
  }
  const char setup = argv[2][0];
  const int port = std::atoi(argv[3]);
  const std::string conninfo = argv[4];
  const std::string consumer = argv[5];
  Stats stats(argv[6]);
  // (e): consumers named down-N are the downstream consumer of the outbox's stream.
  const bool downstream = setup == 'e' && consumer.rfind("down-", 0) == 0;
  const std::string stream = downstream ? std::string("chaos:e:out") : std::string("chaos:") + setup;
  const std::string T = downstream ? std::string("ed") : std::string(1, setup);  // table prefix
  std::signal(SIGTERM, on_signal);

  const auto hard_stop = Clock::now() + 30min;  // bounded even if the driver vanished
  idem::GuardOptions go;
  go.lease = kLease;
  go.retention = 1h;
  go.failure.mode = idem::FailureMode::release;
  go.owner = consumer + ":" + std::to_string(::getpid());
  go.heartbeat = setup == 'g' || setup == 'h';

  // Stores are created lazily and again after a failure to construct (the server may be down).
  std::optional<idem::PostgresStore> pgs;
  std::optional<idem::IdempotencyGuard<idem::PostgresStore>> pguard;
  std::optional<idem::RedisStore> rs;
  std::optional<idem::IdempotencyGuard<idem::RedisStore>> rguard;
  // (f), (i): the multiplexed store and the io thread its connections run on.
  idem_test::WorkerIo io(setup == 'f' || setup == 'i');
  std::optional<idem::AsyncRedisStore> as;
  std::optional<idem::IdempotencyGuard<idem::AsyncRedisStore>> aguard;
  // (d): the tiered store over the fast Redis (no persistence) and PostgreSQL transactional mode.
  std::optional<idem::PostgresStore> dpg;
  std::optional<idem::TieredStore> ts;
  std::optional<idem::IdempotencyGuard<idem::TieredStore>> tguard;
  Pg biz(conninfo);
#ifdef IDEM_CHAOS_SQLITE
  // (l), (m): the driver's SQLite file; (m)'s business transactions on a connection of their own.
  std::optional<idem::SqliteStore> sqs;
  std::optional<idem::IdempotencyGuard<idem::SqliteStore>> sguard;
  struct SqliteHandle {
    sqlite3* db = nullptr;
    ~SqliteHandle() { sqlite3_close_v2(db); }
  } sqbiz;
  const char* sqlite_path = std::getenv("IDEM_CHAOS_SQLITE_PATH");
  auto sqlite_guard = [&]() -> idem::IdempotencyGuard<idem::SqliteStore>& {
    if (!sqs) {
      sqs.emplace(idem::SqliteOptions{.path = sqlite_path ? sqlite_path : "",
                                      .mode = setup == 'l' ? idem::SqliteMode::transactional : idem::SqliteMode::lease,
                                      .synchronous = idem::SqliteSync::normal,
                                      .busy_timeout = idem::millis{5000}});
      sguard.emplace(*sqs, go);
    }
    return *sguard;
  };
  // (m): not idempotent on its own: a redelivery after a crash past this commit applies it again.
  auto apply_sqlite_plain = [&](const Entry& e) {
    if (!sqbiz.db) {
      if (sqlite3_open(sqlite_path ? sqlite_path : "", &sqbiz.db) != SQLITE_OK) throw business_error("sqlite open");
      sqlite3_busy_timeout(sqbiz.db, 5000);
      sqlite3_exec(sqbiz.db, "PRAGMA synchronous=NORMAL", nullptr, nullptr, nullptr);
    }
    const std::string sql = "BEGIN IMMEDIATE; UPDATE m_accounts SET balance = balance + " +
                            std::to_string(std::stoll(e.amount)) + " WHERE id = " + std::to_string(std::stoi(e.account)) +
                            "; INSERT INTO m_effects(event_id) VALUES ('" + e.event + "'); COMMIT;";
    if (sqlite3_exec(sqbiz.db, sql.c_str(), nullptr, nullptr, nullptr) != SQLITE_OK) {
      const std::string why = sqlite3_errmsg(sqbiz.db);
      if (sqlite3_get_autocommit(sqbiz.db) == 0) sqlite3_exec(sqbiz.db, "ROLLBACK", nullptr, nullptr, nullptr);
      throw business_error("sqlite business transaction: " + why);
    }
  };
#endif

  auto redis_guard = [&]() -> idem::IdempotencyGuard<idem::RedisStore>& {
    if (!rs) {
      idem::RedisOptions ro;
      ro.port = port;
      ro.key_prefix = "idem:" + T + ":";
      ro.pool.size = 2;
      ro.connect_timeout = idem::millis{1000};
      ro.command_timeout = idem::millis{2000};
      ro.pool.wait = idem::millis{2000};
      rs.emplace(std::move(ro));
      rguard.emplace(*rs, go);
    }
    return *rguard;
  };
  auto async_guard = [&]() -> idem::IdempotencyGuard<idem::AsyncRedisStore>& {
    if (!as) {
      idem::RedisOptions ro;
      if (setup == 'i') {  // the driver's cluster; a claim is answered once a replica has it
        const char* url = std::getenv("IDEM_CHAOS_CLUSTER_URL");
        ro = idem::parse_redis_url(url ? url : "redis-cluster://");
        ro.min_replica_acks = 1;
        ro.replica_ack_timeout = idem::millis{1000};
      } else {
        ro.port = port;
      }
      ro.key_prefix = "idem:" + T + ":";
      ro.connect_timeout = idem::millis{1000};
      ro.command_timeout = idem::millis{2000};
      as.emplace(io.executor(), std::move(ro));
      aguard.emplace(*as, go);
    }
    return *aguard;
  };
  auto reset_store = [&] {  // a store that could not even be built: build it again
    pguard.reset();
    pgs.reset();
    rguard.reset();
    rs.reset();
    aguard.reset();
    as.reset();
    tguard.reset();
    ts.reset();
    dpg.reset();
#ifdef IDEM_CHAOS_SQLITE
    sguard.reset();
    sqs.reset();
#endif
  };

  // (b) and (d): the business transaction records the event id (ON CONFLICT DO NOTHING) and skips
  // the update when it was recorded before (a redelivery after a crash before complete).
  // Returns false when it skipped.
  auto apply_once = [&](const Entry& e, Pg& db) {
    db.exec("BEGIN");
    auto ins = db.exec("INSERT INTO " + T + "_applied(event_id) VALUES ($1) ON CONFLICT DO NOTHING", {e.event});
    const bool fresh = ins.affected() == 1;
    if (fresh) {
      db.exec("UPDATE " + T + "_accounts SET balance = balance + $1::bigint WHERE id = $2::int",
             {e.amount, e.account});
      db.exec("INSERT INTO " + T + "_effects(event_id) VALUES ($1)", {e.event});
    }
    db.exec("COMMIT");
    return fresh;
  };

  // (c) and (e): one autocommit statement: the balance update and its effect row commit together.
  auto apply_plain = [&](const Entry& e) {
    biz.exec("WITH u AS (UPDATE " + T + "_accounts SET balance = balance + $1::bigint WHERE id = $2::int RETURNING id) "
             "INSERT INTO " + T + "_effects(event_id) SELECT $3 FROM u",
             {e.amount, e.account, e.event});
  };

  auto run_one = [&](const Entry& e, Pg& db) -> idem::Status {
    const std::string payload = e.account + "|" + e.amount;
#ifdef IDEM_CHAOS_SQLITE
    if (setup == 'l') {
      auto out = sqlite_guard().run(e.event, payload, [&](const idem::BasicContext<idem::SqliteStore::Transaction>& ctx) {
        ctx.tx->exec("UPDATE l_accounts SET balance = balance + ? WHERE id = ?", std::stoll(e.amount), std::stoi(e.account));
        ctx.tx->exec("INSERT INTO l_effects(event_id) VALUES (?)", e.event);
      });
      return out.status;
    }
    if (setup == 'm') {
      auto out = sqlite_guard().run(e.event, payload, [&] { apply_sqlite_plain(e); });
      return out.status;
    }
#endif
    if (setup == 'a' || setup == 'j') {
      if (!pgs) {
        pgs.emplace(idem::PostgresOptions{.conninfo = conninfo, .pool = {.size = 2, .wait = idem::millis{3000}},
                                          .statement_timeout = idem::millis{5000}},
                    idem::PostgresStoreOptions{.table = "records_" + T, .mode = idem::PostgresMode::transactional});
        pguard.emplace(*pgs, go);
      }
      auto out = pguard->run(e.event, payload, [&](const idem::BasicContext<idem::PostgresStore::Transaction>& ctx) {
        ctx.tx->exec("UPDATE " + T + "_accounts SET balance = balance + $1::bigint WHERE id = $2::int", e.amount,
                     e.account);
        ctx.tx->exec("INSERT INTO " + T + "_effects(event_id) VALUES ($1)", e.event);
      });
      return out.status;
    }
    if (setup == 'k') {
      if (!pgs) {
        pgs.emplace(idem::PostgresOptions{.conninfo = conninfo, .pool = {.size = 2, .wait = idem::millis{3000}},
                                          .statement_timeout = idem::millis{5000}},
                    idem::PostgresStoreOptions{.table = "records_k", .mode = idem::PostgresMode::lease});
        pguard.emplace(*pgs, go);
      }
      bool skipped = false;
      auto out = pguard->run(e.event, payload, [&] { skipped = !apply_once(e, db); });
      if (skipped) stats.note('K');
      return out.status;
    }
    if (setup == 'd') {
      if (!ts) {
        const char* fast_port = std::getenv("IDEM_CHAOS_FAST_PORT");
        idem::RedisOptions ro;
        ro.port = fast_port ? std::atoi(fast_port) : 0;
        ro.pool.size = 2;
        ro.connect_timeout = idem::millis{300};
        ro.command_timeout = idem::millis{1000};
        dpg.emplace(idem::PostgresOptions{.conninfo = conninfo, .pool = {.size = 2, .wait = idem::millis{3000}},
                                          .statement_timeout = idem::millis{5000}},
                    idem::PostgresStoreOptions{.table = "records_d", .mode = idem::PostgresMode::transactional});
        ts.emplace(std::move(ro), *dpg, idem::TieredStoreOptions{.fast_retry_after = idem::millis{200}});
        tguard.emplace(*ts, go);
      }
      // 'P': a duplicate PostgreSQL answered (Redis had lost the record, or was down): the rest of
      // the duplicates took no PostgreSQL round trip.
      const auto truth_before = ts->stats().truth_duplicates;
      auto out = tguard->run(e.event, payload, [&](const idem::IdempotencyGuard<idem::TieredStore>::context_type& ctx) {
        ctx.tx->exec("UPDATE d_accounts SET balance = balance + $1::bigint WHERE id = $2::int", e.amount, e.account);
        ctx.tx->exec("INSERT INTO d_effects(event_id) VALUES ($1)", e.event);
      });
      if (out.status == idem::Status::duplicate && ts->stats().truth_duplicates != truth_before) stats.note('P');
      return out.status;
    }
    if (setup == 'e' && !downstream) {
      if (!pgs) {
        pgs.emplace(idem::PostgresOptions{.conninfo = conninfo, .pool = {.size = 2, .wait = idem::millis{3000}},
                                          .statement_timeout = idem::millis{5000}},
                    idem::PostgresStoreOptions{.table = "records_e", .mode = idem::PostgresMode::transactional,
                                               .outbox = true});
        pguard.emplace(*pgs, go);
      }
      // The message is written after the account's UPDATE, whose row lock orders the handlers of
      // one account: outbox order per account is commit order.
      auto out = pguard->run(e.event, payload, [&](const idem::BasicContext<idem::PostgresStore::Transaction>& ctx) {
        ctx.tx->exec("UPDATE e_accounts SET balance = balance + $1::bigint WHERE id = $2::int", e.amount, e.account);
        ctx.tx->exec("INSERT INTO e_effects(event_id) VALUES ($1)", e.event);
        ctx.outbox().send("chaos:e:out", e.account, e.amount, {{"type", "balance-changed"}});
      });
      return out.status;
    }
    if (setup == 'f' || setup == 'i') {
      bool skipped = false;
      auto out = async_guard().run(e.event, payload, [&] { skipped = !apply_once(e, db); });
      if (skipped) stats.note('K');
      return out.status;
    }
    if (setup == 'b' || downstream) {
      bool skipped = false;
      auto out = redis_guard().run(e.event, payload, [&] { skipped = !apply_once(e, db); });
      if (skipped) stats.note('K');
      return out.status;
    }
    auto out = redis_guard().run(e.event, payload, [&] { apply_plain(e); });
    return out.status;
  };

  // Handles one delivery; true = ack it. Store and database errors: back off and retry in place.
  // In (f) several lanes call it at once: a store that must be rebuilt is rebuilt after they join.
  std::atomic<bool> reset_wanted{false};
  auto handle = [&](const Entry& e, Pg& db, bool concurrent) -> bool {
    if (e.event.empty()) return true;  // not ours (or deleted): nothing to do
    long long pause = 20;
    const auto give_up = Clock::now() + 20s;
    while (!g_stop && Clock::now() < give_up) {
      try {
        const idem::Status s = run_one(e, db);
        stats.note(status_char(s));
        return s != idem::Status::in_flight;
      } catch (const idem::error& ex) {
        stats.note('E');
        if (!ex.retryable() && dynamic_cast<const idem::outcome_unknown_error*>(&ex) == nullptr &&
            dynamic_cast<const idem::store_error*>(&ex) == nullptr)
          return false;  // not our business here: leave it unacked
      } catch (const business_error&) {
        stats.note('B');
      } catch (const std::exception&) {
        stats.note('E');
        if (!concurrent) reset_store();
        else {
          reset_wanted = true;
          return false;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(pause));
      pause = std::min<long long>(pause * 2, 500);
    }
    return false;
  };

  // (f): a read's deliveries are handled by kLanes threads at once, each with its own database
  // session, all on the consumer's one AsyncRedisStore connection: their acquisitions and
  // completions meet in its queue and go out coalesced (auto-batching). 'C' counts steps that
  // shared a script call with another caller's.
  constexpr size_t kLanes = 4;
  std::vector<std::unique_ptr<Pg>> lane_db;
  for (size_t l = 0; l < kLanes; ++l) lane_db.push_back(std::make_unique<Pg>(conninfo));
  auto handle_lanes = [&](const std::vector<Entry>& entries, std::vector<std::string>& ack) {
    try {
      async_guard();
    } catch (const std::exception&) {
      stats.note('E');
      reset_store();
      std::this_thread::sleep_for(100ms);
      return;  // the entries stay pending and come back
    }
    const auto coalesced_before = as->stats().coalesced;
    std::vector<char> acked(entries.size(), 0);
    std::atomic<size_t> next{0};
    std::vector<std::thread> lanes;
    for (size_t l = 0; l < kLanes; ++l)
      lanes.emplace_back([&, l] {
        for (size_t k; !g_stop && (k = next++) < entries.size();) {
          stats.note('D');
          acked[k] = handle(entries[k], *lane_db[l], true) ? 1 : 0;
        }
      });
    for (auto& t : lanes) t.join();
    for (size_t k = 0; k < entries.size(); ++k)
      if (acked[k]) ack.push_back(entries[k].id);
    for (auto n = as->stats().coalesced - coalesced_before; n > 0; --n) stats.note('C');
    if (reset_wanted.exchange(false)) reset_store();
  };

  // (d), (e): the deliveries of one read through run_batch; returns the entry ids to ack. Items whose
  // run threw are run again in place (a smaller batch each time), as handle() retries one delivery.
  auto handle_batch = [&](const std::vector<Entry>& entries) {
    std::vector<std::string> ack;
    std::vector<const Entry*> todo;
    for (const auto& e : entries) {
      stats.note('D');
      if (e.event.empty()) ack.push_back(e.id);  // not ours (or deleted): nothing to do
      else todo.push_back(&e);
    }
    long long pause = 20;
    const auto give_up = Clock::now() + 20s;
    while (!todo.empty() && !g_stop && Clock::now() < give_up) {
      std::vector<std::string> payloads;
      for (const Entry* e : todo) payloads.push_back(e->account + "|" + e->amount);
      std::vector<idem::BatchItem> items;
      for (size_t k = 0; k < todo.size(); ++k) items.push_back({todo[k]->event, payloads[k]});
      std::vector<const Entry*> again;
      try {
        auto res = redis_guard().run_batch(items, [&](const idem::BatchItem& item) {
          const Entry& e = *todo[static_cast<size_t>(&item - items.data())];
          if (setup == 'h') apply_plain(e);
          else if (!apply_once(e, biz)) stats.note('K');
        });
        for (size_t k = 0; k < todo.size(); ++k) {
          if (!res.errors[k]) {
            stats.note(status_char(res.outcomes[k].status));
            if (res.outcomes[k].status != idem::Status::in_flight) ack.push_back(todo[k]->id);
            continue;
          }
          try {
            std::rethrow_exception(res.errors[k]);
          } catch (const business_error&) {
            stats.note('B');
          } catch (const idem::error& ex) {
            stats.note('E');
            if (!ex.retryable() && dynamic_cast<const idem::store_error*>(&ex) == nullptr)
              continue;  // not our business here: leave it unacked
          } catch (const std::exception&) {
            stats.note('E');
          }
          again.push_back(todo[k]);
        }
      } catch (const idem::error&) {  // the acquisitions failed: nothing ran
        stats.note('E');
        again = todo;
      } catch (const std::exception&) {
        stats.note('E');
        reset_store();
        again = todo;
      }
      todo = std::move(again);
      if (todo.empty()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(pause));
      pause = std::min<long long>(pause * 2, 500);
    }
    return ack;
  };

  // The ids of the entries to ack; the others stay pending and come back.
  auto process = [&](const std::vector<Entry>& entries) {
    std::vector<std::string> ack;
    if ((setup == 'g' || setup == 'h') && !g_stop) {
      for (auto& id : handle_batch(entries)) ack.push_back(std::move(id));
    } else if (setup == 'f' || setup == 'i') {
      handle_lanes(entries, ack);
    } else {
      for (const auto& e : entries) {
        if (g_stop) break;
        stats.note('D');
        if (handle(e, biz, false)) ack.push_back(e.id);
      }
    }
    return ack;
  };

  // The stream through idem::StreamsConsumer: this name's own pending entries first (a previous
  // incarnation's), then entries idle for a lease (a killed consumer's), then new ones. Built again
  // after a failure (Redis may be down when the worker starts).
  std::optional<idem::StreamsConsumer> reader;
  while (!g_stop && Clock::now() < hard_stop) {
    try {
      if (!reader) {
        idem::RedisOptions ro;
        ro.port = port;
        ro.pool.size = 1;
        ro.connect_timeout = idem::millis{1000};
        ro.command_timeout = idem::millis{2000};
        reader.emplace(idem::StreamsConsumerOptions{.redis = ro, .stream = stream, .group = kGroup, .consumer = consumer,
                                                    .count = setup == 'g' || setup == 'h' ? 32u : 16u,
                                                    .block = 100ms, .claim_idle = kLease, .create_group = false});
      }
      const std::vector<idem::StreamEntry> got = reader->poll();
      std::vector<Entry> entries;
      entries.reserve(got.size());
      for (const auto& g : got) entries.push_back(to_entry(g));
      const std::vector<std::string> ack = process(entries);
      std::vector<idem::StreamDecision> decisions(got.size(), {idem::BrokerAction::requeue, {}});
      for (std::size_t i = 0; i < got.size(); ++i)
        if (std::find(ack.begin(), ack.end(), got[i].id) != ack.end()) decisions[i].action = idem::BrokerAction::ack;
      reader->settle(got, decisions);  // Redis down: the entries stay pending and come back later
    } catch (const std::exception&) {
      stats.note('R');
      std::this_thread::sleep_for(100ms);
    }
  }
  return 0;
}

// (e): one outbox relay process, draining idem.records_e_outbox into the stream chaos:e:out until
// SIGTERM (or SIGKILL: its batch then rolls back and is published again by a relay).
int relay_main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: idem_chaos relay REDIS_PORT CONNINFO\n");
    return 2;
  }
  std::signal(SIGTERM, on_signal);
  idem::RedisOptions ro;
  ro.port = std::atoi(argv[2]);
  ro.connect_timeout = idem::millis{1000};
  ro.command_timeout = idem::millis{2000};
  idem::OutboxRelayOptions o;
  o.postgres.conninfo = argv[3];
  o.postgres.statement_timeout = idem::millis{5000};
  o.table = "records_e";
  o.batch = 64;
  o.poll_interval = idem::millis{200};
  o.backoff_initial = idem::millis{20};
  o.backoff_max = idem::millis{500};
  o.claim_idle_timeout = idem::millis{5000};
  o.migrate = false;  // the driver migrated
  idem::OutboxRelay relay{std::make_unique<idem::RedisStreamsPublisher>(idem::RedisStreamsPublisherOptions{.redis = ro}), o};
  relay.start();
  const auto hard_stop = Clock::now() + 30min;  // bounded even if the driver vanished
  while (!g_stop && Clock::now() < hard_stop) std::this_thread::sleep_for(50ms);
  relay.stop();
  return 0;
}

// ---------------------------------------------------------------------------------------------
// The driver.

struct Event {
  std::string id;
  int account;
  long long amount;  // signed cents: credit > 0, debit < 0
};

std::string self_exe() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) throw std::runtime_error("cannot read /proc/self/exe");
  return {buf, static_cast<size_t>(n)};
}

// Runs pg_cluster.sh and waits; the driver has no other threads, so fork+exec is safe.
int run_script(const char* script, const std::vector<std::string>& args, int log_fd) {
  std::vector<std::string> a{"/bin/sh", script};
  a.insert(a.end(), args.begin(), args.end());
  const pid_t pid = idem::test::spawn(a, log_fd);
  int st = 0;
  while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}
int run_pg_cluster(const std::vector<std::string>& args, int log_fd) { return run_script(IDEM_PG_CLUSTER_SCRIPT, args, log_fd); }

struct Counts {
  std::map<char, long long> c;
  long long operator[](char k) const {
    auto it = c.find(k);
    return it == c.end() ? 0 : it->second;
  }
};

Counts read_stats(const std::string& dir) {
  Counts out;
  for (const auto& f : std::filesystem::directory_iterator(dir)) {
    if (f.path().filename().string().rfind("stats-", 0) != 0) continue;
    std::ifstream in(f.path());
    std::string line;
    while (std::getline(in, line))
      if (!line.empty()) ++out.c[line[0]];
  }
  return out;
}

long long stats_lines(const std::string& dir) {
  long long bytes = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir))
    if (f.path().filename().string().rfind("stats-", 0) == 0) bytes += static_cast<long long>(f.file_size());
  return bytes / 2;
}

#ifdef IDEM_CHAOS_SQLITE
// (l), (m): SQL on the setup's file from the driver (tables, then the counts); rows of two columns.
std::vector<std::pair<std::string, long long>> sqlite_rows(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  std::vector<std::pair<std::string, long long>> out;
  if (sqlite3_open(path.c_str(), &db) != SQLITE_OK) {
    sqlite3_close(db);
    throw std::runtime_error("sqlite open " + path);
  }
  sqlite3_busy_timeout(db, 10000);
  const char* rest = sql.c_str();
  while (rest && *rest) {
    sqlite3_stmt* st = nullptr;
    if (sqlite3_prepare_v2(db, rest, -1, &st, &rest) != SQLITE_OK) {
      const std::string why = sqlite3_errmsg(db);
      sqlite3_close(db);
      throw std::runtime_error("sqlite: " + why);
    }
    if (!st) break;  // trailing whitespace
    int rc;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
      const auto* t = sqlite3_column_text(st, 0);
      out.emplace_back(t ? reinterpret_cast<const char*>(t) : "", sqlite3_column_count(st) > 1 ? sqlite3_column_int64(st, 1) : 0);
    }
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE) {
      const std::string why = sqlite3_errmsg(db);
      sqlite3_close(db);
      throw std::runtime_error("sqlite: " + why);
    }
  }
  sqlite3_close(db);
  return out;
}
#endif

struct Result {
  bool ok = false;
  bool finished = false;
  long long doubles = 0, lost = 0, bad_balances = 0, unexplained = 0;
};

class Driver {
public:
  Driver(idem::test::RedisServer& redis, std::string pg_state, std::string conninfo, std::string work, int log_fd)
      : redis_(redis), pg_state_(std::move(pg_state)), conninfo_(std::move(conninfo)), work_(std::move(work)),
        log_fd_(log_fd), exe_(self_exe()) {}

  Result run(char setup, int n_events, std::uint64_t seed, Clock::duration bound) {
    const std::string T(1, setup);
    const std::string stream = "chaos:" + T;
    const std::string dir = work_ + "/" + T;
    std::filesystem::create_directories(dir);
    Result res;

    // (d), (e), (j), (k): a replicated pair of their own; everything of the setup (records, business
    // tables, the outbox and its relays, the consumers' sessions) goes through its multi-host conninfo.
    const bool on_pair = setup == 'd' || setup == 'e' || setup == 'j' || setup == 'k';
    const bool pair_async = on_pair && std::getenv("IDEM_CHAOS_PG_ASYNC") &&
                            std::string(std::getenv("IDEM_CHAOS_PG_ASYNC")) == "1";
    struct PairGuard {
      std::string state;
      int fd;
      ~PairGuard() {
        if (!state.empty()) run_script(IDEM_PG_PAIR_SCRIPT, {"stop", state}, fd);
      }
    } pair{on_pair ? dir + "/pair" : std::string(), log_fd_};
    std::string ci = conninfo_;
    if (on_pair) {
      if (run_script(IDEM_PG_PAIR_SCRIPT, {"start", pair.state, pair_async ? "async" : "sync"}, log_fd_) != 0)
        throw std::runtime_error("pg_pair.sh start failed (see the children's log)");
      std::ifstream in(pair.state + "/conninfo");
      std::getline(in, ci);
    }

    // (l), (m): the setup's own SQLite file (records and business tables), new for each run.
    const bool on_sqlite = setup == 'l' || setup == 'm';
    const std::string sqlite_path = dir + "/chaos.sqlite";
#ifdef IDEM_CHAOS_SQLITE
    if (on_sqlite) {
      for (const char* ext : {"", "-wal", "-shm"}) std::filesystem::remove(sqlite_path + ext);
      ::setenv("IDEM_CHAOS_SQLITE_PATH", sqlite_path.c_str(), 1);
      idem::SqliteStore(idem::SqliteOptions{.path = sqlite_path}).migrate();
      sqlite_rows(sqlite_path, "CREATE TABLE " + T + "_accounts (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL DEFAULT 0); "
                               "WITH RECURSIVE g(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM g WHERE i < " +
                                   std::to_string(kAccounts - 1) + ") INSERT INTO " + T + "_accounts SELECT i, 0 FROM g; "
                               "CREATE TABLE " + T + "_effects (event_id TEXT NOT NULL);");
    }
#else
    if (on_sqlite) throw std::runtime_error("setups (l) and (m) need idem::sqlite, not built here (libsqlite3-dev)");
#endif
    // Tables: accounts, the append-only effects log (no uniqueness: it counts every application).
    {
      Pg pg(ci);
      pg.exec("SET client_min_messages = warning");
      pg.exec("DROP TABLE IF EXISTS " + T + "_accounts, " + T + "_effects, " + T + "_applied");
      pg.exec("CREATE TABLE " + T + "_accounts (id int PRIMARY KEY, balance bigint NOT NULL DEFAULT 0)");
      pg.exec("INSERT INTO " + T + "_accounts SELECT g, 0 FROM generate_series(0, " + std::to_string(kAccounts - 1) + ") g");
      pg.exec("CREATE TABLE " + T + "_effects (event_id text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())");
      if (setup == 'b' || setup == 'f' || setup == 'g' || setup == 'i' || setup == 'k') pg.exec("CREATE TABLE " + T + "_applied (event_id text PRIMARY KEY)");
      if (setup == 'a' || setup == 'j' || setup == 'k') {
        idem::PostgresStore s({.conninfo = ci}, {.table = "records_" + T,
                                                 .mode = setup == 'k' ? idem::PostgresMode::lease
                                                                      : idem::PostgresMode::transactional});
        s.migrate();
      }
      if (setup == 'd') {
        idem::PostgresStore s({.conninfo = ci}, {.table = "records_d", .mode = idem::PostgresMode::transactional});
        s.migrate();
        pg.exec("TRUNCATE idem.records_d");
      }
      if (setup == 'e') {  // the downstream consumer's tables, and the upstream store with its outbox
        pg.exec("DROP TABLE IF EXISTS ed_accounts, ed_effects, ed_applied");
        pg.exec("CREATE TABLE ed_accounts (id int PRIMARY KEY, balance bigint NOT NULL DEFAULT 0)");
        pg.exec("INSERT INTO ed_accounts SELECT g, 0 FROM generate_series(0, " + std::to_string(kAccounts - 1) + ") g");
        pg.exec("CREATE TABLE ed_effects (event_id text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())");
        pg.exec("CREATE TABLE ed_applied (event_id text PRIMARY KEY)");
        idem::PostgresStore s({.conninfo = ci},
                              {.table = "records_e", .mode = idem::PostgresMode::transactional, .outbox = true});
        s.migrate();
      }
    }
    // (d): the tiered store's fast tier, a redis-server without persistence of its own.
    std::optional<idem::test::RedisServer> fast;
    if (setup == 'd') {
      fast.emplace();
      ::setenv("IDEM_CHAOS_FAST_PORT", std::to_string(fast->port()).c_str(), 1);
    }
    long long fast_kills = 0;
    // (i): the records' cluster. No persistence: a write is answered once a replica has it
    // (min_replica_acks 1), and the replica is what takes over.
    std::optional<idem::test::RedisCluster> cluster;
    if (setup == 'i') {
      cluster.emplace(idem::test::RedisCluster::Options{.masters = 3, .replicas_per_master = 1, .node_timeout_ms = 1000});
      ::setenv("IDEM_CHAOS_CLUSTER_URL", cluster->url_all().c_str(), 1);
    }
    long long master_kills = 0;
    Redis r(redis_.port());
    r.cmd({"DEL", stream, stream + ":dlq"});
    r.cmd({"XGROUP", "CREATE", stream, kGroup, "0", "MKSTREAM"});
    if (setup == 'e') {
      r.cmd({"DEL", "chaos:e:out"});
      r.cmd({"XGROUP", "CREATE", "chaos:e:out", kGroup, "0", "MKSTREAM"});
    }

    // The events: unique ids, ~20% published twice, shuffled.
    std::mt19937_64 rng(seed ^ static_cast<std::uint64_t>(setup));
    std::vector<Event> events;
    events.reserve(static_cast<size_t>(n_events));
    for (int i = 0; i < n_events; ++i) {
      const long long cents = static_cast<long long>(rng() % 100'000) + 1;
      events.push_back({"ev-" + T + "-" + std::to_string(i), static_cast<int>(rng() % kAccounts),
                        (rng() % 3 == 0) ? -cents : cents});
    }
    std::vector<int> order;
    for (int i = 0; i < n_events; ++i) order.push_back(i);
    for (int i = 0; i < n_events / 5; ++i) order.push_back(static_cast<int>(rng() % static_cast<std::uint64_t>(n_events)));
    std::shuffle(order.begin(), order.end(), rng);
    const long long planned = static_cast<long long>(order.size());

    std::vector<pid_t> pids(kConsumers, -1);
    int incarnation = 0;
    auto spawn = [&](int slot) {
      const std::string name = "consumer-" + std::to_string(slot);
      pids[static_cast<size_t>(slot)] =
          idem::test::spawn({exe_, "worker", T, std::to_string(redis_.port()), ci + " connect_timeout=2", name,
                             dir + "/stats-" + std::to_string(++incarnation)},
                            log_fd_);
    };
    auto reap = [](pid_t pid) {
      int st = 0;
      while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
      }
    };
    for (int i = 0; i < kConsumers; ++i) spawn(i);
    // (e): slots 0-1 are outbox relays, 2-3 downstream consumers; killed and restarted like the rest.
    std::vector<pid_t> epids;
    long long relay_kills = 0, downstream_kills = 0;
    auto spawn_e = [&](size_t slot) {
      const std::string eci = ci + " connect_timeout=2";
      epids[slot] = idem::test::spawn(
          slot < 2 ? std::vector<std::string>{exe_, "relay", std::to_string(redis_.port()), eci}
                   : std::vector<std::string>{exe_, "worker", T, std::to_string(redis_.port()), eci,
                                              "down-" + std::to_string(slot), dir + "/down-stats-" + std::to_string(++incarnation)},
          log_fd_);
    };
    if (setup == 'e') {
      epids.assign(4, -1);
      for (size_t i = 0; i < epids.size(); ++i) spawn_e(i);
    }

    const auto t0 = Clock::now();
    const auto deadline = t0 + bound;
    std::uniform_int_distribution<int> kill_gap(100, 300);
    auto next_kill = t0 + std::chrono::milliseconds(kill_gap(rng));
    size_t published = 0;
    long long republished = 0;
    long long crashes = 0, unexpected_exits = 0, restarts = 0;
    // (l), (m) keep nothing on PostgreSQL: its restart would test nothing of theirs.
    bool redis_restarted = false, pg_restarted = on_sqlite;
    long long pg_failovers = 0;
    auto last_check = t0;
    const size_t chunk = 400;  // per 50 ms: 8,000 events/s, so production overlaps consumption
    auto next_publish = t0;

    while (!g_stop && Clock::now() < deadline) {
      std::this_thread::sleep_for(10ms);
      const auto now = Clock::now();
      // Producer: at-least-once itself (a chunk whose replies were lost is published again).
      if (published < order.size() && now >= next_publish) {
        next_publish = now + 50ms;
        const size_t end = std::min(order.size(), published + chunk);
        std::vector<std::vector<std::string>> cmds;
        for (size_t i = published; i < end; ++i) {
          const Event& e = events[static_cast<size_t>(order[i])];
          cmds.push_back({"XADD", stream, "*", "e", e.id, "a", std::to_string(e.account), "m", std::to_string(e.amount)});
        }
        try {
          r.pipeline(cmds);
          published = end;
        } catch (const std::exception&) {
          republished += static_cast<long long>(end - published);  // upper bound; some may repeat
        }
      }
      // Consumers that died on their own are restarted too (and counted).
      for (int i = 0; i < kConsumers; ++i) {
        int st = 0;
        if (::waitpid(pids[static_cast<size_t>(i)], &st, WNOHANG) == pids[static_cast<size_t>(i)]) {
          ++unexpected_exits;
          spawn(i);
        }
      }
      for (size_t i = 0; i < epids.size(); ++i) {
        int st = 0;
        if (::waitpid(epids[i], &st, WNOHANG) == epids[i]) {
          ++unexpected_exits;
          spawn_e(i);
        }
      }
      // Killer.
      if (now >= next_kill && !epids.empty() && rng() % 2 == 0) {  // (e): a relay or a downstream consumer
        const size_t slot = static_cast<size_t>(rng() % epids.size());
        ::kill(epids[slot], SIGKILL);
        reap(epids[slot]);
        ++(slot < 2 ? relay_kills : downstream_kills);
        spawn_e(slot);
        next_kill = now + std::chrono::milliseconds(kill_gap(rng));
      }
      if (now >= next_kill) {
        const int slot = static_cast<int>(rng() % kConsumers);
        ::kill(pids[static_cast<size_t>(slot)], SIGKILL);
        reap(pids[static_cast<size_t>(slot)]);
        ++crashes;
        spawn(slot);
        next_kill = now + std::chrono::milliseconds(kill_gap(rng));
      }
      // Server restarts, once each, at 30% and 65% of the planned deliveries.
      const long long progress = stats_lines(dir);
      if (!redis_restarted && progress * 10 >= planned * 3 * 2) {  // 'D' + outcome lines: 2 per delivery
        redis_restarted = true;
        r.drop();
        redis_.stop(SIGKILL);
        std::this_thread::sleep_for(300ms);
        redis_.start();
        ++restarts;
        std::fprintf(stderr, "[%c] redis-server SIGKILLed and restarted (AOF) at %.1f s\n", setup,
                     std::chrono::duration<double>(Clock::now() - t0).count());
      }
      // (i): a master dies at 30%; the driver waits for its replica to take over, then starts it
      // again (it rejoins as a replica).
      if (cluster && master_kills == 0 && progress * 10 >= planned * 3 * 2) {
        ++master_kills;
        const auto k0 = Clock::now();
        const std::size_t victim = cluster->masters().front();
        cluster->kill_master(victim);
        const std::size_t promoted = cluster->wait_failover(victim, 60s);
        cluster->restart_node(victim, false);
        std::fprintf(stderr, "[%c] cluster master %s SIGKILLed at %.1f s, %s took over in %.1f s\n", setup,
                     cluster->addr(victim).c_str(), std::chrono::duration<double>(k0 - t0).count(),
                     cluster->addr(promoted).c_str(), std::chrono::duration<double>(Clock::now() - k0).count());
      }
      // (d): the fast tier dies at 15%, 45% and 80% and comes back empty after 400 ms (its records
      // are lost; PostgreSQL answers until Redis is repaired).
      if (fast && fast_kills < 3 && progress * 100 >= planned * 2 * (fast_kills == 0 ? 15 : fast_kills == 1 ? 45 : 80)) {
        ++fast_kills;
        fast->stop(SIGKILL);
        std::this_thread::sleep_for(400ms);
        fast->start();
        std::fprintf(stderr, "[%c] fast-tier redis-server (no persistence) SIGKILLed and restarted empty at %.1f s\n",
                     setup, std::chrono::duration<double>(Clock::now() - t0).count());
      }
      // (j), (k): failovers at 25%, 50% and 75%: the primary SIGKILLed, the standby promoted, a new
      // standby attached where the dead one was (in sync mode commits wait for it meanwhile).
      if (on_pair && pg_failovers < 3 && progress * 100 >= planned * 2 * 25 * (pg_failovers + 1)) {
        const auto f0 = Clock::now();
        for (const char* step : {"kill-primary", "promote", "attach"})
          if (run_script(IDEM_PG_PAIR_SCRIPT, {step, pair.state}, log_fd_) != 0)
            throw std::runtime_error(std::string("pg_pair.sh ") + step + " failed (see the children's log)");
        ++pg_failovers;
        pg_restarted = pg_failovers == 3;
        std::fprintf(stderr, "[%c] PostgreSQL failover %lld at %.1f s: primary SIGKILLed, standby promoted, new standby "
                     "attached (took %.1f s)\n", setup, pg_failovers, std::chrono::duration<double>(f0 - t0).count(),
                     std::chrono::duration<double>(Clock::now() - f0).count());
      }
      if (!on_pair && redis_restarted && !pg_restarted && progress * 100 >= planned * 65 * 2) {
        pg_restarted = true;
        const auto p0 = Clock::now();
        if (run_pg_cluster({"restart", pg_state_}, log_fd_) != 0) throw std::runtime_error("pg_cluster.sh restart failed");
        ++restarts;
        std::fprintf(stderr, "[%c] PostgreSQL restarted at %.1f s (took %.1f s)\n", setup,
                     std::chrono::duration<double>(p0 - t0).count(), std::chrono::duration<double>(Clock::now() - p0).count());
      }
      // Done when everything is published, both restarts happened, all entries were delivered
      // to the group and none is pending.
      if (published == order.size() && pg_restarted && now - last_check > 250ms) {
        last_check = now;
        try {
          // (e): and every outbox row sent, every message of chaos:e:out delivered and acked.
          if (drained(r, stream) &&
              (setup != 'e' || (Pg(ci).exec("SELECT 1 FROM idem.records_e_outbox WHERE sent_at IS NULL LIMIT 1")
                                        .rows() == 0 &&
                                drained(r, "chaos:e:out")))) {
            res.finished = true;
            break;
          }
        } catch (const std::exception&) {
        }
      }
    }
    const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
    pids.insert(pids.end(), epids.begin(), epids.end());  // (e): relays and downstream consumers
    for (pid_t p : pids) ::kill(p, SIGTERM);
    const auto grace = Clock::now() + 3s;
    for (pid_t p : pids) {
      int st = 0;
      while (::waitpid(p, &st, WNOHANG) == 0) {
        if (Clock::now() > grace) {
          ::kill(p, SIGKILL);
          reap(p);
          break;
        }
        std::this_thread::sleep_for(10ms);
      }
    }

    // Measure: what the business transactions applied, per event.
    Pg pg(ci);
    std::unordered_map<std::string, long long> applied;
    if (on_sqlite) {
#ifdef IDEM_CHAOS_SQLITE
      for (auto& [id, n] : sqlite_rows(sqlite_path, "SELECT event_id, count(*) FROM " + T + "_effects GROUP BY event_id"))
        applied[id] = n;
#endif
    } else {
      auto rows = pg.exec("SELECT event_id, count(*) FROM " + T + "_effects GROUP BY event_id");
      for (int i = 0; i < rows.rows(); ++i) applied[std::string(rows.get(i, 0))] = std::atoll(std::string(rows.get(i, 1)).c_str());
    }
    // (e): the upstream effects are counted apart; the verdict is on the downstream consumer's,
    // found by the outbox id each event's message got (its handler's first send).
    long long up_doubles = 0, up_lost = 0;
    if (setup == 'e') {
      for (const auto& e : events) {
        auto it = applied.find(e.id);
        const long long n = it == applied.end() ? 0 : it->second;
        if (n == 0) ++up_lost;
        if (n > 1) up_doubles += n - 1;
      }
      std::unordered_map<std::string, long long> down;
      auto rows = pg.exec("SELECT event_id, count(*) FROM ed_effects GROUP BY event_id");
      for (int i = 0; i < rows.rows(); ++i) down[std::string(rows.get(i, 0))] = std::atoll(std::string(rows.get(i, 1)).c_str());
      applied.clear();
      for (const auto& e : events) {
        auto it = down.find(idem::outbox_message_id("idem.records_e", e.id, 0));
        if (it != down.end()) applied[e.id] = it->second;
      }
    }
    std::vector<long long> expected(kAccounts, 0), explained(kAccounts, 0);
    long long effects_total = 0;
    for (const auto& e : events) {
      expected[static_cast<size_t>(e.account)] += e.amount;
      auto it = applied.find(e.id);
      const long long n = it == applied.end() ? 0 : it->second;
      effects_total += n;
      explained[static_cast<size_t>(e.account)] += n * e.amount;
      if (n == 0) ++res.lost;
      if (n > 1) res.doubles += n - 1;
    }
    if (on_sqlite) {
#ifdef IDEM_CHAOS_SQLITE
      for (auto& [id_text, bal] : sqlite_rows(sqlite_path, "SELECT id, balance FROM " + T + "_accounts ORDER BY id")) {
        const auto id = static_cast<size_t>(std::atoi(id_text.c_str()));
        if (id < expected.size() && bal != expected[id]) ++res.bad_balances;
        if (id < explained.size() && bal != explained[id]) ++res.unexplained;
      }
#endif
    } else {
      auto rows = pg.exec("SELECT id, balance FROM " + (setup == 'e' ? std::string("ed") : T) + "_accounts ORDER BY id");
      for (int i = 0; i < rows.rows(); ++i) {
        const auto id = static_cast<size_t>(std::atoi(std::string(rows.get(i, 0)).c_str()));
        const long long bal = std::atoll(std::string(rows.get(i, 1)).c_str());
        if (id < expected.size() && bal != expected[id]) ++res.bad_balances;
        if (id < explained.size() && bal != explained[id]) ++res.unexplained;  // balance vs. the effects log
      }
    }
    long long dlq = -1;
    try {
      dlq = r.cmd({"XLEN", stream + ":dlq"})->integer;
    } catch (const std::exception&) {
    }
    const Counts c = read_stats(dir);
    const char* names[] = {"PostgreSQL transactional mode (balance UPDATE through ctx.tx)",
                           "RedisStore + PostgreSQL transaction with applied_events ON CONFLICT DO NOTHING",
                           "RedisStore + plain autocommit UPDATE",
                           "TieredStore: Redis without persistence answers duplicates, PostgreSQL transactional mode "
                           "is the truth (balance UPDATE through ctx.tx)",
                           "PostgreSQL transactional mode + transactional outbox -> relays -> Redis Stream -> downstream "
                           "idem consumer (counted downstream)",
                           "AsyncRedisStore (one multiplexed connection per consumer, 4 threads on it: auto-batched) + PostgreSQL transaction "
                           "with applied_events ON CONFLICT DO NOTHING",
                           "RedisStore + run_batch per read + PostgreSQL transaction with applied_events ON "
                           "CONFLICT DO NOTHING",
                           "RedisStore + run_batch per read + plain autocommit UPDATE",
                           "AsyncRedisStore on a 3-master Redis Cluster (min_replica_acks 1, a master failed over "
                           "mid-run; auto-batched per slot) + PostgreSQL transaction with applied_events ON CONFLICT "
                           "DO NOTHING",
                           "PostgreSQL transactional mode on a replicated pair, three failovers",
                           "PostgresStore lease mode on a replicated pair, three failovers + PostgreSQL transaction with "
                           "applied_events ON CONFLICT DO NOTHING",
                           "SqliteStore transactional mode, four processes on one file (balance UPDATE through ctx.tx)",
                           "SqliteStore lease mode, four processes on one file + a plain SQLite business transaction "
                           "(the lease window counted)"};
    std::printf("setup (%c) %s: %d events, %lld published (%lld duplicates), wall %.1f s%s\n", setup,
                names[setup - 'a'], n_events, planned, planned - n_events, wall, res.finished ? "" : g_stop ? " — INTERRUPTED (counts below are partial)" : " — DID NOT FINISH in its time bound");
    std::printf("(%c) deliveries: %lld\n", setup, c['D']);
    // A consumer killed right after its commit cannot count its run: the effects log is the truth.
    const std::string skipped =
        setup == 'b' || setup == 'f' || setup == 'g' || setup == 'i' || setup == 'k' ? ", handler runs skipped by applied_events: " + std::to_string(c['K']) : "";
    std::printf("(%c) executions: %lld counted by consumers (effects applied: %lld%s)\n", setup, c['X'] + c['L'],
                effects_total, skipped.c_str());
    std::printf("(%c) duplicates suppressed: %lld\n", setup, c['U']);
    if (setup == 'i')
      std::printf("(%c) cluster masters SIGKILLed and failed over: %lld\n", setup, master_kills);
    if (on_pair)
      std::printf("(%c) PostgreSQL failovers (%s replication): %lld\n", setup, pair_async ? "asynchronous" : "synchronous",
                  pg_failovers);
    if (setup == 'f' || setup == 'i')
      std::printf("(%c) steps coalesced into another caller's script call (auto-batching): %lld\n", setup, c['C']);
    if (setup == 'd')
      std::printf("(d) duplicates answered by Redis alone (no PostgreSQL round trip): %lld of %lld (%.1f%%); by "
                  "PostgreSQL: %lld; fast-tier Redis kills (restarted empty): %lld\n",
                  c['U'] - c['P'], c['U'], c['U'] > 0 ? 100.0 * static_cast<double>(c['U'] - c['P']) / static_cast<double>(c['U']) : 0.0,
                  c['P'], fast_kills);
    std::printf("(%c) stale skipped: %lld\n", setup, c['S']);
    std::printf("(%c) in-flight left for redelivery: %lld, lease lost: %lld, dead-lettered: %lld, store/db errors retried: %lld\n",
                setup, c['I'], c['L'], dlq, c['E'] + c['B']);
    std::printf("(%c) crashes injected: %lld (unexpected consumer exits: %lld)\n", setup, crashes, unexpected_exits);
    std::printf("(%c) server restarts: %lld (redis-server SIGKILL + AOF restart%s)\n", setup, restarts,
                setup == 'l' || setup == 'm' ? "; the SQLite file has no server" : ", PostgreSQL restart");
    if (setup == 'e')
      std::printf("(e) upstream double effects: %lld, upstream lost: %lld; relays killed: %lld, downstream consumers "
                  "killed: %lld\n",
                  up_doubles, up_lost, relay_kills, downstream_kills);
    std::printf("(%c) double effects: %lld\n", setup, res.doubles);
    std::printf("(%c) lost messages: %lld\n", setup, res.lost);
    std::printf("(%c) balances: %d accounts, %lld differ from the expected value, %lld differ from the effects log\n",
                setup, kAccounts, res.bad_balances, res.unexplained);
    std::fflush(stdout);
    (void)republished;

    if (setup == 'm')
      std::printf("(m) lease-mode window: %lld events applied twice (a consumer killed after its business commit, before "
                  "the completion; counted, not failed on)\n",
                  res.doubles);
    if (setup == 'c' || setup == 'h' || setup == 'm')
      res.ok = res.finished && res.lost == 0 && res.unexplained == 0;
    else if (pair_async)  // measured, not failed on: what asynchronous replication loses in a failover
      res.ok = res.finished;
    else
      res.ok = res.finished && res.lost == 0 && res.doubles == 0 && res.bad_balances == 0 && res.unexplained == 0 &&
               up_doubles == 0 && up_lost == 0;
    return res;
  }

private:
  static bool drained(Redis& r, const std::string& stream) {
    auto info = r.cmd({"XINFO", "STREAM", stream});
    std::string last_generated;
    for (size_t i = 0; i + 1 < info->elements; i += 2)
      if (str(info->element[i]) == "last-generated-id") last_generated = str(info->element[i + 1]);
    auto groups = r.cmd({"XINFO", "GROUPS", stream});
    for (size_t g = 0; g < groups->elements; ++g) {
      const redisReply* gr = groups->element[g];
      std::string last_delivered;
      long long pending = -1;
      for (size_t i = 0; i + 1 < gr->elements; i += 2) {
        const std::string k = str(gr->element[i]);
        if (k == "last-delivered-id") last_delivered = str(gr->element[i + 1]);
        if (k == "pending") pending = gr->element[i + 1]->integer;
      }
      if (!last_generated.empty() && last_delivered == last_generated && pending == 0) return true;
    }
    return false;
  }

  idem::test::RedisServer& redis_;
  std::string pg_state_, conninfo_, work_;
  int log_fd_;
  std::string exe_;
};

int driver_main(int argc, char** argv) {
  bool large = std::getenv("IDEM_CHAOS_LARGE") && std::string(std::getenv("IDEM_CHAOS_LARGE")) == "1";
  int events = 0;
  std::string setups = "abcdefgijklm";
  std::uint64_t seed = std::random_device{}();
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--large") large = true;
    else if (a == "--events" && i + 1 < argc) events = std::atoi(argv[++i]);
    else if (a == "--setups" && i + 1 < argc) setups = argv[++i];
    else if (a == "--seed" && i + 1 < argc) seed = std::strtoull(argv[++i], nullptr, 10);
    else {
      std::fprintf(stderr, "usage: idem_chaos [--large] [--events N] [--setups abcdefgijklm] [--seed S]\n");
      return 2;
    }
  }
  if (events <= 0) events = large ? 100'000 : 10'000;
  const auto bound = large ? Clock::duration(15min) : Clock::duration(100s);
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  std::signal(SIGPIPE, SIG_IGN);

  char tmpl[] = "/tmp/idem-chaos-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) throw std::runtime_error("mkdtemp failed");
  const std::string work = tmpl;
  const std::string log = work + "/children.log";
  const int log_fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  const std::string pg_state = work + "/pg";
  struct WorkDir {  // removed last, after the servers are gone (kept when IDEM_CHAOS_KEEP=1)
    std::string path;
    ~WorkDir() {
      std::error_code ec;
      if (!std::getenv("IDEM_CHAOS_KEEP")) std::filesystem::remove_all(path, ec);
    }
  } work_dir{work};
  std::printf("chaos: seed %llu, %d events per setup, %d consumers, kills every 100-300 ms, work dir %s\n",
              static_cast<unsigned long long>(seed), events, kConsumers, work.c_str());
  std::fflush(stdout);

  // Servers: stopped by RAII on every path out of here (and killed with us: PDEATHSIG for
  // redis-server and the consumers; the PostgreSQL cluster by pg_cluster.sh stop).
  struct PgGuard {
    std::string state;
    int fd;
    ~PgGuard() { run_pg_cluster({"stop", state}, fd); }
  } pg_guard{pg_state, log_fd};
  if (run_pg_cluster({"start", pg_state}, log_fd) != 0) {
    std::fprintf(stderr, "chaos: PostgreSQL did not start; see %s\n", log.c_str());
    return 1;
  }
  std::string conninfo;
  {
    std::ifstream in(pg_state + "/conninfo");
    std::getline(in, conninfo);
  }
  // Redis persists with AOF and appendfsync always: every write is in the AOF (write(2)) before
  // its reply, so a SIGKILL of redis-server loses nothing acknowledged. The AOF goes to tmpfs when
  // there is one: fsync there is free, and the run injects process crashes, not power loss.
  std::string aof_dir = work + "/redis-data";
  {
    char shm[] = "/dev/shm/idem-chaos-XXXXXX";
    if (std::filesystem::is_directory("/dev/shm") && ::mkdtemp(shm) != nullptr) aof_dir = shm;
    else std::filesystem::create_directories(aof_dir);
  }
  struct AofDir {
    std::string path;
    ~AofDir() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  } aof_guard{aof_dir};
  idem::test::RedisServer redis({"dir " + aof_dir, "appendonly yes", "appendfsync always", "aof-use-rdb-preamble yes"});

  bool ok = true;
  const auto t0 = Clock::now();
  for (char s : setups) {
    if (s < 'a' || s > 'm' || g_stop) continue;
    Driver d(redis, pg_state, conninfo, work, log_fd);
    // (e) runs eight processes (consumers, relays, downstream consumers) and two hops; (j) and (k)
    // wait out three failovers (about 2.5 s each, commits waiting meanwhile): half the events.
    const bool half = s == 'e' || s == 'j' || s == 'k';
    const Result r = d.run(s, half ? std::max(1, events / 2) : events, seed, bound);
    if (!r.ok) {
      ok = false;
      std::printf("(%c) FAILED\n", s);
    }
  }
  std::printf("chaos: total wall %.1f s: %s\n", std::chrono::duration<double>(Clock::now() - t0).count(),
              ok ? "PASS" : "FAIL");
  if (!ok) {
    std::ifstream in(log);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string s = ss.str();
    std::fprintf(stderr, "children's log (tail):\n%s\n", s.size() > 4000 ? s.substr(s.size() - 4000).c_str() : s.c_str());
  }
  std::fflush(stdout);
  // pg_guard stops the cluster as this returns; the work dir goes after it.
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc > 1 && std::string(argv[1]) == "worker") return worker_main(argc, argv);
    if (argc > 1 && std::string(argv[1]) == "relay") return relay_main(argc, argv);
    return driver_main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "idem_chaos: %s\n", e.what());
    return 1;
  }
}
