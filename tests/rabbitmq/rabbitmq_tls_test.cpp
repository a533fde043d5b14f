// RabbitConsumer and RabbitMqPublisher over TLS (amqps://) against a real rabbitmq-server with a
// TLS listener (tests/support/rabbitmq_tls_broker.sh: the CTest fixture's node, or one of the
// test's own outside CTest) and certificates made by openssl: consuming with CA verification and a
// client certificate, each message once through the guard; publishing with publisher confirms; a
// certificate of an unrelated CA and one for another host name refused at once, not retried; bad
// URLs and TLS files refused at construction; the URL's parts.
#include <catch2/catch.hpp>

#include <netinet/in.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "idem/idem.hpp"
#include "idem/outbox/rabbitmq_publisher.hpp"
#include "idem/rabbitmq/consumer.hpp"
#include "rabbitmq_support.hpp"

#ifndef IDEM_RABBITMQ_TLS_BROKER_SCRIPT
#error "IDEM_RABBITMQ_TLS_BROKER_SCRIPT must name tests/support/rabbitmq_tls_broker.sh"
#endif
#ifndef IDEM_RABBITMQ_TLS_FIXTURE_STATE
#define IDEM_RABBITMQ_TLS_FIXTURE_STATE ""
#endif

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

std::string random_name(const char* stem) {
  static std::mt19937_64 rng{std::random_device{}()};
  return std::string(stem) + "-" + std::to_string(rng() % 1'000'000'000);
}

// The fixture's TLS broker (its state dir), or one of our own when there is none. A broker that
// cannot start throws: the test fails.
class TlsBroker {
public:
  TlsBroker() {
    state_ = IDEM_RABBITMQ_TLS_FIXTURE_STATE;
    if (state_.empty() || !read_port("tls_port", false)) {
      char tmpl[] = "/tmp/idem-rmq-tls-state.XXXXXX";
      if (!::mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
      own_ = true;
      state_ = std::string(tmpl) + "/s";
      const std::string line = "'" + std::string(IDEM_RABBITMQ_TLS_BROKER_SCRIPT) + "' start '" + state_ + "'";
      if (std::system(line.c_str()) != 0) throw std::runtime_error("FAILED: " + line);
    }
    tls_port_ = read_port("tls_port", true);
    port_ = read_port("port", true);
  }
  ~TlsBroker() {
    if (!own_) return;
    std::system(("'" + std::string(IDEM_RABBITMQ_TLS_BROKER_SCRIPT) + "' stop '" + state_ + "' >/dev/null 2>&1").c_str());
    ::rmdir(state_.substr(0, state_.rfind('/')).c_str());
  }
  TlsBroker(const TlsBroker&) = delete;
  TlsBroker& operator=(const TlsBroker&) = delete;

  int port() const { return port_; }          // plain AMQP (the admin client)
  int tls_port() const { return tls_port_; }  // AMQPS
  std::string cert(const std::string& name) const { return state_ + "/certs/" + name; }
  std::string amqps(const std::string& host = "127.0.0.1") const {
    return "amqps://guest:guest@" + host + ":" + std::to_string(tls_port_) + "/%2f";
  }

private:
  int read_port(const char* file, bool required) const {
    std::ifstream in(state_ + "/" + file);
    int p = 0;
    if (!(in >> p) || p <= 0) {
      if (required) throw std::runtime_error("no " + std::string(file) + " in " + state_);
      return 0;
    }
    return p;
  }
  std::string state_;
  bool own_ = false;
  int port_ = 0, tls_port_ = 0;
};

TlsBroker& broker() {
  static TlsBroker b;  // one per test process; the fixture's is shared by all of them
  return b;
}

// A TLS server on 127.0.0.1 that completes each handshake with `cert` and hangs up: what a broker
// with a certificate for another host name looks like to the client's checks.
class TlsStub {
public:
  TlsStub(const std::string& cert, const std::string& key) : ctx_(SSL_CTX_new(TLS_server_method())) {
    if (!ctx_ || SSL_CTX_use_certificate_chain_file(ctx_, cert.c_str()) != 1 ||
        SSL_CTX_use_PrivateKey_file(ctx_, key.c_str(), SSL_FILETYPE_PEM) != 1)
      throw std::runtime_error("stub: cannot load " + cert);
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd_, 8) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0)
      throw std::runtime_error("stub: cannot listen");
    port_ = ntohs(a.sin_port);
    thread_ = std::jthread([this](std::stop_token stop) { serve(stop); });
  }
  ~TlsStub() {
    thread_.request_stop();
    thread_.join();
    ::close(fd_);
    SSL_CTX_free(ctx_);
  }
  TlsStub(const TlsStub&) = delete;
  TlsStub& operator=(const TlsStub&) = delete;
  int port() const { return port_; }
  int accepted() const { return accepted_.load(); }  // connections (handshakes tried) so far

private:
  void serve(const std::stop_token& stop) {
    // A client that hung up first makes our close_notify a write to a closed socket: EPIPE for this
    // thread, not a SIGPIPE for the test (the client's own writes keep the default disposition).
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
    while (!stop.stop_requested()) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) continue;
      ++accepted_;
      timeval tv{2, 0};
      ::setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
      SSL* ssl = SSL_new(ctx_);
      SSL_set_fd(ssl, c);
      if (SSL_accept(ssl) == 1) SSL_shutdown(ssl);
      SSL_free(ssl);
      ::close(c);
    }
  }
  SSL_CTX* ctx_;
  int fd_ = -1, port_ = 0;
  std::atomic<int> accepted_{0};
  std::jthread thread_;
};

