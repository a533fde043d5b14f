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
