// PostgresStore beyond the shared contract: options, schema, binary keys, purge, transactional
// mode, and every fault of issue 4 point 6 (each must fail closed with a typed error + SQLSTATE).
#include <catch2/catch.hpp>

#include <sys/socket.h>
#include <netinet/in.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "idem/postgres.hpp"
#include "pg_support.hpp"

using namespace std::chrono_literals;
using idem::AcquireStatus;
using idem::WriteStatus;
using pgtest::ap;
using pgtest::capture;
using pgtest::key;

namespace {

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

}  // namespace

TEST_CASE("postgres: schema and table names are validated identifiers", "[postgres]") {
  for (const char* bad : {"", "Idem", "idem;drop table x", "a\"b", "1abc", "pg_catalog", "x y", "idem--"}) {
    auto o = pgtest::options();
    o.store.schema = bad;
    CHECK_THROWS_AS(pgtest::store(o), idem::invalid_options_error);
  }
  for (const std::string& bad : {std::string(), std::string("records'); DROP TABLE x; --"), std::string("Records"),
                                 std::string(41, 'a')}) {
    auto o = pgtest::options();
    o.store.table = bad;
    CHECK_THROWS_AS(pgtest::store(o), idem::invalid_options_error);
  }
  auto o = pgtest::options();
  o.store.isolation = "chaos";
  CHECK_THROWS_AS(pgtest::store(o), idem::invalid_options_error);
  o = pgtest::options();
  o.client.pool.size = 0;
  CHECK_THROWS_AS(pgtest::store(o), idem::invalid_options_error);
  o = pgtest::options();
  o.store.lock_timeout = 0ms;
  CHECK_THROWS_AS(pgtest::store(o), idem::invalid_options_error);
}

TEST_CASE("postgres: keys are binary-safe, oversized keys are a typed error", "[postgres]") {
  idem::PostgresStore s = pgtest::store();
  const std::string base = key("bin");
  const std::string k1 = base + std::string("\0\xff\x01", 3);
  const std::string k2 = base + std::string("\0", 1);
  auto a = s.acquire(k1, ap(1));
  REQUIRE(a.status == AcquireStatus::acquired);
  CHECK_FALSE(s.inspect(k2).has_value());
  CHECK_FALSE(s.inspect(base).has_value());
  const std::string result("\0r\xfe", 3);
  REQUIRE(s.complete(k1, a.holder, result, 60s) == WriteStatus::ok);
  auto d = s.acquire(k1, ap(2));
  CHECK(d.status == AcquireStatus::duplicate);
  CHECK(d.payload == result);
  CHECK(s.acquire(k2, ap(3)).status == AcquireStatus::acquired);
  CHECK_THROWS_AS(s.acquire(std::string(3000, 'k'), ap(4)), idem::invalid_key_error);
  CHECK_THROWS_AS(s.begin(std::string(3000, 'k'), ap(4)), idem::invalid_key_error);
}

