// Failover, deterministically: what a claim is worth once the master it was made on is gone.
// ProxiedPair (redis_topology.hpp) lets the test decide which writes the replica has — replication
// is held at the proxy, the master SIGKILLed and the replica promoted by hand — so each case shows
// one documented behaviour rather than whatever a race produced: with min_replica_acks 0 a claim
// can vanish in a failover (a second holder while the first one's lease runs, and a fence that
// does not grow), with min_replica_acks 1 an unacknowledged claim never runs a handler and an
// acknowledged one survives with its fence. SentinelTopology then checks that a store built from a
// redis-sentinel:// URL finds the new master by itself, with typed, retryable errors meanwhile.
#include <catch2/catch.hpp>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <typeinfo>

#include "idem/redis/admin.hpp"
#include "idem/idem.hpp"
#include "idem/redis.hpp"
#include "redis_factory.hpp"
#include "redis_topology.hpp"

using namespace std::chrono_literals;
using idem::AcquireStatus;
using idem::RedisStore;
using idem::test::ProxiedPair;
using idem::test::RedisServer;
using idem::test::SentinelTopology;

namespace {

idem::AcquireParams params(std::uint64_t token, idem::millis lease) {
  idem::AcquireParams p;
  p.lease = lease;
  p.retention = 60s;
  p.token = token;
  return p;
}

// A store on `node` that asks `acks` replicas to acknowledge each write. The ack wait is short so
// a refused write costs little; it must stay below the command timeout.
idem::RedisOptions on(RedisServer& node, int acks) {
  idem::RedisOptions o = node.options();
  o.min_replica_acks = acks;
  o.replica_ack_timeout = 300ms;
  o.command_timeout = 2s;
  return o;
}

template <class F>
void wait_until(F&& done, std::chrono::milliseconds bound, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + bound;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) FAIL(what);
    std::this_thread::sleep_for(5ms);
  }
}

// The downstream the README asks for: it keeps the highest fence it has seen and refuses a write
// with a lower one (an equal one is the same holder writing again).
struct FencedSink {
  std::uint64_t highest = 0;
  bool write(std::uint64_t fence) {
    if (fence < highest) return false;
    highest = fence;
    return true;
  }
};

std::string kind(const idem::error& e) {
  const auto* s = dynamic_cast<const idem::store_error*>(&e);
  std::string name = dynamic_cast<const idem::durability_error*>(&e)        ? "durability"
                     : dynamic_cast<const idem::outcome_unknown_error*>(&e) ? "outcome_unknown"
                     : dynamic_cast<const idem::connection_error*>(&e)      ? "connection"
                     : dynamic_cast<const idem::timeout_error*>(&e)         ? "timeout"
                     : s != nullptr                                         ? "store_error"
                                                                            : typeid(e).name();
  return s != nullptr && !s->code().empty() ? name + " " + s->code() : name;
}

}  // namespace

TEST_CASE("redis failover with min_replica_acks 0: a claim the replica never got is granted to a second holder",
          "[redis][failover]") {
  ProxiedPair pair;
  RedisStore first(on(pair.master(), 0));
  const std::string k = "unreplicated-" + idem::test::random_hex();
  pair.hold_replication();
  const auto a = first.acquire(k, params(1, 30s));
  REQUIRE(a.status == AcquireStatus::acquired);
  wait_until([&] { return pair.replication_held(); }, 5s, "the claim was never sent to the replica");
  REQUIRE(pair.replica().command({"EXISTS", first.redis_key(k)}) == "0");

  pair.kill_master();
  pair.promote_replica();
  RedisStore second(on(pair.master(), 0));
  const auto b = second.acquire(k, params(2, 30s));
  // The first holder's 30 s lease has barely started, and the key is granted again: two holders
  // at once. Not a takeover: for the promoted replica the key was never seen.
  WARN("acks 0, claim lost in the failover: first holder fence " << a.holder.fence << " (lease 30 s, running), "
                                                                  << "second holder "
                                                                  << (b.status == AcquireStatus::acquired ? "acquired" : "refused")
                                                                  << " with fence " << b.holder.fence);
  CHECK(b.status == AcquireStatus::acquired);
  CHECK_FALSE(b.takeover);
  CHECK(b.holder.fence <= a.holder.fence);
}

