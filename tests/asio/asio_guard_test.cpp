// IdempotencyGuard::run_async on MemoryStore (called inline) and AsyncRedisStore (awaited), and
// AsyncRedisStore's one connection under load, faults and bad configuration.
#include <catch2/catch.hpp>

#include <atomic>
#include <csignal>
#include <future>
#include <thread>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <fmt/core.h>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_future.hpp>

#include "asio_factory.hpp"
#include "idem/memory/memory_store.hpp"
#include "redis_topology.hpp"

using namespace std::chrono_literals;
namespace asio = boost::asio;
using idem::test::AsyncRedisFactory;
using idem::test::IoThread;
using idem::test::random_hex;

namespace {

struct Amount {
  int cents = 0;
};

// One key, twice, then once with another payload: executed, duplicate (same value), mismatch.
template <class Store>
void runs_once_and_replays(IoThread& io, Store& store) {
  idem::IdempotencyGuard guard{store, {.lease = 5s, .retention = 60s}};
  const std::string key = "once-" + random_hex();
  std::atomic<int> ran{0};
  auto run = [&](std::string payload) {
    return io.run(guard.run_async(key, payload, [&](const idem::Context& ctx) {
      ++ran;
      CHECK(ctx.fence == 1);
      return std::string("charged");
    }));
  };
  auto first = run("p");
  CHECK(first.status == idem::Status::executed);
  CHECK(*first.value == "charged");
  auto second = run("p");
  CHECK(second.status == idem::Status::duplicate);
  CHECK(*second.value == "charged");
  CHECK(run("other").status == idem::Status::mismatch);
  CHECK(ran == 1);
}

// An awaitable handler, a throwing one (recorded per policy, rethrown), then the retry runs.
template <class Store>
void async_handler_and_failure(IoThread& io, Store& store) {
  idem::GuardOptions o{.lease = 5s, .retention = 60s};
  o.failure.mode = idem::FailureMode::record;
  o.failure.backoff = 0ms;
  idem::IdempotencyGuard guard{store, o};
  const std::string key = "async-" + random_hex();
  auto out = io.run(guard.run_async(key, "", [&]() -> asio::awaitable<int> {
    asio::steady_timer t(co_await asio::this_coro::executor);
    t.expires_after(5ms);
    co_await t.async_wait(asio::use_awaitable);
    co_return 42;
  }));
  CHECK(out.status == idem::Status::executed);
  CHECK(*out.value == 42);

  const std::string failing = "fails-" + random_hex();
  CHECK_THROWS_WITH(io.run(guard.run_async(failing, "", []() -> int { throw std::runtime_error("card declined"); })),
                    "card declined");
  auto rec = store.inspect(failing);
  REQUIRE(rec);
  CHECK(rec->state == idem::State::failed);
  auto retry = io.run(guard.run_async(failing, "", [] { return 7; }));
  CHECK(retry.status == idem::Status::executed);
  CHECK(retry.attempt == 2);
}

// `n` keys, each run twice at once, all `n * 2` runs in flight together on the io thread.
template <class Store>
std::map<idem::Status, int> many_in_flight(IoThread& io, Store& store, int n, std::atomic<int>& ran) {
  idem::IdempotencyGuard guard{store, {.lease = 10s, .retention = 60s, .wait_for_in_flight = 0ms}};
  const std::string ns = "many-" + random_hex() + ":";
  std::promise<void> all_done;
  auto left = std::make_shared<std::atomic<int>>(n * 2);
  auto counts = std::make_shared<std::map<idem::Status, int>>();
  auto mu = std::make_shared<std::mutex>();
  for (int i = 0; i < n * 2; ++i) {
    asio::co_spawn(io.io, guard.run_async(ns + std::to_string(i % n), "", [&ran] { return ++ran; }),
                   [&, left, counts, mu](std::exception_ptr e, idem::Outcome<int> out) {
                     {
                       std::lock_guard lock(*mu);
                       if (e) ++(*counts)[idem::Status::previously_failed];  // never expected
                       else ++(*counts)[out.status];
                     }
                     if (--*left == 0) all_done.set_value();
                   });
  }
  all_done.get_future().get();
  return *counts;
}

}  // namespace

TEST_CASE("run_async: executed once, replayed, mismatch (memory)", "[asio]") {
  IoThread io;
  idem::MemoryStore store;
  runs_once_and_replays(io, store);
}

TEST_CASE("run_async: executed once, replayed, mismatch (AsyncRedisStore)", "[asio]") {
  AsyncRedisFactory f;
  runs_once_and_replays(f.io, f.store());
}

