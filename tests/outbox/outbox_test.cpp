// The transactional outbox against real servers: the writer (ctx.outbox().send) in PostgreSQL
// transactional mode, OutboxRelay, and the Redis Streams publisher.

#include <atomic>
#include <cstdio>
#include <latch>
#include <set>
#include <thread>

#include "outbox_support.hpp"

using namespace outboxtest;

namespace {

// ctx.outbox() exists where the transaction has an outbox, directly or through postgres() (a store
// wrapping a PostgresStore transaction, as the tiered store does), and nowhere else.
struct WrapsPostgres {
  idem::PostgresStore::Transaction& postgres();
};
template <class C>
concept HasOutbox = requires(const C& c) { c.outbox().send("d", "k", "p"); };
static_assert(HasOutbox<idem::BasicContext<idem::PostgresStore::Transaction>>);
static_assert(HasOutbox<idem::BasicContext<WrapsPostgres>>);
static_assert(!HasOutbox<idem::BasicContext<int>>);
static_assert(!HasOutbox<idem::Context>);

long count(pgtest::Raw& raw, const std::string& sql) { return std::stol(raw.scalar(sql)); }

// Commits a handler of `key` that sends one message per payload, to `dest`, keyed `mkey`.
std::vector<std::string> commit(Env& env, const std::string& key, const std::string& dest, const std::string& mkey,
                                const std::vector<std::string>& payloads) {
  std::vector<std::string> ids;
  auto out = env.guard.run(key, [&](const auto& ctx) {
    ids.clear();
    for (const auto& p : payloads) ids.push_back(ctx.outbox().send(dest, mkey, p, {{"type", "test"}}));
  });
  REQUIRE(out.status == idem::Status::executed);
  return ids;
}

}  // namespace

TEST_CASE("outbox: a rolled-back handler leaves no message, its re-run writes the same ids", "[outbox]") {
  Env env;
  pgtest::Raw raw;
  std::vector<std::string> first, second;
  REQUIRE_THROWS_AS(env.guard.run("order-1",
                                  [&](const auto& ctx) {
                                    first.push_back(ctx.outbox().send("s", "k", "a"));
                                    first.push_back(ctx.outbox().send("s", "k", "b"));
                                    throw std::runtime_error("card declined after the send");
                                  }),
                    std::runtime_error);
  CHECK(count(raw, "SELECT count(*) FROM " + env.outbox()) == 0);

  idem::test::RedisServer redis;
  idem::RedisStreamsPublisher pub{{.redis = redis.options()}};
  idem::OutboxRelay relay{pub, env.relay_options()};
  CHECK(relay.run_once() == 0);
  CHECK(read_stream(redis.port(), "s").empty());

  auto out = env.guard.run("order-1", [&](const auto& ctx) {
    second.push_back(ctx.outbox().send("s", "k", "a"));
    second.push_back(ctx.outbox().send("s", "k", "b"));
    CHECK(ctx.tx->outbox().sent() == 2);
  });
  REQUIRE(out.status == idem::Status::executed);
  CHECK(first == second);
  CHECK(second[0] == idem::outbox_message_id(env.scope(), "order-1", 0));
  CHECK(second[1] == idem::outbox_message_id(env.scope(), "order-1", 1));
  CHECK(count(raw, "SELECT count(*) FROM " + env.outbox()) == 2);
  // A duplicate does not run the handler: nothing more is written.
  CHECK(env.guard.run("order-1", [&](const auto& ctx) { ctx.outbox().send("s", "k", "c"); }).status ==
        idem::Status::duplicate);
  CHECK(count(raw, "SELECT count(*) FROM " + env.outbox()) == 2);
}