TEST_CASE("postgres: times come from the server clock", "[postgres]") {
  idem::PostgresStore s = pgtest::store();
  pgtest::Raw raw;
  const auto k = key("clock");
  REQUIRE(s.acquire(k, ap(1, 10s)).status == AcquireStatus::acquired);
  const auto server_ms = std::stoll(raw.scalar("SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"));
  auto rec = s.inspect(k);
  REQUIRE(rec);
  CHECK(rec->lease_until_ms > server_ms + 9'000);
  CHECK(rec->lease_until_ms <= server_ms + 10'000);
}

TEST_CASE("postgres: concurrent migrations of a fresh schema all succeed, versioned", "[postgres]") {
  const std::string schema = "mig_" + pgtest::random_hex(8);
  std::atomic<int> ok{0};
  std::vector<std::thread> ts;
  for (int i = 0; i < 6; ++i)
    ts.emplace_back([&, i] {
      auto o = pgtest::options();
      o.store.schema = schema;
      o.store.table = i % 2 ? "records" : "records2";
      idem::PostgresStore s(o.client, o.store);
      try {
        s.migrate();
        if (s.acquire(key("m"), ap(1)).status == AcquireStatus::acquired) ok.fetch_add(1);
      } catch (const std::exception& e) {
        UNSCOPED_INFO(e.what());
      }
    });
  for (auto& t : ts) t.join();
  CHECK(ok.load() == 6);
  pgtest::Raw raw;
  CHECK(raw.scalar("SELECT version FROM " + schema + ".idem_schema_version WHERE table_name = 'records'") == "2");
  CHECK(raw.scalar("SELECT count(*) FROM pg_indexes WHERE schemaname = '" + schema +
                   "' AND indexname = 'records_purge_idx'") == "1");

  // A schema newer than this library is refused, not used.
  raw.exec("UPDATE " + schema + ".idem_schema_version SET version = 99 WHERE table_name = 'records'");
  auto o = pgtest::options();
  o.store.schema = schema;
  idem::PostgresStore newer(o.client, o.store);
  auto e = capture<idem::store_error>([&] { newer.acquire(key("m"), ap(1)); });
  CHECK_FALSE(e.retryable());
  CHECK(std::string(e.what()).find("newer") != std::string::npos);
  raw.exec("DROP SCHEMA " + schema + " CASCADE");
}

TEST_CASE("postgres: without auto_migrate a missing schema is a typed, non-retryable error", "[postgres]") {
  auto o = pgtest::options();
  o.store.schema = "absent_" + pgtest::random_hex(8);
  o.store.auto_migrate = false;
  idem::PostgresStore s(o.client, o.store);
  auto e = capture<idem::store_error>([&] { s.acquire(key("x"), ap(1)); });
  CHECK_FALSE(e.retryable());
  CHECK(!e.code().empty());
  s.migrate();
  CHECK(s.acquire(key("x"), ap(1)).status == AcquireStatus::acquired);
  pgtest::Raw().exec("DROP SCHEMA " + o.store.schema + " CASCADE");
}

TEST_CASE("postgres: purge removes expired rows in bounded batches, from many instances", "[postgres]") {
  auto o = pgtest::options();
  o.store.table = "purge_" + pgtest::random_hex(8);
  idem::PostgresStore s(o.client, o.store);
  idem::AcquireParams p = ap(1, 100ms);
  p.retention = 100ms;
  for (int i = 0; i < 45; ++i) {
    p.token = static_cast<std::uint64_t>(i + 1);
    REQUIRE(s.acquire("p" + std::to_string(i), p).status == AcquireStatus::acquired);
  }
  REQUIRE(s.acquire("kept", ap(99, 30s)).status == AcquireStatus::acquired);
  std::this_thread::sleep_for(1200ms);  // purge works on expiry rounded up to the second
  CHECK(s.purge_expired(10, 1) == 10);  // bounded: one batch only
  std::atomic<std::size_t> removed{0};
  std::vector<std::thread> ts;
  for (int i = 0; i < 3; ++i)
    ts.emplace_back([&] {
      idem::PostgresStore other(o.client, o.store);
      removed.fetch_add(other.purge_expired(4));
    });
  for (auto& t : ts) t.join();
  CHECK(removed.load() == 35);
  CHECK(s.purge_expired() == 0);
  CHECK(s.inspect("kept").has_value());
  pgtest::Raw().exec("DROP TABLE idem_test." + o.store.table);
}

TEST_CASE("postgres: server down is a retryable connection_error with a SQLSTATE", "[postgres][fault]") {
  auto o = pgtest::options();
  o.client.conninfo = "host=127.0.0.1 port=" + std::to_string(free_port()) + " user=postgres connect_timeout=2";
  idem::PostgresStore s(o.client, o.store);
  auto e = capture<idem::connection_error>([&] { s.acquire(key("down"), ap(1)); });
  CHECK(e.retryable());
  CHECK(e.code() == "08001");
  idem::IdempotencyGuard g(s);
  bool ran = false;
  CHECK_THROWS_AS(g.run(key("down"), [&] { ran = true; }), idem::connection_error);
  CHECK_FALSE(ran);
}

TEST_CASE("postgres: statement timeout fails closed as timeout_error 57014", "[postgres][fault]") {
  auto o = pgtest::options();
  o.client.statement_timeout = 150ms;
  o.store.claim_wait = idem::PostgresClaimWait::bounded;  // a claim that waits for the row lock...
  o.store.lock_timeout = 5s;  // the lock wait outlives the statement: the statement timeout must fire
  idem::PostgresStore s(o.client, o.store);
  const auto k = key("timeout");
  REQUIRE(s.acquire(k, ap(1, 100ms)).status == AcquireStatus::acquired);
  std::this_thread::sleep_for(150ms);  // lapsed: the next acquire must lock the row to take over
  pgtest::Raw raw;
  std::string hex;
  for (unsigned char ch : k) {
    static constexpr char d[] = "0123456789abcdef";
    hex += d[ch >> 4];
    hex += d[ch & 15];
  }
  raw.exec("BEGIN");
  raw.exec("SELECT 1 FROM idem_test.records WHERE key = '\\x" + hex + "'::bytea FOR UPDATE");
  auto e = capture<idem::timeout_error>([&] { s.acquire(k, ap(2)); });
  CHECK(e.code() == "57014");
  CHECK(e.retryable());
  raw.exec("ROLLBACK");
  auto rec = s.inspect(k);
  REQUIRE(rec);
  CHECK(rec->holder.token == 1);  // nothing changed blindly

  // The same session timeout bounds the handler's own statements in transactional mode.
  o.store.mode = idem::PostgresMode::transactional;
  idem::PostgresStore tx_store(o.client, o.store);
  idem::IdempotencyGuard g(tx_store);
  const auto k2 = key("timeout-handler");
  CHECK_THROWS_AS(g.run(k2, [](const auto& ctx) { ctx.tx->exec("SELECT pg_sleep(2)"); }), idem::timeout_error);
  CHECK_FALSE(tx_store.inspect(k2).has_value());
}

TEST_CASE("postgres: a corrupted row is corrupt_record_error, never a decision", "[postgres][fault]") {
  idem::PostgresStore s = pgtest::store();
  pgtest::Raw raw;
  const auto k = key("corrupt");
  auto a = s.acquire(k, ap(1));
  REQUIRE(s.complete(k, a.holder, "v", 60s) == WriteStatus::ok);
  raw.exec("UPDATE idem_test.records SET state = 9 WHERE key = '" + k + "'::bytea");
  CHECK_THROWS_AS(s.acquire(k, ap(2)), idem::corrupt_record_error);
  CHECK_THROWS_AS(s.inspect(k), idem::corrupt_record_error);
  idem::IdempotencyGuard g(s);
  bool ran = false;
  CHECK_THROWS_AS(g.run(k, [&] { ran = true; }), idem::corrupt_record_error);
  CHECK_FALSE(ran);
  raw.exec("UPDATE idem_test.records SET state = 2, fence = -4 WHERE key = '" + k + "'::bytea");
  CHECK_THROWS_AS(s.acquire(k, ap(3)), idem::corrupt_record_error);
  CHECK_THROWS_AS(s.inspect(k), idem::corrupt_record_error);
  CHECK(raw.scalar("SELECT fence FROM idem_test.records WHERE key = '" + k + "'::bytea") == "-4");
}

TEST_CASE("postgres: transactional mode commits the record with the handler's writes", "[postgres][tx]") {
  pgtest::Raw raw;
  const std::string t = "biz_" + pgtest::random_hex(8);
  raw.exec("CREATE TABLE " + t + " (id text PRIMARY KEY, n int NOT NULL)");
  idem::PostgresStore s = pgtest::store(idem::PostgresMode::transactional);
  REQUIRE(s.transactional());
  idem::IdempotencyGuard g(s);
  const auto k = key("tx-commit");
  auto out = g.run(k, [&](const auto& ctx) {
    REQUIRE(ctx.tx != nullptr);
    REQUIRE(ctx.tx->backend_pid() != 0);
    auto r = ctx.tx->exec("INSERT INTO " + t + " (id, n) VALUES ($1, $2)", std::string_view(k), ctx.fence);
    CHECK(r.affected() == 1);
    return std::string("done");
  });
  CHECK(out.status == idem::Status::executed);
  CHECK(raw.scalar("SELECT n FROM " + t) == "1");
  auto rec = s.inspect(k);
  REQUIRE(rec);
  CHECK(rec->state == idem::State::completed);
  CHECK(rec->result == "done");
  int calls = 0;
  auto again = g.run(k, [&]() -> std::string { return std::to_string(++calls); });
  CHECK(again.status == idem::Status::duplicate);
  CHECK(*again.value == "done");
  CHECK(calls == 0);
  raw.exec("DROP TABLE " + t);
}

TEST_CASE("postgres: a concurrent duplicate gets in_flight within ~100 ms, never waits out the handler",
          "[postgres][tx]") {
  idem::PostgresStore s = pgtest::store(idem::PostgresMode::transactional);
  auto k = key("tx-nowait");
  auto held = s.begin(k, ap(1));
  REQUIRE(held.decision().status == AcquireStatus::acquired);
  for (int i = 0; i < 2; ++i) {  // the first time the row is an uncommitted insert, then a locked row
    const auto t0 = std::chrono::steady_clock::now();
    auto other = s.begin(k, ap(2));
    const auto took = std::chrono::steady_clock::now() - t0;
    CHECK(other.decision().status == AcquireStatus::in_flight);
    CHECK_FALSE(other.is_open());
    CHECK(took < 600ms);
    const auto t1 = std::chrono::steady_clock::now();
    CHECK(s.acquire(k, ap(3)).status == AcquireStatus::in_flight);  // lease mode on the same table
    CHECK(std::chrono::steady_clock::now() - t1 < 600ms);
    if (i == 0) {
      REQUIRE(held.commit("first", 60s) == WriteStatus::ok);
      // A completed key answers at once, lock or not.
      auto dup = s.begin(k, ap(4));
      CHECK(dup.decision().status == AcquireStatus::duplicate);
      CHECK(dup.decision().payload == "first");
      // Hold a row of a failed key for the second round.
      const auto k2 = key("tx-nowait-2");
      auto a = s.acquire(k2, ap(5));
      REQUIRE(s.fail(k2, a.holder, {.error = "e", .release = true}) == WriteStatus::ok);
      held = s.begin(k2, ap(6));
      REQUIRE(held.decision().status == AcquireStatus::acquired);
      CHECK(held.decision().holder.fence == 2);
      k = k2;
    }
  }
}

TEST_CASE("postgres: a handler exception rolls back, and the record policy writes the failure afresh",
          "[postgres][tx]") {
  pgtest::Raw raw;
  const std::string t = "biz_" + pgtest::random_hex(8);
  raw.exec("CREATE TABLE " + t + " (id text PRIMARY KEY)");
  idem::PostgresStore s = pgtest::store(idem::PostgresMode::transactional);
  idem::GuardOptions go;
  go.failure.mode = idem::FailureMode::record;
  go.failure.max_attempts = 2;
  go.failure.backoff = 1ms;
  go.failure.max_backoff = 1ms;
  idem::IdempotencyGuard g(s, go);
  const auto k = key("tx-fail");
  auto boom = [&](const auto& ctx) {
    ctx.tx->exec("INSERT INTO " + t + " (id) VALUES ($1)", std::to_string(ctx.attempt));
    throw std::runtime_error("handler failed");
  };
  CHECK_THROWS_WITH(g.run(k, boom), "handler failed");
  CHECK(raw.scalar("SELECT count(*) FROM " + t) == "0");
  auto rec = s.inspect(k);
  REQUIRE(rec);
  CHECK(rec->state == idem::State::failed);
  CHECK(rec->error == "handler failed");
  CHECK(rec->attempts == 1);
  std::this_thread::sleep_for(20ms);
  CHECK_THROWS_WITH(g.run(k, boom), "handler failed");
  auto out = g.run(k, boom);
  CHECK(out.status == idem::Status::previously_failed);
  CHECK(raw.scalar("SELECT count(*) FROM " + t) == "0");

  // Release policy: the rollback alone frees the key.
  idem::IdempotencyGuard rel(s);
  const auto k2 = key("tx-release");
  CHECK_THROWS_AS(rel.run(k2, boom), std::runtime_error);
  CHECK_FALSE(s.inspect(k2).has_value());
  auto ok = rel.run(k2, [&](const auto& ctx) { ctx.tx->exec("INSERT INTO " + t + " (id) VALUES ('ok')"); });
  CHECK(ok.status == idem::Status::executed);
  CHECK(raw.scalar("SELECT count(*) FROM " + t) == "1");
  raw.exec("DROP TABLE " + t);
}

TEST_CASE("postgres: a serialization failure is a retryable store_error 40001, nothing committed",
          "[postgres][fault][tx]") {
  pgtest::Raw raw;
  const std::string t = "skew_" + pgtest::random_hex(8);
  raw.exec("CREATE TABLE " + t + " (id int PRIMARY KEY, v int NOT NULL); INSERT INTO " + t + " VALUES (1, 0), (2, 0)");
  auto o = pgtest::options(idem::PostgresMode::transactional);
  o.store.isolation = "serializable";
  idem::PostgresStore s(o.client, o.store);
  const auto ka = key("ssi-a"), kb = key("ssi-b");
  auto a = s.begin(ka, ap(1));
  auto b = s.begin(kb, ap(2));
  REQUIRE(a.decision().status == AcquireStatus::acquired);
  REQUIRE(b.decision().status == AcquireStatus::acquired);
  int failures = 0, commits = 0;
  auto step = [&](auto&& f) {
    try {
      f();
      return true;
    } catch (const idem::outcome_unknown_error&) {
      FAIL("a serialization failure is a known rollback, not an unknown outcome");
    } catch (const idem::store_error& e) {
      CHECK(e.code() == "40001");
      CHECK(e.retryable());
      ++failures;
    }
    return false;
  };
  // Write skew: each reads both rows and writes the one the other did not.
  a.exec("SELECT sum(v) FROM " + t);
  b.exec("SELECT sum(v) FROM " + t);
  a.exec("UPDATE " + t + " SET v = v + 1 WHERE id = 1");
  b.exec("UPDATE " + t + " SET v = v + 1 WHERE id = 2");
  if (step([&] {
        const auto w = a.commit("a", 60s);
        CHECK(w == WriteStatus::ok);
      }))
    ++commits;
  if (step([&] {
        const auto w = b.commit("b", 60s);
        CHECK(w == WriteStatus::ok);
      }))
    ++commits;
  CHECK(failures == 1);
  CHECK(commits == 1);
  CHECK(raw.scalar("SELECT sum(v) FROM " + t) == "1");
  CHECK(s.inspect(ka).has_value() + s.inspect(kb).has_value() == 1);
  raw.exec("DROP TABLE " + t);
}

TEST_CASE("postgres: a connection lost during COMMIT is settled: a rolled-back one is a retryable error",
          "[postgres][fault][tx]") {
  pgtest::Raw raw;
  const std::string t = pgtest::slow_commit_table(raw, 5);  // so the session can be killed inside COMMIT
  idem::PostgresStore s = pgtest::store(idem::PostgresMode::transactional);
  const auto k = key("in-doubt");
  auto tx = s.begin(k, ap(1));
  REQUIRE(tx.decision().status == AcquireStatus::acquired);
  const int pid = tx.backend_pid();
  tx.exec("INSERT INTO " + t + " VALUES (1)");
  std::thread killer([&] {
    pgtest::Raw k2;
    (void)pgtest::backend_waits(k2, pid, "PgSleep", 2s);  // the backend sits in the trigger's sleep
    k2.exec("SELECT pg_terminate_backend(" + std::to_string(pid) + ")");
  });
  // Killed inside the deferred trigger, before its commit record: read afterwards, it rolled back.
  auto e = capture<idem::connection_error>([&] { (void)tx.commit("r", 60s); });
  killer.join();
  CHECK(e.retryable());
  CHECK(std::string(e.what()).find("did not commit (rolled back)") != std::string::npos);
  CHECK_FALSE(tx.is_open());
  CHECK_FALSE(s.inspect(k).has_value());
  // The pool drops the dead connection and goes on.
  CHECK(s.acquire(key("after"), ap(2)).status == AcquireStatus::acquired);
  pgtest::drop_slow_commit_table(raw, t);
}

TEST_CASE("postgres: handler statements do not inherit the claim's short lock_timeout", "[postgres][tx]") {
  pgtest::Raw raw;
  const std::string t = "lockwait_" + pgtest::random_hex(8);
  raw.exec("CREATE TABLE " + t + " (id int PRIMARY KEY, n int NOT NULL); INSERT INTO " + t + " VALUES (1, 0)");
  for (bool idle_lease : {true, false}) {
    auto o = pgtest::options(idem::PostgresMode::transactional);
    o.store.idle_timeout_is_lease = idle_lease;
    idem::PostgresStore s(o.client, o.store);
    idem::IdempotencyGuard g(s);
    pgtest::Raw locker;
    locker.exec("BEGIN; UPDATE " + t + " SET n = n + 100 WHERE id = 1");
    std::thread release([&] {
      std::this_thread::sleep_for(400ms);
      locker.exec("COMMIT");
    });
    auto out = g.run(key("lockwait"), [&](const auto& ctx) {
      ctx.tx->exec("UPDATE " + t + " SET n = n + 1 WHERE id = 1");  // waits ~400 ms for the row
    });
    release.join();
    CHECK(out.status == idem::Status::executed);
  }
  CHECK(raw.scalar("SELECT n FROM " + t) == "202");
  raw.exec("DROP TABLE " + t);
}

TEST_CASE("postgres: conninfo passes through to libpq, URI form and sslmode included", "[postgres]") {
  const std::string port = std::to_string(pgtest::port());
  auto o = pgtest::options();
  o.client.conninfo = "postgresql://postgres@127.0.0.1:" + port + "/postgres?sslmode=disable&application_name=idem-uri";
  idem::PostgresStore s(o.client, o.store);
  CHECK(s.acquire(key("uri"), ap(1)).status == AcquireStatus::acquired);
  // The test server has no TLS: sslmode=require reaching libpq makes the connection fail, typed.
  o.client.conninfo = "postgresql://postgres@127.0.0.1:" + port + "/postgres?sslmode=require";
  idem::PostgresStore tls(o.client, o.store);
  auto e = capture<idem::connection_error>([&] { tls.acquire(key("tls"), ap(1)); });
  CHECK(e.code() == "08001");
  CHECK(std::string(e.what()).find("SSL") != std::string::npos);
}

TEST_CASE("postgres: an exhausted pool is a timeout_error after pool_wait", "[postgres]") {
  auto o = pgtest::options(idem::PostgresMode::transactional);
  o.client.pool.size = 1;
  o.client.pool.wait = 100ms;
  idem::PostgresStore s(o.client, o.store);
  auto held = s.begin(key("pool"), ap(1));
  REQUIRE(held.is_open());
  auto e = capture<idem::timeout_error>([&] { s.acquire(key("pool-2"), ap(2)); });
  CHECK(e.code() == "POOL");
  CHECK(e.retryable());
  REQUIRE(held.commit("r", 60s) == WriteStatus::ok);
  CHECK(s.acquire(key("pool-3"), ap(3)).status == AcquireStatus::acquired);
}

TEST_CASE("postgres: a commit whose claim is gone is lease_lost and commits none of the handler's writes",
          "[postgres][tx]") {
  pgtest::Raw raw;
  const std::string t = "gone_" + pgtest::random_hex(8);
  raw.exec("CREATE TABLE " + t + " (id int)");
  idem::PostgresStore s = pgtest::store(idem::PostgresMode::transactional);
  const auto k = key("claim-gone");
  auto tx = s.begin(k, ap(1));
  REQUIRE(tx.is_open());
  tx.exec("INSERT INTO " + t + " VALUES (1)");
  tx.exec("DELETE FROM idem_test.records WHERE key = convert_to($1, 'UTF8')", k);  // the claim vanishes
  CHECK(tx.commit("r", 60s) == WriteStatus::lease_lost);
  CHECK(raw.scalar("SELECT count(*) FROM " + t) == "0");
  CHECK_FALSE(s.inspect(k).has_value());
  raw.exec("DROP TABLE " + t);
}

TEST_CASE("postgres: stores of different tables and a sequence store share one client's sessions", "[postgres]") {
  auto o = pgtest::options();
  o.client.pool.size = 1;  // one session: both stores' statements must be prepared side by side on it
  auto client = std::make_shared<idem::PostgresClient>(o.client);
  auto other = o.store;
  other.table = "shared_" + pgtest::random_hex(8);
  idem::PostgresStore a(client, o.store), b(client, other);
  CHECK(a.client() == b.client());
  const auto k = key("shared");
  auto x = a.acquire(k, ap(1));
  REQUIRE(x.status == AcquireStatus::acquired);
  auto y = b.acquire(k, ap(2));  // another table: a record of its own
  REQUIRE(y.status == AcquireStatus::acquired);
  REQUIRE(a.complete(k, x.holder, "a", 60s) == WriteStatus::ok);
  REQUIRE(b.complete(k, y.holder, "b", 60s) == WriteStatus::ok);
  CHECK(a.inspect(k)->result == "a");
  CHECK(b.inspect(k)->result == "b");
  const std::string seq_table = "seq_" + pgtest::random_hex(8);
  idem::PostgresSequenceStore seqs(a, {.schema = "idem_test", .table = seq_table});
  CHECK(seqs.advance(k, 1).advanced);
  CHECK(seqs.last_applied(k) == 1u);
  CHECK_THROWS_AS(idem::PostgresStore(std::shared_ptr<idem::PostgresClient>(), o.store), idem::invalid_options_error);
  pgtest::Raw().exec("DROP TABLE idem_test." + other.table + ", idem_test." + seq_table);
}

TEST_CASE("postgres: transactional mode stores exactly the failure text the guard built for an unstorable result",
          "[postgres][tx]") {
  // The text once viewed a temporary that was freed before the store wrote it (seen under ASan).
  pgtest::Raw raw;
  const std::string t = "biz_" + pgtest::random_hex(8);
  raw.exec("CREATE TABLE " + t + " (id text PRIMARY KEY)");
  auto o = pgtest::options();
  o.store.mode = idem::PostgresMode::transactional;
  o.store.max_result_bytes = 16;
  idem::PostgresStore s(o.client, o.store);
  idem::IdempotencyGuard g(s);
  const auto k = key("tx-unstorable");
  auto big = [&](const auto& ctx) {
    ctx.tx->exec("INSERT INTO " + t + " (id) VALUES ($1)", std::string_view(k));
    return std::string(100, 'r');
  };
  CHECK_THROWS_AS(g.run(k, big), idem::result_not_stored_error);
  CHECK(raw.scalar("SELECT count(*) FROM " + t) == "0");  // rolled back with the claim
  auto rec = s.inspect(k);
  REQUIRE(rec);
  CHECK(rec->state == idem::State::failed);
  CHECK(rec->permanent);
  CHECK(rec->error == "result not stored: the encoded result is 100 bytes, over the store's limit of 16");
  auto again = g.run(k, big);
  CHECK(again.status == idem::Status::previously_failed);
  CHECK(again.error == rec->error);
}
