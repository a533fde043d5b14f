// The example server (examples/http_payments) as a client sees it: each case of the Idempotency-Key
// draft over real HTTP (cpp-httplib's client), on a redis-server the case starts itself and on the
// PostgreSQL fixture server (transactional mode). The server is a child process, so it can be
// SIGKILLed mid-request; every handler run is a line on its stdout, which the cases count.

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <csignal>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "pg_support.hpp"
#include "redis_server.hpp"

using namespace std::chrono_literals;

namespace {

// One example server process; `log()` (after stop) is everything it printed.
class PaymentsServer {
 public:
  PaymentsServer(const std::string& store, int processing_ms, int lease_ms = 2000, int retention_ms = 2000) {
    child_ = idem::test::Child::start(
        IDEM_HTTP_PAYMENTS, {"--port", "0", "--store", store, "--processing-ms", std::to_string(processing_ms),
                             "--lease-ms", std::to_string(lease_ms), "--retention-ms", std::to_string(retention_ms)});
    const std::string first = child_.line();
    const auto at = first.find("127.0.0.1:");
    if (at == std::string::npos) {
      const std::string rest = child_.rest();
      child_.wait();
      throw std::runtime_error("the example server did not start: " + first + rest);
    }
    port_ = std::stoi(first.substr(at + 10));
  }
  ~PaymentsServer() { stop(); }
  PaymentsServer(const PaymentsServer&) = delete;
  PaymentsServer& operator=(const PaymentsServer&) = delete;

  [[nodiscard]] int port() const { return port_; }
  // Ends it (SIGKILL is also the crash case) and keeps its output.
  void stop(int sig = SIGKILL) {
    if (child_.pid <= 0) return;
    ::kill(child_.pid, sig);
    log_ += child_.rest();
    child_.wait();
  }
  // Handler runs for `key` in the output so far (call after stop()).
  [[nodiscard]] long runs(const std::string& key) const {
    const std::string needle = "handled key=\"" + key + "\" ";
    long n = 0;
    for (auto at = log_.find(needle); at != std::string::npos; at = log_.find(needle, at + 1)) ++n;
    return n;
  }

