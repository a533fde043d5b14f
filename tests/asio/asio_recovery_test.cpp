// AsyncRedisStore under lost replies: the suite RedisStore runs too (support/lost_reply_suite.hpp).
// The fixture first makes one call so the store's one connection (and its handshake) is up: the
// proxy's next reply is then the call under test. Then a Sentinel failover under the async face.
#include <catch2/catch.hpp>

#include <signal.h>

#include <atomic>
#include <filesystem>
#include <future>
#include <optional>
#include <string>
#include <thread>

#include "asio_factory.hpp"
#include "redis_topology.hpp"
#include "support/lost_reply_suite.hpp"
#include "support/tcp_proxy.hpp"

using namespace std::chrono_literals;
using idem::test::IoThread;
using idem::test::RedisServer;
using idem::test::TcpProxy;

namespace {

struct Proxied {
  RedisServer server;
  TcpProxy proxy{server.port()};
  IoThread io;
  idem::AsyncRedisStore store{io.io.get_executor(), [this] {
                                idem::RedisOptions o = server.options();
                                o.port = proxy.port();
                                o.command_timeout = 1s;
                                return o;
                              }()};
  std::string key = "lost-" + idem::test::random_hex();
  Proxied() { (void)store.inspect(key + "-warm"); }  // the connection and its handshake, before any plan
};

}  // namespace

IDEM_LOST_REPLY_SUITE(Proxied, "async", "[asio]")

namespace {
std::size_t threads_now() {
  std::size_t n = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) n += task.is_directory() ? 1 : 0;
  return n;
}
}  // namespace

// A connection opens on the loop, as a coroutine on its strand: no thread is started for it, and
// a server that accepts the connection but never answers the hello holds the call for
// command_timeout only, then the call fails as a connect that ran nothing (retryable).
TEST_CASE("AsyncRedisStore: a connection opens on the loop, no thread of its own", "[asio]") {
  RedisServer server;
  IoThread io;
  idem::RedisOptions o = server.options();
  o.db = 1;  // so the hello has a request (SELECT) to wait on
  o.command_timeout = 700ms;
  idem::AsyncRedisStore store{io.io.get_executor(), o};  // its check ran on a private loop, and is over
  const std::size_t before = threads_now();
  REQUIRE(::kill(server.pid(), SIGSTOP) == 0);
  std::future<std::optional<idem::Record>> call = store.async_inspect("opening-" + idem::test::random_hex(),
                                                              boost::asio::use_future);
  std::this_thread::sleep_for(300ms);  // the connect is done by the kernel; the hello waits for an answer
  const std::size_t during = threads_now();
  const auto t0 = std::chrono::steady_clock::now();
  bool retryable = false;
  try {
    (void)call.get();
  } catch (const idem::error& e) {
    retryable = e.retryable();
    INFO(e.what());
    CHECK(std::string(e.what()).find("did not answer while authenticating") != std::string::npos);
  }
  const auto waited = std::chrono::steady_clock::now() - t0;
  REQUIRE(::kill(server.pid(), SIGCONT) == 0);
  CHECK(during == before);
  CHECK(retryable);
  CHECK(waited < 2s);
  CHECK_NOTHROW(store.inspect("opening-after-" + idem::test::random_hex()));
}

// Sentinel on the async face: the connection factory asks the sentinels for the master (and checks
// its ROLE); a broken connection or a READONLY answer makes the next connection ask again.
TEST_CASE("AsyncRedisStore: built from a redis-sentinel URL, it follows a failover", "[asio][failover][sentinel]") {
  idem::test::SentinelTopology topo;
  IoThread io;
  idem::RedisOptions o;
  o.url = topo.url();
  o.connect_timeout = 500ms;
  o.command_timeout = 1s;
  idem::AsyncRedisStore store{io.io.get_executor(), o};
  idem::IdempotencyGuard guard{store, {.lease = 30s, .retention = 60s}};
  const std::string ns = "asentinel-" + idem::test::random_hex() + ":";
  std::atomic<int> runs{0};
  REQUIRE(io.run(guard.run_async(ns + "before", "", [&] { return ++runs; })).status == idem::Status::executed);

  topo.kill_master();
  // A call is bounded by two command timeouts (a lost reply asked again) and a connect per
  // sentinel and master tried.
  const auto bound = 2 * o.command_timeout + 4 * o.connect_timeout + 1s;
  int calls = 0;
  for (bool done = false; !done;) {
    REQUIRE(calls < 300);
    ++calls;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      const auto out = io.run(guard.run_async(ns + "during", "", [&] { return ++runs; }));
      CHECK(out.status == idem::Status::executed);
      done = true;
    } catch (const idem::error& e) {
      INFO(e.what());
      CHECK(e.retryable());
    }
    CHECK(std::chrono::steady_clock::now() - t0 <= bound);
    if (!done) std::this_thread::sleep_for(50ms);
  }
  topo.wait_promoted();
  CHECK(runs == 2);
  CHECK(store.stats().connects >= 2);
  CHECK(io.run(guard.run_async(ns + "after", "", [&] { return ++runs; })).status == idem::Status::executed);
  CHECK(guard.run(ns + "during", [&] { return ++runs; }).status == idem::Status::duplicate);
  CHECK(runs == 3);
}
