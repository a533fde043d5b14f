// PostgresStore configuration checked at construction (issue 11 point 3), its size limits and
// results it cannot take, and the upgrade of a version-1 table to schema version 2.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include "idem/idem.hpp"
#include "idem/postgres.hpp"
#include "pg_support.hpp"

using namespace std::chrono_literals;
using pgtest::ap;
using pgtest::capture;
using pgtest::key;

TEST_CASE("postgres config: a malformed conninfo is invalid_options_error at construction", "[postgres]") {
  struct Case {
    std::string conninfo, names;
  };
  const Case cases[] = {
      {"host=127.0.0.1 bogus=1", "bogus"},                     // unknown option
      {"host=127.0.0.1 port=abc", "port"},                     // bad port
      {"host=127.0.0.1 port=70000", "port"},                   // port out of range
      {"host='127.0.0.1 dbname=app", "quoted"},                // broken quoting
      {"host=127.0.0.1 sslmode=verify", "sslmode"},            // bad enumerated value
      {"host=127.0.0.1 connect_timeout=5s", "connect_timeout"},
      {"postgresql://127.0.0.1:abc/app", "port"},              // URI, bad port
      {"postgresql://127.0.0.1/app?bogus=1", "bogus"},         // URI, unknown parameter
      {"postgresql://127.0.0.1/app?sslmode=on", "sslmode"},
  };
  for (const auto& c : cases) {
    INFO(c.conninfo);
    auto e = capture<idem::invalid_options_error>([&] { idem::PostgresClient client({.conninfo = c.conninfo}); });
    CHECK_FALSE(e.retryable());
    const std::string what = e.what();
    CHECK(what.find("PostgresOptions::conninfo") != std::string::npos);
    CHECK(what.find(c.names) != std::string::npos);
    // Through a store's own client as well: nothing is sent, nothing waits for a first message.
    CHECK_THROWS_AS(idem::PostgresStore(idem::PostgresOptions{.conninfo = c.conninfo}), idem::invalid_options_error);
  }
  // Well-formed strings pass: key=value, URI, several hosts and ports, empty (libpq defaults).
  for (const std::string ok : {"", "host=db port=5432 sslmode=verify-full", "host=a,b port=5432,",
                               "postgresql://u@db:5433/app?sslmode=require&target_session_attrs=read-write"}) {
    INFO(ok);
    CHECK_NOTHROW(idem::PostgresClient({.conninfo = ok}));
  }
}

TEST_CASE("postgres config: limits, a guard asking for longer keys is refused, max_result_bytes is checked",
          "[postgres]") {
  auto o = pgtest::options();
  idem::PostgresStore s(o.client, o.store);
  CHECK(s.limits().max_key_bytes == 2048);
  CHECK(s.limits().max_result_bytes == std::size_t{64} << 20);
  idem::GuardOptions g;
  g.max_key_bytes = 4096;
  auto e = capture<idem::invalid_options_error>([&] { idem::IdempotencyGuard guard(s, g); });
  CHECK(std::string(e.what()).find("2048") != std::string::npos);
  g.max_key_bytes = 2048;
  CHECK_NOTHROW(idem::IdempotencyGuard(s, g));
  // A key over the store's own limit: the advice is to hash it, since no option raises the limit.
  auto k = capture<idem::invalid_key_error>([&] { s.acquire(std::string(2049, 'k'), ap(1)); });
  CHECK(std::string(k.what()).find("fingerprint") != std::string::npos);
  CHECK(std::string(k.what()).find("raise") == std::string::npos);
  for (std::size_t bad : {std::size_t{0}, std::size_t{1} << 30}) {
    o.store.max_result_bytes = bad;
    auto m = capture<idem::invalid_options_error>([&] { idem::PostgresStore(o.client, o.store); });
    CHECK(std::string(m.what()).find("max_result_bytes") != std::string::npos);
  }
}

TEST_CASE("postgres config: a result over max_result_bytes completes the key without it, the handler runs once",
          "[postgres]") {
  auto o = pgtest::options();
  o.store.max_result_bytes = 16;
  idem::PostgresStore s(o.client, o.store);
  CHECK(s.limits().max_result_bytes == 16);
  // Called directly, an oversized result is refused before anything is sent.
  const auto kd = key("direct");
  auto a = s.acquire(kd, ap(1));
  CHECK_THROWS_AS(s.complete(kd, a.holder, std::string(17, 'x'), 60s), idem::usage_error);
  CHECK(s.inspect(kd)->state == idem::State::in_progress);
  // Through the guard: result_not_stored_error, then duplicates that say the result is unavailable.
  idem::IdempotencyGuard guard(s);
  const auto k = key("big");
  int ran = 0;
  auto big = [&](const idem::Context&) {
    ++ran;
    return std::string(100, 'r');
  };
  CHECK_THROWS_AS(guard.run(k, big), idem::result_not_stored_error);
  auto again = guard.run(k, big);
  CHECK(again.status == idem::Status::duplicate);
  CHECK(again.result_unavailable);
  CHECK(ran == 1);
  auto rec = s.inspect(k);
  REQUIRE(rec);
  CHECK(rec->state == idem::State::completed);
  CHECK(rec->permanent);
  CHECK(rec->result.empty());
}

