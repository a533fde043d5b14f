// PostgresStore on a real replicated pair (pg_pair.sh: a primary and a streaming standby made with
// pg_basebackup -R): the primary is SIGKILLed and the standby promoted while the stores hold a
// multi-host conninfo (target_session_attrs=read-write). Until a primary answers, every call fails
// with a retryable store error and decides nothing; then the pool refills from the new primary by
// itself, and with synchronous replication nothing completed before is lost. A session on a
// read-only server (a standby, a primary made read-only) never decides a claim either.
#include <catch2/catch.hpp>

#include <spawn.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "idem/postgres.hpp"
#include "pg_pair.hpp"
#include "pg_support.hpp"
#include "support/sanitized.hpp"

using namespace std::chrono_literals;
using idem::AcquireStatus;
using idem::Status;
using idem::WriteStatus;
using pgtest::ap;
using pgtest::key;
using pgtest::Clock;
using pgtest::Pair;
using pgtest::seconds_since;

namespace {

// The stores of these tests on `conninfo`: a small pool, shared by the writers and the checks.
pgtest::Config config(const std::string& conninfo, idem::PostgresMode mode = idem::PostgresMode::lease) {
  pgtest::Config o;
  o.client.conninfo = conninfo;
  o.client.pool.size = 4;
  o.client.pool.wait = 5s;
  o.store.mode = mode;
  o.store.schema = "idem_failover";
  o.store.table = mode == idem::PostgresMode::lease ? "records" : "tx_records";
  return o;
}

// A call that must not decide anything: it throws a retryable store error; its SQLSTATE.
template <class F>
std::string refused(F&& f) {
  try {
    (void)f();
  } catch (const idem::store_error& e) {
    INFO(e.what());
    CHECK(e.retryable());
    return e.code();
  }
  FAIL("the call answered while no writable primary was reachable");
  return {};
}

// Calls f until it answers, each failure meanwhile a retryable store error; counts the failures.
template <class F>
auto until_answered(F&& f, int& failures, std::chrono::seconds limit = 30s) -> decltype(f()) {
  const auto deadline = Clock::now() + limit;
  for (;;) {
    try {
      return f();
    } catch (const idem::store_error& e) {
      INFO(e.what());
      REQUIRE(e.retryable());
      ++failures;
      REQUIRE(Clock::now() < deadline);
      std::this_thread::sleep_for(20ms);
    }
  }
}

std::string server_port(const std::string& conninfo) {
  return pgtest::Raw(conninfo).scalar("SELECT inet_server_port()");
}

}  // namespace

