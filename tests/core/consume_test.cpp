// idem::consume and the Source concept over a source of our own (examples/dir_source.hpp, the
// template for a broker idem does not ship): each key's effect once, duplicates acked, a failing
// handler requeued with its verdict's delay and run again, a poison message dead-lettered with its
// reason, a lost settle (the broker gone) redelivered as duplicates, and the default key.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>

#include "dir_source.hpp"
#include "idem/idem.hpp"

using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

struct Spool {
  fs::path root = fs::temp_directory_path() / ("idem-consume-" + std::to_string(::getpid()) + "-" +
                                               std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
  ~Spool() { fs::remove_all(root); }
  void put(const std::string& name, const std::string& key, const std::string& payload) const {
    fs::create_directories(root / "inbox");
    std::ofstream(root / "inbox" / name, std::ios::binary) << key << '\n' << payload;
  }
  [[nodiscard]] std::size_t count(const char* dir) const {
    std::size_t n = 0;
    for (const auto& e : fs::directory_iterator(root / dir)) n += e.path().extension() != ".reason";
    return n;
  }
};

// A source whose broker connection drops once, at the first settle.
struct DropsOnce : example::DirSource {
  using example::DirSource::DirSource;
  bool dropped = false;
  void settle(std::span<const idem::Verdict> v) {
    if (!dropped) {
      dropped = true;
      throw idem::connection_error("idem: the broker connection was lost while settling", "", true);
    }
    example::DirSource::settle(v);
  }
};

}  // namespace

TEST_CASE("consume: the default key is the outbox id header, else the message own key, and key_of wins", "[consume]") {
  idem::Delivery d;
  d.key = "amqp-message-id";
  CHECK(idem::key_of(d) == "amqp-message-id");
  d.headers = {{"idem-outbox-id", "old"}, {"other", "x"}, {"idem-outbox-id", "42"}};
  CHECK(idem::key_of(d) == "42");  // the last value of the header
  idem::ConsumeOptions o;
  o.key_of = [](const idem::Delivery& m) { return "custom:" + std::string(m.key); };
  CHECK(idem::key_of(d, o) == "custom:amqp-message-id");
  CHECK_FALSE(d.header("missing").has_value());
}

TEST_CASE("consume: every key once over a source of our own, failures requeued, poison dead-lettered", "[consume]") {
  Spool spool;
  spool.put("01", "pay-a", "10");
  spool.put("02", "pay-b", "20");
  spool.put("03", "pay-a", "10");  // the broker delivered pay-a twice
  spool.put("04", "flaky", "30");
  spool.put("05", "poison", "0");
  spool.put("06", "", "no key");  // no key: no redelivery can fix it
  example::DirSource source(spool.root, 4);
  idem::MemoryStore store;
  idem::IdempotencyGuard guard{store, {.lease = 10s, .retention = 1h, .failure = {.mode = idem::FailureMode::release}}};
  std::map<std::string, int> applied;
  int flaky_calls = 0;
  auto handler = [&](const idem::Delivery& m) {
    const std::string key(m.key);
    if (key == "flaky" && ++flaky_calls == 1) throw std::runtime_error("downstream timed out");
    if (key == "poison") throw std::runtime_error("cannot parse amount");
    return ++applied[key];
  };
  idem::ConsumeOptions options{.retry = {.base = 1ms, .cap = 5ms, .jitter = false, .max_attempts = 3}};
  std::size_t acked = 0, dead = 0, rounds = 0;
  while ((spool.count("inbox") || spool.count("delayed")) && rounds++ < 200) {
    const auto r = idem::consume_batch(source, guard, handler, options);
    acked += r.acked;
    dead += r.dead_lettered;
    if (r.polled == 0) std::this_thread::sleep_for(2ms);
  }
  CHECK(applied == std::map<std::string, int>{{"pay-a", 1}, {"pay-b", 1}, {"flaky", 1}});
  CHECK(flaky_calls == 2);
  CHECK(acked == 4);  // pay-a twice (executed, duplicate), pay-b, flaky on its second delivery
  CHECK(dead == 2);   // poison at its third delivery, and the message without a key at once
  CHECK(spool.count("dead") == 2);
  std::ifstream reason(spool.root / "dead" / "05.reason");
  std::string text;
  std::getline(reason, text);
  CHECK_THAT(text, Catch::Contains("cannot parse amount"));
}

TEST_CASE("consume: a settle lost with the broker is redelivered, and the guard answers duplicate", "[consume]") {
  Spool spool;
  for (int i = 0; i < 5; ++i) spool.put("m" + std::to_string(i), "order-" + std::to_string(i), "x");
  DropsOnce source(spool.root);
  idem::MemoryStore store;
  idem::IdempotencyGuard guard{store, {.lease = 10s, .retention = 1h}};
  std::atomic<int> effects{0};
  auto handler = [&](const idem::Delivery&, const idem::Context& ctx) {
    CHECK(ctx.fence > 0);
    return ++effects;
  };
  CHECK_THROWS_AS(idem::consume_batch(source, guard, handler), idem::connection_error);
  CHECK(effects == 5);
  CHECK(spool.count("inbox") == 5);  // released, not lost
  const auto again = idem::consume_batch(source, guard, handler);
  CHECK(again.polled == 5);
  CHECK(again.executed == 0);
  CHECK(again.acked == 5);
  CHECK(effects == 5);
  CHECK(spool.count("inbox") == 0);

  // The loop: runs until stopped, through the same retryable error.
  for (int i = 0; i < 3; ++i) spool.put("n" + std::to_string(i), "refund-" + std::to_string(i), "y");
  source.dropped = false;
  std::stop_source stop;
  std::thread loop([&] { idem::consume(source, guard, stop.get_token(), handler); });
  for (int i = 0; i < 500 && spool.count("inbox") > 0; ++i) std::this_thread::sleep_for(5ms);
  stop.request_stop();
  loop.join();
  CHECK(spool.count("inbox") == 0);
  CHECK(effects == 8);
  CHECK_THROWS_AS(idem::consume(source, guard, stop.get_token(), handler, {.retry = {.base = 2s, .cap = 1s}}),
                  idem::invalid_options_error);
}
