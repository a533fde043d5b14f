#pragma once
// A TCP proxy between a store and a test's server (Redis, PostgreSQL), there to lose a reply on
// purpose: the request reaches the server and runs, and the client never sees the answer. That is
// the one failure a real network makes that a stopped or paused server cannot: the write happened,
// the outcome is unknown to the caller. The proxy can also drop a request before the server sees
// it (a session that died just before the call), hold a reply until the client times out, replace
// it with another (an injected error reply), and refuse new connections (the client cannot ask
// again).
//
// Loopback only, on a free port. One thread polls every socket with a short timeout; it is bounded
// (at most `max_connections` proxied pairs, a fixed buffer, sends that give up after a second) and
// stops with the object, which closes everything.
//
// A "reply" is what one recv() from the server returns, and a "request" what one recv() from the
// client returns: idem's messages are small and each connection has one request in flight, so on
// loopback each arrives whole.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace idem::test {

class TcpProxy {
public:
  enum class Action {
    pass,     // forward the reply
    cut,      // drop the reply and close the client's connection (a connection lost after sending)
    hold,     // drop the reply and every later byte from the server on that connection (a timeout)
    replace,  // send `replacement` to the client instead of the reply
  };
  struct Step {
    Action action = Action::pass;
    std::string replacement;  // Action::replace: the bytes sent instead (e.g. a RESP error reply)
  };

  static constexpr std::size_t max_connections = 64;  // more are closed as soon as accepted

  // Forwards to 127.0.0.1:upstream_port.
  explicit TcpProxy(int upstream_port) : upstream_(upstream_port) {
    listen_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a = loopback(0);
    socklen_t len = sizeof a;
    if (listen_ < 0 || ::bind(listen_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
        ::listen(listen_, static_cast<int>(max_connections)) != 0 ||
        ::getsockname(listen_, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      if (listen_ >= 0) ::close(listen_);
      throw std::runtime_error("test: the proxy cannot listen on loopback");
    }
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { loop(); });
  }
  ~TcpProxy() {
    stop_ = true;
    thread_.join();
    for (const Pair& p : pairs_) close_pair(p);
    ::close(listen_);
  }
  TcpProxy(const TcpProxy&) = delete;
  TcpProxy& operator=(const TcpProxy&) = delete;

  [[nodiscard]] int port() const { return port_; }

  /// The next replies meet `steps` in order (then pass). `refuse_after`: once the last step is
  /// taken, new connections are closed as soon as they are accepted (a retry cannot be made).
  void plan(std::vector<Step> steps, bool refuse_after = false) {
    std::lock_guard lock(mu_);
    steps_.assign(std::make_move_iterator(steps.begin()), std::make_move_iterator(steps.end()));
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
  [[nodiscard]] bool fired() const {
    std::lock_guard lock(mu_);
    return fired_;
  }
  /// The next reply from the server is dropped and its connection closed (once).
  void cut_next_reply() { arm(Action::cut); }
  /// The next request to the server is dropped and its connection closed (once).
  void cut_next_request() { cut_request_ = true; }
  /// New connections are closed at once (true) or proxied (false).
  void refuse(bool on) { refusing_ = on; }
  /// Replies and requests cut so far.
  [[nodiscard]] int cuts() const { return cuts_; }

private:
  struct Pair {
    int client = -1;
    int server = -1;
    bool held = false;
  };

  static sockaddr_in loopback(int port) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    return a;
  }
  static void send_timeout(int fd) {
    const timeval tv{1, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  }
  // False when the peer is gone or does not take the bytes within the send timeout.
  static bool send_all(int fd, const char* p, std::size_t n) {
    while (n > 0) {
      const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
      if (w <= 0) return false;
      p += w;
      n -= static_cast<std::size_t>(w);
    }
    return true;
  }
  static void close_pair(const Pair& p) {
    if (p.client >= 0) ::close(p.client);
    if (p.server >= 0) ::close(p.server);
  }

  void accept_one() {
    Pair p;
    p.client = ::accept4(listen_, nullptr, nullptr, SOCK_CLOEXEC);
    if (p.client < 0) return;
    if (refusing_ || pairs_.size() >= max_connections) return close_pair(p);
    p.server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a = loopback(upstream_);
    if (p.server < 0 || ::connect(p.server, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return close_pair(p);
    send_timeout(p.client);
    send_timeout(p.server);
    pairs_.push_back(p);
  }

  // A request from the client on `p`: forwarded, or cut. False: close the pair.
  bool on_request(const Pair& p, const char* buf, std::size_t n) {
    if (cut_request_.exchange(false)) {
      ++cuts_;
      return false;  // the server never hears the request
    }
    return send_all(p.server, buf, n);
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
      case Action::pass: return send_all(p.client, buf, n);
      case Action::cut: ++cuts_; return false;  // the server answered and the client never hears it
      case Action::hold: p.held = true; return true;
      case Action::replace: return send_all(p.client, step.replacement.data(), step.replacement.size());
    }
    return true;
  }

  void loop() {
    std::vector<char> buf(65536);
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
          const ssize_t n = ::recv(p.client, buf.data(), buf.size(), 0);
          open = n > 0 && on_request(p, buf.data(), static_cast<std::size_t>(n));
        }
        if (open && fds[2 + 2 * i].revents != 0) {
          const ssize_t n = ::recv(p.server, buf.data(), buf.size(), 0);
          open = n > 0 && on_reply(p, buf.data(), static_cast<std::size_t>(n));
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
  std::atomic<bool> cut_request_{false};
  std::atomic<int> cuts_{0};
  mutable std::mutex mu_;
  std::deque<Step> steps_;
  bool refuse_after_ = false;
  bool fired_ = false;
  std::vector<Pair> pairs_;  // the proxy thread's alone (and the destructor's, after join)
  std::thread thread_;
};

}  // namespace idem::test
