// RedisClient over TLS against real TLS-only redis-servers: rediss:// and its parameters, the
// files refused at construction, every TLS check failing closed with a message that names it
// (unknown CA, wrong host, expired certificate, plain-text server, missing client certificate,
// protocol version), a plain-text client on a TLS port failing fast, the pool's idle check and
// the timeouts over TLS, Sentinel over TLS, and secrets kept out of every message.

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <csignal>
#include <mutex>
#include <string>
#include <vector>

#include "idem/redis/admin.hpp"
#include "idem/idem.hpp"
#include "idem/redis.hpp"
#include "redis/redis_factory.hpp"
#include "tls_support.hpp"
#include "support/warnings.hpp"

using namespace std::chrono_literals;
using idem::tlstest::cert;
using idem::tlstest::TlsRedisServer;
using idem::tlstest::TlsServerConfig;

namespace {

idem::tlstest::TlsRedisServer& server() {
  static TlsRedisServer s;
  return s;
}

idem::AcquireParams params(std::uint64_t token) { return idem::test::acquire_params(token); }

// What a store_error said, and of which kind it was.
struct Caught {
  std::string text;
  std::string code;
  bool retryable = false;
  bool connection = false;  // a connection_error
  bool timeout = false;     // a timeout_error
  [[nodiscard]] const char* what() const { return text.c_str(); }
};

// The store_error a failed construction throws (a test failure when none).
template <class F>
Caught construction_error(F&& f) {
  try {
    f();
  } catch (const idem::store_error& e) {
    return {e.what(), e.code(), e.retryable(), dynamic_cast<const idem::connection_error*>(&e) != nullptr,
            dynamic_cast<const idem::timeout_error*>(&e) != nullptr};
  }
  FAIL("no store_error was thrown");
  throw std::logic_error("unreachable");
}

// A TLS check that failed: connection_error, code TLS, not retryable.
void check_tls_refusal(const Caught& e, const std::string& says) {
  INFO(e.what());
  CHECK(e.connection);
  CHECK(e.code == "TLS");
  CHECK_FALSE(e.retryable);
  CHECK_THAT(e.what(), Catch::Contains(says));
}

// Advisories and store errors alike.
struct Warnings : idem::test::Warnings {
  void on_store_error(std::string_view, const std::exception& e) noexcept override {
    std::lock_guard lock(mu);
    seen.emplace_back(e.what());
  }
};

}  // namespace

TEST_CASE("rediss:// and its parameters fill RedisOptions::tls", "[redis][tls][url]") {
  const idem::RedisOptions o = idem::parse_redis_url(
      "rediss://u:p@cache.example.com:6380/2?tls_ca_file=/etc/ca.pem&tls_cert_file=/c.pem&tls_key_file=/k.pem&"
      "tls_server_name=cache.example.com&tls_min_version=1.3");
  CHECK(o.tls.enabled);
  CHECK(o.host == "cache.example.com");
  CHECK(o.port == 6380);
  CHECK(o.db == 2);
  CHECK(o.tls.ca_file == "/etc/ca.pem");
  CHECK(o.tls.cert_file == "/c.pem");
  CHECK(o.tls.key_file == "/k.pem");
  CHECK(o.tls.server_name == "cache.example.com");
  CHECK(o.tls.min_version == idem::TlsVersion::tls1_3);
  CHECK(o.tls.verify_hostname);

  CHECK_FALSE(idem::parse_redis_url("redis://h:1").tls.enabled);
  CHECK(idem::parse_redis_url("redis-cluster://a:1,b:2?tls=yes").tls.enabled);
  const auto s = idem::parse_redis_url("redis-sentinel://a:26379/m?tls=yes&sentinel_tls=yes");
  CHECK(s.tls.enabled);
  CHECK(s.tls.sentinels);
  // A URL turns TLS on, never off.
  idem::RedisOptions base;
  base.tls.enabled = true;
  CHECK(idem::parse_redis_url("redis://h:1", base).tls.enabled);

  CHECK_THROWS_AS(idem::parse_redis_url("rediss://h:1?tls_min_version=1.1"), idem::invalid_options_error);
  CHECK_THROWS_WITH(idem::parse_redis_url("unix:///tmp/r.sock?tls=yes"), Catch::Contains("TCP only"));
  CHECK_THROWS_WITH(idem::parse_redis_url("rediss://h:1?tls_bogus=1"), Catch::Contains("unknown parameter 'tls_bogus'"));
}

