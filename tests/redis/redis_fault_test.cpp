// Faults fail closed with typed errors: the handler never runs and no record changes blindly.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "idem/idem.hpp"
#include "idem/redis.hpp"
#include "redis_factory.hpp"

using namespace std::chrono_literals;
using idem::RedisOptions;
using idem::RedisStore;
using idem::test::RedisServer;

namespace {

using Clock = std::chrono::steady_clock;

constexpr auto params = &idem::test::acquire_params;

// Runs the guard and checks that the handler did not run and the error had type E.
template <class E, class Store>
E guard_throws(Store& store, const std::string& key) {
  idem::IdempotencyGuard guard(store, {.lease = 10s, .retention = 60s});
  bool ran = false;
  try {
    guard.run(key, [&] { ran = true; });
  } catch (const E& e) {
    CHECK_FALSE(ran);
    return e;
  }
  FAIL("guard.run did not throw the expected error type");
  throw std::logic_error("unreachable");
}

struct Warnings : idem::Observer {
  std::vector<std::string> seen;
  void on_warning(std::string_view m) noexcept override { seen.emplace_back(m); }
};

}  // namespace

TEST_CASE("redis down at start: connection_error, retryable, within the connect timeout", "[redis][fault]") {
  RedisOptions o;
  o.port = idem::test::free_port();  // nothing listens there
  o.connect_timeout = 300ms;
  const auto t0 = Clock::now();
  try {
    RedisStore store(o);
    FAIL("connected to a closed port");
  } catch (const idem::connection_error& e) {
    CHECK(e.retryable());
    CHECK(std::string(e.what()).find(std::to_string(o.port)) != std::string::npos);
  }
  CHECK(Clock::now() - t0 < 2s);
}

TEST_CASE("redis unreachable address: connection_error within the connect timeout", "[redis][fault]") {
  RedisOptions o;
  o.host = "10.255.255.1";  // unroutable: SYNs vanish (or the network is refused at once)
  o.connect_timeout = 300ms;
  const auto t0 = Clock::now();
  CHECK_THROWS_AS(RedisStore(o), idem::connection_error);
  CHECK(Clock::now() - t0 < 2s);
}

TEST_CASE("redis that accepts but never answers: timeout_error within the command timeout", "[redis][fault]") {
  // A listening socket nobody accepts from: TCP connects (kernel backlog) but no reply ever comes.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(fd, 16) == 0);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  RedisOptions o;
  o.port = ntohs(a.sin_port);
  o.command_timeout = 300ms;
  const auto t0 = Clock::now();
  CHECK_THROWS_AS(RedisStore(o), idem::timeout_error);
  const auto took = Clock::now() - t0;
  CHECK(took >= 250ms);
  CHECK(took < 3s);
  ::close(fd);
}

TEST_CASE("redis paused mid-call: the same holder's retry times out too, outcome unknown, then the store recovers",
          "[redis][fault]") {
  RedisServer server;
  RedisOptions o = server.options();
  o.command_timeout = 300ms;
  RedisStore store(o);
  const std::string k = "pause-" + idem::test::random_hex();
  server.command({"CLIENT", "PAUSE", "1500", "ALL"});
  // The acquire was sent and may run once the pause ends: its outcome is unknown, not a timeout.
  auto e = guard_throws<idem::outcome_unknown_error>(store, k);
  // Through the guard an acquire in doubt is retryable: the handler did not run, and the key frees
  // itself after the lease if the acquire did happen.
  CHECK(e.retryable());
  CHECK(std::string(e.what()).find("command_timeout") != std::string::npos);
  CHECK(std::string(e.what()).find("the handler did not run") != std::string::npos);
  std::this_thread::sleep_for(1600ms);
  // A read is never resent: a plain timeout, retryable.
  server.command({"CLIENT", "PAUSE", "500", "ALL"});
  CHECK_THROWS_AS(store.inspect(k), idem::timeout_error);
  std::this_thread::sleep_for(600ms);
  idem::IdempotencyGuard guard(store);
  CHECK(guard.run(k + "-after", [] { return 1; }).status == idem::Status::executed);
}