TEST_CASE("run_async: awaitable handler, failure recorded and retried (memory)", "[asio]") {
  IoThread io;
  idem::MemoryStore store;
  async_handler_and_failure(io, store);
}

TEST_CASE("run_async: awaitable handler, failure recorded and retried (AsyncRedisStore)", "[asio]") {
  AsyncRedisFactory f;
  async_handler_and_failure(f.io, f.store());
}

TEST_CASE("run_async: 1000 runs in flight on one thread and one connection, each key once", "[asio]") {
  AsyncRedisFactory f;
  constexpr int keys = 500;  // each run twice
  std::atomic<int> ran{0};
  auto counts = many_in_flight(f.io, f.store(), keys, ran);
  CHECK(ran == keys);
  CHECK(counts[idem::Status::executed] == keys);
  // The second run of each key finds it in flight or completed; never an error.
  CHECK(counts[idem::Status::in_flight] + counts[idem::Status::duplicate] == keys);
  CHECK(counts[idem::Status::previously_failed] == 0);
  const idem::AsyncRedisStats st = f.store().stats();
  CHECK(st.connects == 1);
  // At least 3 steps per key (two for its executed run, one or more for its second) left pipelined
  // and auto-batched: at least two per socket write. Requests alone say less: the more steps
  // coalesce into one script call, the fewer requests there are (the clean-clone check's dev run:
  // 24 requests in 15 writes).
  INFO("requests " << st.requests << " (" << st.coalesced << " steps coalesced) in " << st.writes << " writes");
  CHECK(2 * st.writes <= 3 * keys);
}

TEST_CASE("AsyncRedisStore: blocking calls from 16 threads share one connection (pool.size 1: one lane)", "[asio]") {
  IoThread io;
  idem::RedisOptions o = AsyncRedisFactory::server().options();
  o.pool.size = 1;  // no lanes beside the first: every caller past the first is multiplexed
  idem::AsyncRedisStore store{io.io.get_executor(), o};
  idem::IdempotencyGuard guard{store, {.lease = 10s, .retention = 60s}};
  const std::string ns = "threads-" + random_hex() + ":";
  std::atomic<int> ran{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 16; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 100; ++i) guard.run(ns + std::to_string((t * 100 + i) % 800), [&] { ++ran; });
    });
  for (auto& t : threads) t.join();
  CHECK(ran == 800);
  CHECK(store.stats().connects == 1);
  CHECK(store.stats().coalesced > 0);  // auto-batching: threads' steps shared script calls
}

// A blocked caller that finds the connection idle writes and reads on its own thread: with the
// loop stopped after the first call (which connects through it), blocking calls still complete.
TEST_CASE("AsyncRedisStore: a blocked caller on an idle connection writes and reads on its own thread", "[asio]") {
  idem::test::RedisServer server;
  asio::io_context io;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work(io.get_executor());
  std::thread loop([&] { io.run(); });
  idem::AsyncRedisStore store{io.get_executor(), server.options()};
  const std::string ns = "here-" + random_hex() + ":";
  REQUIRE(store.acquire(ns + "first", idem::test::acquire_params(1)).status == idem::AcquireStatus::acquired);
  work.reset();
  io.stop();
  loop.join();  // nobody runs the loop now

  const auto before = store.stats();
  for (int i = 0; i < 50; ++i) {
    const std::string key = ns + std::to_string(i);
    auto a = store.acquire(key, idem::test::acquire_params(1));
    REQUIRE(a.status == idem::AcquireStatus::acquired);
    REQUIRE(store.complete(key, a.holder, "r", 60s) == idem::WriteStatus::ok);
    auto again = store.acquire(key, idem::test::acquire_params(2));
    REQUIRE(again.status == idem::AcquireStatus::duplicate);
    CHECK(again.payload == "r");
    CHECK(store.inspect(key)->state == idem::State::completed);
  }
  const auto after = store.stats();
  CHECK(after.requests - before.requests == 200);
  CHECK(after.writes - before.writes == 200);
  CHECK(after.connects == 1);

  // The loop back: the store's own requests (and its shutdown) run on it again.
  io.restart();
  work.emplace(io.get_executor());
  loop = std::thread([&] { io.run(); });
  server.command({"SCRIPT", "FLUSH"});  // NOSCRIPT on the caller's thread: the loop reloads and resends
  CHECK(store.acquire(ns + "flushed", idem::test::acquire_params(1)).status == idem::AcquireStatus::acquired);
  CHECK(store.stats().reloads == 1);
  CHECK(store.acquire(ns + "next", idem::test::acquire_params(1)).status == idem::AcquireStatus::acquired);
  work.reset();
  io.stop();  // the store counts as work while it lives: run() would not return on its own
  loop.join();
}