TEST_CASE("TLS files and settings are refused at construction, naming the field", "[redis][tls]") {
  // Port 1: nothing listens there, so only a refusal before connecting can give these messages.
  idem::RedisOptions o;
  o.port = 1;
  o.tls.enabled = true;
  auto refused = [&](const idem::RedisOptions& opt, const std::string& says) {
    try {
      idem::RedisClient c(opt);
      FAIL("constructed");
    } catch (const idem::invalid_options_error& e) {
      CHECK_THAT(e.what(), Catch::Contains(says));
    }
  };
  auto a = o;
  a.tls.ca_file = "/nonexistent/ca.crt";
  refused(a, "tls.ca_file '/nonexistent/ca.crt' cannot be read: No such file or directory");
  auto b = o;
  b.tls.ca_file = cert("ca.crt");
  b.tls.cert_file = cert("client.crt");
  b.tls.key_file = "/nonexistent/client.key";
  refused(b, "tls.key_file '/nonexistent/client.key' cannot be read");
  auto c = b;
  c.tls.key_file.clear();
  refused(c, "tls.cert_file is set without tls.key_file");
  auto d = b;
  d.tls.key_file = cert("server.key");  // another certificate's key
  refused(d, "tls.key_file '" + cert("server.key") + "' cannot be used: key values mismatch");
  auto e = d;
  e.tls.cert_file = cert("ca.key");  // a key where the certificate belongs
  refused(e, "tls.cert_file");
  auto f = o;
  f.tls.enabled = false;
  f.tls.ca_file = cert("ca.crt");
  refused(f, "idem does not fall back to plain text");
  auto g = o;
  g.tls.ca_dir = "/nonexistent-dir";
  refused(g, "tls.ca_dir '/nonexistent-dir' cannot be read");
}

TEST_CASE("a store over TLS works, reuses its connections and keeps the timeouts", "[redis][tls]") {
  idem::RedisOptions o = server().options();
  o.pool.size = 1;
  idem::RedisStore store(o);
  const std::string k = "tls-" + idem::test::random_hex();
  REQUIRE(store.acquire(k, params(1)).status == idem::AcquireStatus::acquired);

  SECTION("one pooled connection serves many calls: session tickets do not make it look closed") {
    const long long before = server().stat("total_connections_received");
    for (int i = 0; i < 50; ++i) (void)store.inspect(k);
    CHECK(server().stat("total_connections_received") == before + 1);  // + the harness's own, for INFO
  }
  SECTION("an idle connection the server closed is replaced before use, no call fails") {
    CHECK(server().command({"CLIENT", "KILL", "TYPE", "normal"}) != "0");
    std::this_thread::sleep_for(50ms);
    CHECK(store.inspect(k));
  }
  SECTION("a server that stops answering is a timeout_error within command_timeout, retryable") {
    idem::RedisOptions t = server().options();
    t.command_timeout = 300ms;
    t.pool.size = 1;
    idem::RedisStore slow(t);
    ::kill(server().pid(), SIGSTOP);
    const auto t0 = std::chrono::steady_clock::now();
    bool timed_out = false, retryable = false;
    try {
      (void)slow.inspect(k);
    } catch (const idem::timeout_error& e) {
      timed_out = true;
      retryable = e.retryable();
    }
    const auto took = std::chrono::steady_clock::now() - t0;
    ::kill(server().pid(), SIGCONT);
    CHECK(timed_out);
    CHECK(retryable);
    CHECK(took < 3s);
    CHECK(slow.inspect(k));  // a fresh connection afterwards
  }
  SECTION("TLS 1.3 only, and a server name given explicitly") {
    idem::RedisOptions v = server().options();
    v.tls.min_version = idem::TlsVersion::tls1_3;
    v.tls.server_name = "localhost";
    idem::RedisStore s13(v);
    CHECK(s13.inspect(k));
  }
}

TEST_CASE("a server certificate from an unknown CA fails closed", "[redis][tls][fail]") {
  idem::RedisOptions o = server().options();
  o.tls.ca_file = cert("other-ca.crt");
  const auto e = construction_error([&] { idem::RedisStore s(o); });
  check_tls_refusal(e, "chain of trust check: self-signed certificate in certificate chain");
}

