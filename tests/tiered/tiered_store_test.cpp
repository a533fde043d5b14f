// TieredStore beyond the contract: which tier answers, what a lost Redis record costs (a
// PostgreSQL round trip and a repair, never a second run), Redis down (exact on PostgreSQL alone,
// one warning), PostgreSQL down (typed errors, nothing runs), the races between the tiers, fences
// from PostgreSQL, and sequences advanced in the PostgreSQL transaction.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <csignal>
#include <exception>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "support/tcp_proxy.hpp"
#include "tiered_support.hpp"

#ifndef IDEM_TIERED_SANITIZED
#define IDEM_TIERED_SANITIZED 0
#endif

using namespace std::chrono_literals;
using idem::AcquireStatus;
using idem::Status;
using idem::WriteStatus;

namespace {

using Guard = idem::IdempotencyGuard<idem::TieredStore>;
using Ctx = Guard::context_type;

idem::GuardOptions guard_options() {
  idem::GuardOptions o;
  o.lease = 5s;
  o.retention = 600s;
  return o;
}

// A private redis-server, a transactional PostgresStore and a TieredStore over both.
struct Rig {
  explicit Rig(idem::PostgresMode mode = idem::PostgresMode::transactional)
      : pg(pgtest::store(tieredtest::pg_options(mode))),
        warnings(std::make_shared<tieredtest::Warnings>()),
        store(tieredtest::redis_options(redis), pg, {.fast_retry_after = 100ms, .observer = warnings}),
        prefix("r" + pgtest::random_hex() + ":") {}
  std::string key(const std::string& name) const { return prefix + name; }
  idem::test::RedisServer redis;
  idem::PostgresStore pg;
  std::shared_ptr<tieredtest::Warnings> warnings;
  idem::TieredStore store;
  std::string prefix;
};

// An effects table without uniqueness: every committed run of a handler is a row.
struct Effects {
  pgtest::Raw raw;
  std::string table = "idem_test.tiered_fx_" + pgtest::random_hex(8);
  Effects() { raw.exec("CREATE TABLE " + table + " (key text NOT NULL)"); }
  ~Effects() {
    try {
      raw.exec("DROP TABLE IF EXISTS " + table);
    } catch (...) {
    }
  }
  Effects(const Effects&) = delete;
  Effects& operator=(const Effects&) = delete;
  void write(const Ctx& ctx) const { ctx.tx->exec("INSERT INTO " + table + "(key) VALUES ($1)", std::string(ctx.key)); }
  std::string count(const std::string& where = "true") { return raw.scalar("SELECT count(*) FROM " + table + " WHERE " + where); }
  std::string twice() {
    return raw.scalar("SELECT count(*) FROM (SELECT key FROM " + table + " GROUP BY key HAVING count(*) > 1) d");
  }
};

}  // namespace

TEST_CASE("tiered: a duplicate is answered by Redis alone, PostgreSQL untouched", "[tiered]") {
  Rig r;
  Guard guard(r.store, guard_options());
  const auto k = r.key("dup");
  auto first = guard.run(k, [](const Ctx&) { return std::string("v1"); });
  REQUIRE(first.status == Status::executed);
  const auto before = r.store.stats();
  for (int i = 0; i < 5; ++i) {
    auto again = guard.run(k, []() -> std::string { throw std::logic_error("must not run"); });
    CHECK(again.status == Status::duplicate);
    CHECK(again.value == std::string("v1"));
  }
  const auto after = r.store.stats();
  CHECK(after.fast_duplicates - before.fast_duplicates == 5);
  CHECK(after.truth_decisions == before.truth_decisions);
  // An in-flight key is Redis's answer too: no transaction is opened for it.
  auto held = r.store.begin(r.key("held"), pgtest::ap(77));
  REQUIRE(held.is_open());
  auto busy = r.store.begin(r.key("held"), pgtest::ap(78));
  CHECK(busy.decision().status == AcquireStatus::in_flight);
  CHECK(busy.answered_by_fast());
  CHECK_THROWS_AS(busy.postgres(), idem::usage_error);
  CHECK(held.commit("x", 60s) == WriteStatus::ok);
}

