#pragma once
// A real redis-server for one test process: a free 127.0.0.1 port, a temp dir, no persistence,
// an `admin` ACL user for the harness's own commands, and a Unix socket. Starting fails the test
// (throws) when the server cannot be started; it never skips. Children are fork+exec'ed and get
// PR_SET_PDEATHSIG, so a crashed test cannot leave a server behind.

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "idem/redis.hpp"
#include "../support/process.hpp"  // free_port, spawn

#ifndef IDEM_REDIS_SERVER
#define IDEM_REDIS_SERVER "redis-server"
#endif

namespace idem::test {

inline constexpr const char* admin_user = "idem-admin";

// One command on `c`, arguments binary-safe; null when the connection failed (c->errstr says why).
inline std::unique_ptr<redisReply, void (*)(void*)> command_argv(redisContext* c, const std::vector<std::string>& args) {
  std::vector<const char*> argv;
  std::vector<size_t> lens;
  for (const auto& a : args) {
    argv.push_back(a.data());
    lens.push_back(a.size());
  }
  return {static_cast<redisReply*>(redisCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data())),
          freeReplyObject};
}

// A worker process exec'ed by a test, its stdout (and stderr) on a pipe the test reads.
struct Child {
  pid_t pid = -1;
  int out = -1;  // read end of the child's stdout

  static Child start(const std::string& exe, const std::vector<std::string>& args) {
    int p[2];
    if (::pipe(p) != 0) throw std::runtime_error("test: pipe failed");
    std::vector<std::string> argv{exe};
    argv.insert(argv.end(), args.begin(), args.end());
    Child c;
    c.pid = spawn(argv, p[1]);
    ::close(p[1]);
    c.out = p[0];
    return c;
  }
  // One line of output, or "" at EOF.
  std::string line() const {
    std::string s;
    char ch;
    while (::read(out, &ch, 1) == 1) {
      if (ch == '\n') return s;
      s += ch;
    }
    return s;
  }
  // Everything up to EOF.
  std::string rest() const {
    std::string s;
    char buf[4096];
    ssize_t n;
    while ((n = ::read(out, buf, sizeof buf)) > 0) s.append(buf, static_cast<std::size_t>(n));
    return s;
  }
  // Reaps it: its exit code, or 128 + the signal that ended it.
  int wait() {
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    ::close(out);
    pid = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
};

class RedisServer {
public:
  /// Starts a server; `config` lines are appended to the generated redis.conf. `tls_only`: it
  /// listens with TLS only (`port 0`, `tls-port P`; `config` names the certificates), and the
  /// harness's own commands go through its Unix socket, so the harness needs no TLS client.
  explicit RedisServer(std::vector<std::string> config = {}, bool tls_only = false)
      : config_(std::move(config)), tls_only_(tls_only) {
    char tmpl[] = "/tmp/idem-redis-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) throw std::runtime_error("test: mkdtemp failed");
    dir_ = tmpl;
    std::string last_error;
    for (int attempt = 0; attempt < 5; ++attempt) {
      port_ = free_port();
      try {
        start();
        return;
      } catch (const std::exception& e) {
        last_error = e.what();
      }
    }
    cleanup_dir();
    throw std::runtime_error("test: redis-server could not be started: " + last_error);
  }
  ~RedisServer() {
    stop();
    cleanup_dir();
  }
  RedisServer(const RedisServer&) = delete;
  RedisServer& operator=(const RedisServer&) = delete;

  [[nodiscard]] int port() const { return port_; }
  [[nodiscard]] std::string socket_path() const { return dir_ + "/redis.sock"; }
  [[nodiscard]] pid_t pid() const { return pid_; }
  /// Password of the harness's admin user: random per server, so a test can never drive
  /// another test's server by landing on a port that server took first.
  [[nodiscard]] const std::string& admin_password() const { return admin_password_; }

  /// Options of a store on this server (TCP), as the default user unless told otherwise.
  [[nodiscard]] RedisOptions options() const {
    RedisOptions o;
    o.host = "127.0.0.1";
    o.port = port_;
    o.connect_timeout = millis{2000};
    o.command_timeout = millis{5000};
    return o;
  }

