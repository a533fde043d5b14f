// Recovery (issue 11): pools heal after a restart, a write whose reply was lost is settled by the
// same holder asking again (no re-run, no false status), and when that cannot be done the error
// says the outcome is unknown. Lost replies come from support/tcp_proxy.hpp: the request reaches
// the server and runs, the reply never reaches the client. The single calls' cases are the shared
// lost-reply suite (support/lost_reply_suite.hpp, also run on AsyncRedisStore); the guard's,
// batches', sequences' and the replica cases are here.
#include <catch2/catch.hpp>

#include <atomic>
#include <csignal>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "idem/redis.hpp"
#include "redis_factory.hpp"
#include "support/lost_reply_suite.hpp"
#include "support/tcp_proxy.hpp"

using namespace std::chrono_literals;
using idem::AcquireStatus;
using idem::WriteStatus;
using idem::test::RedisServer;
using idem::test::TcpProxy;

namespace {

constexpr auto params = &idem::test::acquire_params;

// A server, a proxy in front of it and a store through the proxy (one connection, so the
// retry must open a fresh one).
struct Proxied {
  RedisServer server;
  TcpProxy proxy{server.port()};
  idem::RedisStore store{[this] {
    idem::RedisOptions o = server.options();
    o.port = proxy.port();
    o.pool.size = 1;
    o.command_timeout = 1s;
    return o;
  }()};
  std::string key = "lost-" + idem::test::random_hex();
  Proxied() { (void)store.inspect(key + "-warm"); }  // the connection up before any plan
};

}  // namespace

IDEM_LOST_REPLY_SUITE(Proxied, "redis", "[redis]")

TEST_CASE("redis restarted under an idle connection: the next N calls at once all succeed", "[redis][recovery]") {
  constexpr int n = 4;
  RedisServer server;
  idem::RedisOptions o = server.options();
  o.pool.size = 1;  // one lane: the calls at once share one connection
  idem::RedisStore store(o);
  idem::IdempotencyGuard guard(store, {.lease = 10s, .retention = 60s});
  const std::string ns = "restart-" + idem::test::random_hex() + ":";
  // n calls at once while the server is paused: they queue on the store's one connection.
  server.command({"CLIENT", "PAUSE", "300", "ALL"});
  std::vector<std::thread> fill;
  for (int i = 0; i < n; ++i) fill.emplace_back([&, i] { (void)store.inspect(ns + "fill-" + std::to_string(i)); });
  for (auto& t : fill) t.join();
  REQUIRE(store.stats().connects == 1);

  server.stop(SIGTERM);
  server.start();  // same port, no data, no scripts loaded

  std::atomic<int> executed{0}, failed{0};
  std::vector<std::thread> calls;
  for (int i = 0; i < n; ++i)
    calls.emplace_back([&, i] {
      try {
        if (guard.run(ns + "after-" + std::to_string(i), [] { return 1; }).status == idem::Status::executed)
          ++executed;
      } catch (...) {
        ++failed;
      }
    });
  for (auto& t : calls) t.join();
  CHECK(failed.load() == 0);
  CHECK(executed.load() == n);
  for (int i = 0; i < n; ++i)
    CHECK(guard.run(ns + "again-" + std::to_string(i), [] { return 2; }).status == idem::Status::executed);
  CHECK(store.stats().connects == 2);  // the dead idle one noticed before a write, one reconnect
}

TEST_CASE("redis lost replies through the guard: the handler runs once, executed", "[redis][recovery]") {
  Proxied t;
  idem::IdempotencyGuard guard(t.store, {.lease = 10s, .retention = 60s});
  for (const int skip : {0, 1}) {  // 0: the acquire's reply is lost, 1: the complete's
    const std::string k = t.key + "-" + std::to_string(skip);
    int runs = 0;
    t.proxy.arm(TcpProxy::Action::cut, skip);
    auto out = guard.run(k, [&] { return ++runs; });
    CHECK(t.proxy.fired());
    CHECK(out.status == idem::Status::executed);
    CHECK(runs == 1);
    auto again = guard.run(k, [&] { return ++runs; });
    CHECK(again.status == idem::Status::duplicate);
    CHECK(again.value == 1);
    CHECK(runs == 1);
  }
}

TEST_CASE("redis lost batch replies: the same holder's retry settles every key", "[redis][recovery]") {
  Proxied t;
  std::vector<std::string> names;
  for (int i = 0; i < 5; ++i) names.push_back(t.key + "-" + std::to_string(i));
  const std::vector<std::string_view> keys(names.begin(), names.end());
  t.proxy.arm(TcpProxy::Action::cut);
  auto claims = t.store.acquire_batch(keys, params(21));
  CHECK(t.proxy.fired());
  std::vector<idem::CompleteItem> done;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    CHECK(claims[i].status == AcquireStatus::acquired);
    CHECK(claims[i].holder == idem::Holder{1, 21});
    done.push_back({keys[i], claims[i].holder, "r"});
  }
  t.proxy.arm(TcpProxy::Action::cut);
  for (WriteStatus s : t.store.complete_batch(done, 60s)) CHECK(s == WriteStatus::ok);
  CHECK(t.proxy.fired());
  for (std::string_view k : keys) CHECK(t.store.acquire(k, params(22)).payload == "r");
}

