// The Redis Cluster harness itself (redis_cluster.hpp), with redis-cli and hiredis only — no idem
// client: the cluster forms (3 masters, a replica each, every slot covered), keys are found by
// slot, a slot migrates step by step (ASK and TRYAGAIN in the middle, MOVED after), a SIGKILLed
// master is failed over to its replica and rejoins as a replica when restarted.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "redis_cluster.hpp"

using idem::test::RedisCluster;

namespace {
double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}
}  // namespace

TEST_CASE("redis cluster harness: forms, migrates a slot step by step, fails over and rejoins", "[redis][cluster]") {
  auto t0 = std::chrono::steady_clock::now();
  RedisCluster c;
  std::printf("cluster harness: formed 6 nodes in %.2f s (%s)\n", seconds_since(t0), c.url().c_str());

  // Topology: 3 masters with one replica each, every slot owned once.
  const auto masters = c.masters();
  REQUIRE(masters.size() == 3);
  int covered = 0, next = 0;
  for (const auto& r : c.slot_ranges()) {
    CHECK(r.first == next);
    next = r.last + 1;
    covered += r.last - r.first + 1;
  }
  CHECK(covered == 16384);
  for (std::size_t m : masters) CHECK(c.replicas_of(m).size() == 1);
  CHECK(c.health().empty());

  // Keys by slot agree with the server's CLUSTER KEYSLOT.
  for (int slot : {0, 1234, 16383}) {
    const std::string k = RedisCluster::key_in_slot(slot, "idem:");
    CHECK(c.command(0, {"CLUSTER", "KEYSLOT", "idem:" + k}) == std::to_string(slot));
    const std::string t = RedisCluster::tag_for_slot(slot);
    CHECK(c.command(0, {"CLUSTER", "KEYSLOT", "idem:{" + t + "}:x"}) == std::to_string(slot));
  }

  // A slot with 250 keys moves from one master to another, one step at a time.
  const int slot = 777;
  const std::size_t from = c.master_of(slot);
  const std::size_t to = masters[0] == from ? masters[1] : masters[0];
  const std::string tag = RedisCluster::tag_for_slot(slot);
  for (int i = 0; i < 250; ++i) REQUIRE(c.command(from, {"SET", "{" + tag + "}:" + std::to_string(i), "v"}) == "OK");
  t0 = std::chrono::steady_clock::now();
  RedisCluster::SlotMigration mig(c, slot, from, to);
  mig.begin();
  REQUIRE(mig.move_keys(100) == 100);
  {
    // Mid-migration: a moved key answers ASK on the source, a key still there is served, a
    // multi-key call over both answers TRYAGAIN, the target answers MOVED without ASKING.
    const auto keys_left = c.call(from, {"CLUSTER", "GETKEYSINSLOT", std::to_string(slot), "1000"});
    REQUIRE(keys_left.elements.size() == 150);
    std::set<std::string> left;
    for (const auto& k : keys_left.elements) left.insert(k.str);
    std::string moved_key;
    for (int i = 0; i < 250 && moved_key.empty(); ++i) {
      const std::string k = "{" + tag + "}:" + std::to_string(i);
      if (!left.count(k)) moved_key = k;
    }
    const std::string kept_key = *left.begin();
    CHECK(c.command(from, {"GET", moved_key}).rfind("ASK " + std::to_string(slot) + " " + c.addr(to), 0) == 0);
    CHECK(c.command(from, {"GET", kept_key}) == "v");
    CHECK(c.command(from, {"MGET", moved_key, kept_key}).rfind("TRYAGAIN", 0) == 0);
    CHECK(c.command(to, {"GET", moved_key}).rfind("MOVED", 0) == 0);
  }
  while (mig.move_keys(40) > 0) {
  }
  mig.finish();
  CHECK(mig.moved() == 250);
  std::printf("cluster harness: slot %d (250 keys) moved %s -> %s in %.2f s\n", slot, c.addr(from).c_str(),
              c.addr(to).c_str(), seconds_since(t0));
  CHECK(c.master_of(slot) == to);
  CHECK(c.command(to, {"GET", "{" + tag + "}:7"}) == "v");
  CHECK(c.command(from, {"GET", "{" + tag + "}:7"}) == "MOVED " + std::to_string(slot) + " " + c.addr(to));
  // migrate_slot does the same in one call, and moves it back.
  CHECK(c.migrate_slot(slot, to, from, std::chrono::milliseconds(20), 64) == 250);
  CHECK(c.master_of(slot) == from);
  c.wait_ok();

  // SIGKILL of a master: its replica takes over, the cluster is healthy again; restarted, the
  // old master rejoins as a replica of the new one.
  const std::size_t victim = c.masters()[1];
  const auto replicas = c.kill_master(victim);
  REQUIRE(replicas.size() == 1);
  t0 = std::chrono::steady_clock::now();
  const std::size_t promoted = c.wait_failover(victim);
  std::printf("cluster harness: master %s killed, %s promoted in %.2f s\n", c.addr(victim).c_str(),
              c.addr(promoted).c_str(), seconds_since(t0));
  CHECK(promoted == replicas[0]);
  const auto after = c.masters();
  CHECK(after.size() == 3);
  CHECK(std::find(after.begin(), after.end(), victim) == after.end());
  CHECK(std::find(after.begin(), after.end(), promoted) != after.end());
  t0 = std::chrono::steady_clock::now();
  c.restart_node(victim);
  std::printf("cluster harness: %s restarted and synced as a replica in %.2f s\n", c.addr(victim).c_str(),
              seconds_since(t0));
  const auto reps = c.replicas_of(promoted);
  CHECK(reps == std::vector<std::size_t>{victim});
  CHECK(RedisCluster::field(c.command(victim, {"INFO", "replication"}), "role") == "slave");
  // The promoted replica had the data: the keys of slot 777 are still there if it was theirs.
  if (c.master_of(slot) == promoted) CHECK(c.command(promoted, {"GET", "{" + tag + "}:7"}) == "v");
}