  /// Starts (or restarts after stop) on the same port and directory.
  void start() {
    {
      std::ofstream conf(dir_ + "/redis.conf");
      if (tls_only_)
        conf << "port 0\ntls-port " << port_ << "\n";
      else
        conf << "port " << port_ << "\n";
      conf << "bind 127.0.0.1\ndir " << dir_ << "\nsave \"\"\nappendonly no\n"
           << "daemonize no\nlogfile " << dir_ << "/redis.log\nunixsocket " << socket_path()
           << "\nunixsocketperm 700\n"
           << "user " << admin_user << " on >" << admin_password_ << " ~* &* +@all\n";
      for (const auto& line : config_) conf << line << "\n";
    }
    pid_ = spawn({IDEM_REDIS_SERVER, dir_ + "/redis.conf"});
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        throw std::runtime_error("redis-server (" IDEM_REDIS_SERVER ") exited at start: " + log_tail());
      }
      try {
        // Ours, not a server another test started on the same port a moment earlier.
        if (command({"INFO", "server"}).find("process_id:" + std::to_string(pid_) + "\r") != std::string::npos &&
            (!tls_only_ || port_listening()))
          return;
      } catch (const std::exception&) {
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    stop();
    throw std::runtime_error("redis-server did not answer PING within 10 s: " + log_tail());
  }

  /// Stops the server with `sig` (SIGTERM: clean; SIGKILL: crash) and reaps it.
  void stop(int sig = SIGKILL) {
    if (pid_ <= 0) return;
    ::kill(pid_, sig);
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
  }

  /// Runs one command as the admin user; returns the reply flattened to text ("(nil)", "ERR ...").
  std::string command(const std::vector<std::string>& args) const {
    timeval tv{5, 0};
    std::unique_ptr<redisContext, void (*)(redisContext*)> c(
        tls_only_ ? redisConnectUnixWithTimeout(socket_path().c_str(), tv) : redisConnectWithTimeout("127.0.0.1", port_, tv),
        redisFree);
    if (!c || c->err) throw std::runtime_error("test: cannot connect to the test redis-server");
    redisSetTimeout(c.get(), tv);
    auto run = [&](const std::vector<std::string>& a) {
      auto r = command_argv(c.get(), a);
      if (!r) throw std::runtime_error(std::string("test: redis command failed: ") + c->errstr);
      return flatten(r.get());
    };
    const std::string auth = run({"AUTH", admin_user, admin_password_});
    if (auth != "OK") throw std::runtime_error("test: admin AUTH failed: " + auth);
    return run(args);
  }

  /// INFO stats' counter `name` (total_connections_received, ...).
  long long stat(const std::string& name) const {
    const std::string info = command({"INFO", "stats"});
    const auto at = info.find(name + ":");
    if (at == std::string::npos) throw std::runtime_error("test: no " + name + " in INFO stats");
    return std::stoll(info.substr(at + name.size() + 1));
  }

  std::string log_tail() const {
    std::ifstream in(dir_ + "/redis.log");
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string s = ss.str();
    return s.size() > 2000 ? s.substr(s.size() - 2000) : s;
  }

private:
  static std::string random_password() {
    std::random_device rd;
    return "admin-" + std::to_string(rd()) + "-" + std::to_string(rd());
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

  // Something accepts connections on the port (a TLS-only server answers INFO on its socket
  // before its TLS port is up).
  bool port_listening() const {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<std::uint16_t>(port_));
    const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    ::close(fd);
    return ok;
  }

  void cleanup_dir() {
    std::error_code ec;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
  }

  std::vector<std::string> config_;
  bool tls_only_ = false;
  std::string admin_password_ = random_password();
  std::string dir_;
  int port_ = 0;
  pid_t pid_ = -1;
};

#ifdef IDEM_REDIS_LUA_DIR
/// SHA1 of a generated script (`acquire`, `seq/sequence_advance`, ...) in the build's
/// IDEM_REDIS_LUA_DIR, as EVALSHA wants it, computed by `server` (redis.sha1hex) without loading it.
inline std::string generated_script_sha(const RedisServer& server, const std::string& name) {
  std::ifstream in(std::string(IDEM_REDIS_LUA_DIR) + "/" + name + ".lua", std::ios::binary);
  if (!in) throw std::runtime_error("test: no generated script " + name + " in " IDEM_REDIS_LUA_DIR);
  std::stringstream ss;
  ss << in.rdbuf();
  return server.command({"EVAL", "return redis.sha1hex(ARGV[1])", "0", ss.str()});
}
#endif

}  // namespace idem::test
