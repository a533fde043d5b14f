// AsyncRedisStore under the failures of tests/redis/redis_recovery_test.cpp: a reply lost after
// the server ran the request (support/tcp_proxy.hpp) is settled by the same holder asking again on
// a fresh connection, never guessed; when that cannot be done, the outcome is unknown; reads are
// not resent. Each case first makes one call so the store's one connection (and its handshake) is
// up: the proxy's next reply is then the call under test.
#include <catch2/catch.hpp>

#include <string>
#include <thread>

#include "asio_factory.hpp"
#include "support/tcp_proxy.hpp"

using namespace std::chrono_literals;
using idem::AcquireStatus;
using idem::WriteStatus;
using idem::test::IoThread;
using idem::test::RedisServer;
using idem::test::TcpProxy;

namespace {

constexpr auto params = &idem::test::acquire_params;

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

TEST_CASE("async lost acquire reply: the same holder's retry is acquired with the same fence", "[asio][recovery]") {
  Proxied t;
  t.proxy.arm(TcpProxy::Action::cut);
  auto r = t.store.acquire(t.key, params(77));
  CHECK(t.proxy.fired());
  CHECK(r.status == AcquireStatus::acquired);
  CHECK(r.holder == idem::Holder{1, 77});
  CHECK(t.store.acquire(t.key, params(78)).status == AcquireStatus::in_flight);
  CHECK(t.store.complete(t.key, r.holder, "done", 60s) == WriteStatus::ok);
  CHECK(t.store.stats().resent >= 1);
}

TEST_CASE("async lost complete reply: the retry answers ok, nothing is overwritten", "[asio][recovery]") {
  Proxied t;
  auto r = t.store.acquire(t.key, params(5));
  REQUIRE(r.status == AcquireStatus::acquired);
  t.proxy.arm(TcpProxy::Action::cut);
  CHECK(t.store.complete(t.key, r.holder, "the result", 60s) == WriteStatus::ok);
  CHECK(t.proxy.fired());
  auto d = t.store.acquire(t.key, params(6));
  CHECK(d.status == AcquireStatus::duplicate);
  CHECK(d.payload == "the result");
  CHECK(t.store.complete(t.key, r.holder, "other", 60s) == WriteStatus::lease_lost);
}

TEST_CASE("async reply held past command_timeout: the same holder's retry settles it", "[asio][recovery]") {
  Proxied t;
  auto r = t.store.acquire(t.key, params(5));
  t.proxy.arm(TcpProxy::Action::hold);
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(t.store.complete(t.key, r.holder, "v", 60s) == WriteStatus::ok);
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  CHECK(t.store.acquire(t.key, params(6)).payload == "v");
}

TEST_CASE("async lost reply and no retry possible: outcome_unknown_error, then the holder settles it",
          "[asio][recovery]") {
  Proxied t;
  auto r = t.store.acquire(t.key, params(5));
  t.proxy.arm(TcpProxy::Action::cut, 0, {}, /*refuse_after=*/true);
  try {
    (void)t.store.complete(t.key, r.holder, "v", 60s);
    FAIL("a lost reply with no retry possible was reported as settled");
  } catch (const idem::outcome_unknown_error& e) {
    CHECK_FALSE(e.retryable());
    CHECK(std::string(e.what()).find("unknown") != std::string::npos);
  }
  t.proxy.refuse(false);
  CHECK(t.store.complete(t.key, r.holder, "v", 60s) == WriteStatus::ok);
  auto rec = t.store.inspect(t.key);
  REQUIRE(rec);
  CHECK(rec->state == idem::State::completed);
}

TEST_CASE("async lost reply, then an error reply to the retry: outcome_unknown_error with its code",
          "[asio][recovery]") {
  Proxied t;
  auto r = t.store.acquire(t.key, params(5));
  // The retry goes on a new connection (no handshake as the default user: no AUTH, no SELECT).
  t.proxy.plan({{TcpProxy::Action::cut, {}}, {TcpProxy::Action::replace, "-LOADING injected by the test\r\n"}});
  try {
    (void)t.store.complete(t.key, r.holder, "v", 60s);
    FAIL("an error reply to the retry was reported as settled");
  } catch (const idem::outcome_unknown_error& e) {
    CHECK(e.code() == "LOADING");
    CHECK_FALSE(e.retryable());
    CHECK(std::string(e.what()).find(t.key) != std::string::npos);
  }
  CHECK(t.store.acquire(t.key, params(6)).payload == "v");  // the first had run
}

TEST_CASE("async reads are not resent: a lost inspect reply is a retryable connection_error", "[asio][recovery]") {
  Proxied t;
  t.proxy.arm(TcpProxy::Action::cut);
  CHECK_THROWS_AS(t.store.inspect(t.key), idem::connection_error);
  CHECK_NOTHROW(t.store.inspect(t.key));
}