TEST_CASE("postgres failover: the stores follow the promoted standby, decide nothing meanwhile and lose no completion",
          "[postgres][failover][tx]") {
  Pair pair("sync");
  const auto lo = config(pair.conninfo()), to = config(pair.conninfo(), idem::PostgresMode::transactional);
  auto client = std::make_shared<idem::PostgresClient>(lo.client);
  idem::PostgresStore lease(client, lo.store);
  idem::PostgresStore tx(client, to.store);
  idem::IdempotencyGuard glease(lease);
  idem::IdempotencyGuard gtx(tx);
  const std::string effects = "effects_" + pgtest::random_hex(8);
  pgtest::Raw(pair.conninfo()).exec("CREATE TABLE " + effects + " (key text PRIMARY KEY)");
  const std::string old_port = server_port(pair.conninfo());

  // Before: keys completed in both modes, a lease holder in progress, a transactional claim open.
  std::vector<std::string> done, tx_done;
  for (int i = 0; i < 10; ++i) {
    const auto k = key("lease-" + std::to_string(i));
    auto a = lease.acquire(k, ap(100 + i));
    REQUIRE(a.status == AcquireStatus::acquired);
    REQUIRE(lease.complete(k, a.holder, "r:" + k, 600s) == WriteStatus::ok);
    done.push_back(k);
    const auto t = key("tx-" + std::to_string(i));
    auto out = gtx.run(t, [&](const auto& ctx) {
      ctx.tx->exec("INSERT INTO " + effects + " VALUES ($1)", t);
      return "tx:" + t;
    });
    REQUIRE(out.status == Status::executed);
    tx_done.push_back(t);
  }
  const auto held_key = key("held");
  const auto held = lease.acquire(held_key, ap(7, 120s));
  REQUIRE(held.status == AcquireStatus::acquired);
  const auto open_key = key("open-claim");
  auto open = tx.begin(open_key, ap(8));
  REQUIRE(open.decision().status == AcquireStatus::acquired);
  open.exec("INSERT INTO " + effects + " VALUES ($1)", open_key);

  const double kill_s = pair.step("kill-primary");
  const auto killed_at = Clock::now();
  // The claim open on the dead primary can never commit; what it learns is a store error.
  try {
    const WriteStatus w = open.commit("never", 600s);
    FAIL("a commit on a killed primary answered " << static_cast<int>(w));
  } catch (const idem::store_error& e) {
    INFO(e.what());
    CHECK((e.code() == "08006" || e.code().rfind("57P", 0) == 0));
  }
  // No writable primary: every call fails retryable, decides nothing and runs no handler.
  int ran = 0;
  constexpr int outage_rounds = 3, calls_per_round = 7;
  for (int i = 0; i < outage_rounds; ++i) {
    refused([&] { return lease.acquire(done[0], ap(200)); });     // would be duplicate
    refused([&] { return lease.acquire(key("new"), ap(201)); });  // would be acquired
    refused([&] { return lease.complete(held_key, held.holder, "early", 600s); });
    refused([&] { return tx.begin(tx_done[0], ap(202)); });
    refused([&] { return lease.inspect(done[0]); });
    refused([&] { return glease.run(key("guard-new"), [&] { return ++ran; }); });
    refused([&] { return gtx.run(tx_done[0], [&](const auto&) { return std::to_string(++ran); }); });
  }
  CHECK(ran == 0);
  const double refused_s = seconds_since(killed_at);

  const double promote_s = pair.step("promote");
  const double attach_s = pair.step("attach");
  // The pool refills from the new primary by itself: the same store objects, no reconfiguration.
  const auto back = Clock::now();
  int failures = 0;
  auto first = until_answered([&] { return lease.acquire(done[0], ap(300)); }, failures);
  const double reconnect_s = seconds_since(back);
  CHECK(first.status == AcquireStatus::duplicate);
  const std::string new_port = server_port(pair.conninfo());
  CHECK(new_port != old_port);
  CHECK(pair.read("primary") == "b");

  // Synchronous replication: every completion acknowledged before the failover is there.
  for (const auto& k : done) {
    auto d = lease.acquire(k, ap(301));
    CHECK(d.status == AcquireStatus::duplicate);
    CHECK(d.payload == "r:" + k);
  }
  for (const auto& t : tx_done) {
    auto d = gtx.run(t, [&](const auto&) { return std::to_string(++ran); });
    CHECK(d.status == Status::duplicate);
    CHECK(d.value == "tx:" + t);
  }
  CHECK(ran == 0);
  pgtest::Raw raw(pair.conninfo());
  CHECK(raw.scalar("SELECT count(*) FROM " + effects) == "10");  // the open claim's write is not
  CHECK_FALSE(tx.inspect(open_key).has_value());
  // The lease holder from before still holds its key (fence and token replicated): it completes.
  CHECK(lease.complete(held_key, held.holder, "after", 600s) == WriteStatus::ok);
  CHECK(lease.acquire(held_key, ap(302)).payload == "after");
  // Both modes take new keys on the new primary.
  CHECK(glease.run(key("after-lease"), [] { return 1; }).status == Status::executed);
  const auto t = key("after-tx");
  CHECK(gtx.run(t,
                [&](const auto& ctx) {
                  ctx.tx->exec("INSERT INTO " + effects + " VALUES ($1)", t);
                  return std::string("ok");
                })
            .status == Status::executed);
  std::printf(
      "failover: kill %.2f s, %d refused calls in %.2f s, promote %.2f s, attach %.2f s, first answer "
      "%.3f s after attach (%d failures), primary port %s -> %s\n",
      kill_s, outage_rounds * calls_per_round, refused_s, promote_s, attach_s, reconnect_s, failures, old_port.c_str(),
      new_port.c_str());
}

