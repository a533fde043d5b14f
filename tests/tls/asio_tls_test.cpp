// AsyncRedisStore over TLS: its connection is opened by RedisStore's connection factory (the same
// TLS checks) and then driven by the loop through the TLS session. The store contract over
// rediss:// (the least-privilege ACL user, server certificate and host name checked), and the
// async face's own TLS cases: mutual TLS, the refusals, a server that stops answering, a broken
// connection, coalesced calls in TLS records.
#include <csignal>
#include <thread>

#include "asio/asio_factory.hpp"
#include "contract/contract_suite.hpp"
#include "tls_factory.hpp"

using namespace std::chrono_literals;
using idem::test::IoThread;
using idem::tlstest::cert;
using idem::tlstest::TlsRedisServer;
using idem::tlstest::TlsServerConfig;

namespace {

struct AsyncTlsFactory : idem::test::RedisFactoryBase {
  using store_type = idem::AsyncRedisStore;
  static TlsRedisServer& server() { return idem::tlstest::RedisTlsFactory::server(); }
  // rediss:// as the least-privilege ACL user, the test CA trusted, the host name checked.
  static idem::RedisOptions options(const std::string& ca = "ca.crt", const std::string& more = "") {
    idem::RedisOptions o;
    o.url = "rediss://idem-app:app%20secret%21@localhost:" + std::to_string(server().port()) +
            "/0?tls_ca_file=" + cert(ca) + more;
    o.command_timeout = idem::millis{5000};
    return o;
  }
  IoThread io;
  idem::AsyncRedisStore s{io.io.get_executor(), options()};
  store_type& store() { return s; }
};

idem::AcquireParams params(std::uint64_t token) { return idem::test::acquire_params(token); }

template <class F>
idem::connection_error construction_error(F&& f) {
  try {
    f();
  } catch (const idem::connection_error& e) {
    return e;
  }
  FAIL("the store was built");
  throw std::logic_error("unreachable");
}

}  // namespace

IDEM_CONTRACT_SUITE(AsyncTlsFactory, "[asio][tls]")

TEST_CASE("AsyncRedisStore over TLS: coalesced calls, a stopped server, a broken connection", "[asio][tls]") {
  IoThread io;
  idem::RedisOptions o = AsyncTlsFactory::options();
  o.command_timeout = 500ms;
  o.pool.size = 1;  // one lane: concurrent blocked callers are multiplexed on the one connection
  idem::AsyncRedisStore store{io.io.get_executor(), o};
  idem::IdempotencyGuard guard{store, {.lease = 10s, .retention = 60s}};
  const std::string ns = "atls-" + idem::test::random_hex() + ":";

  SECTION("many runs in flight share TLS records and coalesced calls, each key once") {
    std::atomic<int> ran{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t)
      threads.emplace_back([&, t] {
        for (int i = 0; i < 50; ++i) guard.run(ns + std::to_string((t * 50 + i) % 200), [&] { ++ran; });
      });
    for (auto& t : threads) t.join();
    CHECK(ran == 200);
    CHECK(store.stats().connects == 1);
  }
  SECTION("a server that stops answering: in doubt within command_timeout, served again after SIGCONT") {
    auto first = store.acquire(ns + "a", params(1));
    REQUIRE(first.status == idem::AcquireStatus::acquired);
    ::kill(AsyncTlsFactory::server().pid(), SIGSTOP);
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_THROWS_AS(store.complete(ns + "a", first.holder, "r", 60s), idem::store_error);
    CHECK(std::chrono::steady_clock::now() - t0 < 10s);
    ::kill(AsyncTlsFactory::server().pid(), SIGCONT);
    CHECK(store.complete(ns + "a", first.holder, "r", 60s) == idem::WriteStatus::ok);
    CHECK(store.acquire(ns + "a", params(2)).status == idem::AcquireStatus::duplicate);
  }
  SECTION("the server closes the connection: the next call reconnects over TLS") {
    REQUIRE(store.acquire(ns + "b", params(3)).status == idem::AcquireStatus::acquired);
    CHECK(AsyncTlsFactory::server().command({"CLIENT", "KILL", "TYPE", "normal"}) != "0");
    std::this_thread::sleep_for(50ms);
    CHECK(store.acquire(ns + "b", params(4)).status == idem::AcquireStatus::in_flight);
    CHECK(store.stats().connects >= 2);
  }
}

