// AsyncRedisStore on a Redis Cluster of its own (3 masters, no replicas): keys of every master,
// auto-batching per slot, and one slot migrated step by step under single and coalesced calls —
// ASK while the slot is IMPORTING / MIGRATING, TRYAGAIN for a coalesced call whose keys are split,
// MOVED after — with every answer the contract's or a retryable error, never a wrong one.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "asio_factory.hpp"
#include "idem/redis/hash_slot.hpp"
#include "redis_cluster.hpp"

using idem::test::RedisCluster;

namespace {

idem::AcquireParams params(std::uint64_t token) { return idem::test::acquire_params(token); }

// Acquires `key`: "acquired", "duplicate", "in_flight", "retry:<code>" for a retryable store
// error, else "error: <message>". No Catch macro here: the storms call it from many threads, and
// Catch's assertions are not thread-safe; the main thread checks the answers.
std::string try_acquire(idem::AsyncRedisStore& s, const std::string& key, std::uint64_t token) {
  try {
    const auto r = s.acquire(key, params(token));
    switch (r.status) {
      case idem::AcquireStatus::acquired: return "acquired";
      case idem::AcquireStatus::duplicate: return "duplicate";
      case idem::AcquireStatus::in_flight: return "in_flight";
      default: return "other";
    }
  } catch (const idem::store_error& e) {
    return e.retryable() ? "retry:" + e.code() : std::string("error: ") + e.what();
  } catch (const std::exception& e) {
    return std::string("error: ") + e.what();
  }
}

// Acquires and completes `key`: "" when both went through, else what happened.
std::string complete(idem::AsyncRedisStore& s, const std::string& key, std::uint64_t token) {
  try {
    const auto r = s.acquire(key, params(token));
    if (r.status != idem::AcquireStatus::acquired) return "acquire answered " + std::to_string(static_cast<int>(r.status));
    if (s.complete(key, r.holder, "done", idem::millis{60'000}) != idem::WriteStatus::ok) return "complete: lease lost";
    return "";
  } catch (const std::exception& e) {
    return std::string("error: ") + e.what();
  }
}

}  // namespace

TEST_CASE("AsyncRedisStore on a cluster: keys of every master, coalesced per slot, a slot migrated under calls",
          "[asio][cluster]") {
  RedisCluster c(RedisCluster::Options{.masters = 3, .replicas_per_master = 0});
  idem::test::IoThread io;
  idem::RedisOptions o = c.options();
  o.key_prefix = "idem:";
  idem::AsyncRedisStore s{io.io.get_executor(), o};

  // Keys spread over every master: each completed once, then a duplicate.
  std::set<std::size_t> masters_hit;
  for (int i = 0; i < 60; ++i) {
    const std::string k = "spread:" + std::to_string(i);
    REQUIRE(complete(s, k, 100 + static_cast<std::uint64_t>(i)).empty());
    masters_hit.insert(c.master_of(idem::redis_hash_slot("idem:" + k)));
    CHECK(try_acquire(s, k, 999) == "duplicate");
  }
  CHECK(masters_hit.size() == 3);
  CHECK(s.stats().connects == 3);  // one connection per master

  // Auto-batching groups one slot's steps: 16 threads on keys of one hash tag share script calls.
  const int slot = 4242;
  const std::string tag = RedisCluster::tag_for_slot(slot);
  auto key = [&](const std::string& stem, int i) { return "{" + tag + "}:" + stem + std::to_string(i); };
  const auto coalesced_before = s.stats().coalesced;
  {
    std::vector<std::string> failed(16);
    std::vector<std::thread> ts;
    for (int t = 0; t < 16; ++t)
      ts.emplace_back([&, t] {
        for (int i = 0; i < 20 && failed[static_cast<std::size_t>(t)].empty(); ++i)
          failed[static_cast<std::size_t>(t)] =
              complete(s, key("pre", t * 20 + i), 1000 + static_cast<std::uint64_t>(t * 20 + i));
      });
    for (auto& t : ts) t.join();
    for (const auto& f : failed) CHECK(f.empty());
  }
  CHECK(s.stats().coalesced > coalesced_before);

  // The slot moves from its master to another, step by step.
  const std::size_t from = c.master_of(slot);
  const auto ms = c.masters();
  const std::size_t to = ms[0] == from ? ms[1] : ms[0];
  RedisCluster::SlotMigration mig(c, slot, from, to);
  mig.begin();
  REQUIRE(mig.move_keys(160) == 160);  // half the completed records are on the target now

  // Mid-migration, one call at a time: a record still on the source is served there, a moved one
  // through ASK on the target, a new key (on neither) through ASK too.
  for (int i = 0; i < 320; i += 7) CHECK(try_acquire(s, key("pre", i), 77) == "duplicate");
  for (int i = 0; i < 10; ++i) CHECK(try_acquire(s, key("new", i), 500 + static_cast<std::uint64_t>(i)) == "acquired");

  // Coalesced calls over keys on both sides answer TRYAGAIN (the call ran nothing): the store sends
  // their steps again one by one, so each caller gets its own call's answer.
  std::mutex mu;
  std::map<std::string, int> answers;
  auto storm = [&](const std::string& stem, int n, bool completed) {
    std::vector<std::thread> ts;
    for (int t = 0; t < 16; ++t)
      ts.emplace_back([&, t] {
        for (int i = t; i < n; i += 16) {
          const std::string a = try_acquire(s, completed ? key("pre", i) : key(stem, i), 9000 + static_cast<std::uint64_t>(i));
          std::lock_guard lk(mu);
          ++answers[a];
        }
      });
    for (auto& t : ts) t.join();
  };
  const auto coalesced_mid = s.stats().coalesced;
  storm("", 320, true);
  storm("mid", 64, false);
  CHECK(s.stats().coalesced > coalesced_mid);  // coalesced calls met the split slot (TRYAGAIN: sent apart)

  while (mig.move_keys(100) > 0) {
  }
  mig.finish();
  // After: the store's map still names the source, which answers MOVED; every record replays.
  storm("", 320, true);
  storm("after", 64, false);
  for (int i = 0; i < 64; ++i) CHECK(try_acquire(s, key("after", i), 1) == "in_flight");
  for (const auto& [a, n] : answers) std::printf("asio cluster: %d answers %s\n", n, a.c_str());
  // A coalesced call that met TRYAGAIN went out again as single calls: no caller saw the split.
  CHECK(answers.size() == 2);  // no retry, no error, nothing else
  CHECK(answers["duplicate"] == 640);
  CHECK(answers["acquired"] == 128);

  // A store made after the migration routes there at once.
  idem::AsyncRedisStore s2{io.io.get_executor(), o};
  for (int i = 0; i < 320; i += 31) CHECK(try_acquire(s2, key("pre", i), 3) == "duplicate");
}

TEST_CASE("AsyncRedisStore on a cluster: a bad seed list is refused at construction", "[asio][cluster]") {
  idem::test::IoThread io;
  idem::RedisOptions o;
  o.url = "redis-cluster://127.0.0.1:1";
  o.connect_timeout = idem::millis{500};
  CHECK_THROWS_AS((idem::AsyncRedisStore{io.io.get_executor(), o}), idem::connection_error);
}