TEST_CASE("redis killed mid-run then restarted: fail closed, then the pool reconnects", "[redis][fault]") {
  RedisServer server;
  RedisOptions o = server.options();
  o.pool.size = 4;
  o.connect_timeout = 300ms;
  RedisStore store(o);
  idem::IdempotencyGuard guard(store, {.lease = 10s, .retention = 60s});
  const std::string ns = "kill-" + idem::test::random_hex() + ":";
  REQUIRE(guard.run(ns + "before", [] { return 1; }).status == idem::Status::executed);

  server.stop(SIGKILL);
  auto e = guard_throws<idem::connection_error>(store, ns + "down");
  CHECK(e.retryable());
  // A handler that was running when the server died cannot record its result: it is reported.
  CHECK_THROWS_AS(guard.run(ns + "down2", [] { return 2; }), idem::store_error);

  server.start();  // same port, empty data (no persistence), no scripts loaded
  int runs = 0;
  auto after = guard.run(ns + "after", [&] {
    ++runs;
    return 3;
  });
  CHECK(after.status == idem::Status::executed);
  CHECK(runs == 1);
  // Every pooled connection was to the dead server; each is replaced without a failed call.
  for (int i = 0; i < 8; ++i)
    CHECK(guard.run(ns + "again-" + std::to_string(i), [] { return 4; }).status == idem::Status::executed);
}

TEST_CASE("redis OOM under maxmemory noeviction: capacity_error", "[redis][fault]") {
  RedisServer server;
  RedisStore store(server.options());
  const std::string k = "oom-" + idem::test::random_hex();
  auto held = store.acquire(k + "-held", params(1));
  REQUIRE(server.command({"CONFIG", "SET", "maxmemory", "1"}) == "OK");
  auto e = guard_throws<idem::capacity_error>(store, k);
  CHECK(e.code() == "OOM");
  CHECK(e.retryable());
  CHECK_THROWS_AS(store.complete(k + "-held", held.holder, "x", 60s), idem::capacity_error);
  REQUIRE(server.command({"CONFIG", "SET", "maxmemory", "0"}) == "OK");
  CHECK_FALSE(store.inspect(k).has_value());  // nothing was written
  CHECK(store.complete(k + "-held", held.holder, "x", 60s) == idem::WriteStatus::ok);
}

TEST_CASE("redis read-only replica: READONLY store_error", "[redis][fault]") {
  RedisServer server;
  RedisStore store(server.options());
  const std::string k = "ro-" + idem::test::random_hex();
  REQUIRE(server.command({"REPLICAOF", "127.0.0.1", std::to_string(idem::test::free_port())}) == "OK");
  auto e = guard_throws<idem::store_error>(store, k);
  CHECK(e.code() == "READONLY");
  CHECK(e.retryable());
  REQUIRE(server.command({"REPLICAOF", "NO", "ONE"}) == "OK");
  CHECK_FALSE(store.inspect(k).has_value());
}

TEST_CASE("redis NOAUTH and WRONGPASS: store_error, not retryable", "[redis][fault]") {
  RedisServer server({"requirepass right-pw"});
  RedisOptions o = server.options();
  try {
    RedisStore s(o);
    FAIL("connected without a password");
  } catch (const idem::store_error& e) {
    CHECK(e.code() == "NOAUTH");
    CHECK_FALSE(e.retryable());
  }
  o.password = "wrong-pw";
  try {
    RedisStore s(o);
    FAIL("connected with a wrong password");
  } catch (const idem::store_error& e) {
    CHECK(e.code() == "WRONGPASS");
    CHECK_FALSE(e.retryable());
    CHECK(std::string(e.what()).find("wrong-pw") == std::string::npos);
  }
  o.password = "right-pw";
  RedisStore s(o);
  CHECK(s.acquire("auth-ok", params(1)).status == idem::AcquireStatus::acquired);
}

TEST_CASE("redis foreign value on the key: WRONGTYPE store_error", "[redis][fault]") {
  RedisServer server;
  RedisStore store(server.options());
  const std::string k = "foreign-" + idem::test::random_hex();
  server.command({"HSET", store.redis_key(k), "f", "v"});
  auto e = guard_throws<idem::store_error>(store, k);
  CHECK(e.code() == "WRONGTYPE");
  CHECK_FALSE(e.retryable());
  CHECK_THROWS_AS(store.inspect(k), idem::store_error);
  CHECK(server.command({"TYPE", store.redis_key(k)}) == "hash");
}