TEST_CASE("AsyncRedisStore over mutual TLS: without a certificate it fails closed, with it it is served",
          "[asio][tls][fail]") {
  TlsRedisServer mtls(TlsServerConfig{"server", "yes", {}});
  IoThread io;
  const auto e = construction_error([&] { idem::AsyncRedisStore s(io.io.get_executor(), mtls.options()); });
  CHECK(e.code() == "TLS");
  CHECK_FALSE(e.retryable());
  idem::AsyncRedisStore s(io.io.get_executor(), mtls.mtls_options());
  auto a = s.acquire("mtls-a", params(1));
  REQUIRE(a.status == idem::AcquireStatus::acquired);
  CHECK(s.complete("mtls-a", a.holder, "r", 60s) == idem::WriteStatus::ok);
  CHECK(s.acquire("mtls-a", params(2)).payload == "r");
}

TEST_CASE("AsyncRedisStore over TLS: an unknown CA and a wrong host name fail closed, not retryable",
          "[asio][tls][fail]") {
  IoThread io;
  idem::RedisOptions o = AsyncTlsFactory::options("other-ca.crt");
  auto e = construction_error([&] { idem::AsyncRedisStore s(io.io.get_executor(), o); });
  CHECK(e.code() == "TLS");
  CHECK_FALSE(e.retryable());
  idem::RedisOptions named = AsyncTlsFactory::options("ca.crt", "&tls_server_name=wrong.example");
  e = construction_error([&] { idem::AsyncRedisStore s(io.io.get_executor(), named); });
  CHECK(e.code() == "TLS");
  CHECK_THAT(e.what(), Catch::Contains("host name"));
}

// A plain-text port answers the ClientHello with an error or waits for a newline: either way a
// TLS refusal naming the cause, well before connect_timeout, and not retryable.
TEST_CASE("AsyncRedisStore over rediss:// at a plain-text port fails closed at once, not retryable",
          "[asio][tls][fail]") {
  IoThread io;
  idem::test::RedisServer real;
  idem::tlstest::SilentServer silent(true);
  for (const int port : {real.port(), real.port(), real.port(), real.port(), silent.port()}) {
    idem::RedisOptions o;
    o.url = "rediss://127.0.0.1:" + std::to_string(port) + "?tls_ca_file=" + cert("ca.crt");
    o.connect_timeout = 10s;
    const auto t0 = std::chrono::steady_clock::now();
    const auto e = construction_error([&] { idem::AsyncRedisStore s(io.io.get_executor(), o); });
    INFO(e.what());
    CHECK(std::chrono::steady_clock::now() - t0 < 2s);
    CHECK(e.code() == "TLS");
    CHECK_FALSE(e.retryable());
    CHECK_THAT(e.what(), Catch::Contains("the server at 127.0.0.1:" + std::to_string(port) + " does not speak TLS"));
    CHECK_THAT(e.what(), Catch::Contains("use redis://"));
  }
}

#ifdef IDEM_TEST_OUTBOX
#include "idem/outbox/redis_streams_publisher.hpp"

// The outbox's Redis Streams publisher connects through the same factory: rediss:// (and mutual
// TLS) work there too, and a TLS refusal is a publish_error no retry can help.
TEST_CASE("RedisStreamsPublisher over rediss:// and mutual TLS", "[tls][outbox]") {
  TlsRedisServer mtls(TlsServerConfig{"server", "yes", {}});
  const std::string stream = "tls-out-" + idem::test::random_hex();
  std::vector<idem::OutboxMessage> batch{{.id = "m1", .destination = stream, .message_key = "k", .payload = "a"},
                                         {.id = "m2", .destination = stream, .message_key = "k", .payload = "b"}};
  idem::RedisStreamsPublisher pub{{.redis = mtls.mtls_options()}};
  pub.publish(batch);
  CHECK(mtls.command({"XLEN", stream}) == "2");

  idem::RedisStreamsPublisher no_cert{{.redis = mtls.options()}};
  try {
    no_cert.publish(batch);
    FAIL("a publisher without a client certificate published");
  } catch (const idem::publish_error& e) {
    CHECK_FALSE(e.retryable());
    CHECK_THAT(e.what(), Catch::Contains("certificate"));
  }
  CHECK(mtls.command({"XLEN", stream}) == "2");
}
#endif
