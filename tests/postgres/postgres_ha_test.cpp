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

#include "idem/idem.hpp"
#include "idem/postgres.hpp"
#include "idem/postgres/admin.hpp"
#include "pg_pair.hpp"
#include "pg_support.hpp"
#include "support/tcp_proxy.hpp"

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

// Collects a client's advisories.
struct Warnings : idem::Observer {
  std::mutex mu;
  std::vector<std::string> seen;
  void on_warning(std::string_view m) noexcept override {
    std::lock_guard lk(mu);
    seen.emplace_back(m);
  }
  std::string all() {
    std::lock_guard lk(mu);
    std::string s;
    for (const auto& m : seen) s += m + "\n";
    return s;
  }
};

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