TEST_CASE("redis failover with min_replica_acks 1: a claim no replica acknowledged runs no handler",
          "[redis][failover]") {
  ProxiedPair pair;
  RedisStore first(on(pair.master(), 1));
  idem::IdempotencyGuard guard(first, {.lease = 30s, .retention = 60s});
  const std::string ns = "unacked-" + idem::test::random_hex() + ":";
  int runs = 0;
  // While replication flows, the same store's writes are acknowledged.
  REQUIRE(guard.run(ns + "before", [&] { return ++runs; }).status == idem::Status::executed);

  pair.hold_replication();
  try {
    (void)first.acquire(ns + "k", params(1, 30s));
    FAIL("an unacknowledged claim was reported acquired");
  } catch (const idem::durability_error& e) {
    CHECK(e.acks() == 0);
    CHECK(e.wanted() == 1);
    CHECK(e.retryable());
  }
  try {
    (void)guard.run(ns + "g", [&] { return ++runs; });
    FAIL("the guard returned for an unacknowledged claim");
  } catch (const idem::durability_error& e) {
    CHECK(e.acks() == 0);
  }
  CHECK(runs == 1);  // "before" only
  CHECK(pair.replication_held());
  CHECK(pair.replica().command({"EXISTS", first.redis_key(ns + "k")}) == "0");

  pair.kill_master();
  pair.promote_replica();
  pair.restart_old_master_as_replica();  // so the promoted node can acknowledge with acks 1 too
  RedisStore second(on(pair.master(), 1));
  idem::IdempotencyGuard guard2(second, {.lease = 30s, .retention = 60s});
  // The lost claims ran nothing, so granting them again is no second execution.
  const auto b = second.acquire(ns + "k", params(2, 30s));
  CHECK(b.status == AcquireStatus::acquired);
  CHECK(b.holder.fence == 1);
  CHECK(guard2.run(ns + "g", [&] { return ++runs; }).status == idem::Status::executed);
  CHECK(runs == 2);
  // And what was acknowledged before the failover survived it.
  CHECK(guard2.run(ns + "before", [&] { return ++runs; }).status == idem::Status::duplicate);
  CHECK(runs == 2);
}

TEST_CASE("redis failover fences with min_replica_acks 1: the next holder's fence is higher and the old holder "
          "is refused downstream",
          "[redis][failover]") {
  ProxiedPair pair;
  RedisStore first(on(pair.master(), 1));
  const std::string k = "fenced-" + idem::test::random_hex();
  const auto lease = 500ms;
  const auto a = first.acquire(k, params(1, lease));
  const auto acquired_at = std::chrono::steady_clock::now();
  REQUIRE(a.status == AcquireStatus::acquired);
  CHECK(pair.replica().command({"EXISTS", first.redis_key(k)}) == "1");  // acknowledged: on the replica already

  pair.hold_replication();
  pair.kill_master();
  pair.promote_replica();
  pair.restart_old_master_as_replica();
  std::this_thread::sleep_until(acquired_at + lease + 100ms);
  RedisStore second(on(pair.master(), 1));
  const auto b = second.acquire(k, params(2, lease));
  REQUIRE(b.status == AcquireStatus::acquired);
  CHECK(b.takeover);  // the claim crossed the failover: a lapsed lease, taken over
  CHECK(b.holder.fence > a.holder.fence);

  FencedSink sink;
  CHECK(sink.write(b.holder.fence));
  CHECK_FALSE(sink.write(a.holder.fence));  // the old holder, paused across the failover, writes late
  WARN("acks 1 across a failover: old holder fence " << a.holder.fence << ", next holder fence " << b.holder.fence
                                                     << ", the old holder's late write refused downstream");
}

TEST_CASE("redis failover fences with min_replica_acks 0: a claim lost in the failover gives the next holder the "
          "same fence, and the downstream accepts both",
          "[redis][failover]") {
  ProxiedPair pair;
  RedisStore first(on(pair.master(), 0));
  const std::string k = "unfenced-" + idem::test::random_hex();
  const auto lease = 500ms;
  pair.hold_replication();
  const auto a = first.acquire(k, params(1, lease));
  const auto acquired_at = std::chrono::steady_clock::now();
  REQUIRE(a.status == AcquireStatus::acquired);
  wait_until([&] { return pair.replication_held(); }, 5s, "the claim was never sent to the replica");

  pair.kill_master();
  pair.promote_replica();
  std::this_thread::sleep_until(acquired_at + lease + 100ms);
  RedisStore second(on(pair.master(), 0));
  const auto b = second.acquire(k, params(2, lease));
  REQUIRE(b.status == AcquireStatus::acquired);
  // The documented acks-off behaviour: the record is gone, so the fence starts again at 1.
  CHECK_FALSE(b.takeover);
  CHECK(a.holder.fence == 1);
  CHECK(b.holder.fence == a.holder.fence);
  FencedSink sink;
  CHECK(sink.write(b.holder.fence));
  CHECK(sink.write(a.holder.fence));  // equal fences: the downstream cannot tell the holders apart
  WARN("acks 0 across a failover: old holder fence " << a.holder.fence << ", next holder fence " << b.holder.fence
                                                     << ", the downstream accepted both writes");
}