// The server restarted while the connection sat idle: the next blocked call finds it closed before
// writing, so it is sent once on a fresh connection: nothing resent, nothing in doubt.
TEST_CASE("AsyncRedisStore: a connection closed while idle is replaced before the next blocked call writes", "[asio]") {
  idem::test::RedisServer server;
  IoThread io;
  idem::AsyncRedisStore store{io.io.get_executor(), server.options()};
  const std::string ns = "closed-" + random_hex() + ":";
  REQUIRE(store.acquire(ns + "a", idem::test::acquire_params(1)).status == idem::AcquireStatus::acquired);
  server.stop(SIGKILL);
  server.start();
  CHECK(store.acquire(ns + "b", idem::test::acquire_params(1)).status == idem::AcquireStatus::acquired);
  const auto st = store.stats();
  CHECK(st.connects == 2);
  CHECK(st.resent == 0);
}

TEST_CASE("AsyncRedisStore: a killed server fails calls closed, then it reconnects by itself", "[asio]") {
  idem::test::RedisServer server;
  IoThread io;
  idem::RedisOptions o = server.options();
  o.command_timeout = 1s;
  idem::AsyncRedisStore store{io.io.get_executor(), o};
  const std::string ns = "kill-" + random_hex() + ":";
  idem::IdempotencyGuard guard{store, {.lease = 10s, .retention = 60s}};
  CHECK(io.run(guard.run_async(ns + "before", "", [] { return 1; })).status == idem::Status::executed);
  server.stop(SIGKILL);
  // Down: an error, retryable, never a duplicate and never a handler run.
  bool ran = false;
  try {
    (void)io.run(guard.run_async(ns + "down", "", [&] { ran = true; return 1; }));
    FAIL("a call against a dead server succeeded");
  } catch (const idem::store_error& e) {
    CHECK(e.retryable());
  }
  CHECK_FALSE(ran);
  server.start();
  auto after = io.run(guard.run_async(ns + "after", "", [] { return 2; }));
  CHECK(after.status == idem::Status::executed);
  // What completed before the crash is gone with it (no persistence here), so only the reconnect is checked.
  CHECK(store.stats().connects >= 2);
}

TEST_CASE("AsyncRedisStore: a stopped server times out in doubt, and after SIGCONT it serves again", "[asio]") {
  idem::test::RedisServer server;
  IoThread io;
  idem::RedisOptions o = server.options();
  o.command_timeout = 300ms;
  idem::AsyncRedisStore store{io.io.get_executor(), o};
  const std::string ns = "stop-" + random_hex() + ":";
  idem::AcquireParams p = idem::test::acquire_params(1);
  auto first = store.acquire(ns + "a", p);
  REQUIRE(first.status == idem::AcquireStatus::acquired);
  ::kill(server.pid(), SIGSTOP);
  const auto t0 = std::chrono::steady_clock::now();
  // The complete is lost twice (first sending, then the resend on a fresh connection, which
  // cannot even connect in time): its outcome is unknown, never assumed.
  CHECK_THROWS_AS(store.complete(ns + "a", first.holder, "r", 60s), idem::store_error);
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);
  ::kill(server.pid(), SIGCONT);
  // The same holder asks again: the server ran the step at most once, and answers it as done.
  CHECK(store.complete(ns + "a", first.holder, "r", 60s) == idem::WriteStatus::ok);
  auto again = store.acquire(ns + "a", idem::test::acquire_params(2));
  CHECK(again.status == idem::AcquireStatus::duplicate);
  CHECK(again.payload == "r");
}

// The idle health check: a connection idle for health_check_interval sends PING. A server that
// answers keeps the connection; one that does not (stopped here; a host gone without a FIN, a
// partition in production) loses it before a call is written to it, so the next call connects
// afresh and is not sent into a dead connection to end in doubt.
TEST_CASE("AsyncRedisStore: an idle connection is checked by PING and a silent one dropped before the next call",
          "[asio]") {
  idem::test::RedisServer server;
  IoThread io;
  idem::RedisOptions o = server.options();
  o.command_timeout = 300ms;
  o.health_check_interval = 200ms;
  idem::AsyncRedisStore store{io.io.get_executor(), o};
  const std::string ns = "idle-" + random_hex() + ":";
  REQUIRE(store.acquire(ns + "a", idem::test::acquire_params(1)).status == idem::AcquireStatus::acquired);
  std::this_thread::sleep_for(900ms);
  auto st = store.stats();
  CHECK(st.health_checks >= 2);  // every 200 ms of silence
  CHECK(st.health_failures == 0);
  CHECK(st.connects == 1);  // a healthy connection is kept

  ::kill(server.pid(), SIGSTOP);
  const auto checks = st.health_checks;
  bool dropped = false;
  for (int i = 0; i < 40 && !dropped; ++i) {
    std::this_thread::sleep_for(50ms);
    dropped = store.stats().health_failures > 0;
  }
  ::kill(server.pid(), SIGCONT);
  CHECK(dropped);
  CHECK(store.stats().health_checks > checks);
  // The next call opens a fresh connection and runs once: no resend, nothing in doubt.
  CHECK(store.acquire(ns + "b", idem::test::acquire_params(2)).status == idem::AcquireStatus::acquired);
  st = store.stats();
  CHECK(st.connects == 2);
  CHECK(st.resent == 0);
}

