#pragma once
// A TCP proxy between the store and the fixture server, to lose a reply on purpose: armed with
// cut_next_reply(), it drops the next bytes the server sends and closes that connection, so the
// server has run the request but the client never sees the answer; cut_next_request() drops the
// next request and closes its connection instead (a session that died just before the call, whose
// request the server never saw). refuse() closes every new
// connection at once (the client cannot ask again). Loopback only, a free port, one thread that
// polls with a short timeout and stops with the object.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace pgtest {

class Proxy {
public:
  // Forwards to 127.0.0.1:upstream_port.
  explicit Proxy(int upstream_port) : upstream_(upstream_port) {
    listen_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a = loopback(0);
    if (listen_ < 0 || ::bind(listen_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(listen_, 16) != 0)
      throw std::runtime_error("proxy: cannot listen on loopback");
    socklen_t len = sizeof a;
    ::getsockname(listen_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { loop(); });
  }
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;
  ~Proxy() {
    stop_ = true;
    thread_.join();
    for (auto& p : pairs_) close_pair(p);
    ::close(listen_);
  }

  int port() const { return port_; }
  // The next reply from the server is dropped and its connection closed (once).
  void cut_next_reply() { armed_ = true; }
  // The next request to the server is dropped and its connection closed (once).
  void cut_next_request() { armed_request_ = true; }
  // While on, new connections are closed as soon as they are accepted.
  void refuse(bool on) { refuse_ = on; }
  // Replies and requests dropped so far.
  int cuts() const { return cuts_; }

private:
  struct Pair {
    int client = -1, server = -1;
  };

  static sockaddr_in loopback(int port) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return a;
  }
  static void close_pair(Pair& p) {
    if (p.client >= 0) ::close(p.client);
    if (p.server >= 0) ::close(p.server);
    p.client = p.server = -1;
  }
  static bool write_all(int fd, const char* d, ssize_t n) {
    while (n > 0) {
      const ssize_t w = ::send(fd, d, static_cast<std::size_t>(n), MSG_NOSIGNAL);
      if (w <= 0) return false;
      d += w;
      n -= w;
    }
    return true;
  }

  void accept_one() {
    Pair p;
    p.client = ::accept4(listen_, nullptr, nullptr, SOCK_CLOEXEC);
    if (p.client < 0) return;
    if (refuse_) return close_pair(p);
    p.server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a = loopback(upstream_);
    if (p.server < 0 || ::connect(p.server, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return close_pair(p);
    pairs_.push_back(p);
  }

  // Moves what is readable on one side to the other; false when the pair is done.
  bool pump(Pair& p, bool from_server) {
    char buf[65536];
    const ssize_t n = ::recv(from_server ? p.server : p.client, buf, sizeof buf, 0);
    if (n <= 0) return false;
    if (from_server ? armed_.exchange(false) : armed_request_.exchange(false)) {
      ++cuts_;
      return false;  // the server answered and the client never hears it, or it never hears the request
    }
    return write_all(from_server ? p.client : p.server, buf, n);
  }

  void loop() {
    while (!stop_) {
      std::vector<pollfd> fds{{listen_, POLLIN, 0}};
      for (const auto& p : pairs_) {
        fds.push_back({p.client, POLLIN, 0});
        fds.push_back({p.server, POLLIN, 0});
      }
      if (::poll(fds.data(), fds.size(), 20) <= 0) continue;
      std::vector<Pair> live;
      for (std::size_t i = 0; i < pairs_.size(); ++i) {
        Pair& p = pairs_[i];
        bool ok = true;
        if (fds[1 + 2 * i].revents) ok = pump(p, false);
        if (ok && fds[2 + 2 * i].revents) ok = pump(p, true);
        if (ok)
          live.push_back(p);
        else
          close_pair(p);
      }
      pairs_ = std::move(live);
      if (fds[0].revents) accept_one();
    }
  }

  int upstream_;
  int listen_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false}, armed_{false}, armed_request_{false}, refuse_{false};
  std::atomic<int> cuts_{0};
  std::vector<Pair> pairs_;  // the proxy thread's only
  std::thread thread_;
};

}  // namespace pgtest
