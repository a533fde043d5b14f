// PostgresStore on a replicated pair of its own (pg_pair.sh) where a commit's fate is in doubt:
// a cancelled wait for the synchronous standby is reported as durability_error, never as done,
// and a COMMIT in doubt as the primary fails is settled on the promoted standby: committed when
// only its answer was lost, not committed when the primary died inside it.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <string_view>
#include <vector>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "idem/idem.hpp"
#include "idem/postgres.hpp"
#include "idem/postgres/admin.hpp"
#include "pg_pair.hpp"
#include "pg_support.hpp"
#include "support/tcp_proxy.hpp"
#include "support/warnings.hpp"

using namespace std::chrono_literals;
using idem::AcquireStatus;
using idem::State;
using idem::WriteStatus;
using pgtest::ap;
using pgtest::Clock;
using pgtest::key;
using pgtest::Pair;
using pgtest::seconds_since;

namespace {

pgtest::Config config(const std::string& conninfo, idem::PostgresMode mode) {
  pgtest::Config o;
  o.client.conninfo = conninfo;
  o.client.pool.size = 4;
  o.client.pool.wait = 5s;
  o.client.statement_timeout = 500ms;  // shorter than the waits below: it must not cut them
  o.store.mode = mode;
  o.store.schema = "idem_ha";
  o.store.table = mode == idem::PostgresMode::lease ? "records" : "tx_records";
  return o;
}

// The pid of a backend waiting for the synchronous standby, "" when none within 5 s.
std::string sync_waiter(pgtest::Raw& raw) {
  for (int i = 0; i < 250; ++i) {
    auto pid = raw.scalar("SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep' LIMIT 1");
    if (!pid.empty()) return pid;
    std::this_thread::sleep_for(20ms);
  }
  return {};
}

// Runs `commit` on a thread, cancels its wait for the standby once it has waited 1 s (longer than
// statement_timeout), and returns what the commit threw.
template <class F>
std::exception_ptr cancelled(pgtest::Raw& raw, F&& commit) {
  std::exception_ptr thrown;
  std::atomic<bool> returned{false};
  std::thread t([&] {
    try {
      commit();
    } catch (...) {
      thrown = std::current_exception();
    }
    returned = true;
  });
  const std::string pid = sync_waiter(raw);
  CHECK_FALSE(pid.empty());
  std::this_thread::sleep_for(1s);
  CHECK_FALSE(returned.load());  // statement_timeout (500 ms) does not end the wait
  if (!pid.empty()) raw.exec("SELECT pg_cancel_backend(" + pid + ")");
  t.join();
  return thrown;
}

// `e` holds a retryable E whose text has `what` and `why`.
template <class E>
void check_thrown(const std::exception_ptr& e, const char* what, const char* why = "") {
  REQUIRE(e);
  try {
    std::rethrow_exception(e);
  } catch (const E& x) {
    INFO(x.what());
    CHECK(x.retryable());
    CHECK_THAT(std::string(x.what()), Catch::Contains(what) && Catch::Contains(why));
  } catch (const std::exception& x) {
    FAIL("expected a retryable " << what << " error, got: " << x.what());
  }
}

// A write whose synchronous wait was cut: committed on the primary only.
void check_durability(const std::exception_ptr& e) { check_thrown<idem::durability_error>(e, "committed on the primary"); }

// A COMMIT settled as not committed (and `why`, when given): nothing was written, a redelivery
// runs the message again.
void check_not_committed(const std::exception_ptr& e, const char* why = "") {
  check_thrown<idem::connection_error>(e, "did not commit", why);
}

// Names the synchronous standbys of `raw`'s server ('nobody': one that never connects, so every
// commit there waits; '': none) and gives the checkpointer, which applies it to that wait, time to.
void sync_standbys(pgtest::Raw& raw, const char* names) {
  raw.exec(std::string("ALTER SYSTEM SET synchronous_standby_names = '") + names + "'");
  raw.exec("SELECT pg_reload_conf()");
  std::this_thread::sleep_for(500ms);
}

// What `f` threw, and how long it took.
template <class F>
std::pair<std::exception_ptr, double> timed(F&& f) {
  const auto t0 = Clock::now();
  std::exception_ptr e;
  try {
    f();
  } catch (...) {
    e = std::current_exception();
  }
  return {e, seconds_since(t0)};
}

// A commit idem cut after statement_timeout + sync_replication_wait: committed on the primary only,
// and the message says what to fix.
void check_cut(const std::pair<std::exception_ptr, double>& got, const char* what) {
  std::printf("%s: cut after %.2f s\n", what, got.second);
  check_thrown<idem::durability_error>(got.first, "committed on the primary", "synchronous_standby_names");
  check_thrown<idem::durability_error>(got.first, "idem cancelled the wait", "sync_replication_wait");
  CHECK(got.second >= 1.4);  // not before statement_timeout (500 ms) + sync_replication_wait (1 s)
  CHECK(got.second < 5.0);   // but soon after: not as long as no standby attaches
}

using idem::test::Warnings;

}  // namespace