TEST_CASE("postgres config: a version-1 table is upgraded to version 2 in place", "[postgres]") {
  pgtest::Raw raw;
  const std::string schema = "upgrade_" + pgtest::random_hex(8);
  auto o = pgtest::options();
  o.store.schema = schema;
  idem::PostgresStore old_store(o.client, o.store);
  old_store.migrate();
  // Put the table back at version 1: v1's acquire function had no answer for a result that was
  // not stored (it answered an ordinary duplicate with the empty result).
  const std::string fn = schema + ".records_acquire";
  std::string def = raw.scalar("SELECT pg_get_functiondef('" + fn + "'::regproc)");
  const std::string v2_branch = "IF r.state = 2 AND r.permanent THEN";
  REQUIRE(def.find(v2_branch) != std::string::npos);
  def.replace(def.find(v2_branch), v2_branch.size(), "IF false THEN");
  raw.exec(def);
  raw.exec("UPDATE " + schema + ".idem_schema_version SET version = 1 WHERE table_name = 'records'");
  const auto held = key("held"), gone = key("gone");
  auto h = old_store.acquire(held, ap(1));
  auto u = old_store.acquire(gone, ap(2));
  REQUIRE(old_store.complete_unavailable(gone, u.holder, "too large", 60s) == idem::WriteStatus::ok);
  CHECK_FALSE(old_store.acquire(gone, ap(3)).result_unavailable);  // what version 1 answered
  // A new process (a store of its own) migrates on first use: version 2, rows kept.
  idem::PostgresStore upgraded(o.client, o.store);
  auto d = upgraded.acquire(gone, ap(4));
  CHECK(d.status == idem::AcquireStatus::duplicate);
  CHECK(d.result_unavailable);
  CHECK(d.payload == "too large");
  CHECK(raw.scalar("SELECT version FROM " + schema + ".idem_schema_version WHERE table_name = 'records'") == "2");
  CHECK(upgraded.complete(held, h.holder, "after upgrade", 60s) == idem::WriteStatus::ok);
  CHECK(upgraded.acquire(held, ap(5)).payload == "after upgrade");
  // The older store's prepared statements call the replaced function too.
  CHECK(old_store.acquire(gone, ap(6)).result_unavailable);
  raw.exec("DROP SCHEMA " + schema + " CASCADE");
}

TEST_CASE("postgres config: a server whose commits no standby confirms is reported when the store is built",
          "[postgres][config]") {
  struct Warnings : idem::Observer {
    std::string all;
    void on_warning(std::string_view m) noexcept override { all += std::string(m) + "\n"; }
  };
  auto w = std::make_shared<Warnings>();
  auto o = pgtest::options();
  o.client.observer = w;
  idem::PostgresStore s(o.client, o.store);
  INFO(w->all);
  // The fixture: no standby, synchronous_commit off (pg_cluster.sh starts it fast).
  CHECK_THAT(w->all, Catch::Contains("synchronous_standby_names = '', pg_is_in_recovery() = false"));
  CHECK_THAT(w->all, Catch::Contains("in lease mode such a key runs its handler again"));
  CHECK_THAT(w->all, Catch::Contains("in transactional mode the handler's writes are lost with their record"));
  // A server that cannot be reached now is no error at construction: the first call says so.
  auto down = pgtest::options();
  down.client.conninfo = "host=127.0.0.1 port=1 user=postgres dbname=postgres";
  idem::PostgresStore unreachable(down.client, down.store);
  CHECK_THROWS_AS(unreachable.acquire(pgtest::key("x"), pgtest::ap(1)), idem::connection_error);
}

namespace {
// What the pool and the guard report, copied out of the events (their views die with the call).
struct PoolRecorder : idem::Observer {
  std::mutex mu;
  std::size_t checkouts_that_waited = 0, events = 0, max_in_use = 0, size = 0;
  std::map<std::string, std::size_t> calls;
  void on_pool(const idem::PoolEvent& e) noexcept override {
    std::lock_guard lock(mu);
    if (e.pool != "postgres") return;
    ++events;
    size = e.size;
    max_in_use = std::max(max_in_use, e.in_use);
    if (e.wait >= 100ms) ++checkouts_that_waited;
  }
  void on_store_call(const idem::StoreCallEvent& e) noexcept override {
    std::lock_guard lock(mu);
    ++calls[std::string(e.op)];
  }
};
}  // namespace

TEST_CASE("postgres config: the pool reports its use and a checkout's wait to the guard's observer", "[postgres]") {
  // Transactional mode holds the session for the handler's whole run: with a pool of one, a second
  // run's begin waits for the first handler to finish, and that wait is what the observer hears.
  auto o = pgtest::options(idem::PostgresMode::transactional);
  o.client.pool.size = 1;
  o.client.pool.wait = 5000ms;
  idem::PostgresStore s(o.client, o.store);
  auto rec = std::make_shared<PoolRecorder>();
  idem::IdempotencyGuard guard(s, {.observer = rec});
  std::atomic<bool> in_handler{false};
  std::thread first([&] {
    guard.run(key("first"), [&](const idem::Context&) {
      in_handler = true;
      std::this_thread::sleep_for(300ms);
      return 1;
    });
  });
  while (!in_handler) std::this_thread::sleep_for(5ms);
  guard.run(key("second"), [](const idem::Context&) { return 2; });
  first.join();
  std::lock_guard lock(rec->mu);
  CHECK(rec->size == 1);
  CHECK(rec->max_in_use == 1);
  CHECK(rec->events >= 4);  // two checkouts, two returns
  CHECK(rec->checkouts_that_waited == 1);
  CHECK(rec->calls["begin"] == 2);
  CHECK(rec->calls["commit"] == 2);
}