// A TCP relay on 127.0.0.1 whose upstream port can change for new connections, and which can cut
// the ones it has: a broker that comes back with another certificate, as its clients see it.
class SwitchProxy {
public:
  explicit SwitchProxy(int upstream) : upstream_(upstream) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a = loopback(0);
    socklen_t len = sizeof a;
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd_, 8) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0)
      throw std::runtime_error("proxy: cannot listen");
    port_ = ntohs(a.sin_port);
    thread_ = std::jthread([this](std::stop_token stop) { loop(stop); });
  }
  ~SwitchProxy() {
    thread_.request_stop();
    thread_.join();
    for (const auto& [a, b] : pairs_) ::close(a), ::close(b);
    ::close(fd_);
  }
  SwitchProxy(const SwitchProxy&) = delete;
  SwitchProxy& operator=(const SwitchProxy&) = delete;
  int port() const { return port_; }
  void upstream(int port) { upstream_ = port; }  // for the connections accepted from now on
  void cut() {  // closes every connection it relays now, and waits until it has
    cut_ = true;
    while (cut_) std::this_thread::sleep_for(5ms);
  }

private:
  static sockaddr_in loopback(int port) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    return a;
  }
  void loop(const std::stop_token& stop) {
    sigset_t pipe;  // a write to a closed peer is EPIPE here, not a SIGPIPE for the test
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
    char buf[16384];
    while (!stop.stop_requested()) {
      if (cut_) {
        for (const auto& [a, b] : pairs_) ::close(a), ::close(b);
        pairs_.clear();
        cut_ = false;
      }
      std::vector<pollfd> fds{{fd_, POLLIN, 0}};
      for (const auto& [a, b] : pairs_) fds.push_back({a, POLLIN, 0}), fds.push_back({b, POLLIN, 0});
      if (::poll(fds.data(), fds.size(), 10) <= 0) continue;
      if (fds[0].revents) {
        const int c = ::accept(fd_, nullptr, nullptr);
        const int u = c >= 0 ? ::socket(AF_INET, SOCK_STREAM, 0) : -1;
        sockaddr_in a = loopback(upstream_.load());
        if (u >= 0 && ::connect(u, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
          pairs_.emplace_back(c, u);
        } else {
          if (c >= 0) ::close(c);
          if (u >= 0) ::close(u);
        }
        continue;  // the pairs changed under fds
      }
      for (std::size_t i = 0; i < pairs_.size(); ++i) {
        auto [a, b] = pairs_[i];
        bool dead = false;
        for (int side = 0; side < 2 && !dead; ++side) {
          if (!fds[1 + 2 * i + side].revents) continue;
          const int from = side == 0 ? a : b, to = side == 0 ? b : a;
          const ssize_t n = ::recv(from, buf, sizeof buf, 0);
          dead = n <= 0 || ::send(to, buf, static_cast<std::size_t>(n), MSG_NOSIGNAL) != n;
        }
        if (dead) {
          ::close(a), ::close(b);
          pairs_.erase(pairs_.begin() + static_cast<std::ptrdiff_t>(i));
          break;  // the indexes changed under fds
        }
      }
    }
  }
  std::atomic<int> upstream_;
  std::atomic<bool> cut_{false};
  int fd_ = -1, port_ = 0;
  std::vector<std::pair<int, int>> pairs_;  // (client, upstream), the relay thread's own
  std::jthread thread_;
};

