#pragma once
// The TLS tests' Redis side: the fixture's certificates (tls_fixture.sh made them) and a
// redis-server that speaks TLS only (test::RedisServer with tls_only: `port 0`, `tls-port P`),
// started per test process on a free loopback port; the harness's own admin commands go through
// the server's Unix socket.

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "idem/redis.hpp"
#include "redis/redis_server.hpp"

namespace idem::tlstest {

// The fixture's state directory (compiled in; IDEM_TLS_STATE overrides it).
inline std::string state_dir() {
  const char* s = std::getenv("IDEM_TLS_STATE");
  return s && *s ? s : IDEM_TLS_STATE_DEFAULT;
}
// A file of the fixture's certificates: "ca.crt", "client.key", ...
inline std::string cert(const std::string& name) {
  const std::string path = state_dir() + "/certs/" + name;
  if (!std::filesystem::exists(path))
    throw std::runtime_error("test: no " + path + ": the TLS fixture (tls_fixture.sh start) did not run");
  return path;
}
inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct TlsServerConfig {
  std::string cert = "server";         // server.crt/.key, expired, wronghost
  std::string auth_clients = "no";     // tls-auth-clients: no, yes, optional
  std::vector<std::string> extra;      // more redis.conf lines
};

// A TLS-only redis-server (test::RedisServer with tls_only) and its clients' options.
class TlsRedisServer : public test::RedisServer {
public:
  explicit TlsRedisServer(const TlsServerConfig& cfg = {}) : test::RedisServer(config(cfg), true) {}

  // Options of a client of this server: TLS on, the test CA trusted, no client certificate.
  [[nodiscard]] RedisOptions options() const {
    RedisOptions o = test::RedisServer::options();
    o.tls.enabled = true;
    o.tls.ca_file = cert("ca.crt");
    return o;
  }
  // The same with the client certificate (mutual TLS).
  [[nodiscard]] RedisOptions mtls_options() const {
    RedisOptions o = options();
    o.tls.cert_file = cert("client.crt");
    o.tls.key_file = cert("client.key");
    return o;
  }

private:
  static std::vector<std::string> config(const TlsServerConfig& cfg) {
    std::vector<std::string> lines{"tls-cert-file " + cert(cfg.cert + ".crt"), "tls-key-file " + cert(cfg.cert + ".key"),
                                   "tls-ca-cert-file " + cert("ca.crt"), "tls-auth-clients " + cfg.auth_clients};
    lines.insert(lines.end(), cfg.extra.begin(), cfg.extra.end());
    return lines;
  }
};

// Three TLS-only masters, the cluster bus over TLS too (tls-cluster yes), slots split by
// CLUSTER ADDSLOTSRANGE and the nodes introduced by CLUSTER MEET, all through the Unix sockets.
struct TlsCluster {
  std::vector<std::unique_ptr<TlsRedisServer>> nodes;

  TlsCluster() {
    const std::vector<std::string> cluster{"cluster-enabled yes", "tls-cluster yes", "cluster-config-file nodes.conf",
                                           "cluster-node-timeout 5000"};
    for (int i = 0; i < 3; ++i)
      nodes.push_back(std::make_unique<TlsRedisServer>(TlsServerConfig{"server", "no", cluster}));
    const int ranges[3][2] = {{0, 5460}, {5461, 10922}, {10923, 16383}};
    for (int i = 0; i < 3; ++i)
      if (nodes[i]->command({"CLUSTER", "ADDSLOTSRANGE", std::to_string(ranges[i][0]), std::to_string(ranges[i][1])}) !=
          "OK")
        throw std::runtime_error("test: CLUSTER ADDSLOTSRANGE failed");
    for (int i = 1; i < 3; ++i)
      if (nodes[0]->command({"CLUSTER", "MEET", "127.0.0.1", std::to_string(nodes[i]->port())}) != "OK")
        throw std::runtime_error("test: CLUSTER MEET failed");
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!ok()) {
      if (std::chrono::steady_clock::now() > deadline) throw std::runtime_error("test: the TLS cluster did not form");
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  [[nodiscard]] bool ok() const {
    for (const auto& n : nodes)
      if (n->command({"CLUSTER", "INFO"}).find("cluster_state:ok") == std::string::npos) return false;
    return true;
  }
  // "redis-cluster://127.0.0.1:P?tls=yes" through one seed (the CA comes with the options).
  [[nodiscard]] std::string url() const {
    return "redis-cluster://127.0.0.1:" + std::to_string(nodes[1]->port()) + "?tls=yes";
  }
  // Keys held by each master, added up.
  [[nodiscard]] long long keys() const {
    long long total = 0;
    for (const auto& n : nodes) total += keys_on(*n);
    return total;
  }
  static long long keys_on(TlsRedisServer& n) {
    const std::string info = n.command({"INFO", "keyspace"});
    const auto at = info.find("keys=");
    return at == std::string::npos ? 0 : std::stoll(info.substr(at + 5));
  }
};

// A loopback listener that never answers a TLS handshake, as a plain-text Redis does when the
// ClientHello's bytes hold no newline (a real one does so only some of the time: its bytes are
// random). With answer_ping it answers "PING\r\n" with +PONG, as that Redis would; without, it is
// a server that says nothing at all (a slow one, a stalled network), where a timeout is right.
class SilentServer {
public:
  explicit SilentServer(bool answer_ping) : answer_ping_(answer_ping) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd_, 16) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0)
      throw std::runtime_error("test: cannot listen on a loopback port");
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~SilentServer() {
    stop_ = true;
    thread_.join();
    for (const auto& c : clients_) ::close(c.fd);
    ::close(fd_);
  }
  SilentServer(const SilentServer&) = delete;
  SilentServer& operator=(const SilentServer&) = delete;

  [[nodiscard]] int port() const { return port_; }
  // Connections accepted so far: a probe is one more than the clients.
  [[nodiscard]] int accepted() const { return accepted_.load(); }

private:
  struct Client {
    int fd;
    std::string in;
  };
  void serve() {
    while (!stop_) {
      std::vector<pollfd> fds{{fd_, POLLIN, 0}};
      for (const auto& c : clients_) fds.push_back({c.fd, POLLIN, 0});
      if (::poll(fds.data(), fds.size(), 20) <= 0) continue;
      if (fds[0].revents & POLLIN) {
        const int c = ::accept(fd_, nullptr, nullptr);
        if (c >= 0) {
          clients_.push_back({c, {}});
          ++accepted_;
        }
      }
      for (std::size_t i = 1; i < fds.size(); ++i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP))) continue;
        Client& c = clients_[i - 1];
        char buf[4096];
        const ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
        if (n <= 0) continue;  // closed by the client: kept until the end, never read again
        c.in.append(buf, static_cast<std::size_t>(n));
        if (answer_ping_ && c.in == "PING\r\n") {
          ::send(c.fd, "+PONG\r\n", 7, MSG_NOSIGNAL);
          c.in.clear();
        }
      }
      std::erase_if(clients_, [](const Client& c) {
        char b;
        if (::recv(c.fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) != 0) return false;
        ::close(c.fd);
        return true;
      });
    }
  }

  bool answer_ping_;
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> accepted_{0};
  std::vector<Client> clients_;
  std::thread thread_;
};

}  // namespace idem::tlstest