TEST_CASE("tiered: after FLUSHALL every redelivery is a duplicate from PostgreSQL, and Redis is repaired",
          "[tiered]") {
  Rig r;
  Effects fx;
  Guard guard(r.store, guard_options());
  const int n = 40;
  for (int i = 0; i < n; ++i)
    REQUIRE(guard.run(r.key(std::to_string(i)), [&](const Ctx& ctx) { fx.write(ctx); return i; }).status ==
            Status::executed);
  r.redis.command({"FLUSHALL"});
  const auto s0 = r.store.stats();
  for (int i = 0; i < n; ++i) {
    auto out = guard.run(r.key(std::to_string(i)), [&](const Ctx& ctx) { fx.write(ctx); return -1; });
    CHECK(out.status == Status::duplicate);
    CHECK(out.value == i);
  }
  const auto s1 = r.store.stats();
  CHECK(s1.truth_duplicates - s0.truth_duplicates == n);
  CHECK(s1.repairs - s0.repairs == n);
  for (int i = 0; i < n; ++i) CHECK(guard.run(r.key(std::to_string(i)), [] { return -2; }).value == i);
  CHECK(r.store.stats().fast_duplicates - s1.fast_duplicates == n);
  CHECK(fx.count() == std::to_string(n));
}

TEST_CASE("tiered: Redis restarted without persistence under 8 threads: no handler commits twice", "[tiered]") {
  Rig r;
  Effects fx;
  Guard guard(r.store, guard_options());
  const int keys = IDEM_TIERED_SANITIZED ? 60 : 200, threads = 8;
  std::atomic<bool> restarted{false};
  std::atomic<int> pass{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t + 1));
      std::vector<int> todo(static_cast<std::size_t>(keys));
      for (int i = 0; i < keys; ++i) todo[static_cast<std::size_t>(i)] = i;
      for (int round = 0; round < 50 && !todo.empty(); ++round) {
        std::shuffle(todo.begin(), todo.end(), rng);
        std::vector<int> again;
        for (int i : todo) {
          try {
            auto out = guard.run(r.key(std::to_string(i)), [&](const Ctx& ctx) { fx.write(ctx); });
            if (out.status == Status::in_flight) again.push_back(i);
          } catch (const idem::error&) {
            again.push_back(i);
          }
        }
        todo = std::move(again);
        if (!todo.empty()) std::this_thread::sleep_for(10ms);
      }
      pass.fetch_add(todo.empty() ? 1 : 0);
    });
  }
  std::this_thread::sleep_for(IDEM_TIERED_SANITIZED ? 800ms : 150ms);
  r.redis.stop(SIGKILL);
  std::this_thread::sleep_for(150ms);
  r.redis.start();
  restarted = true;
  for (auto& t : ts) t.join();
  CHECK(pass.load() == threads);
  CHECK(fx.count() == std::to_string(keys));
  CHECK(fx.twice() == "0");
}

TEST_CASE("tiered: Redis down: every message still exact on PostgreSQL alone, one warning per outage",
          "[tiered]") {
  Effects fx;
  idem::test::RedisServer redis;
  auto pg = pgtest::store(tieredtest::pg_options());
  auto warnings = std::make_shared<tieredtest::Warnings>();
  auto ro = tieredtest::redis_options(redis);
  redis.stop(SIGKILL);
  // Built while Redis is down: not an error, the store decides on PostgreSQL alone.
  idem::TieredStore store(ro, pg, {.fast_retry_after = 100ms, .observer = warnings});
  CHECK(store.fast() == nullptr);
  Guard guard(store, guard_options());
  const std::string prefix = "d" + pgtest::random_hex() + ":";
  const int n = 20;
  for (int round = 0; round < 3; ++round)
    for (int i = 0; i < n; ++i) {
      auto out = guard.run(prefix + std::to_string(i), [&](const Ctx& ctx) { fx.write(ctx); return i; });
      CHECK(out.status == (round == 0 ? Status::executed : Status::duplicate));
      CHECK(out.value == i);
    }
  CHECK(fx.count() == std::to_string(n));
  CHECK(fx.twice() == "0");
  CHECK(warnings->messages().size() == 1);
  CHECK(store.stats().fast_duplicates == 0);
  // Redis back: after fast_retry_after it is asked again; the first duplicate of each key repairs
  // its record, the next one is Redis's alone.
  redis.start();
  std::this_thread::sleep_for(150ms);
  for (int i = 0; i < n; ++i) CHECK(guard.run(prefix + std::to_string(i), [] { return -1; }).value == i);
  const auto s = store.stats();
  for (int i = 0; i < n; ++i) CHECK(guard.run(prefix + std::to_string(i), [] { return -1; }).value == i);
  CHECK(store.stats().fast_duplicates - s.fast_duplicates == n);
  const auto msgs = warnings->messages();
  REQUIRE(msgs.size() == 2);
  CHECK(msgs[1].find("answers again") != std::string::npos);
  CHECK(fx.count() == std::to_string(n));
}

