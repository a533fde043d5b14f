#pragma once
// A TCP proxy between a RedisClient and a test's redis-server, on a free loopback port, that can
// lose one reply on purpose: the request reaches the server and runs, and the proxy then cuts the
// client's connection (or holds the reply until the client times out, or replaces it with an
// error reply), as planned reply by reply. One thread polls every socket; everything is closed when the proxy is destroyed.
//
// A "reply" is what one recv() from the server returns: idem's replies are small and each
// connection has one request in flight, so on loopback a reply arrives whole.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

namespace idem::test {

class RedisProxy {
public:
  enum class Action {
    pass,     // forward the reply
    cut,      // drop the reply and close the client's connection (a connection lost after sending)
    hold,     // drop the reply and every later byte from the server on that connection (a timeout)
    replace,  // send `replacement` to the client instead of the reply
  };
  struct Step {
    Action action = Action::pass;
    std::string replacement;  // Action::replace: the bytes sent instead (a RESP error reply)
  };

  explicit RedisProxy(int upstream_port) : upstream_(upstream_port) {
    listen_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a = loopback(0);
    socklen_t len = sizeof a;
    if (listen_ < 0 || ::bind(listen_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(listen_, 64) != 0 ||
        ::getsockname(listen_, reinterpret_cast<sockaddr*>(&a), &len) != 0)
      throw std::runtime_error("test: the proxy cannot listen on loopback");
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { loop(); });
  }
  ~RedisProxy() {
    stop_ = true;
    thread_.join();
    for (const Pair& p : pairs_) close_pair(p);
    ::close(listen_);
  }
  RedisProxy(const RedisProxy&) = delete;
  RedisProxy& operator=(const RedisProxy&) = delete;

  [[nodiscard]] int port() const { return port_; }

  /// The next replies meet `steps` in order (then pass). `refuse_after`: once the last step is
  /// taken, new connections are closed as soon as they are accepted (a retry cannot be made).
  void plan(std::vector<Step> steps, bool refuse_after = false) {
    std::lock_guard lock(mu_);
    steps_.assign(steps.begin(), steps.end());
    refuse_after_ = refuse_after;
    fired_ = false;
  }
  /// Acts on the next reply after letting `skip` replies through.
  void arm(Action a, int skip = 0, std::string replacement = {}, bool refuse_after = false) {
    std::vector<Step> steps(static_cast<std::size_t>(skip));
    steps.push_back({a, std::move(replacement)});
    plan(std::move(steps), refuse_after);
  }
  /// Whether the planned steps have all been taken.
  [[nodiscard]] bool fired() {
    std::lock_guard lock(mu_);
    return fired_;
  }
  /// New connections are closed at once (true) or proxied (false).
  void refuse(bool on) { refusing_ = on; }

private:
  struct Pair {
    int client;
    int server;
    bool held = false;
  };

  static sockaddr_in loopback(int port) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    return a;
  }
  static void send_all(int fd, const char* p, std::size_t n) {
    while (n > 0) {
      const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
      if (w <= 0) return;
      p += w;
      n -= static_cast<std::size_t>(w);
    }
  }
  static void close_pair(const Pair& p) {
    ::close(p.client);
    ::close(p.server);
  }

  void accept_one() {
    const int c = ::accept(listen_, nullptr, nullptr);
    if (c < 0) return;
    if (refusing_) {
      ::close(c);
      return;
    }
    const int s = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a = loopback(upstream_);
    if (s < 0 || ::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(c);
      if (s >= 0) ::close(s);
      return;
    }
    pairs_.push_back({c, s});
  }

  // A reply from the server on `p`: forwarded, or the planned step. False: close the pair.
  bool on_reply(Pair& p, const char* buf, std::size_t n) {
    if (p.held) return true;
    std::lock_guard lock(mu_);
    Step step;
    if (!steps_.empty()) {
      step = std::move(steps_.front());
      steps_.pop_front();
      if (steps_.empty()) {
        fired_ = true;
        if (refuse_after_) refusing_ = true;
      }
    }
    switch (step.action) {
      case Action::pass: send_all(p.client, buf, n); return true;
      case Action::cut: return false;
      case Action::hold: p.held = true; return true;
      case Action::replace: send_all(p.client, step.replacement.data(), step.replacement.size()); return true;
    }
    return true;
  }

  void loop() {
    char buf[65536];
    while (!stop_) {
      std::vector<pollfd> fds{{listen_, POLLIN, 0}};
      for (const Pair& p : pairs_) {
        fds.push_back({p.client, POLLIN, 0});
        fds.push_back({p.server, POLLIN, 0});
      }
      if (::poll(fds.data(), fds.size(), 20) <= 0) continue;
      std::vector<Pair> keep;
      for (std::size_t i = 0; i < pairs_.size(); ++i) {
        Pair& p = pairs_[i];
        bool open = true;
        if (fds[1 + 2 * i].revents != 0) {
          const ssize_t n = ::recv(p.client, buf, sizeof buf, 0);
          if (n <= 0) open = false;
          else send_all(p.server, buf, static_cast<std::size_t>(n));
        }
        if (open && fds[2 + 2 * i].revents != 0) {
          const ssize_t n = ::recv(p.server, buf, sizeof buf, 0);
          open = n > 0 && on_reply(p, buf, static_cast<std::size_t>(n));
        }
        if (open) keep.push_back(p);
        else close_pair(p);
      }
      pairs_ = std::move(keep);
      if (fds[0].revents != 0) accept_one();
    }
  }

  int upstream_;
  int listen_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<bool> refusing_{false};
  std::mutex mu_;
  std::deque<Step> steps_;
  bool refuse_after_ = false;
  bool fired_ = false;
  std::vector<Pair> pairs_;  // the proxy thread's alone (and the destructor's, after join)
  std::thread thread_;
};

}  // namespace idem::test