TEST_CASE("redis sentinel: RedisAdmin (the idem tool) reaches the master through a redis-sentinel URL",
          "[redis][failover][sentinel][admin]") {
  SentinelTopology topo;
  idem::RedisOptions o;
  o.url = topo.url();
  RedisStore store(o);
  const std::string key = "admin-sentinel-" + idem::test::random_hex();
  auto r = store.acquire(key, params(7, 30s));
  REQUIRE(r.status == idem::AcquireStatus::acquired);
  REQUIRE(store.complete(key, r.holder, "done", 60s) == idem::WriteStatus::ok);
  idem::RedisAdmin admin(o);
  const auto rec = admin.inspect(key);
  REQUIRE(rec);
  CHECK(rec->record.state == idem::State::completed);
  CHECK(rec->record.result == "done");
  CHECK_FALSE(admin.doctor().empty());
}

TEST_CASE("redis sentinel: a store built from a redis-sentinel URL follows a failover", "[redis][failover][sentinel]") {
  SentinelTopology topo;
  {
    // A name the sentinels do not monitor: refused at construction, and the message says which.
    idem::RedisOptions bad;
    bad.url = topo.url() + "-nope";
    try {
      RedisStore s(bad);
      FAIL("a store was built for a master no sentinel knows");
    } catch (const idem::error& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find("'m-nope'") != std::string::npos);
    }
  }

  idem::RedisOptions o;
  o.url = topo.url();
  o.connect_timeout = 500ms;
  o.command_timeout = 1s;
  o.pool.size = 2;
  auto client = std::make_shared<idem::RedisClient>(o);
  RedisStore store(client);
  idem::IdempotencyGuard guard(store, {.lease = 30s, .retention = 60s});
  const std::string ns = "sentinel-" + idem::test::random_hex() + ":";
  int runs = 0;
  REQUIRE(guard.run(ns + "before", [&] { return ++runs; }).status == idem::Status::executed);
  const std::string before = client->address();
  CHECK(before == topo.master_address());
  const auto discovered = client->discoveries();
  CHECK(discovered >= 1);

  topo.kill_master();
  // Calls right through the failover. A write may be sent twice (its reply lost, then asked
  // again as the same holder), so a call is bounded by two command timeouts and a connect.
  const auto bound = 2 * o.command_timeout + o.connect_timeout + 500ms;
  std::map<std::string, int> failures;
  auto slowest = 0ms;
  int calls = 0;
  for (bool done = false; !done;) {
    REQUIRE(calls < 300);  // >= 300 x 50 ms: several times what a failover takes here
    ++calls;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      const auto out = guard.run(ns + "during", [&] { return ++runs; });
      CHECK(out.status == idem::Status::executed);
      done = true;
    } catch (const idem::error& e) {
      INFO(e.what());
      CHECK(e.retryable());
      ++failures[kind(e)];
    } catch (const std::exception& e) {
      FAIL("an untyped error during the failover: " << e.what());
    }
    const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
    CHECK(took <= bound);
    slowest = std::max(slowest, took);
    if (!done) std::this_thread::sleep_for(50ms);
  }
  topo.wait_promoted();  // the sentinels agree; the store got there first or at the same time
  CHECK(client->address() == topo.master_address());
  CHECK(client->address() != before);
  CHECK(client->discoveries() > discovered);
  CHECK(runs == 2);
  std::string seen;
  for (const auto& [k, n] : failures) seen += (seen.empty() ? "" : ", ") + k + "=" + std::to_string(n);
  WARN("sentinel failover: " << calls << " calls until one succeeded, slowest " << slowest.count() << " ms (bound "
                             << bound.count() << " ms), address " << before << " -> " << client->address()
                             << ", discoveries " << discovered << " -> " << client->discoveries()
                             << ", failures: " << (seen.empty() ? "none" : seen));
  // The same store keeps working on the new master.
  CHECK(guard.run(ns + "after", [&] { return ++runs; }).status == idem::Status::executed);
}

TEST_CASE("redis sentinel: no sentinel reachable is a connection_error at construction", "[redis][sentinel]") {
  idem::RedisOptions o;
  o.url = "redis-sentinel://127.0.0.1:" + std::to_string(idem::test::free_port()) + ",127.0.0.1:" +
          std::to_string(idem::test::free_port()) + ",127.0.0.1:" + std::to_string(idem::test::free_port()) + "/m";
  o.connect_timeout = 500ms;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    RedisStore s(o);
    FAIL("a store was built with no sentinel to ask");
  } catch (const idem::connection_error& e) {
    INFO(e.what());
    CHECK(e.retryable());
    CHECK(std::string(e.what()).find("sentinel") != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - t0 < 3 * o.connect_timeout + 1s);
}