TEST_CASE("postgres failover: a session on a read-only server never decides a claim", "[postgres][failover]") {
  Pair pair("async");
  const auto ci = pair.conninfo();
  auto po = config(ci);
  idem::PostgresStore primary(po.client, po.store);
  const auto k = key("done");
  auto a = primary.acquire(k, ap(1));
  REQUIRE(a.status == AcquireStatus::acquired);
  REQUIRE(primary.complete(k, a.holder, "r", 600s) == WriteStatus::ok);

  {  // A standby: refused at connect, with the completed record right there.
    pgtest::Raw standby(pair.conninfo("b.conninfo"));
    REQUIRE(standby.scalar("SELECT pg_is_in_recovery()") == "t");
    const auto replayed = [&] {
      try {  // the table itself may not be replayed yet
        return standby.scalar("SELECT count(*) FROM idem_failover.records WHERE key = convert_to('" + k +
                              "', 'UTF8')") == "1";
      } catch (const std::runtime_error&) {
        return false;
      }
    };
    const auto deadline = Clock::now() + 10s;
    while (!replayed()) {
      REQUIRE(Clock::now() < deadline);
      std::this_thread::sleep_for(20ms);
    }
    // Named alone, it is refused when the store is built; listed first with
    // target_session_attrs=any, every session libpq opens there is refused.
    auto alone = config(pair.conninfo("b.conninfo"));
    const auto bad = pgtest::capture<idem::invalid_options_error>([&] { idem::PostgresStore s(alone.client, alone.store); });
    CHECK_THAT(bad.what(), Catch::Contains("is a standby"));
    const std::string any = "host=127.0.0.1,127.0.0.1 port=" + pair.read("b.port") + "," + pair.read("a.port") +
                            " user=postgres dbname=postgres target_session_attrs=any";
    auto so = config(any);
    idem::PostgresStore on_standby(so.client, so.store);
    CHECK(refused([&] { return on_standby.acquire(k, ap(2)); }) == "25006");  // not duplicate
    CHECK(refused([&] { return on_standby.acquire(key("new"), ap(3)); }) == "25006");
    auto to = config(any, idem::PostgresMode::transactional);
    idem::PostgresStore tx_on_standby(to.client, to.store);
    CHECK(refused([&] { return tx_on_standby.begin(key("new"), ap(4)); }) == "25006");
    // Listed first with target_session_attrs=read-write, libpq passes it by for the primary.
    auto bo = config("host=127.0.0.1,127.0.0.1 port=" + pair.read("b.port") + "," + pair.read("a.port") +
                     " user=postgres dbname=postgres target_session_attrs=read-write");
    idem::PostgresStore standby_first(bo.client, bo.store);
    CHECK(standby_first.acquire(k, ap(5)).status == AcquireStatus::duplicate);
  }

  {  // A primary made read-only under a pooled session: the claim fails, the session is dropped.
    auto ro = config(pair.conninfo("a.conninfo") + " application_name=idem_ro_test");
    ro.client.pool.size = 2;
    idem::PostgresStore s(ro.client, ro.store);
    REQUIRE(s.acquire(k, ap(10)).status == AcquireStatus::duplicate);  // a pooled, prepared session
    pgtest::Raw admin(pair.conninfo("a.conninfo"));
    admin.exec("SET default_transaction_read_only = off");  // this session stays writable
    admin.exec("ALTER SYSTEM SET default_transaction_read_only = on");
    admin.exec("SELECT pg_reload_conf()");
    std::this_thread::sleep_for(300ms);  // the idle backend reads the new setting with its next command
    const std::string sessions = "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'idem_ro_test'";
    CHECK(admin.scalar(sessions) == "1");
    // The pooled session answers 25006 (read-only transaction) instead of duplicate.
    const auto e = pgtest::capture<idem::connection_error>([&] { (void)s.acquire(k, ap(11)); });
    CHECK(e.code() == "25006");
    CHECK(e.retryable());
    CHECK_THAT(e.what(), Catch::Contains("acquire failed"));  // the statement's answer, on the pooled session
    // The next needs a new session, which the server's read-only report refuses.
    int ran = 0;
    idem::IdempotencyGuard g(s);
    const auto e2 = pgtest::capture<idem::connection_error>([&] { (void)g.run(key("ro-new"), [&] { return ++ran; }); });
    CHECK(e2.code() == "25006");
    CHECK(e2.retryable());
    CHECK_THAT(e2.what(), Catch::Contains("cannot use PostgreSQL"));
    CHECK(ran == 0);
    // Dropped, not given back: no session of this store stays on the read-only server.
    const auto deadline = Clock::now() + 5s;
    while (admin.scalar(sessions) != "0") {
      REQUIRE(Clock::now() < deadline);
      std::this_thread::sleep_for(20ms);
    }
    admin.exec("ALTER SYSTEM RESET default_transaction_read_only");
    admin.exec("SELECT pg_reload_conf()");
    int failures = 0;
    CHECK(until_answered([&] { return s.acquire(k, ap(12)); }, failures).status == AcquireStatus::duplicate);
  }
}