TEST_CASE("a certificate for another host fails closed, server_name and verify_hostname decide the name",
          "[redis][tls][fail]") {
  TlsRedisServer wrong(TlsServerConfig{"wronghost", "no", {}});
  const auto e = construction_error([&] { idem::RedisStore s(wrong.options()); });
  check_tls_refusal(e, "host name check: IP address mismatch");
  CHECK_THAT(e.what(), Catch::Contains("'127.0.0.1'"));

  idem::RedisOptions named = server().options();
  named.tls.server_name = "wrong.example";
  check_tls_refusal(construction_error([&] { idem::RedisStore s(named); }), "host name check: hostname mismatch");

  // The chain is still checked without the name check.
  idem::RedisOptions unnamed = wrong.options();
  unnamed.tls.verify_hostname = false;
  idem::RedisStore s(unnamed);
  CHECK_FALSE(s.inspect("tls-unnamed"));
}

TEST_CASE("an expired server certificate fails closed", "[redis][tls][fail]") {
  TlsRedisServer expired(TlsServerConfig{"expired", "no", {}});
  const auto e = construction_error([&] { idem::RedisStore s(expired.options()); });
  check_tls_refusal(e, "validity period check: certificate has expired");
}

TEST_CASE("mutual TLS: a client without a certificate fails closed, one with it is served", "[redis][tls][fail]") {
  TlsRedisServer mtls(TlsServerConfig{"server", "yes", {}});
  const auto e = construction_error([&] { idem::RedisStore s(mtls.options()); });
  check_tls_refusal(e, "client certificate");
  idem::RedisStore s(mtls.mtls_options());
  CHECK_FALSE(s.inspect("tls-mtls"));
}

// rediss:// at a plain-text port: a TLS refusal that names the cause, long before connect_timeout
// (a timeout would say "retry", which can never help), for the store and the admin alike.
void check_plain_text_refusal(const Caught& e, std::chrono::steady_clock::duration took, const std::string& at) {
  INFO(e.what());
  CHECK(e.connection);
  CHECK(e.code == "TLS");
  CHECK_FALSE(e.retryable);
  CHECK_THAT(e.what(), Catch::Contains("the server at " + at + " does not speak TLS"));
  CHECK_THAT(e.what(), Catch::Contains("plain-text port"));
  CHECK_THAT(e.what(), Catch::Contains("use redis://"));
  CHECK(took < 2s);  // connect_timeout is 10 s
}

template <class F>
void check_plain_text_port(const idem::RedisOptions& o, F&& open) {
  const std::string at = "127.0.0.1:" + std::to_string(o.port);
  const auto t0 = std::chrono::steady_clock::now();
  const auto e = construction_error([&] { open(o); });
  check_plain_text_refusal(e, std::chrono::steady_clock::now() - t0, at);
}

TEST_CASE("a TLS client on a plain-text port fails closed at once, not retryable", "[redis][tls][fail]") {
  auto tls_to = [](int port) {
    idem::RedisOptions o;
    o.host = "127.0.0.1";
    o.port = port;
    o.connect_timeout = 10s;
    o.tls.enabled = true;
    o.tls.ca_file = cert("ca.crt");
    return o;
  };
  const auto store = [](const idem::RedisOptions& o) { idem::RedisStore s(o); };
  const auto admin = [](const idem::RedisOptions& o) { idem::RedisAdmin a(o); };
  SECTION("a real redis-server: it answers the ClientHello with an error, or waits for a newline") {
    // Which one depends on the handshake's random bytes: several tries meet both.
    idem::test::RedisServer plain;
    for (int i = 0; i < 6; ++i) {
      check_plain_text_port(tls_to(plain.port()), store);
      check_plain_text_port(tls_to(plain.port()), admin);
    }
    // The URL as the tool and the stores take it.
    idem::RedisOptions url;
    url.url = "rediss://127.0.0.1:" + std::to_string(plain.port()) + "?tls_ca_file=" + cert("ca.crt");
    url.connect_timeout = 10s;
    check_plain_text_port(idem::parse_redis_url(url.url, url), store);
  }
  SECTION("a silent plain-text port: the PING probe tells it from a slow server") {
    idem::tlstest::SilentServer plain(true);
    check_plain_text_port(tls_to(plain.port()), store);
    check_plain_text_port(tls_to(plain.port()), admin);
    CHECK(plain.accepted() == 4);  // each handshake and its probe
  }
  SECTION("a server that answers nothing at all stays a retryable timeout") {
    idem::tlstest::SilentServer mute(false);
    idem::RedisOptions o = tls_to(mute.port());
    o.connect_timeout = 600ms;
    const auto t0 = std::chrono::steady_clock::now();
    const auto e = construction_error([&] { idem::RedisStore s(o); });
    INFO(e.what());
    CHECK(e.timeout);
    CHECK(e.retryable);
    CHECK(std::chrono::steady_clock::now() - t0 >= 600ms);
    CHECK(std::chrono::steady_clock::now() - t0 < 3s);
  }
}