TEST_CASE("AsyncRedisStore: health_check_interval 0 sends no PING, a negative one is refused", "[asio]") {
  idem::test::RedisServer server;
  IoThread io;
  idem::RedisOptions o = server.options();
  o.health_check_interval = 0ms;
  idem::AsyncRedisStore store{io.io.get_executor(), o};
  (void)store.inspect("warm");
  std::this_thread::sleep_for(300ms);
  CHECK(store.stats().health_checks == 0);
  o.health_check_interval = -1ms;
  CHECK_THROWS_AS(idem::AsyncRedisStore(io.io.get_executor(), o), idem::invalid_options_error);
}

TEST_CASE("AsyncRedisStore: SCRIPT FLUSH under load reloads and resends", "[asio]") {
  AsyncRedisFactory f;
  const std::string ns = "flush-" + random_hex() + ":";
  CHECK(f.store().acquire(ns + "a", idem::test::acquire_params(1)).status == idem::AcquireStatus::acquired);
  AsyncRedisFactory::server().command({"SCRIPT", "FLUSH"});
  CHECK(f.store().acquire(ns + "b", idem::test::acquire_params(2)).status == idem::AcquireStatus::acquired);
  CHECK(f.store().stats().reloads >= 1);
}

TEST_CASE("AsyncRedisStore: bad configuration is refused at construction", "[asio]") {
  IoThread io;
  CHECK_THROWS_AS(idem::AsyncRedisStore(io.io.get_executor(), {.url = "redis-cluster://127.0.0.1:7000", .max_redirects = 0}),
                  idem::invalid_options_error);
  // Cluster, Sentinel and TLS go through RedisStore's connection factory: no seed or sentinel
  // answering is a retryable connection_error; rediss:// at a plain-text port is a TLS error no
  // retry can help.
  idem::RedisOptions cluster;
  cluster.url = fmt::format("redis-cluster://127.0.0.1:{}", idem::test::free_port());
  cluster.connect_timeout = 300ms;
  CHECK_THROWS_AS(idem::AsyncRedisStore(io.io.get_executor(), cluster), idem::connection_error);
  idem::RedisOptions sentinel;
  sentinel.url = fmt::format("redis-sentinel://127.0.0.1:{}/mymaster", idem::test::free_port());
  sentinel.connect_timeout = 300ms;
  CHECK_THROWS_AS(idem::AsyncRedisStore(io.io.get_executor(), sentinel), idem::connection_error);
  {
    idem::test::RedisServer plain;
    idem::RedisOptions tls;
    tls.url = fmt::format("rediss://127.0.0.1:{}", plain.port());
    tls.connect_timeout = 500ms;
    try {
      idem::AsyncRedisStore s(io.io.get_executor(), tls);
      FAIL("rediss:// to a plain-text port was accepted");
    } catch (const idem::connection_error& e) {
      CHECK(e.code() == "TLS");
      CHECK_FALSE(e.retryable());
    }
  }
  idem::RedisOptions nowhere;
  nowhere.port = idem::test::free_port();
  CHECK_THROWS_AS(idem::AsyncRedisStore(io.io.get_executor(), nowhere), idem::connection_error);
  idem::test::RedisServer lru{{"maxmemory 100mb", "maxmemory-policy allkeys-lru"}};
  try {
    idem::AsyncRedisStore s(io.io.get_executor(), lru.options());
    FAIL("an evicting server was accepted");
  } catch (const idem::store_error& e) {
    CHECK(e.code() == "EVICTION");
  }
}

TEST_CASE("AsyncRedisStore: bad input fails the call, nothing is sent", "[asio]") {
  AsyncRedisFactory f;
  idem::Holder none{};
  CHECK_THROWS_AS(f.store().complete("k", none, "r", 60s), idem::usage_error);
  CHECK_THROWS_AS(f.store().acquire("", idem::test::acquire_params(1)), idem::invalid_key_error);
  CHECK(f.store().stats().requests == 0);
}

