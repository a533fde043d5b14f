#pragma once
// A small synchronous Boost.Beast HTTP/1.1 server on 127.0.0.1 (a free port), a thread per
// connection, keep-alive: enough to drive the Beast adapter from a test and from bench/http.

#include <atomic>
#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "idem/http/beast.hpp"

namespace idem::test {

class BeastServer {
 public:
  using Handler = std::function<idem::http::beast_response(const idem::http::beast_request&)>;

  explicit BeastServer(Handler handler, std::size_t body_limit = std::size_t{8} << 20)
      : handler_(std::move(handler)),
        body_limit_(body_limit),
        acceptor_(ioc_, {boost::asio::ip::make_address("127.0.0.1"), 0}) {
    accepting_ = std::thread([this] { accept_loop(); });
  }
  ~BeastServer() {
    stopping_ = true;
    // Wake the blocking accept with a connection of our own; the accept thread then stops.
    try {
      boost::asio::io_context ioc;
      boost::asio::ip::tcp::socket s(ioc);
      s.connect({boost::asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port())});
    } catch (...) {
    }
    accepting_.join();
    std::lock_guard lock(mu_);
    for (auto& t : sessions_) t.join();  // each ends when its client closes
  }
  BeastServer(const BeastServer&) = delete;
  BeastServer& operator=(const BeastServer&) = delete;

  [[nodiscard]] int port() const { return port_; }

 private:
  void accept_loop() {
    for (;;) {
      boost::system::error_code ec;
      boost::asio::ip::tcp::socket socket(ioc_);
      acceptor_.accept(socket, ec);
      if (stopping_) return;
      if (ec) continue;
      std::lock_guard lock(mu_);
      sessions_.emplace_back([this, s = std::move(socket)]() mutable { session(std::move(s)); });
    }
  }

  void session(boost::asio::ip::tcp::socket socket) {
    namespace http = boost::beast::http;
    boost::beast::flat_buffer buffer;
    for (;;) {
      boost::system::error_code ec;
      http::request_parser<http::string_body> parser;
      parser.body_limit(body_limit_);
      http::read(socket, buffer, parser, ec);
      if (ec == http::error::body_limit) {
        idem::http::beast_response res{http::status::payload_too_large, 11};
        res.prepare_payload();
        http::write(socket, res, ec);
        break;
      }
      if (ec) break;
      const idem::http::beast_request req = parser.release();
      idem::http::beast_response res = handler_(req);
      res.keep_alive(req.keep_alive());
      res.prepare_payload();  // a body without Content-Length would end only at EOF
      http::write(socket, res, ec);
      if (ec || !res.keep_alive()) break;
    }
    boost::system::error_code ignored;
    socket.shutdown(boost::asio::ip::tcp::socket::shutdown_send, ignored);
  }

  Handler handler_;
  std::size_t body_limit_;
  boost::asio::io_context ioc_;
  boost::asio::ip::tcp::acceptor acceptor_;
  int port_ = acceptor_.local_endpoint().port();
  std::atomic<bool> stopping_{false};
  std::thread accepting_;
  std::mutex mu_;
  std::vector<std::thread> sessions_;
};

}  // namespace idem::test