TEST_CASE("tiered: PostgreSQL down fails closed: typed errors, no handler runs, the Redis claim is released",
          "[tiered]") {
  idem::test::TcpProxy proxy(pgtest::port());
  const std::string app = "tiered_down_" + pgtest::random_hex(8);
  auto o = tieredtest::pg_options();
  o.client.conninfo = "host=127.0.0.1 port=" + std::to_string(proxy.port()) +
                      " user=postgres dbname=postgres connect_timeout=2 application_name=" + app;
  o.client.pool.wait = 2s;
  idem::PostgresStore pg(o.client, o.store);
  idem::test::RedisServer redis;
  idem::TieredStore store(tieredtest::redis_options(redis), pg);
  Guard guard(store, guard_options());
  const std::string prefix = "x" + pgtest::random_hex() + ":";
  REQUIRE(guard.run(prefix + "done", [] { return 1; }).status == Status::executed);

  proxy.refuse(true);
  pgtest::Raw raw;
  raw.exec("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = '" + app + "'");
  int ran = 0;
  for (int i = 0; i < 3; ++i) {
    try {
      guard.run(prefix + "new", [&] { ++ran; });
      FAIL("a run with PostgreSQL down answered");
    } catch (const idem::store_error& e) {
      CHECK(e.retryable());
    }
  }
  CHECK(ran == 0);
  // The duplicate is Redis's answer: it holds only what PostgreSQL committed.
  CHECK(guard.run(prefix + "done", [] { return 2; }).value == 1);
  // The Redis claim was released: once PostgreSQL is back the key runs at once, not after a lease.
  auto rec = store.fast()->inspect(prefix + "new");
  REQUIRE(rec);
  CHECK(rec->state != idem::State::in_progress);
  proxy.refuse(false);
  CHECK(guard.run(prefix + "new", [&] { ++ran; }).status == Status::executed);
  CHECK(ran == 1);
}

TEST_CASE("tiered races: PostgreSQL holds the key while Redis lost it: in_flight, the Redis claim released",
          "[tiered]") {
  Rig r;
  const auto k = r.key("held-in-pg");
  auto direct = r.pg.begin(k, pgtest::ap(5));  // a holder that went straight to PostgreSQL
  REQUIRE(direct.is_open());
  auto t = r.store.begin(k, pgtest::ap(6));
  CHECK(t.decision().status == AcquireStatus::in_flight);
  CHECK_FALSE(t.answered_by_fast());
  auto rec = r.store.fast()->inspect(k);
  REQUIRE(rec);
  CHECK(rec->state == idem::State::failed);  // released: the next claim goes on to PostgreSQL at once
  REQUIRE(direct.commit("from-pg", 60s) == WriteStatus::ok);
  // Redis claims again, PostgreSQL says duplicate: the answer is PostgreSQL's and Redis is repaired.
  auto d = r.store.begin(k, pgtest::ap(7));
  CHECK(d.decision().status == AcquireStatus::duplicate);
  CHECK(d.decision().payload == "from-pg");
  auto fixed = r.store.fast()->inspect(k);
  REQUIRE(fixed);
  CHECK(fixed->state == idem::State::completed);
  CHECK(fixed->result == "from-pg");
  CHECK(r.store.begin(k, pgtest::ap(8)).answered_by_fast());
}

TEST_CASE("tiered: fences come from PostgreSQL and keep growing after Redis lost its records", "[tiered]") {
  Rig r;
  idem::GuardOptions o = guard_options();
  // Recorded failures keep PostgreSQL's record (and its fence); a released one rolls back to nothing.
  o.failure.mode = idem::FailureMode::record;
  o.failure.backoff = 0ms;
  o.failure.max_attempts = 10;
  Guard guard(r.store, o);
  const auto k = r.key("fence");
  std::vector<std::uint64_t> fences;
  for (int i = 0; i < 3; ++i) {
    CHECK_THROWS(guard.run(k, [&](const Ctx& ctx) {
      fences.push_back(ctx.fence);
      throw std::runtime_error("again");
    }));
    if (i == 1) r.redis.command({"FLUSHALL"});
  }
  r.redis.stop(SIGKILL);
  r.redis.start();
  std::this_thread::sleep_for(150ms);
  auto out = guard.run(k, [&](const Ctx& ctx) { fences.push_back(ctx.fence); });
  CHECK(out.status == Status::executed);
  CHECK(fences == std::vector<std::uint64_t>{1, 2, 3, 4});
  CHECK(out.fence == 4);
}