TEST_CASE("redis garbage record: corrupt_record_error, never a duplicate", "[redis][fault]") {
  RedisServer server;
  RedisStore store(server.options());
  const std::string ns = "garbage-" + idem::test::random_hex() + ":";
  const std::vector<std::string> garbage{"completed", std::string(10, '\0'), std::string("\x82\x01", 2),
                                         std::string("\x82\x01\x00\x00\x00\x00\x00\x00\x00\x01\x99", 11),
                                         std::string("\xb2\x01\x00\x00\x00\x00\x00\x00\x00\x01\x00\x00\x00\x09x", 15)};
  int i = 0;
  for (const auto& g : garbage) {
    const std::string k = ns + std::to_string(i++);
    INFO("garbage #" << i);
    server.command({"SET", store.redis_key(k), g});
    guard_throws<idem::corrupt_record_error>(store, k);
    CHECK_THROWS_AS(store.inspect(k), idem::corrupt_record_error);
    CHECK_THROWS_AS(store.complete(k, idem::Holder{1, 1}, "x", 60s), idem::corrupt_record_error);
    CHECK(server.command({"GET", store.redis_key(k)}) == g);  // left as found
  }
  // In a batch (one many.lua call): the damaged key's error is thrown once every answer is in, and
  // the keys after it in the same call were still decided (they lapse after their lease).
  const std::string bad = ns + "0", before = ns + "batch-before", after = ns + "batch-after";
  const std::vector<std::string_view> keys{before, bad, after};
  idem::AcquireParams p{.lease = 30s, .retention = 60s, .token = 77};
  CHECK_THROWS_AS(store.acquire_batch(keys, p), idem::corrupt_record_error);
  CHECK(store.inspect(before)->state == idem::State::in_progress);
  CHECK(store.inspect(after)->state == idem::State::in_progress);
  const std::vector<idem::CompleteItem> items{{before, idem::Holder{1, 77}, "b"}, {bad, idem::Holder{1, 77}, "x"},
                                              {after, idem::Holder{1, 77}, "a"}};
  CHECK_THROWS_AS(store.complete_batch(items, 60s), idem::corrupt_record_error);
  CHECK(store.inspect(after)->state == idem::State::completed);
  CHECK(server.command({"GET", store.redis_key(bad)}) == garbage[0]);
}

// maxmemory 0 (the default): nothing is evicted yet, so the store is built, with a warning.
TEST_CASE("redis eviction policy that can drop keys is reported to the observer", "[redis][fault]") {
  RedisServer server;
  auto obs = std::make_shared<Warnings>();
  RedisOptions o = server.options();
  o.observer = obs;
  { RedisStore quiet(o); }
  CHECK(obs->seen.empty());
  REQUIRE(server.command({"CONFIG", "SET", "maxmemory-policy", "volatile-lru"}) == "OK");
  RedisStore store(o);
  REQUIRE(obs->seen.size() == 1);
  CHECK(obs->seen[0].find("volatile-lru") != std::string::npos);
  CHECK(store.eviction_policy() == "volatile-lru");
}

TEST_CASE("redis that can evict idem's records is refused at construction, observer or not", "[redis][fault]") {
  RedisServer server;
  REQUIRE(server.command({"CONFIG", "SET", "maxmemory", "100mb"}) == "OK");
  RedisOptions o = server.options();
  { RedisStore ok(o); }  // noeviction at a maxmemory: accepted (writes fail with OOM at the limit)
  for (const char* policy : {"volatile-lru", "allkeys-lru", "volatile-ttl"}) {
    INFO(policy);
    REQUIRE(server.command({"CONFIG", "SET", "maxmemory-policy", policy}) == "OK");
    try {
      RedisStore store(o);
      FAIL("a server that can evict idempotency records was accepted");
    } catch (const idem::store_error& e) {
      CHECK(e.code() == "EVICTION");
      CHECK_FALSE(e.retryable());
      const std::string what = e.what();
      CHECK(what.find(policy) != std::string::npos);
      CHECK(what.find("noeviction") != std::string::npos);
      CHECK(what.find("unsafe_allow_eviction") != std::string::npos);
    }
  }
  // The loud opt-out: accepted, with a warning.
  auto obs = std::make_shared<Warnings>();
  o.unsafe_allow_eviction = true;
  o.observer = obs;
  RedisStore store(o);
  REQUIRE(obs->seen.size() == 1);
  CHECK(obs->seen[0].find("unsafe_allow_eviction") != std::string::npos);
}

