#pragma once
// The TLS tests' Redis side: the fixture's certificates (tls_fixture.sh made them) and a
// redis-server that speaks TLS only (`port 0`, `tls-port P`), started per test process on a free
// loopback port. The harness's own admin commands go through the server's Unix socket, so the
// harness needs no TLS client of its own.

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <hiredis/hiredis.h>
#include <sys/wait.h>
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

class TlsRedisServer {
public:
  explicit TlsRedisServer(TlsServerConfig cfg = {}) : cfg_(std::move(cfg)) {
    char tmpl[] = "/tmp/idem-redis-tls-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) throw std::runtime_error("test: mkdtemp failed");
    dir_ = tmpl;
    std::string last;
    for (int attempt = 0; attempt < 5; ++attempt) {
      port_ = test::free_port();
      try {
        start();
        return;
      } catch (const std::exception& e) {
        last = e.what();
      }
    }
    std::filesystem::remove_all(dir_);
    throw std::runtime_error("test: a TLS redis-server could not be started: " + last);
  }
  ~TlsRedisServer() {
    stop();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  TlsRedisServer(const TlsRedisServer&) = delete;
  TlsRedisServer& operator=(const TlsRedisServer&) = delete;

  [[nodiscard]] int port() const { return port_; }
  [[nodiscard]] pid_t pid() const { return pid_; }

  // Options of a client of this server: TLS on, the test CA trusted, no client certificate.
  [[nodiscard]] RedisOptions options() const {
    RedisOptions o;
    o.host = "127.0.0.1";
    o.port = port_;
    o.connect_timeout = millis{2000};
    o.command_timeout = millis{5000};
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

  void start() {
    {
      std::ofstream conf(dir_ + "/redis.conf");
      conf << "bind 127.0.0.1\nport 0\ntls-port " << port_ << "\ndir " << dir_ << "\nsave \"\"\nappendonly no\n"
           << "daemonize no\nlogfile " << dir_ << "/redis.log\nunixsocket " << socket_path()
           << "\nunixsocketperm 700\n"
           << "tls-cert-file " << cert(cfg_.cert + ".crt") << "\ntls-key-file " << cert(cfg_.cert + ".key")
           << "\ntls-ca-cert-file " << cert("ca.crt") << "\ntls-auth-clients " << cfg_.auth_clients << "\n"
           << "user " << test::admin_user << " on >" << admin_password_ << " ~* &* +@all\n";
      for (const auto& line : cfg_.extra) conf << line << "\n";
    }
    pid_ = test::spawn({IDEM_REDIS_SERVER, dir_ + "/redis.conf"});
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        throw std::runtime_error("redis-server exited at start: " + log_tail());
      }
      try {
        if (command({"INFO", "server"}).find("process_id:" + std::to_string(pid_) + "\r") != std::string::npos &&
            tls_port_listening())
          return;
      } catch (const std::exception&) {
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    stop();
    throw std::runtime_error("the TLS redis-server did not answer within 10 s: " + log_tail());
  }

  void stop(int sig = SIGKILL) {
    if (pid_ <= 0) return;
    ::kill(pid_, sig);
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
  }

  // One command as the admin user, over the Unix socket; the reply flattened to text.
  std::string command(const std::vector<std::string>& args) const {
    timeval tv{5, 0};
    std::unique_ptr<redisContext, void (*)(redisContext*)> c(redisConnectUnixWithTimeout(socket_path().c_str(), tv),
                                                              redisFree);
    if (!c || c->err) throw std::runtime_error("test: cannot connect to the TLS redis-server's socket");
    redisSetTimeout(c.get(), tv);
    auto run = [&](const std::vector<std::string>& a) {
      auto r = test::command_argv(c.get(), a);
      if (!r) throw std::runtime_error(std::string("test: redis command failed: ") + c->errstr);
      return flatten(r.get());
    };
    const std::string auth = run({"AUTH", test::admin_user, admin_password_});
    if (auth != "OK") throw std::runtime_error("test: admin AUTH failed: " + auth);
    return run(args);
  }

  // INFO stats' counter `name` (total_connections_received, ...).
  long long stat(const std::string& name) const {
    const std::string info = command({"INFO", "stats"});
    const auto at = info.find(name + ":");
    if (at == std::string::npos) throw std::runtime_error("test: no " + name + " in INFO stats");
    return std::stoll(info.substr(at + name.size() + 1));
  }

  std::string log_tail() const {
    const std::string s = read_file(dir_ + "/redis.log");
    return s.size() > 2000 ? s.substr(s.size() - 2000) : s;
  }

private:
  [[nodiscard]] std::string socket_path() const { return dir_ + "/redis.sock"; }

  bool tls_port_listening() const {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<std::uint16_t>(port_));
    const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    ::close(fd);
    return ok;
  }

  static std::string flatten(const redisReply* r) {
    switch (r->type) {
      case REDIS_REPLY_STRING:
      case REDIS_REPLY_STATUS:
      case REDIS_REPLY_ERROR: return std::string(r->str, r->len);
      case REDIS_REPLY_INTEGER: return std::to_string(r->integer);
      case REDIS_REPLY_NIL: return "(nil)";
      case REDIS_REPLY_ARRAY: {
        std::string out;
        for (size_t i = 0; i < r->elements; ++i) out += (i ? "\n" : "") + flatten(r->element[i]);
        return out;
      }
      default: return "?";
    }
  }

  TlsServerConfig cfg_;
  std::string admin_password_ = "admin-tls-" + std::to_string(std::random_device{}());
  std::string dir_;
  int port_ = 0;
  pid_t pid_ = -1;
};

}  // namespace idem::tlstest