TEST_CASE("a plain-text client on a TLS-only port fails fast and says to use rediss://", "[redis][tls][fail]") {
  idem::RedisOptions o;
  o.host = "127.0.0.1";
  o.port = server().port();
  o.command_timeout = 5000ms;
  const auto t0 = std::chrono::steady_clock::now();
  const auto e = construction_error([&] { idem::RedisStore s(o); });
  INFO(e.what());
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);  // not the command timeout
  CHECK(e.connection);
  CHECK_THAT(e.what(), Catch::Contains("rediss://"));
}

TEST_CASE("a server limited to TLS 1.2 refuses a client that asks for 1.3 at least", "[redis][tls][fail]") {
  TlsRedisServer old(TlsServerConfig{"server", "no", {"tls-protocols \"TLSv1.2\""}});
  idem::RedisOptions o = old.options();
  idem::RedisStore ok(o);  // the default minimum is 1.2
  CHECK_FALSE(ok.inspect("tls-v12"));
  o.tls.min_version = idem::TlsVersion::tls1_3;
  const auto e = construction_error([&] { idem::RedisStore s(o); });
  check_tls_refusal(e, "the handshake was refused");
}

TEST_CASE("secrets never appear in error messages or observer warnings", "[redis][tls][secrets]") {
  TlsRedisServer acl(TlsServerConfig{"server", "no", idem::test::acl_config()});
  const std::string password = "app secret!";
  const std::string wrong_password = "not-the-secret-42";
  const std::string key_pem = idem::tlstest::read_file(cert("client.key"));
  const std::string key_body = key_pem.substr(key_pem.find('\n') + 1, 64);  // a line of the key's base64
  REQUIRE(key_body.size() == 64);
  std::vector<std::string> messages;
  auto keep = [&](auto&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      messages.emplace_back(e.what());
    }
  };
  const std::string at = "@localhost:" + std::to_string(acl.port()) + "/0?tls_ca_file=" + cert("ca.crt");
  keep([&] { idem::RedisStore s(idem::RedisOptions{.url = "rediss://idem-app:" + wrong_password + at}); });
  keep([&] { idem::RedisStore s(idem::RedisOptions{.url = "rediss://idem-app:" + wrong_password + "@localhost:1"}); });
  keep([&] { idem::parse_redis_url("rediss://idem-app:" + wrong_password + "@localhost:99999"); });
  idem::RedisOptions mismatch = acl.options();
  mismatch.password = wrong_password;
  mismatch.tls.cert_file = cert("client.crt");
  mismatch.tls.key_file = cert("server.key");
  keep([&] { idem::RedisStore s(mismatch); });
  idem::RedisOptions swapped = acl.options();
  swapped.tls.cert_file = cert("client.key");  // a key where the certificate belongs
  swapped.tls.key_file = cert("client.key");
  keep([&] { idem::RedisStore s(swapped); });
  idem::RedisOptions other_ca = acl.options();
  other_ca.password = wrong_password;
  other_ca.tls.ca_file = cert("other-ca.crt");
  keep([&] { idem::RedisStore s(other_ca); });
  REQUIRE(messages.size() == 6);

  // The right password: the store works, its observer warns (no CONFIG GET for this user), and a
  // guard's store errors reach the observer once the server is gone; none of it quotes a secret.
  auto warnings = std::make_shared<Warnings>();
  idem::RedisOptions good;
  good.url = "rediss://idem-app:app%20secret%21" + at;
  good.observer = warnings;
  good.command_timeout = 500ms;
  {
    idem::RedisStore store(good);
    idem::IdempotencyGuard guard(store, {.lease = 10s, .retention = 60s, .observer = warnings});
    CHECK(guard.run("tls-secret-" + idem::test::random_hex(), "p", [] { return 1; }).status ==
          idem::Status::executed);
    acl.stop();
    keep([&] { (void)guard.run("tls-secret-" + idem::test::random_hex(), "p", [] { return 1; }); });
  }
  {
    std::lock_guard lock(warnings->mu);
    CHECK_FALSE(warnings->seen.empty());
    messages.insert(messages.end(), warnings->seen.begin(), warnings->seen.end());
  }
  for (const std::string& m : messages) {
    INFO(m);
    CHECK(m.find(password) == std::string::npos);
    CHECK(m.find("app%20secret") == std::string::npos);
    CHECK(m.find(wrong_password) == std::string::npos);
    CHECK(m.find(key_body) == std::string::npos);
    CHECK(m.find("PRIVATE KEY") == std::string::npos);
  }
}