TEST_CASE("postgres ha: the replication settings are reported when a store is built and by doctor",
          "[postgres][failover][ha]") {
  Pair pair("sync");
  auto w = std::make_shared<Warnings>();
  auto o = config(pair.conninfo(), idem::PostgresMode::lease);
  o.client.observer = w;
  { idem::PostgresStore s(o.client, o.store); }
  CHECK(w->all().empty());  // a synchronous standby streams: nothing to warn of
  idem::PostgresAdmin admin(o.client, o.store);
  std::string replication;
  for (const auto& f : admin.doctor())
    if (f.check == "replication") replication = std::string(idem::to_string(f.severity)) + ": " + f.message;
  INFO(replication);
  CHECK_THAT(replication, Catch::StartsWith("ok: synchronous_commit = on, synchronous_standby_names = '*'"));
  CHECK_THAT(replication, Catch::Contains("loses no acknowledged completion"));

  pair.step("stop-standby");
  { idem::PostgresStore s(o.client, o.store); }
  INFO(w->all());
  CHECK_THAT(w->all(), Catch::Contains("pg_is_in_recovery() = false, 0 standby(s) streaming"));
  CHECK_THAT(w->all(), Catch::Contains("none is connected: every write waits until one attaches"));
  // A guard's observer hears what was raised before it came.
  auto g_obs = std::make_shared<Warnings>();
  idem::PostgresStore s(o.client, o.store);
  idem::GuardOptions go;
  go.observer = g_obs;
  idem::IdempotencyGuard g(s, go);
  CHECK_THAT(g_obs->all(), Catch::Contains("none is connected"));
}

TEST_CASE("postgres ha: a commit whose wait for the synchronous standby is cancelled is durability_error",
          "[postgres][failover][ha]") {
  Pair pair("sync");
  auto lo = config(pair.conninfo(), idem::PostgresMode::lease);
  auto to = config(pair.conninfo(), idem::PostgresMode::transactional);
  // 0: a commit waits as long as the server does (past statement_timeout + 0), until cancelled.
  lo.client.sync_replication_wait = to.client.sync_replication_wait = 0ms;
  idem::PostgresStore lease(lo.client, lo.store), tx(to.client, to.store);
  const auto k = key("lease"), kt = key("tx");
  auto a = lease.acquire(k, ap(1));  // replicated: the standby is still there
  REQUIRE(a.status == AcquireStatus::acquired);
  REQUIRE_FALSE(tx.inspect(kt).has_value());  // migrated while the standby is there
  pair.step("stop-standby");
  pgtest::Raw raw(pair.conninfo("a.conninfo"));

  check_durability(cancelled(raw, [&] { (void)lease.complete(k, a.holder, "done", 60s); }));
  auto rec = lease.inspect(k);  // committed on the primary: visible there, yet never reported done
  REQUIRE(rec);
  CHECK(rec->state == State::completed);

  auto t = tx.begin(kt, ap(2));
  REQUIRE(t.decision().status == AcquireStatus::acquired);
  check_durability(cancelled(raw, [&] { (void)t.commit("tx-done", 60s); }));
  CHECK(tx.inspect(kt)->state == State::completed);

  // Through the guard: the message is not acked (a retryable store error), the handler ran once.
  idem::IdempotencyGuard g(lease);
  int ran = 0;
  const auto kg = key("guard");
  std::exception_ptr e = cancelled(raw, [&] {
    (void)g.run(kg, [&](const idem::Context&) {
      ++ran;
      return std::string("g");
    });
  });
  CHECK(ran == 0);  // the acquire itself waited and was cancelled: no handler ran
  check_durability(e);
}

TEST_CASE("postgres ha: sync_replication_wait defaults to 10 s and may not be negative", "[postgres][ha][sync-wait]") {
  CHECK(idem::PostgresOptions{}.sync_replication_wait == 10s);
  idem::PostgresOptions o;
  o.conninfo = "host=127.0.0.1 port=1 connect_timeout=1";  // nothing listens: not an error at construction
  o.sync_replication_wait = -1ms;
  try {
    idem::PostgresClient c(o);
    FAIL("a negative sync_replication_wait was accepted");
  } catch (const idem::invalid_options_error& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("sync_replication_wait must be >= 0"));
  }
  o.sync_replication_wait = 0ms;
  CHECK_NOTHROW(idem::PostgresClient(o));
}

