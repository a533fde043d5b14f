// The Boost.Beast adapter over real HTTP: a Beast server (beast_server.hpp) answering through an
// Endpoint, on a MemoryStore and on a redis-server the case starts, driven by cpp-httplib's client.

#include <httplib.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <string>
#include <thread>

#include "beast_server.hpp"
#include "redis_server.hpp"

namespace {

namespace http = boost::beast::http;

template <class Store>
void beast_cases(Store& store) {
  idem::IdempotencyGuard<Store> guard{store, {.lease = idem::millis{2'000}, .retention = idem::millis{60'000}}};
  idem::http::Endpoint<Store> endpoint{guard};
  std::atomic<int> runs{0};
  idem::test::BeastServer server([&](const idem::http::beast_request& req) {
    return idem::http::handle(endpoint, req, [&](const idem::http::beast_request& r) {
      idem::http::beast_response res{http::status::created, r.version()};
      res.set(http::field::content_type, "application/json");
      res.body() = "{\"run\":" + std::to_string(++runs) + ",\"echo\":\"" + r.body() + "\"}";
      return res;
    });
  });
  httplib::Client client("127.0.0.1", server.port());
  auto post = [&](const std::string& key, const std::string& body) {
    httplib::Headers h;
    if (!key.empty()) h.emplace("Idempotency-Key", key);
    auto res = client.Post("/orders", h, body, "text/plain");
    REQUIRE(res);
    return *res;
  };
  const std::string key = "\"beast-" + std::to_string(std::random_device{}()) + "\"";
  const auto first = post(key, "a");
  CHECK(first.status == 201);
  CHECK(first.get_header_value("Content-Type") == "application/json");
  const auto again = post(key, "a");
  CHECK(again.status == 201);
  CHECK(again.body == first.body);
  CHECK(again.get_header_value("Idempotent-Replayed") == "true");
  CHECK(post(key, "b").status == 422);
  CHECK(post("", "a").status == 400);
  CHECK(post("a b", "a").status == 400);  // unquoted with a space
  CHECK(runs == 1);
}

}  // namespace

TEST_CASE("http beast: the adapter on a MemoryStore") {
  idem::MemoryStore store;
  beast_cases(store);
}

TEST_CASE("http beast: the adapter on a RedisStore") {
  idem::test::RedisServer redis;
  idem::RedisStore store{redis.options()};
  beast_cases(store);
}

#ifdef IDEM_TEST_HTTP_ASYNC
// handle_async on a coroutine Beast server (one io thread): the store awaited through run_async,
// the handler an awaitable that takes 400 ms, so a concurrent retry finds the key in flight.
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include "idem/asio/redis_store.hpp"
#include "idem/http/async.hpp"

namespace {

namespace asio = boost::asio;

template <class Store>
void async_cases(asio::io_context& io, Store& store) {
  idem::IdempotencyGuard<Store> guard{store, {.lease = idem::millis{5'000}, .retention = idem::millis{60'000}}};
  idem::http::Endpoint<Store> endpoint{guard};
  std::atomic<int> runs{0};
  asio::ip::tcp::acceptor acceptor(io, {asio::ip::make_address("127.0.0.1"), 0});
  const int port = acceptor.local_endpoint().port();
  auto session = [&](asio::ip::tcp::socket socket) -> asio::awaitable<void> {
    boost::beast::flat_buffer buffer;
    for (;;) {
      idem::http::beast_request req;
      boost::system::error_code ec;
      co_await http::async_read(socket, buffer, req, asio::redirect_error(asio::use_awaitable, ec));
      if (ec) co_return;
      idem::http::beast_response res = co_await idem::http::handle_async(
          endpoint, req, [&](const idem::http::beast_request& r) -> asio::awaitable<idem::http::beast_response> {
            asio::steady_timer t(co_await asio::this_coro::executor, std::chrono::milliseconds(400));
            co_await t.async_wait(asio::use_awaitable);
            idem::http::beast_response out{http::status::created, r.version()};
            out.body() = "{\"run\":" + std::to_string(++runs) + "}";
            co_return out;
          });
      co_await http::async_write(socket, res, asio::redirect_error(asio::use_awaitable, ec));
      if (ec) co_return;
    }
  };
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        for (;;) {
          boost::system::error_code ec;
          auto s = co_await acceptor.async_accept(asio::redirect_error(asio::use_awaitable, ec));
          if (ec) co_return;
          asio::co_spawn(io, session(std::move(s)), asio::detached);
        }
      },
      asio::detached);
  std::thread loop([&] { io.run(); });
  auto post = [&](const std::string& key, const std::string& body) {
    httplib::Client client("127.0.0.1", port);
    httplib::Headers h;
    if (!key.empty()) h.emplace("Idempotency-Key", key);
    auto res = client.Post("/orders", h, body, "text/plain");
    REQUIRE(res);
    return *res;
  };
  const std::string key = "async-" + std::to_string(std::random_device{}());  // bare: as SDKs send it
  int busy_status = 0;
  std::string busy_retry_after;
  std::thread second([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    httplib::Client client("127.0.0.1", port);
    if (auto r = client.Post("/orders", {{"Idempotency-Key", key}}, "a", "text/plain")) {
      busy_status = r->status;
      busy_retry_after = r->get_header_value("Retry-After");
    }
  });
  const auto first = post(key, "a");
  second.join();
  CHECK(first.status == 201);
  CHECK(busy_status == 409);  // in flight on the same io thread, answered without waiting
  CHECK(!busy_retry_after.empty());
  const auto again = post("\"" + key + "\"", "a");
  CHECK(again.status == 201);
  CHECK(again.body == first.body);
  CHECK(again.get_header_value("Idempotent-Replayed") == "true");
  CHECK(post(key, "b").status == 422);
  CHECK(post("", "a").status == 400);
  CHECK(runs == 1);
  asio::post(io, [&] { acceptor.close(); });
  io.stop();
  loop.join();
}

}  // namespace

TEST_CASE("http beast async: handle_async on a MemoryStore") {
  asio::io_context io;
  idem::MemoryStore store;
  async_cases(io, store);
}

TEST_CASE("http beast async: handle_async on an AsyncRedisStore") {
  idem::test::RedisServer redis;
  asio::io_context io;
  idem::AsyncRedisStore store{io.get_executor(), redis.options()};
  async_cases(io, store);
}
#endif