// Three TLS-only masters (tls_support.hpp's TlsCluster): the store and the admin reach each.
TEST_CASE("Redis Cluster over TLS: every node connection is TLS", "[redis][tls][cluster]") {
  idem::tlstest::TlsCluster cluster;
  auto& nodes = cluster.nodes;
  idem::RedisOptions o = nodes[0]->options();
  o.url = cluster.url();
  idem::RedisStore store(o);
  const std::string ns = "tls-cluster-" + idem::test::random_hex() + ":";
  for (int i = 0; i < 60; ++i) {
    const std::string k = ns + std::to_string(i);
    REQUIRE(store.acquire(k, params(static_cast<std::uint64_t>(i + 1))).status == idem::AcquireStatus::acquired);
    REQUIRE(store.inspect(k));
  }
  std::string where = store.client()->address();
  for (auto& n : nodes) CHECK_THAT(where, Catch::Contains(std::to_string(n->port())));  // a client per master
  for (auto& n : nodes) CHECK(idem::tlstest::TlsCluster::keys_on(*n) > 0);  // every master holds some of them
  CHECK(cluster.keys() == 60);

  // RedisAdmin deletes a prefix's keys on every master, and nothing outside it.
  REQUIRE(store.acquire("kept", params(99)).status == idem::AcquireStatus::acquired);
  idem::RedisOptions scoped = o;
  scoped.key_prefix = o.key_prefix + ns;
  idem::RedisAdmin admin(scoped);
  CHECK(admin.remove_all() == 60);
  CHECK(cluster.keys() == 1);
  CHECK(admin.remove_all() == 0);

  // Without TLS the same cluster is unreachable, and says why.
  idem::RedisOptions plain;
  plain.url = "redis-cluster://127.0.0.1:" + std::to_string(nodes[1]->port());
  CHECK_THROWS_WITH(idem::RedisStore(plain), Catch::Contains("rediss://"));
}

TEST_CASE("RedisAdmin (the idem tool) reads records over rediss://, with mutual TLS too", "[redis][tls][admin]") {
  for (const bool mutual : {false, true}) {
    INFO((mutual ? "mutual TLS" : "server-checked TLS"));
    TlsRedisServer server(TlsServerConfig{"server", mutual ? "yes" : "no", {}});
    const idem::RedisOptions o = mutual ? server.mtls_options() : server.options();
    idem::RedisStore store(o);
    const std::string key = "admin-tls-" + std::to_string(mutual);
    idem::AcquireParams p;
    p.token = 9;
    p.retention = 60s;
    auto r = store.acquire(key, p);
    REQUIRE(r.status == idem::AcquireStatus::acquired);
    REQUIRE(store.complete(key, r.holder, "receipt", 60s) == idem::WriteStatus::ok);
    idem::RedisAdmin admin(o);
    const auto rec = admin.inspect(key);
    REQUIRE(rec);
    CHECK(rec->record.result == "receipt");
    CHECK(admin.stats().records >= 1);
  }
  // The same checks as the stores': a CA that did not sign the server is refused, not retried.
  TlsRedisServer server;
  idem::RedisOptions wrong_ca = server.options();
  wrong_ca.tls.ca_file = cert("other-ca.crt");
  try {
    idem::RedisAdmin admin(wrong_ca);
    FAIL("an admin connection trusted a server its CA did not sign");
  } catch (const idem::connection_error& e) {
    CHECK(e.code() == "TLS");
    CHECK_FALSE(e.retryable());
  }
}