TEST_CASE("redis: a guard's observer hears the store's warnings without being set in RedisOptions", "[redis][fault]") {
  RedisServer server;
  REQUIRE(server.command({"CONFIG", "SET", "maxmemory", "100mb"}) == "OK");
  REQUIRE(server.command({"CONFIG", "SET", "maxmemory-policy", "allkeys-lru"}) == "OK");
  RedisOptions o = server.options();
  o.unsafe_allow_eviction = true;
  RedisStore store(o);  // warns at construction, before any guard exists
  auto obs = std::make_shared<Warnings>();
  idem::IdempotencyGuard guard(store, {.observer = obs});
  REQUIRE(obs->seen.size() == 1);
  CHECK(obs->seen[0].find("unsafe_allow_eviction") != std::string::npos);
  CHECK(guard.run("k", [] { return 1; }).status == idem::Status::executed);
}

TEST_CASE("redis ACL user without CONFIG: the policy check warns instead of failing", "[redis][fault][acl]") {
  RedisServer server(idem::test::acl_config());
  auto obs = std::make_shared<Warnings>();
  RedisOptions o;
  o.url = "redis://idem-app:app%20secret%21@127.0.0.1:" + std::to_string(server.port());
  o.observer = obs;
  RedisStore store(o);
  REQUIRE(obs->seen.size() == 1);
  CHECK(obs->seen[0].find("cannot read") != std::string::npos);
  CHECK(store.eviction_policy().empty());
  // Keys outside the ACL's key pattern are refused with NOPERM.
  RedisOptions other = o;
  other.key_prefix = "elsewhere:";
  other.observer = nullptr;
  RedisStore outside(other);
  try {
    outside.acquire("k", params(1));
    FAIL("wrote outside the ACL key pattern");
  } catch (const idem::store_error& e) {
    CHECK(e.code() == "NOPERM");
    CHECK_FALSE(e.retryable());
  }
}

// `n` threads each make `call(i)` while the server is paused (CLIENT PAUSE 800 ms): how many
// were answered once it resumed.
template <class Call>
int calls_through_a_pause(RedisServer& server, int n, Call call) {
  server.command({"CLIENT", "PAUSE", "800", "ALL"});
  std::atomic<int> answered{0};
  std::vector<std::thread> calls;
  for (int i = 0; i < n; ++i)
    calls.emplace_back([&, i] {
      try {
        call(i, "slow-" + std::to_string(i) + "-" + idem::test::random_hex());
        ++answered;
      } catch (...) {
      }
    });
  for (auto& t : calls) t.join();
  return answered.load();
}

TEST_CASE("redis store calls behind a slow one share its connection, no pool to wait for", "[redis][fault]") {
  RedisServer server;
  RedisOptions o = server.options();
  o.pool.size = 1;      // one lane
  o.pool.wait = 100ms;  // the pool's: RedisStore's calls do not take pooled connections
  o.command_timeout = 3s;
  RedisStore store(o);
  CHECK(calls_through_a_pause(server, 4, [&](int, const std::string& k) { (void)store.inspect(k); }) == 4);
  CHECK(store.stats().connects == 1);
}

TEST_CASE("redis store: overlapping blocked callers each get a lane up to pool.size, the rest share the first",
          "[redis][fault]") {
  RedisServer server;
  RedisOptions o = server.options();
  o.pool.size = 3;
  o.command_timeout = 3s;
  RedisStore store(o);
  CHECK(calls_through_a_pause(server, 6, [&](int, const std::string& k) { (void)store.inspect(k); }) == 6);
  CHECK(store.stats().connects == 3);  // three lanes opened, never more than pool.size
  CHECK(store.stats().requests == 6);
}

TEST_CASE("redis sequence store calls behind a slow one share the store's connection, no pool to wait for",
          "[redis][fault]") {
  RedisServer server;
  RedisOptions o = server.options();
  o.pool.size = 1;
  o.pool.wait = 100ms;
  o.command_timeout = 3s;
  RedisStore store(o);
  idem::RedisSequenceStore seqs(store);
  CHECK(calls_through_a_pause(server, 4, [&](int i, const std::string& entity) {
          if (i % 2)
            (void)seqs.advance(entity, 7);
          else
            (void)seqs.last_applied(entity);
        }) == 4);
  CHECK(store.stats().connects == 1);  // one connection for the store and its sequence store
}