idem::RabbitConsumerOptions consumer_options(const std::string& url, const std::string& queue) {
  idem::RabbitConsumerOptions o;
  o.url = url;
  o.queue = queue;
  o.prefetch = 20;
  o.retry.cap = 300ms;
  o.connect_timeout = 5000ms;
  return o;
}

idem::OutboxMessage message(const std::string& id, const std::string& destination, const std::string& body) {
  idem::OutboxMessage m;
  m.id = id;
  m.destination = destination;
  m.payload = body;
  return m;
}

template <class F>
std::string refused(F&& construct) {
  try {
    construct();
  } catch (const idem::invalid_options_error& e) {
    return e.what();
  }
  FAIL("accepted");
  return {};
}

}  // namespace

TEST_CASE("amqp url: user, password and vhost percent-decoded, default ports by scheme, fields kept when absent") {
  auto parsed = [](const std::string& url, idem::RabbitMqPublisherOptions o = {}) {
    o.url = url;
    o.verify_peer = false;  // amqps:// would load the system's CA bundle: not what this is about
    return idem::RabbitMqPublisher(o).options();
  };
  {
    const auto o = parsed("amqps://us%40er:p%3Ass%2Fw%25rd@broker.example/%2f");
    CHECK(o.tls);
    CHECK(o.host == "broker.example");
    CHECK(o.port == 5671);
    CHECK(o.user == "us@er");
    CHECK(o.password == "p:ss/w%rd");
    CHECK(o.vhost == "/");
  }
  {
    idem::RabbitMqPublisherOptions base;
    base.port = 1111;
    base.user = "relay";
    base.password = "secret";
    base.vhost = "prod";
    const auto o = parsed("amqp://rabbit", base);  // no port: the scheme's; no user, password, vhost: the fields'
    CHECK_FALSE(o.tls);
    CHECK(o.host == "rabbit");
    CHECK(o.port == 5672);
    CHECK(o.user == "relay");
    CHECK(o.password == "secret");
    CHECK(o.vhost == "prod");
  }
  {
    const auto o = parsed("amqp://app@10.0.0.7:1234/prod%2Feu");
    CHECK(o.host == "10.0.0.7");
    CHECK(o.port == 1234);
    CHECK(o.user == "app");
    CHECK(o.password == "guest");  // not in the URL: the field's
    CHECK(o.vhost == "prod/eu");
  }
  {
    const auto o = parsed("AMQPS://[::1]:5999/v1");
    CHECK(o.tls);
    CHECK(o.host == "::1");
    CHECK(o.port == 5999);
    CHECK(o.vhost == "v1");
  }
  {
    const auto o = parsed("amqp://u:@h/");  // an empty password; "/" alone keeps the vhost field
    CHECK(o.user == "u");
    CHECK(o.password.empty());
    CHECK(o.vhost == "/");
  }
}