TEST_CASE("redis lost complete_advance reply: ok, the sequence advanced once", "[redis][recovery]") {
  Proxied t;
  idem::RedisSequenceStore seqs{t.store};
  auto r = t.store.acquire(t.key, params(31));
  t.proxy.arm(TcpProxy::Action::cut);
  auto out = seqs.complete_advance(t.store, t.key, r.holder, "r", 60s, "acct-1", 7);
  CHECK(t.proxy.fired());
  CHECK(out.status == WriteStatus::ok);
  // The retry's compare-and-set finds the sequence it already set: not advanced again.
  CHECK(out.advance.previous == std::optional<std::uint64_t>(7));
  CHECK(seqs.last_applied("acct-1") == std::optional<std::uint64_t>(7));
  CHECK(t.store.acquire(t.key, params(32)).payload == "r");
}

TEST_CASE("redis transient error replies are retryable store_errors", "[redis][recovery]") {
  Proxied t;
  for (const char* code : {"NOREPLICAS", "LOADING", "MASTERDOWN", "TRYAGAIN", "BUSY"}) {
    INFO(code);
    t.proxy.arm(TcpProxy::Action::replace, 0, std::string("-") + code + " injected by the test proxy\r\n");
    try {
      (void)t.store.acquire(t.key + code, params(1));
      FAIL("an error reply was not reported");
    } catch (const idem::store_error& e) {
      CHECK(e.code() == code);
      CHECK(e.retryable());
    }
  }
}

TEST_CASE("redis NOREPLICAS from a primary without its replicas: retryable, nothing written", "[redis][recovery]") {
  RedisServer server({"min-replicas-to-write 1"});
  idem::RedisStore store(server.options());
  const std::string k = "noreplicas-" + idem::test::random_hex();
  try {
    (void)store.acquire(k, params(1));
    FAIL("wrote without the replicas min-replicas-to-write asks for");
  } catch (const idem::store_error& e) {
    CHECK(e.code() == "NOREPLICAS");
    CHECK(e.retryable());
  }
  REQUIRE(server.command({"CONFIG", "SET", "min-replicas-to-write", "0"}) == "OK");
  CHECK_FALSE(store.inspect(k).has_value());
}

TEST_CASE("redis limits come from proto-max-bulk-len, a result over them completes without it",
          "[redis][recovery]") {
  {
    RedisServer server;
    idem::RedisStore store(server.options());
    CHECK(store.limits().max_result_bytes == (512u << 20) - (1u << 20));
    CHECK(store.limits().max_key_bytes == (512u << 20) - (1u << 20) - store.options().key_prefix.size());
  }
  RedisServer server({"proto-max-bulk-len 1mb"});
  idem::RedisStore store(server.options());
  const std::size_t most = (1u << 20) - (1u << 17);
  REQUIRE(store.limits().max_result_bytes == most);
  idem::IdempotencyGuard guard(store, {.lease = 10s, .retention = 60s});
  const std::string k = "large-" + idem::test::random_hex();
  int runs = 0;
  auto large = [&] {
    ++runs;
    return std::string(most + 1, 'x');
  };
  CHECK_THROWS_AS(guard.run(k, large), idem::result_not_stored_error);
  auto again = guard.run(k, large);
  CHECK(again.status == idem::Status::duplicate);
  CHECK(again.result_unavailable);
  CHECK(runs == 1);
  // One that fits is stored as usual.
  CHECK(guard.run(k + "-fits", [] { return std::string((1u << 20) - (1u << 17), 'y'); }).status ==
        idem::Status::executed);
}

namespace {

// A primary and one replica of it, the link up and caught up.
struct Replicated {
  RedisServer primary;
  RedisServer replica{{"replicaof 127.0.0.1 " + std::to_string(primary.port())}};
  Replicated() {
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (replica.command({"INFO", "replication"}).find("master_link_status:up") == std::string::npos) {
      if (std::chrono::steady_clock::now() > deadline) FAIL("the replica did not sync: " + replica.log_tail());
      std::this_thread::sleep_for(20ms);
    }
  }
  [[nodiscard]] idem::RedisOptions options(int acks) const {
    idem::RedisOptions o = primary.options();
    o.min_replica_acks = acks;
    o.replica_ack_timeout = 300ms;
    o.command_timeout = 2s;
    return o;
  }
  void pause_replica() { ::kill(replica.pid(), SIGSTOP); }
  // Until the replica has acknowledged everything the primary wrote.
  void wait_caught_up() {
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    for (;;) {
      const std::string info = primary.command({"INFO", "replication"});
      auto field = [&](const std::string& name) {
        const auto at = info.find(name);
        return at == std::string::npos ? std::string() : info.substr(at + name.size(), info.find_first_of(",\r", at) - at - name.size());
      };
      if (!field("offset=").empty() && field("offset=") == field("master_repl_offset:")) return;
      if (std::chrono::steady_clock::now() > deadline) FAIL("the replica did not catch up: " + info);
      std::this_thread::sleep_for(20ms);
    }
  }
  void resume_replica() { ::kill(replica.pid(), SIGCONT); }
};

// Collects the store's warnings.
struct Warnings : idem::Observer {
  std::vector<std::string> seen;
  void on_warning(std::string_view m) noexcept override { seen.emplace_back(m); }
};

}  // namespace