TEST_CASE("AsyncRedisStore: min_replica_acks waits for the replica in the same write", "[asio]") {
  idem::test::ProxiedPair pair;
  IoThread io;
  idem::RedisOptions o = pair.master().options();
  o.min_replica_acks = 1;
  o.replica_ack_timeout = 300ms;
  idem::AsyncRedisStore store{io.io.get_executor(), o};
  const std::string ns = "acks-" + random_hex() + ":";
  auto a = store.acquire(ns + "a", idem::test::acquire_params(1));
  REQUIRE(a.status == idem::AcquireStatus::acquired);
  CHECK(store.complete(ns + "a", a.holder, "r", 60s) == idem::WriteStatus::ok);
  // The replica stops getting writes: a change is reported, not trusted; a duplicate answer
  // (nothing written) needs no replica.
  pair.hold_replication();
  try {
    (void)store.acquire(ns + "b", idem::test::acquire_params(2));
    FAIL("an unreplicated claim was reported as taken");
  } catch (const idem::durability_error& e) {
    CHECK(e.acks() == 0);
    CHECK(e.wanted() == 1);
  }
  CHECK(pair.replication_held());
  CHECK(store.acquire(ns + "a", idem::test::acquire_params(3)).status == idem::AcquireStatus::duplicate);
}

TEST_CASE("run_async: any completion token (a callback, use_future) on a given executor (memory)", "[asio]") {
  idem::MemoryStore store;
  idem::IdempotencyGuard guard{store, {.lease = 5s, .retention = 60s}};
  asio::io_context ctx;
  std::exception_ptr seen_error;
  std::optional<idem::Outcome<int>> seen;
  guard.run_async(ctx, "token-cb", "p", [] { return 7; },
                  [&](std::exception_ptr e, idem::Outcome<int> out) {
                    seen_error = e;
                    seen = std::move(out);
                  });
  auto fut = guard.run_async(ctx.get_executor(), "token-cb", "p", [] { return 8; }, asio::use_future);
  ctx.run();
  CHECK_FALSE(seen_error);
  REQUIRE(seen);
  CHECK(seen->status == idem::Status::executed);
  CHECK(*seen->value == 7);
  const auto dup = fut.get();
  CHECK(dup.status == idem::Status::duplicate);
  CHECK(*dup.value == 7);
}

// Boost 1.74 (Debian 12) has no per-operation cancellation slots: a caller waiting on the store
// is ended by ending the store. Its pending calls — written and unanswered, coalesced or queued —
// complete with a retryable connection_error that says they may have run, never with an answer.
TEST_CASE("AsyncRedisStore: callers waiting when the store goes away get an error that says they may have run",
          "[asio][batch]") {
  idem::test::RedisServer server;
  IoThread io;
  auto store = std::make_unique<idem::AsyncRedisStore>(io.io.get_executor(), server.options());
  (void)store->inspect("warm");
  const std::string ns = "gone-" + random_hex() + ":";
  ::kill(server.pid(), SIGSTOP);  // the calls are written and wait for their replies
  std::vector<std::promise<idem::AcquireResult>> waiting(12);
  for (std::size_t i = 0; i < waiting.size(); ++i)
    store->async_acquire(ns + std::to_string(i % 6), idem::test::acquire_params(100 + i),
                         [&p = waiting[i]](std::exception_ptr e, idem::AcquireResult r) {
                           if (e) p.set_exception(e);
                           else p.set_value(std::move(r));
                         });
  std::this_thread::sleep_for(200ms);
  store.reset();
  ::kill(server.pid(), SIGCONT);
  for (auto& p : waiting) {
    auto f = p.get_future();
    REQUIRE(f.wait_for(5s) == std::future_status::ready);
    try {
      (void)f.get();
      FAIL("a call pending when its store was destroyed was answered");
    } catch (const idem::connection_error& e) {
      CHECK(e.retryable());
      CHECK_THAT(e.what(), Catch::Contains("may or may not have run"));
    }
  }
  // The server goes on; what ran holds its key until the lease, as any crash after a claim.
  idem::AsyncRedisStore again{io.io.get_executor(), server.options()};
  for (int i = 0; i < 6; ++i) {
    const auto s = again.acquire(ns + std::to_string(i), idem::test::acquire_params(7)).status;
    CHECK((s == idem::AcquireStatus::in_flight || s == idem::AcquireStatus::acquired));
  }
}