TEST_CASE("amqp url and TLS files: a malformed url, a missing or unloadable file refused at construction") {
  auto publisher = [](const std::string& url) {
    return refused([&] {
      idem::RabbitMqPublisherOptions o;
      o.url = url;
      idem::RabbitMqPublisher p(o);
    });
  };
  CHECK_THAT(publisher("http://h"), Catch::Contains("url") && Catch::Contains("amqp://"));
  CHECK_THAT(publisher("amqp://"), Catch::Contains("no host"));
  CHECK_THAT(publisher("amqp://h:99999"), Catch::Contains("port"));
  CHECK_THAT(publisher("amqp://h:"), Catch::Contains("port"));
  CHECK_THAT(publisher("amqp://h:56x2"), Catch::Contains("port"));
  CHECK_THAT(publisher("amqp://h/a/b"), Catch::Contains("%2f"));
  CHECK_THAT(publisher("amqp://u:p%zz@h"), Catch::Contains("password"));
  CHECK_THAT(publisher("amqp://h/v%2"), Catch::Contains("vhost"));
  CHECK_THAT(publisher("amqp://u%00@h"), Catch::Contains("user"));
  CHECK_THAT(publisher("amqp://h?heartbeat=10"), Catch::Contains("query"));
  CHECK_THAT(publisher("amqp://[::1:5672"), Catch::Contains("]"));
  CHECK_THAT(publisher("amqp://@h"), Catch::Contains("user"));
  // The password is never quoted.
  CHECK_THAT(publisher("amqp://u:hunter2@h:0"), !Catch::Contains("hunter2"));

  const std::string missing = "/nonexistent/idem-ca.pem";
  {
    idem::RabbitMqPublisherOptions o;
    o.url = "amqps://h";
    o.ca_file = missing;
    CHECK_THAT(refused([&] { idem::RabbitMqPublisher p(o); }), Catch::Contains("ca_file") && Catch::Contains(missing));
    o.ca_file = "/etc/hostname";  // exists, not PEM
    CHECK_THAT(refused([&] { idem::RabbitMqPublisher p(o); }), Catch::Contains("ca_file"));
    o.ca_file.clear();
    o.cert_file = "/etc/hostname";  // without key_file (checked before the file is loaded)
    CHECK_THAT(refused([&] { idem::RabbitMqPublisher p(o); }), Catch::Contains("key_file"));
  }
  {
    idem::RabbitMqPublisherOptions o;  // TLS files without TLS
    o.ca_file = "/etc/hostname";
    CHECK_THAT(refused([&] { idem::RabbitMqPublisher p(o); }), Catch::Contains("tls"));
    o.url = "amqp://h";
    o.tls = true;  // a plain-text URL with tls on
    CHECK_THAT(refused([&] { idem::RabbitMqPublisher p(o); }), Catch::Contains("amqps://"));
  }
  // The consumer checks the same before connecting (no broker at these addresses).
  CHECK_THAT(refused([&] { idem::RabbitConsumer c(consumer_options("amqp://h:port", "q")); }),
             Catch::Contains("RabbitConsumerOptions::url") && Catch::Contains("port"));
  {
    auto o = consumer_options("amqps://127.0.0.1:1", "q");
    o.key_file = missing;
    CHECK_THAT(refused([&] { idem::RabbitConsumer c(o); }), Catch::Contains("key_file") && Catch::Contains(missing));
    o.key_file.clear();
    o.ca_file = missing;
    CHECK_THAT(refused([&] { idem::RabbitConsumer c(o); }), Catch::Contains("ca_file") && Catch::Contains(missing));
  }
}