TEST_CASE("tiered: a Redis completion that fails after the commit: executed, reported, PostgreSQL answers next",
          "[tiered]") {
  Rig r;
  const auto k = r.key("late");
  auto t = r.store.begin(k, pgtest::ap(9));
  REQUIRE(t.is_open());
  t.exec("SELECT 1");
  r.redis.stop(SIGKILL);
  CHECK(t.commit("done", 60s) == WriteStatus::ok);
  CHECK(r.warnings->messages().size() == 1);
  CHECK(r.store.degraded());
  r.redis.start();
  std::this_thread::sleep_for(150ms);
  auto d = r.store.begin(k, pgtest::ap(10));
  CHECK(d.decision().status == AcquireStatus::duplicate);
  CHECK(d.decision().payload == "done");
  CHECK_FALSE(d.answered_by_fast());
  CHECK(r.store.begin(k, pgtest::ap(11)).answered_by_fast());
}

TEST_CASE("tiered: a handler exception rolls back its writes and releases both claims", "[tiered]") {
  Rig r;
  Effects fx;
  Guard guard(r.store, guard_options());
  const auto k = r.key("boom");
  CHECK_THROWS_WITH(guard.run(k, [&](const Ctx& ctx) {
                      fx.write(ctx);
                      throw std::runtime_error("boom");
                    }),
                    "boom");
  CHECK(fx.count() == "0");
  auto out = guard.run(k, [&](const Ctx& ctx) { fx.write(ctx); });
  CHECK(out.status == Status::executed);
  CHECK(out.fence == 1);  // the released claim rolled back with the writes: no trace of the first run
  CHECK(fx.count() == "1");
}

TEST_CASE("tiered: sequences advance in the PostgreSQL transaction (run_sequenced)", "[tiered][sequence]") {
  Rig r;
  Effects fx;
  idem::PostgresSequenceStore seqs(r.pg, {.schema = "idem_test", .table = "tiered_seqs"});
  Guard guard(r.store, guard_options());
  const std::string entity = "acct-" + pgtest::random_hex();
  std::vector<std::string> keys;  // the events' keys outlive the calls
  keys.reserve(8);
  auto ev = [&](const std::string& id, std::uint64_t seq) {
    keys.push_back(r.key(id));
    return idem::SequencedEvent{.key = keys.back(), .entity = entity, .seq = seq, .payload = {}};
  };
  auto write = [&](const Ctx& ctx) { fx.write(ctx); };
  CHECK(idem::run_sequenced(guard, seqs, ev("e1", 1), write).status == Status::executed);
  CHECK(idem::run_sequenced(guard, seqs, ev("e3", 3), write).status == Status::executed);
  CHECK(idem::run_sequenced(guard, seqs, ev("e2", 2), write).status == Status::stale);
  CHECK(seqs.last_applied(entity) == 3u);
  // A handler exception rolls the advance back with the writes.
  CHECK_THROWS(idem::run_sequenced(guard, seqs, ev("e4", 4), [](const Ctx&) { throw std::runtime_error("no"); }));
  CHECK(seqs.last_applied(entity) == 3u);
  auto four = idem::run_sequenced(guard, seqs, ev("e4", 4), write);
  CHECK(four.status == Status::executed);
  CHECK(four.advanced);
  CHECK(fx.count() == "3");
}

TEST_CASE("tiered lease mode: the heartbeat extends PostgreSQL's lease and Redis's claim", "[tiered]") {
  Rig r(idem::PostgresMode::lease);
  idem::GuardOptions o = guard_options();
  o.lease = 300ms;
  o.heartbeat = true;
  Guard guard(r.store, o);
  const auto k = r.key("lease");
  std::atomic<bool> inside{false};
  // Catch's assertions are not thread-safe: the rival records what it saw, the main thread checks.
  std::optional<AcquireStatus> rival_saw;
  std::exception_ptr rival_error;
  std::thread rival([&] {
    while (!inside) std::this_thread::sleep_for(5ms);
    std::this_thread::sleep_for(450ms);  // past one lease: only the heartbeat keeps it
    try {
      rival_saw = r.store.acquire(k, pgtest::ap(99, 300ms)).status;
    } catch (...) {
      rival_error = std::current_exception();
    }
  });
  auto out = guard.run(k, [&](const idem::Context& ctx) {
    inside = true;
    std::this_thread::sleep_for(700ms);
    return static_cast<int>(ctx.fence);
  });
  rival.join();
  if (rival_error) std::rethrow_exception(rival_error);
  CHECK(rival_saw == AcquireStatus::in_flight);
  CHECK(out.status == Status::executed);
  CHECK(guard.run(k, [] { return 0; }).value == 1);
  CHECK(r.store.inspect(k)->state == idem::State::completed);
}