TEST_CASE("postgres failover: repeated failovers under load lose no acknowledged completion or advance (sync replication)",
          "[postgres][failover][tx]") {
  // Ten failovers in a plain build, three under a sanitizer (slower, same paths); IDEM_PG_FAILOVERS sets it.
  constexpr int default_rounds = idem_test::sanitized ? 3 : 10;
  const char* env = std::getenv("IDEM_PG_FAILOVERS");
  const int rounds = env && *env ? std::max(1, std::atoi(env)) : default_rounds;
  Pair pair("sync");
  const auto lo = config(pair.conninfo()), to = config(pair.conninfo(), idem::PostgresMode::transactional);
  auto client = std::make_shared<idem::PostgresClient>(lo.client);
  idem::PostgresStore lease(client, lo.store);
  idem::PostgresStore tx(client, to.store);
  const std::string effects = "effects_" + pgtest::random_hex(8);
  pgtest::Raw(pair.conninfo()).exec("CREATE TABLE " + effects + " (key text PRIMARY KEY)");
  lease.migrate();
  tx.migrate();
  idem::PostgresSequenceStore seqs(client, {.table = "seq_" + pgtest::random_hex(6)});
  seqs.migrate();

  // Two writers on fresh keys (lease mode, transactional mode with a business write), through
  // every failover. A run that returned executed was acknowledged: its record must survive.
  struct Tally {
    std::mutex mu;
    std::vector<std::string> acked;
    std::map<std::string, int> errors;  // by type and SQLSTATE
    std::vector<std::string> wrong;     // answers a fresh key must never get, other errors
    double longest_failure = 0;         // seconds: the longest call that ended in an error (a stall)
  };
  Tally lease_tally, tx_tally;
  std::atomic<bool> stop{false};
  const std::string prefix = "f" + pgtest::random_hex(6) + ":";
  auto writer = [&](bool transactional, Tally& tally, const std::string& name) {
    idem::IdempotencyGuard gl(lease);
    idem::IdempotencyGuard gt(tx);
    for (int i = 0; !stop.load(); ++i) {
      bool failed = true;
      const auto started = Clock::now();
      const std::string k = prefix + name + std::to_string(i);
      try {
        const auto out = transactional ? gt.run(k,
                                                [&](const auto& ctx) {
                                                  ctx.tx->exec("INSERT INTO " + effects + " VALUES ($1)", k);
                                                  return "v:" + k;
                                                })
                                       : gl.run(k, [&] { return "v:" + k; });
        std::lock_guard lk(tally.mu);
        failed = false;
        if (out.status == Status::executed)
          tally.acked.push_back(k);
        else
          tally.wrong.push_back(k + " answered " + std::string(idem::to_string(out.status)));
      } catch (const idem::outcome_unknown_error& e) {
        std::lock_guard lk(tally.mu);
        ++tally.errors["outcome_unknown " + e.code()];
      } catch (const idem::store_error& e) {
        std::lock_guard lk(tally.mu);
        if (e.retryable())  // a lost COMMIT settled on an id the new primary reassigned is counted apart
          ++tally.errors[e.code() + (std::string_view(e.what()).find("reassigned") != std::string_view::npos
                                         ? " (id reassigned)"
                                         : "")];
        else
          tally.wrong.push_back(k + ": " + e.what());
      } catch (const std::exception& e) {
        std::lock_guard lk(tally.mu);
        tally.wrong.push_back(k + ": " + e.what());
      }
      if (failed) {
        {
          std::lock_guard lk(tally.mu);
          tally.longest_failure = std::max(tally.longest_failure, seconds_since(started));
        }
        std::this_thread::sleep_for(20ms);  // no primary yet: do not spin
      }
    }
  };
  // A third writer advances one entity's sequence 1, 2, 3, ... through the failovers: an advance
  // acknowledged (advanced, or found already applied when a lost answer is asked again) must stay.
  const std::string entity = prefix + "entity";
  std::atomic<std::uint64_t> seq_acked{0};
  std::vector<std::string> seq_wrong;
  auto sequencer = [&] {
    for (std::uint64_t n = 1; !stop.load();) {
      try {
        const auto a = seqs.advance(entity, n);
        if (a.advanced || a.previous == n) {
          seq_acked = n++;
        } else {
          seq_wrong.push_back("advance " + std::to_string(n) + " found " + std::to_string(a.previous.value_or(0)));
          return;
        }
      } catch (const idem::error&) {
        std::this_thread::sleep_for(20ms);  // no primary yet; the same n again
      }
    }
  };
  // Two transactional writers: their lost COMMITs are settled on the new primary, which hands the
  // ids their transactions had to its own (the other writers'): each must be told, not left unknown.
  std::thread wl(writer, false, std::ref(lease_tally), "l");
  std::thread wt(writer, true, std::ref(tx_tally), "t");
  std::thread wt2(writer, true, std::ref(tx_tally), "u");
  std::thread ws(sequencer);
  struct Join {
    std::atomic<bool>& stop;
    std::thread &a, &b, &c, &d;
    ~Join() {
      stop = true;
      for (std::thread* t : {&a, &b, &c, &d})
        if (t->joinable()) t->join();
    }
  } join{stop, wl, wt, wt2, ws};

  const auto acked_now = [&] {
    std::lock_guard a(lease_tally.mu);
    std::lock_guard b(tx_tally.mu);
    return lease_tally.acked.size() + tx_tally.acked.size();
  };
  const auto t_all = Clock::now();
  for (int r = 0; r < rounds; ++r) {
    const auto before = acked_now();
    const auto t_load = Clock::now() + 10s;
    while (acked_now() < before + 40) {  // writers are running on this primary
      REQUIRE(Clock::now() < t_load);
      std::this_thread::sleep_for(10ms);
    }
    const double kill_s = pair.step("kill-primary");
    std::this_thread::sleep_for(200ms);  // the writers meet the outage
    const double promote_s = pair.step("promote");
    const double attach_s = pair.step("attach");
    const auto back = Clock::now();
    const auto mark = acked_now();
    while (acked_now() < mark + 5) {  // the writers came back by themselves
      REQUIRE(seconds_since(back) < 30);
      std::this_thread::sleep_for(10ms);
    }
    std::printf(
        "round %d: kill %.2f s, promote %.2f s, attach %.2f s, writers acknowledged again %.3f s after "
        "attach; new primary: slot %s\n",
        r + 1, kill_s, promote_s, attach_s, seconds_since(back), pair.read("primary").c_str());
  }
  stop = true;
  wl.join();
  wt.join();
  wt2.join();
  ws.join();
  for (const auto& w : seq_wrong) FAIL_CHECK(w);
  CHECK(seqs.last_applied(entity).value_or(0) >= seq_acked.load());
  CHECK(seq_acked.load() > 0);

  for (Tally* t : {&lease_tally, &tx_tally}) {
    for (const auto& w : t->wrong) FAIL_CHECK(w);
    std::string errs;
    for (const auto& [what, n] : t->errors) errs += " " + what + " x" + std::to_string(n) + ";";
    std::printf("%s: %zu acknowledged, longest failed call %.2f s, errors:%s\n",
                t == &lease_tally ? "lease writer" : "tx writers", t->acked.size(), t->longest_failure, errs.c_str());
  }
  // A lost COMMIT is always knowable here (a synchronous standby has it, or the new primary's
  // history does not): none may end unknown after settle_wait.
  for (const auto& [what, n] : tx_tally.errors) CHECK_FALSE(what.rfind("outcome_unknown", 0) == 0);
  CHECK(tx_tally.longest_failure < std::chrono::duration<double>(to.client.settle_wait).count());
  // Every acknowledged completion is on the primary that survived the last failover.
  int lost = 0;
  for (const auto& k : lease_tally.acked) {
    auto rec = lease.inspect(k);
    if (!rec || rec->state != idem::State::completed || rec->result != "v:" + k) ++lost;
  }
  for (const auto& k : tx_tally.acked) {
    auto rec = tx.inspect(k);
    if (!rec || rec->state != idem::State::completed || rec->result != "v:" + k) ++lost;
  }
  CHECK(lost == 0);
  pgtest::Raw raw(pair.conninfo());
  // The business writes committed exactly with their records: one row per completed tx record.
  CHECK(raw.scalar("SELECT count(*) FROM " + effects +
                   " e WHERE NOT EXISTS (SELECT 1 FROM idem_failover.tx_records r "
                   "WHERE r.key = convert_to(e.key, 'UTF8') AND r.state = 2)") == "0");
  const auto rows = std::stoul(raw.scalar("SELECT count(*) FROM " + effects));
  CHECK(rows >= tx_tally.acked.size());
  std::printf("%d failovers in %.1f s: %zu + %zu acknowledged completions, %d lost; %lu business rows\n", rounds,
              seconds_since(t_all), lease_tally.acked.size(), tx_tally.acked.size(), lost, rows);
}