TEST_CASE("RabbitConsumer over amqps:// (CA verified, client certificate): every message once through the guard") {
  auto& b = broker();
  const std::string q = random_name("tls-pay");
  auto o = consumer_options(b.amqps(), q);
  o.ca_file = b.cert("ca.pem");
  o.cert_file = b.cert("client.pem");
  o.key_file = b.cert("client.key");
  idem::RabbitConsumer c(o);  // declares the queue
  CHECK(c.options().tls);
  CHECK(c.options().port == b.tls_port());
  CHECK(c.options().vhost == "/");

  constexpr int events = 60;
  {
    idem::RabbitMqPublisherOptions po;  // plain text, by URL too
    po.url = "amqp://guest:guest@127.0.0.1:" + std::to_string(b.port());
    idem::RabbitMqPublisher pub(po);
    std::vector<idem::OutboxMessage> batch;
    for (int i = 0; i < events; ++i) {
      batch.push_back(message("ev-" + std::to_string(i), q, "body-" + std::to_string(i)));
      if (i % 4 == 0) batch.push_back(message("ev-" + std::to_string(i), q, "body-" + std::to_string(i)));
    }
    pub.publish(batch);
  }
  const std::size_t sent = events + (events + 3) / 4;

  idem::MemoryStore store;
  idem::IdempotencyGuard guard{store, {.lease = 5s}};
  std::map<std::string, int> applied;
  std::stop_source stop;
  std::thread t([&] {
    c.run(stop.get_token(), [&](const idem::RabbitDelivery& d) -> idem::RabbitDecision {
      try {
        return c.decide(guard.run(d.message_id, d.body, [&] { return ++applied[d.message_id]; }));
      } catch (...) {
        return c.decide(std::current_exception());
      }
    });
  });
  const auto deadline = Clock::now() + 20s;
  while (Clock::now() < deadline && c.stats().acked < sent) std::this_thread::sleep_for(20ms);
  stop.request_stop();
  t.join();
  CHECK(c.stats().acked == sent);
  CHECK(c.stats().reconnects == 0);
  CHECK(applied.size() == events);
  for (const auto& [id, n] : applied) CHECK(n == 1);
  idem::test::AmqpAdmin admin(b.port());
  CHECK(admin.ready(q) == 0);
}

TEST_CASE("RabbitMqPublisher over amqps:// (CA verified): the message arrives, confirmed") {
  auto& b = broker();
  const std::string q = random_name("tls-out");
  idem::test::AmqpAdmin admin(b.port());
  admin.declare_queue(q);
  idem::RabbitMqPublisherOptions o;
  o.url = b.amqps("localhost");  // the certificate names localhost too
  o.ca_file = b.cert("ca.pem");
  idem::RabbitMqPublisher pub(o);
  CHECK(pub.options().tls);
  std::vector<idem::OutboxMessage> batch{message("out-1", q, "over tls"), message("out-2", q, "second")};
  batch[0].headers = {{"h", "v"}};
  pub.publish(batch);
  CHECK(pub.connections() == 1);
  const auto got = admin.drain(q);
  REQUIRE(got.size() == 2);
  CHECK(got[0].message_id == "out-1");
  CHECK(got[0].body == "over tls");
  CHECK(got[0].header("h") == "v");
  CHECK(got[1].message_id == "out-2");
  admin.delete_queue(q);
}

TEST_CASE("TLS: a broker certificate of an unrelated CA is refused at once, not retried (consumer and publisher)") {
  auto& b = broker();
  const std::string q = random_name("tls-ca");
  {
    auto o = consumer_options(b.amqps(), q);
    o.ca_file = b.cert("other-ca.pem");
    const auto t0 = Clock::now();
    try {
      idem::RabbitConsumer c(o);
      FAIL("connected with a CA that did not sign the broker's certificate");
    } catch (const idem::connection_error& e) {
      CHECK_FALSE(e.retryable());
      CHECK(e.code() == "TLS");
      CHECK_THAT(e.what(), Catch::Contains("TLS certificate verification failed for host 127.0.0.1") &&
                               Catch::Contains("ca_file") && Catch::Contains("other-ca.pem"));
    }
    CHECK(Clock::now() - t0 < 3s);
  }
  {
    idem::RabbitMqPublisherOptions o;
    o.url = b.amqps();
    o.ca_file = b.cert("other-ca.pem");
    idem::RabbitMqPublisher pub(o);
    const std::vector<idem::OutboxMessage> batch{message("x-1", q, "x")};
    const auto t0 = Clock::now();
    try {
      pub.publish(batch);
      FAIL("published with a CA that did not sign the broker's certificate");
    } catch (const idem::publish_error& e) {
      CHECK_FALSE(e.retryable());
      CHECK_THAT(e.what(), Catch::Contains("TLS certificate verification failed for host 127.0.0.1"));
    }
    CHECK(Clock::now() - t0 < 3s);
    CHECK(pub.connections() == 0);
  }
  {
    // verify_peer off: the same CA mismatch is let through (and the connection works).
    idem::RabbitMqPublisherOptions o;
    o.url = b.amqps();
    o.verify_peer = false;
    idem::test::AmqpAdmin admin(b.port());
    admin.declare_queue(q);
    idem::RabbitMqPublisher pub(o);
    const std::vector<idem::OutboxMessage> batch{message("y-1", q, "y")};
    pub.publish(batch);
    CHECK(admin.drain(q).size() == 1);
    admin.delete_queue(q);
  }
}