TEST_CASE("redis min_replica_acks 1: each write transition is on the replica when it returns",
          "[redis][replication]") {
  Replicated t;
  idem::RedisStore store(t.options(1));
  const std::string k = "acked-" + idem::test::random_hex();
  const std::string raw = store.redis_key(k);
  auto r = store.acquire(k, params(7));
  REQUIRE(r.status == AcquireStatus::acquired);
  // WAIT returned only once the replica had the claim: it is there now, no polling.
  CHECK(t.replica.command({"EXISTS", raw}) == "1");
  REQUIRE(store.complete(k, r.holder, "done", 60s) == WriteStatus::ok);
  CHECK(t.replica.command({"GET", raw}) == t.primary.command({"GET", raw}));
  auto dup = store.acquire(k, params(8));
  CHECK(dup.status == AcquireStatus::duplicate);
  CHECK(dup.payload == "done");
}

TEST_CASE("redis min_replica_acks 1 with the replica stopped: the handler does not run, reads still answer",
          "[redis][replication]") {
  Replicated t;
  idem::RedisStore store(t.options(1));
  idem::IdempotencyGuard guard(store, {.lease = 30s, .retention = 60s});
  const std::string ns = "unacked-" + idem::test::random_hex() + ":";
  REQUIRE(guard.run(ns + "done", [] { return 1; }).status == idem::Status::executed);
  auto held = store.acquire(ns + "held", params(11));
  REQUIRE(held.status == AcquireStatus::acquired);

  t.pause_replica();
  int runs = 0;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    (void)guard.run(ns + "new", [&] { return ++runs; });
    FAIL("a claim no replica acknowledged ran the handler");
  } catch (const idem::durability_error& e) {
    CHECK(e.acks() == 0);
    CHECK(e.wanted() == 1);
    CHECK(e.retryable());
    CHECK(e.code() == "WAIT");
    CHECK(std::string(e.what()).find("the handler did not run") != std::string::npos);
  }
  CHECK(runs == 0);
  CHECK(std::chrono::steady_clock::now() - t0 >= 250ms);  // it waited replica_ack_timeout, no longer
  // A duplicate changed nothing: answered (after the WAIT that came with it), not an error.
  CHECK(guard.run(ns + "done", [&] { return ++runs; }).status == idem::Status::duplicate);
  // A completion the replica did not acknowledge stands on the primary and is reported.
  try {
    (void)store.complete(ns + "held", held.holder, "r", 60s);
    FAIL("an unacknowledged completion was reported ok");
  } catch (const idem::durability_error& e) {
    CHECK(std::string(e.what()).find("the write stands on the primary") != std::string::npos);
  }
  t.resume_replica();
  auto rec = store.inspect(ns + "held");
  REQUIRE(rec);
  CHECK(rec->state == idem::State::completed);
  // Once the replica is back and has caught up (on a loaded machine that takes a moment), the
  // same calls succeed again.
  t.wait_caught_up();
  CHECK(guard.run(ns + "after", [&] { return ++runs; }).status == idem::Status::executed);
  CHECK(runs == 1);
}

TEST_CASE("redis min_replica_acks above the replicas attached: a warning at construction, writes fail closed",
          "[redis][replication]") {
  RedisServer server;
  auto warnings = std::make_shared<Warnings>();
  idem::RedisOptions o = server.options();
  o.min_replica_acks = 1;
  o.replica_ack_timeout = 100ms;
  o.observer = warnings;
  idem::RedisStore store(o);
  REQUIRE(warnings->seen.size() == 1);
  CHECK(warnings->seen[0].find("0 replica(s) connected") != std::string::npos);
  CHECK_THROWS_AS(store.acquire("alone-" + idem::test::random_hex(), params(1)), idem::durability_error);
  // Batches are written in one script per chunk and checked by the WAIT after them.
  const std::vector<std::string_view> keys{"alone-a", "alone-b"};
  CHECK_THROWS_AS(store.acquire_batch(keys, params(2)), idem::durability_error);
}