// synchronous_standby_names names a standby that is not connected: every commit waits on the
// server for one to attach, a wait statement_timeout does not cover. Each write is cancelled after
// statement_timeout + sync_replication_wait and reported as durability_error, its record committed
// on the primary, as a commit whose wait pg_cancel_backend cut.
TEST_CASE("postgres ha: a commit no synchronous standby confirms is cancelled after sync_replication_wait",
          "[postgres][failover][ha][sync-wait]") {
  Pair pair("async");  // the standby streams but is not named: as if the named one were gone
  pgtest::Raw raw(pair.conninfo("a.conninfo"));
  auto lo = config(pair.conninfo(), idem::PostgresMode::lease);
  auto to = config(pair.conninfo(), idem::PostgresMode::transactional);
  lo.client.sync_replication_wait = to.client.sync_replication_wait = 1s;
  lo.store.batch_sessions = 1;  // the batch's writes queue on one session: each cut, not each waited for
  idem::PostgresStore lease(lo.client, lo.store), tx(to.client, to.store);
  const auto fresh = key("fresh"), held = key("held"), kt = key("tx"), kf = key("tx-fail"), kg = key("guard");
  const std::vector<std::string> batch{key("b1"), key("b2"), key("b3")};
  auto h = lease.acquire(held, ap(1));
  REQUIRE(h.status == AcquireStatus::acquired);
  std::vector<idem::Holder> bh;
  for (const auto& b : batch) {
    auto a = lease.acquire(b, ap(2));
    REQUIRE(a.status == AcquireStatus::acquired);
    bh.push_back(a.holder);
  }
  auto t = tx.begin(kt, ap(3));  // a claim commits nothing: it opens the transaction
  REQUIRE(t.decision().status == AcquireStatus::acquired);
  auto tf = tx.begin(kf, ap(4));
  REQUIRE(tf.decision().status == AcquireStatus::acquired);
  idem::PostgresSequenceStore seqs(lease, {.table = "seq_" + pgtest::random_hex(6)});
  seqs.migrate();
  sync_standbys(raw, "nobody");

  check_cut(timed([&] { (void)lease.acquire(fresh, ap(5)); }), "acquire of a new key");
  check_cut(timed([&] { (void)lease.complete(held, h.holder, "done", 60s); }), "complete");
  check_cut(timed([&] { (void)t.commit("tx-done", 60s); }), "transactional COMMIT");
  check_cut(timed([&] { (void)tf.fail({.error = "boom", .retention = 60s}); }), "transactional record failure");
  check_cut(timed([&] {
              auto w = lease.batch_writer();
              for (std::size_t i = 0; i < batch.size(); ++i) w.complete(batch[i], bh[i], "batch", 60s);
              (void)w.finish();
            }),
            "a batch of three completions");
  check_cut(timed([&] { (void)seqs.advance("entity", 1); }), "sequence advance");
  idem::IdempotencyGuard g(lease);
  int ran = 0;
  check_cut(timed([&] {
              (void)g.run(kg, [&](const idem::Context&) {
                ++ran;
                return std::string("g");
              });
            }),
            "a guard's run");
  CHECK(ran == 0);  // its acquire was cut: no handler ran, the message is not acked

  sync_standbys(raw, "");
  // Each cut write committed on the primary. The cut acquire holds its key for its lease: a
  // redelivery meets in_flight until it ends, then takes the key over; the completions are there.
  auto rec = lease.inspect(fresh);
  REQUIRE(rec);
  CHECK(rec->state == State::in_progress);
  CHECK(lease.acquire(fresh, ap(6)).status == AcquireStatus::in_flight);
  CHECK(lease.inspect(kg)->state == State::in_progress);
  CHECK(lease.inspect(held)->state == State::completed);
  CHECK(lease.inspect(held)->result == "done");
  // The first write of the batch waited out the bound; those queued behind it were cancelled at
  // once, in their wait (committed) or, on a slow server, still running (rolled back: still held).
  CHECK(lease.inspect(batch[0])->state == State::completed);
  for (std::size_t i = 1; i < batch.size(); ++i) CHECK(lease.inspect(batch[i])->state != State::failed);
  CHECK(tx.inspect(kt)->state == State::completed);
  CHECK(tx.inspect(kf)->state == State::failed);
  CHECK(seqs.last_applied("entity") == 1u);
  // And the sessions idem cancelled were dropped, not reused: calls go on normally.
  const auto after = key("after");
  auto a = lease.acquire(after, ap(7));
  REQUIRE(a.status == AcquireStatus::acquired);
  CHECK(lease.complete(after, a.holder, "ok", 60s) == WriteStatus::ok);
}