TEST_CASE("TLS: a broker certificate for another host name is refused at once with verify_hostname") {
  auto& b = broker();
  TlsStub stub(b.cert("wrong-host.pem"), b.cert("wrong-host.key"));  // signed by the right CA, for wrong.example
  const std::string url = "amqps://127.0.0.1:" + std::to_string(stub.port());
  {
    auto o = consumer_options(url, "q");
    o.ca_file = b.cert("ca.pem");
    const auto t0 = Clock::now();
    try {
      idem::RabbitConsumer c(o);
      FAIL("connected to a broker whose certificate is for another name");
    } catch (const idem::connection_error& e) {
      CHECK_FALSE(e.retryable());
      CHECK_THAT(e.what(), Catch::Contains("TLS certificate verification failed for host 127.0.0.1") &&
                               Catch::Contains("verify_hostname"));
    }
    CHECK(Clock::now() - t0 < 3s);
    // verify_hostname off: the certificate is accepted; the stub then hangs up, which is a
    // retryable lost connection, not a verification failure.
    o.verify_hostname = false;
    try {
      idem::RabbitConsumer c(o);
      FAIL("the stub speaks no AMQP");
    } catch (const idem::connection_error& e) {
      CHECK(e.retryable());
      CHECK_THAT(e.what(), !Catch::Contains("verification"));
    }
  }
  {
    // A consumer whose broker comes back with a certificate for another name: run() reconnects
    // once, is refused, and throws; it does not spin reconnecting.
    SwitchProxy proxy(b.tls_port());
    auto o = consumer_options("amqps://127.0.0.1:" + std::to_string(proxy.port()), random_name("tls-switch"));
    o.ca_file = b.cert("ca.pem");
    idem::RabbitConsumer c(o);  // through the proxy to the broker: its certificate passes
    proxy.upstream(stub.port());
    const int before = stub.accepted();
    proxy.cut();
    std::stop_source stop;
    std::jthread watchdog([&](std::stop_token done) {
      for (int i = 0; i < 200 && !done.stop_requested(); ++i) std::this_thread::sleep_for(50ms);
      stop.request_stop();  // 10 s: run() did not throw
    });
    const auto t0 = Clock::now();
    try {
      c.run(stop.get_token(), [&](const idem::RabbitDelivery&) { return idem::RabbitDecision{}; });
      FAIL("run() returned (stopped by the watchdog) instead of throwing");
    } catch (const idem::connection_error& e) {
      CHECK_FALSE(e.retryable());
      CHECK_THAT(e.what(), Catch::Contains("TLS certificate verification failed"));
    }
    CHECK(Clock::now() - t0 < 3s);
    CHECK(stub.accepted() - before == 1);  // one reconnection, refused, not retried
  }
  {
    idem::RabbitMqPublisherOptions o;
    o.url = url;
    o.ca_file = b.cert("ca.pem");
    idem::RabbitMqPublisher pub(o);
    const std::vector<idem::OutboxMessage> batch{message("z-1", "q", "z")};
    const auto t0 = Clock::now();
    try {
      pub.publish(batch);
      FAIL("published to a broker whose certificate is for another name");
    } catch (const idem::publish_error& e) {
      CHECK_FALSE(e.retryable());
      CHECK_THAT(e.what(), Catch::Contains("TLS certificate verification failed for host 127.0.0.1") &&
                               Catch::Contains("verify_hostname"));
    }
    CHECK(Clock::now() - t0 < 3s);
  }
}