 private:
  idem::test::Child child_;
  int port_ = 0;
  std::string log_;
};

struct Reply {
  int status = 0;  // 0: no answer (connection dropped)
  std::string body;
  httplib::Headers headers;
  [[nodiscard]] std::string header(const std::string& name) const {
    const auto it = headers.find(name);
    return it == headers.end() ? std::string() : it->second;
  }
};

Reply post(int port, const std::string& key_field, const std::string& body) {
  httplib::Client client("127.0.0.1", port);
  client.set_read_timeout(10, 0);
  httplib::Headers headers;
  if (!key_field.empty()) headers.emplace("Idempotency-Key", key_field);
  auto res = client.Post("/charges", headers, body, "application/json");
  if (!res) return {};
  return {res->status, res->body, res->headers};
}

std::string unique(const std::string& name) { return name + "-" + pgtest::random_hex(10); }
std::string quoted(const std::string& key) { return "\"" + key + "\""; }

std::string postgres_url() { return "postgresql://postgres@127.0.0.1:" + std::to_string(pgtest::port()) + "/postgres"; }

const std::string charge = R"({"amount":500,"currency":"eur"})";

// 400 / replay / 422 / stored 4xx / unstored 5xx / bad input / expiry, on one fast server.
void draft_cases(const std::string& store) {
  PaymentsServer server(store, 0);
  const int port = server.port();

  const Reply missing = post(port, "", charge);
  CHECK(missing.status == 400);
  CHECK(missing.header("Content-Type") == "application/problem+json");

  const std::string k = unique("created");
  const Reply created = post(port, quoted(k), charge);
  REQUIRE(created.status == 201);
  CHECK(created.header("Idempotent-Replayed").empty());
  const Reply replayed = post(port, quoted(k), charge);
  CHECK(replayed.status == 201);
  CHECK(replayed.body == created.body);
  CHECK(replayed.header("Location") == created.header("Location"));
  CHECK(replayed.header("Idempotent-Replayed") == "true");
  const auto expires = std::chrono::steady_clock::now() + 2100ms;

  const Reply other = post(port, quoted(k), R"({"amount":999,"currency":"eur"})");
  CHECK(other.status == 422);
  CHECK(other.header("Content-Type") == "application/problem+json");

  const std::string declined = unique("declined");
  CHECK(post(port, quoted(declined), R"({"amount":500,"source":"tok_declined"})").status == 402);
  const Reply declined_again = post(port, quoted(declined), R"({"amount":500,"source":"tok_declined"})");
  CHECK(declined_again.status == 402);
  CHECK(declined_again.header("Idempotent-Replayed") == "true");

  const std::string down = unique("down");
  CHECK(post(port, quoted(down), R"({"amount":500,"source":"tok_processor_down"})").status == 503);
  const Reply down_again = post(port, quoted(down), R"({"amount":500,"source":"tok_processor_down"})");
  CHECK(down_again.status == 503);
  CHECK(down_again.header("Idempotent-Replayed").empty());

  // Bad input: a clear 4xx, and the key is not taken (its first valid use runs).
  const std::string token = unique("tok");
  CHECK(post(port, "a b", charge).status == 400);     // unquoted with a space
  CHECK(post(port, "\"a\";p=1", charge).status == 400);  // parameters
  const Reply too_long = post(port, quoted(std::string(256, 'k')), charge);
  CHECK(too_long.status == 400);
  CHECK_THAT(too_long.body, Catch::Contains("longer than 255"));
  const std::string huge = unique("huge");
  const Reply big = post(port, quoted(huge), std::string(2 << 20, 'x'));
  CHECK(big.status == 413);
  CHECK(post(port, quoted(token), charge).header("Idempotent-Replayed").empty());
  CHECK(post(port, quoted(huge), charge).header("Idempotent-Replayed").empty());
  // A bare key (accept_bare_keys, the default: what most SDKs send) is the same key as its quoted form.
  const Reply bare = post(port, token, charge);
  CHECK(bare.status == 201);
  CHECK(bare.header("Idempotent-Replayed") == "true");
  const std::string uuid = "8e03978e-40d5-43e8-bc93-" + unique("u").substr(0, 12);
  CHECK(post(port, uuid, charge).status == 201);
  CHECK(post(port, uuid, charge).header("Idempotent-Replayed") == "true");

  // Expiry (retention 2 s): the key is free again and runs anew.
  std::this_thread::sleep_until(expires);
  const Reply after = post(port, quoted(k), charge);
  CHECK(after.status == 201);
  CHECK(after.header("Idempotent-Replayed").empty());
  CHECK(after.body != created.body);

  server.stop();
  CHECK(server.runs(k) == 2);
  CHECK(server.runs(declined) == 1);
  CHECK(server.runs(down) == 2);
  CHECK(server.runs(token) == 1);
  CHECK(server.runs(huge) == 1);
}

// 409 while the first runs; identical concurrent requests; a server SIGKILLed mid-request.
void slow_cases(const std::string& store) {
  auto server = std::make_unique<PaymentsServer>(store, 700);
  int port = server->port();

  // cpp-httplib's client builds function-local static regexes on first use; doing that here, before
  // any client thread starts, orders it before them for TSan (the library is not instrumented).
  CHECK(post(port, "", charge).status == 400);

  const std::string k = unique("busy");
  Reply first;
  std::thread t([&] { first = post(port, quoted(k), charge); });
  std::this_thread::sleep_for(250ms);
  const Reply busy = post(port, quoted(k), charge);
  t.join();
  CHECK(busy.status == 409);
  CHECK(busy.header("Content-Type") == "application/problem+json");
  const std::string retry_after = busy.header("Retry-After");
  // The lease left (under 2 s), spread by up to half again (idem::verdict), in whole seconds.
  CHECK((retry_after == "1" || retry_after == "2" || retry_after == "3"));
  CHECK(first.status == 201);
  CHECK(post(port, quoted(k), charge).body == first.body);

  const std::string same = unique("same");
  std::vector<Reply> replies(8);
  std::vector<std::thread> clients;
  for (auto& r : replies) clients.emplace_back([&, p = &r] { *p = post(port, quoted(same), charge); });
  for (auto& c : clients) c.join();
  std::set<std::string> bodies;
  for (const auto& r : replies) {
    CHECK((r.status == 201 || r.status == 409));
    if (r.status == 201) bodies.insert(r.body);
  }
  CHECK(bodies.size() == 1);
  const Reply settled = post(port, quoted(same), charge);
  CHECK(settled.status == 201);
  CHECK(bodies.count(settled.body) == 1);

  // SIGKILL while the handler runs: nothing answered, nothing stored; after the lease the retry
  // runs once on the new server, and then replays.
  const std::string crash = unique("crash");
  const auto sent = std::chrono::steady_clock::now();
  Reply lost;
  std::thread c([&] { lost = post(port, quoted(crash), charge); });
  std::this_thread::sleep_for(250ms);
  server->stop(SIGKILL);
  c.join();
  CHECK(lost.status == 0);
  server->stop();
  CHECK(server->runs(same) == 1);
  CHECK(server->runs(crash) == 0);
  server = std::make_unique<PaymentsServer>(store, 0);
  port = server->port();
  std::this_thread::sleep_until(sent + 2100ms);
  const Reply retried = post(port, quoted(crash), charge);
  CHECK(retried.status == 201);
  CHECK(retried.header("Idempotent-Replayed").empty());
  CHECK(post(port, quoted(crash), charge).header("Idempotent-Replayed") == "true");
  server->stop();
  CHECK(server->runs(crash) == 1);
}

}  // namespace

TEST_CASE("http redis: the draft's cases, bad input and expiry") {
  idem::test::RedisServer redis;
  draft_cases("redis://127.0.0.1:" + std::to_string(redis.port()));
}

TEST_CASE("http redis: 409 in flight, concurrent duplicates, SIGKILL mid-request") {
  idem::test::RedisServer redis;
  slow_cases("redis://127.0.0.1:" + std::to_string(redis.port()));
}

TEST_CASE("http redis: the store down answers 503 with Retry-After and takes no key") {
  idem::test::RedisServer redis;
  PaymentsServer server("redis://127.0.0.1:" + std::to_string(redis.port()), 0);
  const std::string k = unique("outage");
  redis.stop(SIGKILL);
  const Reply down = post(server.port(), quoted(k), charge);
  CHECK(down.status == 503);
  CHECK(down.header("Retry-After") == "1");
  CHECK(down.header("Content-Type") == "application/problem+json");
  redis.start();
  const Reply back = post(server.port(), quoted(k), charge);
  CHECK(back.status == 201);
  CHECK(back.header("Idempotent-Replayed").empty());
  server.stop();
  CHECK(server.runs(k) == 1);
}

TEST_CASE("http postgres: the draft's cases, bad input and expiry") { draft_cases(postgres_url()); }

TEST_CASE("http postgres: 409 in flight, concurrent duplicates, SIGKILL mid-request") { slow_cases(postgres_url()); }