TEST_CASE("postgres ha: a COMMIT whose answer is lost as the primary fails is settled on the promoted standby",
          "[postgres][failover][ha]") {
  Pair pair("sync");
  // The way to slot a goes through a proxy that cuts COMMIT's answer and then closes (a dead
  // host refuses connections: libpq goes on to the next host).
  std::optional<idem::test::TcpProxy> proxy(std::in_place, std::stoi(pair.read("a.port")));
  const std::string ci = "host=127.0.0.1,127.0.0.1 port=" + std::to_string(proxy->port()) + "," + pair.read("b.port") +
                         " user=postgres dbname=postgres target_session_attrs=read-write connect_timeout=5";
  auto o = config(ci, idem::PostgresMode::transactional);
  o.client.settle_wait = 10s;
  idem::PostgresStore s(o.client, o.store);
  REQUIRE_FALSE(s.inspect(key("warm-up")).has_value());

  const auto k = key("in-doubt");
  auto t = s.begin(k, ap(7));
  REQUIRE(t.decision().status == AcquireStatus::acquired);
  proxy->plan({{idem::test::TcpProxy::Action::cut, {}}}, true);  // COMMIT's answer lost, no way back to a
  double failover = 0;
  std::thread fail_over([&] {
    while (!proxy->fired()) std::this_thread::sleep_for(5ms);
    proxy.reset();
    std::this_thread::sleep_for(200ms);
    const auto t0 = Clock::now();
    pair.step("kill-primary");
    pair.step("promote");
    failover = seconds_since(t0);
  });
  const auto t0 = Clock::now();
  WriteStatus w = WriteStatus::lease_lost;
  try {
    w = t.commit("settled", 60s);
  } catch (const std::exception& e) {
    fail_over.join();
    FAIL("the commit was not settled: " << e.what());
  }
  const double settled = seconds_since(t0);
  fail_over.join();
  std::printf("COMMIT answer lost, primary killed + standby promoted in %.2f s, settled after %.2f s\n", failover,
              settled);
  CHECK(w == WriteStatus::ok);  // it had committed, on both nodes (synchronous): read on the new primary
  CHECK(settled >= failover);
  auto rec = s.inspect(k);
  REQUIRE(rec);
  CHECK(rec->result == "settled");
}

TEST_CASE("postgres ha: a COMMIT cut short by the primary's failure is settled on the promoted standby as not committed",
          "[postgres][failover][ha]") {
  Pair pair("sync");
  auto o = config(pair.conninfo(), idem::PostgresMode::transactional);
  o.client.settle_wait = 10s;
  idem::PostgresStore s(o.client, o.store);
  REQUIRE_FALSE(s.inspect(key("warm-up")).has_value());
  pgtest::Raw raw(pair.conninfo((pair.read("primary") + ".conninfo").c_str()));
  // The primary dies inside COMMIT: before the commit record is written, on either node.
  const std::string t = pgtest::slow_commit_table(raw, 30);

  const auto k = key("cut-short");
  auto tx = s.begin(k, ap(3));
  REQUIRE(tx.decision().status == AcquireStatus::acquired);
  const int pid = tx.backend_pid();
  tx.exec("INSERT INTO " + t + " VALUES (1)");
  double failover = 0;
  bool sleeping = false;
  std::thread fail_over([&] {
    sleeping = pgtest::backend_waits(raw, pid, "PgSleep");  // the backend sits in the trigger's sleep
    const auto t0 = Clock::now();
    pair.step("kill-primary");
    pair.step("promote");
    failover = seconds_since(t0);
  });
  const auto t0 = Clock::now();
  std::exception_ptr thrown;
  try {
    (void)tx.commit("never", 60s);
  } catch (...) {
    thrown = std::current_exception();
  }
  const double settled = seconds_since(t0);
  fail_over.join();
  std::printf("COMMIT cut short: primary killed + standby promoted in %.2f s, settled after %.2f s\n", failover,
              settled);
  CHECK(sleeping);
  check_not_committed(thrown);
  // On the new primary: neither the record nor the handler's write, and the key can be claimed.
  CHECK_FALSE(s.inspect(k).has_value());
  pgtest::Raw now(pair.conninfo());
  CHECK(now.scalar("SELECT count(*) FROM " + t) == "0");
  pair.step("attach");  // a synchronous primary's writes wait for a standby
  CHECK(s.acquire(k, ap(4)).status == AcquireStatus::acquired);
}