TEST_CASE("outbox: ids are printable and distinct for any key bytes, and scoped by table", "[outbox]") {
  const std::string nul_key("a\0b", 3);
  const std::string a = idem::outbox_message_id("s.t", nul_key, 0);
  CHECK(a.size() == 34);
  CHECK(a != idem::outbox_message_id("s.t", std::string("a\0c", 3), 0));
  CHECK(a != idem::outbox_message_id("s.u", nul_key, 0));
  CHECK(a != idem::outbox_message_id("s.t", nul_key, 1));
  for (char ch : a) CHECK(((ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f') || ch == '-'));
}

TEST_CASE("outbox: misuse fails closed", "[outbox]") {
  auto cfg = pgtest::options(idem::PostgresMode::transactional);
  cfg.store.table = "nob" + pgtest::random_hex(8);
  idem::PostgresStore plain = pgtest::store(cfg);  // no outbox option
  idem::IdempotencyGuard<idem::PostgresStore> g{plain, {.failure = {.mode = idem::FailureMode::release}}};
  CHECK_THROWS_AS(g.run("k", [&](const auto& ctx) { ctx.outbox().send("s", "k", "p"); }), idem::usage_error);

  auto lease_cfg = pgtest::options(idem::PostgresMode::lease);
  lease_cfg.store.outbox = true;
  idem::PostgresStore lease = pgtest::store(lease_cfg);
  idem::IdempotencyGuard<idem::PostgresStore> lg{lease, {.failure = {.mode = idem::FailureMode::release}}};
  CHECK_THROWS_AS(lg.run(pgtest::key("lease"), [&](const auto& ctx) { ctx.outbox().send("s", "k", "p"); }),
                  idem::usage_error);

  idem::OutboxRelayOptions bad;
  bad.table = "Bad-Name";
  idem::test::RedisServer redis;
  idem::RedisStreamsPublisher pub{{.redis = redis.options()}};
  CHECK_THROWS_AS(idem::OutboxRelay(pub, bad), idem::invalid_options_error);
  idem::OutboxRelayOptions zero;
  zero.batch = 0;
  CHECK_THROWS_AS(idem::OutboxRelay(pub, zero), idem::invalid_options_error);
}

TEST_CASE("outbox: the relay publishes binary messages with their id, key and headers, then purges", "[outbox]") {
  Env env;
  pgtest::Raw raw;
  idem::test::RedisServer redis;
  const std::string key("acct\0\xff", 6), payload("{\"x\":1}\0tail", 12);
  const auto ids = commit(env, "evt-1", "balances", key, {payload, "second"});
  auto opt = env.relay_options();
  opt.retention = 1ms;
  idem::OutboxRelay relay{std::make_unique<idem::RedisStreamsPublisher>(
                              idem::RedisStreamsPublisherOptions{.redis = redis.options(), .stream_prefix = "app:"}),
                          opt};
  std::vector<idem::OutboxRelayEvent> events;
  relay.set_observer([&](const idem::OutboxRelayEvent& e) { events.push_back(e); });
  CHECK(relay.run_once() == 2);
  const auto got = read_stream(redis.port(), "app:balances");
  REQUIRE(got.size() == 2);
  CHECK(got[0].id == ids[0]);
  CHECK(got[0].key == key);
  CHECK(got[0].payload == payload);
  CHECK(got[0].fields.at("h:type") == "test");
  CHECK(got[1].payload == "second");
  CHECK(relay.run_once() == 0);
  CHECK(count(raw, "SELECT count(*) FROM " + env.outbox() + " WHERE sent_at IS NULL") == 0);
  std::this_thread::sleep_for(5ms);
  CHECK(relay.purge() == 2);
  CHECK(count(raw, "SELECT count(*) FROM " + env.outbox()) == 0);
  CHECK(relay.stats().published == 2);
  REQUIRE(!events.empty());
  CHECK(events[0].kind == idem::OutboxRelayEvent::Kind::published);
}

TEST_CASE("outbox: broker down -> rows wait with backoff, nothing lost", "[outbox]") {
  Env env;
  pgtest::Raw raw;
  idem::test::RedisServer redis;
  std::vector<std::string> ids;
  for (int i = 0; i < 5; ++i) {
    auto v = commit(env, "down-" + std::to_string(i), "s", "k" + std::to_string(i % 2), {"p" + std::to_string(i)});
    ids.push_back(v[0]);
  }
  redis.stop();
  idem::RedisStreamsPublisher pub{{.redis = redis.options()}};
  idem::OutboxRelay relay{pub, env.relay_options()};
  CHECK(relay.run_once() == 0);
  CHECK(relay.stats().publish_failures == 1);
  CHECK(count(raw, "SELECT count(*) FROM " + env.outbox() + " WHERE sent_at IS NULL AND attempts = 1 AND "
                   "last_error LIKE '%redis-streams%'") == 5);
  // In backoff: not claimed again at once.
  CHECK(relay.run_once() == 0);
  CHECK(relay.stats().publish_failures == 1);
  redis.start();
  std::size_t sent = 0;
  for (int i = 0; i < 100 && sent < 5; ++i) {
    sent += relay.run_once();
    std::this_thread::sleep_for(10ms);
  }
  CHECK(sent == 5);
  std::set<std::string> got;
  for (const auto& e : read_stream(redis.port(), "s")) got.insert(e.id);
  CHECK(got == std::set<std::string>(ids.begin(), ids.end()));
}

TEST_CASE("outbox: two relays at once send every row once, in order per key", "[outbox]") {
  Env env;
  idem::test::RedisServer redis;
  constexpr int keys = 8, per_key = 40;
  // Written key by key in turn, so each key's rows are in outbox order 0..per_key-1.
  for (int n = 0; n < per_key; ++n)
    for (int k = 0; k < keys; ++k)
      commit(env, "m-" + std::to_string(k) + "-" + std::to_string(n), "orders", "key" + std::to_string(k),
             {std::to_string(n)});
  auto opt = env.relay_options();
  opt.batch = 7;  // small batches: the relays interleave, and hold rows back behind each other
  idem::RedisStreamsPublisher pub1{{.redis = redis.options()}}, pub2{{.redis = redis.options()}};
  idem::OutboxRelay r1{pub1, opt}, r2{pub2, opt};
  pgtest::Raw raw;
  // Both connected before either starts, and started together: on a loaded machine a relay still
  // connecting could otherwise find the other one done (the CI saw r2 publish nothing).
  r1.migrate();
  r2.migrate();
  std::latch start(2);
  auto drain = [&](idem::OutboxRelay& r) {
    start.arrive_and_wait();
    for (int i = 0; i < 2000; ++i) {
      if (r.run_once() == 0 && count(raw, "SELECT count(*) FROM " + env.outbox() + " WHERE sent_at IS NULL") == 0)
        return;
    }
  };
  std::thread a([&] {
    pgtest::Raw mine;
    start.arrive_and_wait();
    for (int i = 0; i < 2000; ++i)
      if (r1.run_once() == 0 && std::stol(mine.scalar("SELECT count(*) FROM " + env.outbox() +
                                                      " WHERE sent_at IS NULL")) == 0)
        return;
  });
  drain(r2);
  a.join();
  const auto entries = read_stream(redis.port(), "orders");
  CHECK(entries.size() == static_cast<std::size_t>(keys * per_key));
  std::map<std::string, int> last;
  std::set<std::string> ids;
  for (const auto& e : entries) {
    ids.insert(e.id);
    const int n = std::stoi(e.payload);
    auto it = last.find(e.key);
    if (it != last.end()) CHECK(n == it->second + 1);  // per key: strictly in order, no gap, no repeat
    else CHECK(n == 0);
    last[e.key] = n;
  }
  CHECK(ids.size() == entries.size());
  CHECK(r1.stats().published + r2.stats().published == static_cast<std::uint64_t>(keys * per_key));
  CHECK(r1.stats().published > 0);
  CHECK(r2.stats().published > 0);
}

TEST_CASE("outbox: a relay killed between publish and mark-sent -> sent again, applied once downstream",
          "[outbox]") {
  Env env;
  idem::test::RedisServer redis;
  const auto ids = commit(env, "pay-1", "balances", "acct-1", {"+100", "-20"});
  // The worker's relay publishes both rows (one batch) and is SIGKILLed before it marks them sent.
  REQUIRE(relay_killed_after_publish("redis", env, std::to_string(redis.port())) == 2);
  pgtest::Raw raw;
  CHECK(count(raw, "SELECT count(*) FROM " + env.outbox() + " WHERE sent_at IS NULL") == 2);
  REQUIRE(read_stream(redis.port(), "balances").size() == 2);

  idem::RedisStreamsPublisher pub{{.redis = redis.options()}};
  idem::OutboxRelay relay{pub, env.relay_options()};
  CHECK(relay.run_once() == 2);
  const auto entries = read_stream(redis.port(), "balances");
  REQUIRE(entries.size() == 4);
  CHECK(entries[0].id == entries[2].id);
  CHECK(entries[1].id == entries[3].id);
  CHECK(entries[0].id == ids[0]);

  Downstream down(redis);
  down.consume(entries);
  CHECK(down.applied.size() == 2);
  for (const auto& [id, n] : down.applied) CHECK(n == 1);
  CHECK(down.duplicates == 2);
}

TEST_CASE("outbox: the running relay is woken by NOTIFY, not by its poll", "[outbox]") {
  Env env;
  idem::test::RedisServer redis;
  auto opt = env.relay_options();
  opt.poll_interval = std::chrono::minutes(5);
  idem::RedisStreamsPublisher pub{{.redis = redis.options()}};
  idem::OutboxRelay relay{pub, opt};
  relay.migrate();
  relay.start();
  std::this_thread::sleep_for(300ms);  // the loop's first empty claim, then it waits
  const auto t0 = std::chrono::steady_clock::now();
  commit(env, "wake-1", "w", "k", {"hello"});
  bool seen = false;
  while (!seen && std::chrono::steady_clock::now() - t0 < 10s) {
    seen = read_stream(redis.port(), "w").size() == 1;
    if (!seen) std::this_thread::sleep_for(5ms);
  }
  const auto took = std::chrono::steady_clock::now() - t0;
  relay.stop();
  CHECK(seen);
  CHECK(took < 5s);
  CHECK(relay.stats().notifications >= 1);
  relay.stop();  // idempotent
}

TEST_CASE("outbox: the idem-outbox-relay program publishes what is due with --once", "[outbox]") {
  Env env;
  idem::test::RedisServer redis;
  const auto ids = commit(env, "prog-1", "prog", "k", {"one", "two"});
  auto child = idem::test::Child::start(
      IDEM_OUTBOX_RELAY_PROGRAM, {"--conninfo", pgtest::conninfo(), "--schema", "idem_test", "--table", env.table,
                                  "--redis", "redis://127.0.0.1:" + std::to_string(redis.port()), "--once"});
  CHECK(child.wait() == 0);
  const auto entries = read_stream(redis.port(), "prog");
  REQUIRE(entries.size() == 2);
  CHECK(entries[0].id == ids[0]);
  CHECK(entries[1].id == ids[1]);
}
