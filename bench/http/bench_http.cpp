// Requests per second of a Boost.Beast server answering POST with and without idem::http, over
// keep-alive loopback connections: a plain handler, idem with a new key per request (acquire +
// complete), idem replaying one key (a duplicate: one acquire). Prints each rate and its ratio to
// the plain one. Not a test.
//
//   idem_bench_http [--store memory|redis://127.0.0.1:6379] [--seconds 3] [--connections 4]

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "beast_server.hpp"
#include "idem/redis.hpp"

namespace {

namespace http = boost::beast::http;
using Clock = std::chrono::steady_clock;

http::response<http::string_body> charge(const idem::http::beast_request& req) {
  http::response<http::string_body> res{http::status::created, req.version()};
  res.set(http::field::content_type, "application/json");
  res.body() = R"({"id":"ch_0000000000000001","amount":500})";
  return res;
}

// Requests answered in `seconds` by `connections` keep-alive clients; `key(i)` is the i-th
// request's Idempotency-Key field ("" = none).
template <class Key>
double rate(int port, int connections, double seconds, Key key) {
  std::atomic<long> done{0};
  std::atomic<bool> bad{false};
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  std::vector<std::thread> clients;
  for (int c = 0; c < connections; ++c) {
    clients.emplace_back([&, c] {
      boost::asio::io_context ioc;
      boost::asio::ip::tcp::socket s(ioc);
      s.connect({boost::asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)});
      boost::beast::flat_buffer buf;
      for (long i = 0; Clock::now() < end; ++i) {
        idem::http::beast_request req{http::verb::post, "/charges", 11};
        req.set(http::field::host, "127.0.0.1");
        req.set(http::field::content_type, "application/json");
        const std::string k = key(c, i);
        if (!k.empty()) req.set("Idempotency-Key", k);
        req.body() = R"({"amount":500,"currency":"eur"})";
        req.prepare_payload();
        http::write(s, req);
        http::response<http::string_body> res;
        http::read(s, buf, res);
        if (res.result_int() != 201) bad = true;
        ++done;
      }
      s.shutdown(boost::asio::ip::tcp::socket::shutdown_both);
    });
  }
  for (auto& t : clients) t.join();
  if (bad) std::fprintf(stderr, "idem_bench_http: some answers were not 201\n");
  return static_cast<double>(done) / seconds;
}

template <class Store>
void run(Store& store, int connections, double seconds) {
  idem::IdempotencyGuard<Store> guard{store, {.lease = idem::millis{30'000}, .retention = idem::millis{600'000}}};
  idem::http::Endpoint<Store> endpoint{guard};
  idem::test::BeastServer plain([](const idem::http::beast_request& req) { return charge(req); });
  idem::test::BeastServer guarded([&](const idem::http::beast_request& req) {
    return idem::http::handle(endpoint, req, [](const idem::http::beast_request& r) { return charge(r); });
  });
  const std::string run_id = std::to_string(std::random_device{}());
  const double base = rate(plain.port(), connections, seconds, [](int, long) { return std::string(); });
  const double fresh = rate(guarded.port(), connections, seconds, [&](int c, long i) {
    return "\"" + run_id + "-" + std::to_string(c) + "-" + std::to_string(i) + "\"";
  });
  auto dup_key = [&](int, long) { return "\"dup-" + run_id + "\""; };
  rate(guarded.port(), 1, 0.05,
       dup_key);  // the first request runs; the measured ones replay it, none finds it in flight
  const double dup = rate(guarded.port(), connections, seconds, dup_key);
  std::printf("%-34s %10.0f req/s\n", "plain Beast handler", base);
  std::printf("%-34s %10.0f req/s  %.2fx of plain\n", "idem::http, new key per request", fresh, fresh / base);
  std::printf("%-34s %10.0f req/s  %.2fx of plain\n", "idem::http, duplicate (replay)", dup, dup / base);
}

}  // namespace

int main(int argc, char** argv) try {
  std::string store = "memory";
  double seconds = 3;
  int connections = 4;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--store")
      store = argv[i + 1];
    else if (k == "--seconds")
      seconds = std::atof(argv[i + 1]);
    else if (k == "--connections")
      connections = std::atoi(argv[i + 1]);
  }
  std::printf("store %s, %d keep-alive connections, %.1f s per mode\n", store.c_str(), connections, seconds);
  if (store == "memory") {
    idem::MemoryStore s;
    run(s, connections, seconds);
  } else {
    idem::RedisStore s{idem::parse_redis_url(store)};
    run(s, connections, seconds);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "idem_bench_http: %s\n", e.what());
  return 1;
}