// The hole of a transaction id alone: a standby promoted without the WAL of our transaction hands
// that same id (epoch included) to its own next transactions. Here the standby is stopped before
// the claim, so it never sees our id; the primary dies inside our COMMIT; the standby comes back
// and is promoted, and other transactions run on it until one of them has committed under our
// id. Only then can the store reach the new primary (a proxy refuses it meanwhile): the lost
// COMMIT must be answered "not committed" at once, not "unknown" after settle_wait.
TEST_CASE("postgres ha: a lost COMMIT whose transaction id the promoted standby reassigned is settled as not committed",
          "[postgres][failover][ha]") {
  Pair pair("sync");
  idem::test::TcpProxy to_b(std::stoi(pair.read("b.port")));
  const std::string ci = "host=127.0.0.1,127.0.0.1 port=" + pair.read("a.port") + "," + std::to_string(to_b.port()) +
                         " user=postgres dbname=postgres target_session_attrs=read-write connect_timeout=5";
  auto o = config(ci, idem::PostgresMode::transactional);
  o.store.table = "reused_" + pgtest::random_hex(6);
  o.client.settle_wait = 10s;
  idem::PostgresStore s(o.client, o.store);
  REQUIRE_FALSE(s.inspect(key("warm-up")).has_value());
  pgtest::Raw raw(pair.conninfo("a.conninfo"));
  const std::string t = pgtest::slow_commit_table(raw, 30);  // committed on both nodes (synchronous)
  const std::string effects = "effects_" + pgtest::random_hex(8);
  raw.exec("CREATE TABLE " + effects + " (key text PRIMARY KEY)");
  pair.step("stop-standby");  // from here on, nothing the primary writes reaches the standby

  const auto k = key("reused");
  auto tx = s.begin(k, ap(5));
  REQUIRE(tx.decision().status == AcquireStatus::acquired);
  const int pid = tx.backend_pid();
  const std::string xid = raw.scalar("SELECT backend_xid FROM pg_stat_activity WHERE pid = " + std::to_string(pid));
  REQUIRE_FALSE(xid.empty());
  tx.exec("INSERT INTO " + t + " VALUES (1)");
  std::string reused_status, burned;
  Clock::time_point opened{};
  bool sleeping = false;
  std::thread fail_over([&] {
    sleeping = pgtest::backend_waits(raw, pid, "PgSleep");  // inside COMMIT, before its commit record
    to_b.refuse(true);
    pair.step("kill-primary");
    pair.step("start-standby");
    pair.step("promote");
    // Other clients' transactions on the new primary, committed without waiting for a standby,
    // until one of them got our transaction's id.
    pgtest::Raw other(pair.conninfo("b.conninfo"));
    other.exec("SET synchronous_commit = local");
    const auto target = std::stoull(xid);
    int n = 0;
    for (std::uint64_t got = 0; got < target && n < 100000; ++n) got = std::stoull(other.scalar("SELECT pg_current_xact_id()::text"));
    burned = std::to_string(n);
    reused_status = other.scalar("SELECT pg_xact_status('" + xid + "'::xid8)");
    opened = Clock::now();
    to_b.refuse(false);
  });
  std::exception_ptr thrown;
  try {
    (void)tx.commit("never", 60s);
  } catch (...) {
    thrown = std::current_exception();
  }
  const auto settled = Clock::now();
  fail_over.join();
  const double after_open = std::chrono::duration<double>(settled - opened).count();
  std::printf("xid %s reassigned on the new primary (%s transactions, status there: %s); settled %.3f s after the "
              "store could reach it\n",
              xid.c_str(), burned.c_str(), reused_status.c_str(), after_open);
  CHECK(sleeping);
  CHECK(reused_status == "committed");
  CHECK(after_open < 2.0);  // well under settle_wait (10 s): the answer is known at the first read
  check_not_committed(thrown, "reassigned");
  CHECK_FALSE(s.inspect(k).has_value());
  // The redelivery runs the handler once, and its copy after that is a duplicate.
  pair.step("attach");  // a synchronous primary's writes wait for a standby
  idem::IdempotencyGuard g(s);
  int ran = 0;
  for (int i = 0; i < 2; ++i) {
    const auto out = g.run(k, [&](const auto& ctx) {
      ++ran;
      ctx.tx->exec("INSERT INTO " + effects + " VALUES ($1)", k);
      return std::string("charged");
    });
    CHECK(out.status == (i == 0 ? idem::Status::executed : idem::Status::duplicate));
  }
  CHECK(ran == 1);
  CHECK(pgtest::Raw(pair.conninfo()).scalar("SELECT count(*) FROM " + effects) == "1");
}
