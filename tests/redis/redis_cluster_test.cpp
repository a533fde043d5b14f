// idem::redis on a real Redis Cluster (redis_cluster.hpp: 6 nodes, 3 masters + 3 replicas):
//   - the store contract on a cluster store (one cluster per test process, started on first use);
//   - keys spread over every master; hash-tagged sequences (SequenceGate + complete_advance) and
//     the cross-slot refusal; batches split over the nodes, answered in input order;
//   - resharding (slots with completed and in-progress records moved step by step: ASK,
//     TRYAGAIN, MOVED) under 4 worker processes, one of them on AsyncRedisStore (the engine's
//     async face): every key executed exactly once;
//   - a master SIGKILLed under 4 worker processes, with min_replica_acks 1 (no completed key
//     runs again, no concurrent holder) and 0 (what runs twice, counted).
// The workers are fork+exec'ed idem_redis_cluster_worker (redis_cluster_worker.cpp). Sizes are
// smaller in sanitized builds (IDEM_CLUSTER_SANITIZED).
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "idem/idem.hpp"
#include "idem/redis.hpp"
#include "idem/redis/hash_slot.hpp"
#include "redis_cluster.hpp"
#include "redis_factory.hpp"

#ifndef IDEM_CLUSTER_SANITIZED
#define IDEM_CLUSTER_SANITIZED 0
#endif

using namespace std::chrono_literals;
using idem::RedisStore;
using idem::test::RedisCluster;

namespace {

constexpr bool sanitized = IDEM_CLUSTER_SANITIZED != 0;

// One cluster per test process, started on first use (each CTest entry is its own process).
RedisCluster& shared_cluster() {
  static RedisCluster c;
  return c;
}

idem::RedisOptions cluster_options(const RedisCluster& c, int pool = 16) {
  idem::RedisOptions o = c.options();
  o.pool.size = pool;
  return o;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Keys matching `pattern` on node `i` (SCAN, so other tests' keys are not counted).
long long count_keys(const RedisCluster& c, std::size_t i, const std::string& pattern) {
  long long n = 0;
  std::string cursor = "0";
  do {
    const auto r = c.call(i, {"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"});
    REQUIRE(r.elements.size() == 2);
    cursor = r.elements[0].str;
    n += static_cast<long long>(r.elements[1].elements.size());
  } while (cursor != "0");
  return n;
}

idem::AcquireParams params(std::uint64_t token, idem::millis lease = 30s) {
  idem::AcquireParams p;
  p.lease = lease;
  p.retention = 10min;
  p.token = token;
  return p;
}

}  // namespace

// The store contract on a cluster: redis_cluster_contract_test.cpp, on the CTest fixture's cluster.

// ---- spread, sequences, batches ----------------------------------------------------------------

TEST_CASE("redis cluster: 300 guarded keys land on all three masters", "[redis][cluster]") {
  auto& c = shared_cluster();
  RedisStore store{cluster_options(c)};
  idem::IdempotencyGuard guard{store, {.lease = 30s, .retention = 10min}};
  const std::string ns = "spread-" + idem::test::random_hex() + ":";
  for (int i = 0; i < 300; ++i) {
    auto out = guard.run(ns + std::to_string(i), [&] { return i; });
    REQUIRE(out.status == idem::Status::executed);
  }
  const auto masters = c.masters();
  REQUIRE(masters.size() == 3);
  long long total = 0;
  std::string spread;
  for (std::size_t m : masters) {
    const long long n = count_keys(c, m, "idem:" + ns + "*");
    CHECK(n > 0);
    total += n;
    spread += " " + c.addr(m) + "=" + std::to_string(n);
  }
  CHECK(total == 300);
  std::printf("cluster spread: 300 keys over the masters:%s\n", spread.c_str());
  // Each record on the master of its slot; replayed as a duplicate with its value.
  for (int i = 0; i < 300; i += 37) {
    const std::string rk = store.redis_key(ns + std::to_string(i));
    CHECK(c.command(c.master_of(idem::redis_hash_slot(rk)), {"EXISTS", rk}) == "1");
    auto out = guard.run(ns + std::to_string(i), [&] { return -1; });
    CHECK(out.status == idem::Status::duplicate);
    CHECK(out.value == i);
  }
  // address() lists the masters; a stable cluster needs no redirection.
  const std::string addr = store.client()->address();
  for (std::size_t m : masters) CHECK(addr.find(c.addr(m)) != std::string::npos);
  CHECK(std::count(addr.begin(), addr.end(), ',') == 2);
  const auto st = store.client()->stats();
  CHECK(st.map_refreshes >= 1);
  CHECK(st.moved == 0);
  CHECK(st.ask == 0);
  CHECK(st.discoveries == 0);
}

TEST_CASE("redis cluster: hash-tagged sequences through SequenceGate and the cross-slot refusal",
          "[redis][cluster][sequence]") {
  auto& c = shared_cluster();
  RedisStore store{cluster_options(c)};
  idem::RedisSequenceStore seqs{store};
  idem::IdempotencyGuard guard{store, {.lease = 30s, .retention = 10min}};
  idem::SequenceGate gate{seqs};
  const std::string ns = idem::test::random_hex();
  constexpr int entities = 24, events = 4;
  std::set<std::size_t> nodes;
  std::map<std::string, std::vector<int>> ran;
  // 8 entities on each master.
  std::vector<std::string> names;
  std::map<std::size_t, int> per_master;
  for (int e = 0; static_cast<int>(names.size()) < entities; ++e) {
    const std::string entity = "acct-" + ns + "-" + std::to_string(e);
    if (per_master[c.master_of(idem::redis_hash_slot(seqs.sequence_key(entity)))]++ < entities / 3)
      names.push_back(entity);
  }
  for (const std::string& entity : names) {
    const std::string first_key = "{" + entity + "}:evt-1";
    // The record and the sequence share the entity's slot.
    REQUIRE(idem::redis_hash_slot(store.redis_key(first_key)) == idem::redis_hash_slot(seqs.sequence_key(entity)));
    nodes.insert(c.master_of(idem::redis_hash_slot(seqs.sequence_key(entity))));
    for (int q = 1; q <= events; ++q) {
      const std::string key = "{" + entity + "}:evt-" + std::to_string(q);
      auto out = gate.run(guard, {.key = key, .entity = entity, .seq = static_cast<std::uint64_t>(q)}, [&] {
        ran[entity].push_back(q);
        return q;
      });
      CHECK(out.status == idem::Status::executed);
    }
    CHECK(seqs.last_applied(entity) == static_cast<std::uint64_t>(events));
    // Older events (a new key, or a replay of an applied one) are stale; nothing runs.
    auto older = gate.run(guard, {.key = "{" + entity + "}:evt-2b", .entity = entity, .seq = 2}, [&] {
      ran[entity].push_back(-2);
      return -2;
    });
    CHECK(older.status == idem::Status::stale);
    auto replay = gate.run(guard, {.key = "{" + entity + "}:evt-3", .entity = entity, .seq = 3}, [&] {
      ran[entity].push_back(-3);
      return -3;
    });
    CHECK(replay.status == idem::Status::stale);
    CHECK(ran[entity] == std::vector<int>{1, 2, 3, 4});
  }
  CHECK(nodes.size() == 3);

  // advance and last_applied alone work on any node.
  const std::string lone = "lone-" + ns;
  CHECK(seqs.advance(lone, 5).advanced);
  CHECK(seqs.last_applied(lone) == 5u);

  // A record key outside the entity's slot: refused before anything is sent, naming the tag.
  const std::string entity = names.front();
  std::string untagged = "evt-untagged-" + ns;
  while (idem::redis_hash_slot(store.redis_key(untagged)) == idem::redis_hash_slot(seqs.sequence_key(entity)))
    untagged += "x";
  {
    auto a = store.acquire(untagged, params(41));
    REQUIRE(a.status == idem::AcquireStatus::acquired);
    std::string what;
    try {
      seqs.complete_advance(store, untagged, a.holder, "r", 10min, entity, 9);
      FAIL("complete_advance across slots did not throw");
    } catch (const idem::usage_error& e) {
      what = e.what();
    }
    INFO("usage_error: " << what);
    CHECK(what.find("{" + entity + "}") != std::string::npos);
    auto rec = store.inspect(untagged);
    REQUIRE(rec);
    CHECK(rec->state == idem::State::in_progress);  // nothing was sent
    CHECK(seqs.last_applied(entity) == static_cast<std::uint64_t>(events));
  }
  {
    // The same through the gate. The refusal should come before the handler runs: a usage_error
    // after it leaves an effect whose record lapses and runs again.
    const std::string key = untagged + "-gate";
    bool handler_ran = false;
    std::string what;
    try {
      gate.run(guard, {.key = key, .entity = entity, .seq = 10}, [&] {
        handler_ran = true;
        return 10;
      });
      FAIL("SequenceGate across slots did not throw");
    } catch (const idem::usage_error& e) {
      what = e.what();
    }
    INFO("usage_error: " << what);
    CHECK(what.find("{" + entity + "}") != std::string::npos);
    CHECK_FALSE(handler_ran);
    CHECK(seqs.last_applied(entity) == static_cast<std::uint64_t>(events));
    auto rec = store.inspect(key);
    if (rec) std::printf("cluster sequences: after the refused gate run the key is %s (fence %llu)\n",
                         std::string(idem::to_string(rec->state)).c_str(),
                         static_cast<unsigned long long>(rec->holder.fence));
  }
}

TEST_CASE("redis cluster: batches of 500 keys over all nodes answer in input order", "[redis][cluster][batch]") {
  auto& c = shared_cluster();
  RedisStore store{cluster_options(c)};
  const std::string ns = "batch-" + idem::test::random_hex() + ":";
  const int n = sanitized ? 200 : 500;
  std::vector<std::string> keys;
  std::set<std::size_t> nodes;
  for (int i = 0; i < n; ++i) {
    keys.push_back(ns + std::to_string(i));
    nodes.insert(c.master_of(idem::redis_hash_slot(store.redis_key(keys.back()))));
  }
  CHECK(nodes.size() == 3);
  // Before the batch: every 7th key completed ("pre-i"), every 11th (not 7th) held by another.
  auto done_before = [](int i) { return i % 7 == 0; };
  auto held = [](int i) { return i % 11 == 0 && i % 7 != 0; };
  for (int i = 0; i < n; ++i) {
    if (done_before(i)) {
      auto a = store.acquire(keys[static_cast<std::size_t>(i)], params(900));
      REQUIRE(a.status == idem::AcquireStatus::acquired);
      REQUIRE(store.complete(keys[static_cast<std::size_t>(i)], a.holder, "pre-" + std::to_string(i), 10min) ==
              idem::WriteStatus::ok);
    } else if (held(i)) {
      REQUIRE(store.acquire(keys[static_cast<std::size_t>(i)], params(901)).status == idem::AcquireStatus::acquired);
    }
  }
  const std::vector<std::string_view> views(keys.begin(), keys.end());
  const auto t0 = std::chrono::steady_clock::now();
  auto claims = store.acquire_batch(views, params(777));
  const double acquire_s = seconds_since(t0);
  REQUIRE(claims.size() == keys.size());
  std::vector<idem::CompleteItem> items;
  std::vector<int> item_index;
  std::vector<std::string> results(keys.size());
  for (int i = 0; i < n; ++i) {
    const auto& r = claims[static_cast<std::size_t>(i)];
    INFO("key " << i);
    if (done_before(i)) {
      CHECK(r.status == idem::AcquireStatus::duplicate);
      CHECK(r.payload == "pre-" + std::to_string(i));
    } else if (held(i)) {
      CHECK(r.status == idem::AcquireStatus::in_flight);
    } else {
      REQUIRE(r.status == idem::AcquireStatus::acquired);
      CHECK(r.holder.fence == 1);
      CHECK(r.holder.token == 777);
      results[static_cast<std::size_t>(i)] = "r-" + std::to_string(i);
      idem::Holder h = r.holder;
      if (i % 13 == 0) h.token = 778;  // a wrong holder: lease_lost at this position only
      items.push_back({keys[static_cast<std::size_t>(i)], h, results[static_cast<std::size_t>(i)]});
      item_index.push_back(i);
    }
  }
  const auto t1 = std::chrono::steady_clock::now();
  auto st = store.complete_batch(items, 10min);
  const double complete_s = seconds_since(t1);
  REQUIRE(st.size() == items.size());
  std::vector<idem::CompleteItem> again;
  for (std::size_t j = 0; j < items.size(); ++j) {
    const int i = item_index[j];
    INFO("key " << i);
    if (i % 13 == 0) {
      CHECK(st[j] == idem::WriteStatus::lease_lost);
      again.push_back({items[j].key, claims[static_cast<std::size_t>(i)].holder, items[j].result});
    } else {
      CHECK(st[j] == idem::WriteStatus::ok);
    }
  }
  for (auto s : store.complete_batch(again, 10min)) CHECK(s == idem::WriteStatus::ok);
  // Every key completed once (fence 1) with its result; the held ones still held.
  for (int i = 0; i < n; ++i) {
    INFO("key " << i);
    auto rec = store.inspect(keys[static_cast<std::size_t>(i)]);
    REQUIRE(rec);
    CHECK(rec->holder.fence == 1);
    if (held(i)) {
      CHECK(rec->state == idem::State::in_progress);
    } else {
      CHECK(rec->state == idem::State::completed);
      CHECK(rec->result == (done_before(i) ? "pre-" + std::to_string(i) : results[static_cast<std::size_t>(i)]));
    }
  }
  // A second batch: duplicates with their results, in order.
  auto replay = store.acquire_batch(views, params(779));
  REQUIRE(replay.size() == keys.size());
  for (int i = 0; i < n; ++i) {
    INFO("key " << i);
    const auto& r = replay[static_cast<std::size_t>(i)];
    if (held(i)) {
      CHECK(r.status == idem::AcquireStatus::in_flight);
    } else {
      CHECK(r.status == idem::AcquireStatus::duplicate);
      CHECK(r.payload == (done_before(i) ? "pre-" + std::to_string(i) : results[static_cast<std::size_t>(i)]));
    }
  }
  // A key twice in one batch: the second is in_flight behind the first, wherever it sits.
  const std::string a = ns + "twice-a", b = ns + "twice-b";
  const std::vector<std::string_view> twice{a, b, a};
  auto tw = store.acquire_batch(twice, params(780));
  REQUIRE(tw.size() == 3);
  CHECK(tw[0].status == idem::AcquireStatus::acquired);
  CHECK(tw[1].status == idem::AcquireStatus::acquired);
  CHECK(tw[2].status == idem::AcquireStatus::in_flight);
  std::printf("cluster batches: %d keys over %zu masters: acquire_batch %.3f s, complete_batch (%zu) %.3f s\n", n,
              nodes.size(), acquire_s, items.size(), complete_s);
}

// ---- processes: resharding and failover ---------------------------------------------------------

namespace {

using idem::test::Child;
Child start_worker(const std::vector<std::string>& args) { return Child::start(IDEM_REDIS_CLUSTER_WORKER, args); }

// What the workers printed at exit, summed.
struct WorkerReport {
  std::map<std::string, long long> stats;     // map_refreshes, moved, ask, tryagain, discoveries
  std::map<std::string, long long> outcomes;  // executed, duplicate, in_flight, ...
  std::map<std::string, long long> errors;    // type[:code][/final]
  std::map<std::string, std::string> messages;
  long long left = 0;
  int done = 0;
  std::vector<std::string> fatal;

  void add(const std::string& out) {
    std::istringstream in(out);
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream ls(line);
      std::string word;
      ls >> word;
      auto kv = [&](std::map<std::string, long long>& into) {
        std::string item;
        while (ls >> item) {
          const auto eq = item.rfind('=');
          if (eq != std::string::npos) into[item.substr(0, eq)] += std::stoll(item.substr(eq + 1));
        }
      };
      if (word == "stats") kv(stats);
      else if (word == "outcomes") kv(outcomes);
      else if (word == "errors") kv(errors);
      else if (word == "errmsg") {
        std::string type;
        ls >> type;
        std::string msg;
        std::getline(ls, msg);
        messages.emplace(type, msg);
      } else if (word == "left") {
        long long n = 0;
        ls >> n;
        left += n;
      } else if (word == "done") {
        ++done;
      } else if (word == "fatal") {
        fatal.push_back(line);
      }
    }
  }
  [[nodiscard]] std::string errors_text() const {
    std::string s = "{";
    for (const auto& [k, n] : errors) s += (s.size() > 1 ? " " : "") + k + "=" + std::to_string(n);
    return s + "}";
  }
  [[nodiscard]] long long errors_matching(const std::string& part) const {
    long long n = 0;
    for (const auto& [k, v] : errors)
      if (k.find(part) != std::string::npos) n += v;
    return n;
  }
  [[nodiscard]] long long stat(const std::string& k) const {
    auto it = stats.find(k);
    return it == stats.end() ? 0 : it->second;
  }
};

struct Event {
  char type = 'E';  // E effect, C completion confirmed, L lease_lost, X completion threw
  int worker = 0;
  std::uint64_t fence = 0;
  std::int64_t t = 0;
};

using Events = std::map<std::string, std::vector<Event>>;

void read_log(Events& ev, const std::string& path, int worker) {
  std::ifstream in(path);
  std::string type, key;
  std::uint64_t fence = 0;
  std::int64_t t = 0;
  while (in >> type >> key >> fence >> t) ev[key].push_back({type[0], worker, fence, t});
}

// Every execution after a key's first, classified.
struct Doubles {
  int keys_twice = 0;             // keys executed more than once
  int unconfirmed_takeover = 0;   // (i) no completion confirmed before; taken over later with a higher fence
  int completed_rerun = 0;        // (ii) a completion had been confirmed before it ran again
  int fence_not_higher = 0;       // (ii) ran again with a fence not above an earlier run's
  int concurrent = 0;             // (ii) ran within an earlier run's lease
  int completed_before_kill_rerun = 0;  // keys completed (confirmed) before the kill that ran after it
  [[nodiscard]] int second_kind() const { return completed_rerun + fence_not_higher + concurrent; }
};

Doubles classify(const Events& ev, std::chrono::milliseconds lease, std::int64_t kill_ns) {
  Doubles d;
  const std::int64_t window = std::chrono::nanoseconds(lease).count() - 1'000'000'000;  // 1 s margin for WAIT, scheduling
  for (const auto& [key, all] : ev) {
    std::vector<Event> es = all;
    std::sort(es.begin(), es.end(), [](const Event& a, const Event& b) { return a.t < b.t; });
    std::vector<const Event*> runs;
    for (const auto& e : es)
      if (e.type == 'E') runs.push_back(&e);
    if (runs.size() > 1) ++d.keys_twice;
    bool counted_kill = false;
    for (std::size_t j = 1; j < runs.size(); ++j) {
      const Event& e2 = *runs[j];
      bool completed_before = false, completed_before_kill = false;
      for (const auto& e : es)
        if (e.type == 'C' && e.t < e2.t) {
          completed_before = true;
          if (kill_ns != 0 && e.t < kill_ns) completed_before_kill = true;
        }
      // Concurrent: e2 began within an earlier run's lease (less a margin for the WAIT before
      // acquire answers and for scheduling), so that holder could still have been running. An
      // earlier holder whose completion was still in flight after its lease is fenced (its
      // complete answers lease_lost): not concurrent.
      std::uint64_t max_fence = 0;
      bool live = false;
      for (std::size_t k = 0; k < j; ++k) {
        max_fence = std::max(max_fence, runs[k]->fence);
        if (e2.t - runs[k]->t < window) live = true;
      }
      if (completed_before) ++d.completed_rerun;
      else if (e2.fence <= max_fence) ++d.fence_not_higher;
      else if (live) ++d.concurrent;
      else ++d.unconfirmed_takeover;
      if (completed_before_kill && e2.t > kill_ns && !counted_kill) {
        ++d.completed_before_kill_rerun;
        counted_kill = true;
      }
    }
  }
  return d;
}

// The workers' key file and logs; removed at the end of the case (kept with IDEM_KEEP_CLUSTER=1).
struct RunDir {
  std::string path;
  RunDir() {
    char tmpl[] = "/tmp/idem-cluster-run-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) throw std::runtime_error("test: mkdtemp failed");
    path = tmpl;
  }
  ~RunDir() {
    const char* keep = std::getenv("IDEM_KEEP_CLUSTER");
    if (keep != nullptr && *keep == '1') return;
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  RunDir(const RunDir&) = delete;
  RunDir& operator=(const RunDir&) = delete;
};

void write_lines(const std::string& path, const std::vector<std::string>& lines) {
  std::ofstream out(path);
  for (const auto& l : lines) out << l << "\n";
}

// Workers 0 and 2 run single keys, 1 and 3 batches; with `async_face`, worker 2 runs its single
// keys on AsyncRedisStore (the engine's other face) instead of RedisStore.
std::vector<Child> start_workers(const std::string& url, const std::string& dir, const std::string& key_file,
                                 int lease_ms, int acks, int handler_us, const std::string& stop_file,
                                 bool async_face = false) {
  std::vector<Child> workers;
  for (int w = 0; w < 4; ++w) {
    const char* mode = w % 2 == 1 ? "batch" : w == 2 && async_face && IDEM_WORKER_ASYNC ? "async" : "single";
    std::vector<std::string> args{"--url=" + url,
                                  "--keys=" + key_file,
                                  "--log=" + dir + "/w" + std::to_string(w) + ".log",
                                  std::string("--mode=") + mode,
                                  "--lease-ms=" + std::to_string(lease_ms),
                                  "--acks=" + std::to_string(acks),
                                  "--handler-us=" + std::to_string(handler_us),
                                  "--seed=" + std::to_string(1000 + w),
                                  "--deadline-s=" + std::to_string(sanitized ? 400 : 200)};
    if (!stop_file.empty()) args.push_back("--stop-file=" + stop_file);
    workers.push_back(start_worker(args));
  }
  for (auto& w : workers) REQUIRE(w.line() == "ready");
  return workers;
}

WorkerReport finish_workers(std::vector<Child>& workers) {
  WorkerReport rep;
  for (auto& w : workers) {
    const std::string out = w.rest();
    rep.add(out);
    const int rc = w.wait();
    INFO("worker output:\n" << out);
    CHECK(rc == 0);
  }
  return rep;
}

// The test's own last pass through a fresh guard: every key must be a duplicate. Handler runs
// are logged as worker 4 (E, then C when confirmed) so classify() sees them.
int verify_all_duplicate(const RedisCluster& c, const std::vector<std::string>& keys, Events& ev, int& errors) {
  idem::RedisOptions o = cluster_options(c, 4);
  o.url = c.url_all();
  RedisStore store{o};
  idem::IdempotencyGuard guard{store, {.lease = 30s, .retention = 10min}};
  int duplicates = 0;
  for (const auto& k : keys) {
    for (int attempt = 0;; ++attempt) {
      try {
        auto out = guard.run(k, [&](const idem::Context& ctx) {
          ev[k].push_back({'E', 4, ctx.fence, now_ns()});
          return std::string("verify");
        });
        if (out.status == idem::Status::executed) ev[k].push_back({'C', 4, out.fence, now_ns()});
        if (out.status == idem::Status::duplicate) ++duplicates;
        break;
      } catch (const idem::error& e) {
        ++errors;
        if (attempt > 20) throw;
        std::this_thread::sleep_for(100ms);
      }
    }
  }
  return duplicates;
}

std::string stats_text(const WorkerReport& r) {
  return "moved=" + std::to_string(r.stat("moved")) + " ask=" + std::to_string(r.stat("ask")) +
         " tryagain=" + std::to_string(r.stat("tryagain")) + " map_refreshes=" + std::to_string(r.stat("map_refreshes"));
}

void check_typed(const WorkerReport& r) {
  INFO("errors " << r.errors_text());
  for (const auto& [type, msg] : r.messages) UNSCOPED_INFO("first " << type << ":" << msg);
  CHECK(r.errors_matching("untyped") == 0);
  CHECK(r.errors_matching("idem_error") == 0);
  CHECK(r.errors_matching("usage_error") == 0);
  CHECK(r.errors_matching("corrupt_record_error") == 0);
  CHECK(r.errors_matching("store_error:none") == 0);
  CHECK(r.fatal.empty());
}

}  // namespace

TEST_CASE("redis cluster: resharding under 4 worker processes executes every key exactly once",
          "[redis][cluster][process]") {
  const auto t_start = std::chrono::steady_clock::now();
  RedisCluster c;
  const RunDir run_dir;
  const std::string& dir = run_dir.path;
  const std::string ns = idem::test::random_hex();
  const auto masters = c.masters();
  REQUIRE(masters.size() == 3);

  // Two slots of each master move to the next one: slot first+50 and first+3000 of its range.
  struct Move {
    int slot;
    std::size_t from, to;
  };
  std::vector<Move> moves;
  for (std::size_t m = 0; m < masters.size(); ++m) {
    int first = 16384;
    for (const auto& r : c.slot_ranges())
      if (r.node == masters[m]) first = std::min(first, r.first);
    for (int off : {50, 3000}) moves.push_back({first + off, masters[m], masters[(m + 1) % masters.size()]});
  }
  // Half the keys in the slots that move (tagged), half anywhere.
  const int total = sanitized ? 400 : 1600;
  std::vector<std::string> keys;
  for (int i = 0; i < total; ++i) {
    if (i % 2 == 0) {
      const auto& mv = moves[static_cast<std::size_t>(i / 2) % moves.size()];
      keys.push_back("{" + RedisCluster::tag_for_slot(mv.slot) + "}:" + ns + ":" + std::to_string(i));
    } else {
      keys.push_back("w-" + ns + "-" + std::to_string(i));
    }
  }
  write_lines(dir + "/keys", keys);

  // In-progress records of the test's own, in every slot that moves: still held after the move.
  RedisStore store{cluster_options(c)};
  std::vector<std::pair<std::string, idem::Holder>> held;
  for (const auto& mv : moves)
    for (int j = 0; j < 3; ++j) {
      const std::string k = "{" + RedisCluster::tag_for_slot(mv.slot) + "}:held-" + ns + "-" + std::to_string(j);
      auto a = store.acquire(k, params(5000 + static_cast<std::uint64_t>(j), 120s));
      REQUIRE(a.status == idem::AcquireStatus::acquired);
      held.emplace_back(k, a.holder);
    }

  const int lease_ms = 5000;
  const std::string stop = dir + "/stop";
  auto workers = start_workers(c.url(), dir, dir + "/keys", lease_ms, 0, sanitized ? 10000 : 8000, stop, true);
  std::this_thread::sleep_for(sanitized ? 1000ms : 300ms);

  // The moves, one at a time (overlapping migrations race their config-epoch bumps), each step
  // with pauses, while the workers run: one slot of each master early (new keys and claims of
  // the first pass in flight), the other three a second later (mostly completed records). Before each
  // MIGRATE the test looks at the chunk's records (approximately: they can change before the
  // MIGRATE) to count what moved in flight.
  const auto t_moves = std::chrono::steady_clock::now();
  std::atomic<int> keys_migrated{0}, in_progress_migrated{0}, completed_migrated{0};
  const std::string prefix = store.options().key_prefix;
  auto move_one = [&](const Move& mv) {
    RedisCluster::SlotMigration mig(c, mv.slot, mv.from, mv.to);
    mig.before_migrate([&](const std::vector<std::string>& redis_keys) {
      for (const auto& rk : redis_keys) {
        try {
          auto rec = store.inspect(std::string_view(rk).substr(prefix.size()));
          if (rec && rec->state == idem::State::in_progress) ++in_progress_migrated;
          if (rec && rec->state == idem::State::completed) ++completed_migrated;
        } catch (const std::exception&) {
        }
      }
    });
    mig.begin();
    std::this_thread::sleep_for(200ms);  // MIGRATING / IMPORTING, nothing moved yet: new keys ASK
    while (mig.move_keys(8) > 0) std::this_thread::sleep_for(40ms);  // part moved: ASK, TRYAGAIN
    std::this_thread::sleep_for(200ms);
    while (mig.move_keys(100) > 0) {
    }
    mig.finish();  // MOVED from here on
    keys_migrated += mig.moved();
  };
  for (std::size_t i = 0; i < moves.size(); ++i) {
    if (i == masters.size()) std::this_thread::sleep_for(sanitized ? 2s : 1s);
    move_one(moves[i < masters.size() ? 2 * i : 2 * (i - masters.size()) + 1]);
  }
  const double moves_s = seconds_since(t_moves);
  for (const auto& mv : moves) CHECK(c.master_of(mv.slot) == mv.to);
  // The test's held records moved with their holders: they complete on the new master.
  for (const auto& [k, h] : held) {
    INFO("held key " << k);
    CHECK(store.complete(k, h, "held", 10min) == idem::WriteStatus::ok);
    CHECK(c.command(c.master_of(idem::redis_hash_slot(store.redis_key(k))), {"EXISTS", store.redis_key(k)}) == "1");
  }
  std::this_thread::sleep_for(500ms);
  std::ofstream(stop).put('\n');
  WorkerReport rep = finish_workers(workers);
  const auto test_stats = store.client()->stats();

  Events ev;
  for (int w = 0; w < 4; ++w) read_log(ev, dir + "/w" + std::to_string(w) + ".log", w);
  int verify_errors = 0;
  const int duplicates = verify_all_duplicate(c, keys, ev, verify_errors);
  int once = 0, twice = 0, missing = 0;
  for (const auto& k : keys) {
    int runs = 0;
    for (const auto& e : ev[k]) runs += e.type == 'E';
    if (runs == 0) ++missing;
    else if (runs == 1) ++once;
    else ++twice;
  }
  const Doubles d = classify(ev, std::chrono::milliseconds(lease_ms), 0);
  auto masters_now = c.masters();
  auto masters_was = masters;
  std::sort(masters_now.begin(), masters_now.end());
  std::sort(masters_was.begin(), masters_was.end());
  const bool same_masters = masters_now == masters_was;
  std::printf(
      "cluster resharding: keys=%d slots_moved=%zu keys_migrated=%d (in_progress=%d completed=%d, in %.2f s) redirects %s (test client moved=%llu "
      "ask=%llu tryagain=%llu) errors=%s executed_once=%d executed_twice=%d missing=%d (unconfirmed_takeover=%d "
      "completed_rerun=%d fence_not_higher=%d concurrent=%d) verify_duplicates=%d/%zu outcomes",
      total, moves.size(), keys_migrated.load(), in_progress_migrated.load(), completed_migrated.load(), moves_s, stats_text(rep).c_str(),
      static_cast<unsigned long long>(test_stats.moved), static_cast<unsigned long long>(test_stats.ask),
      static_cast<unsigned long long>(test_stats.tryagain), rep.errors_text().c_str(), once, twice, missing,
      d.unconfirmed_takeover, d.completed_rerun, d.fence_not_higher, d.concurrent, duplicates, keys.size());
  for (const auto& [k, n] : rep.outcomes) std::printf(" %s=%lld", k.c_str(), n);
  std::printf(" slot_repairs=%d wall=%.1f s\n", c.slot_repairs(), seconds_since(t_start));
  for (const auto& [type, msg] : rep.messages) std::printf("  first %s:%s\n", type.c_str(), msg.c_str());

  CHECK(same_masters);  // no failover happened: any double below is the client's
  CHECK(rep.done == 4);
  CHECK(rep.left == 0);
  check_typed(rep);
  CHECK(rep.errors_matching("/final") == 0);  // no node died: every error is one a retry can fix
  CHECK(missing == 0);
  CHECK(twice == 0);
  CHECK(duplicates == static_cast<int>(keys.size()));
  CHECK(verify_errors == 0);
  CHECK(rep.stat("moved") + rep.stat("ask") > 0);  // the move was seen by the workers
  CHECK(keys_migrated > 0);
}

namespace {

void failover_run(int acks) {
  const auto t_start = std::chrono::steady_clock::now();
  RedisCluster c;
  const RunDir run_dir;
  const std::string& dir = run_dir.path;
  const std::string ns = idem::test::random_hex();
  const int total = sanitized ? 800 : 3000;
  std::vector<std::string> keys;
  for (int i = 0; i < total; ++i) keys.push_back("f-" + ns + "-" + std::to_string(i));
  write_lines(dir + "/keys", keys);
  // The victim: a master that is one of the URL's seeds when there is one.
  const auto masters = c.masters();
  std::size_t victim = masters[0];
  for (std::size_t m : masters)
    if (m <= 1) victim = m;

  const int lease_ms = 3000;
  // 2 ms per key: the first pass (every key executed once) outlasts the kill; after it the
  // workers pass over every key again (duplicates) until the stop file, a second after the
  // killed node rejoined, so completed keys are asked again across the failover.
  const std::string stop = dir + "/stop";
  idem::RedisOptions watcher_options = cluster_options(c, 4);
  watcher_options.min_replica_acks = acks;
  RedisStore watcher{watcher_options};  // a client of the test's, idle during the failover
  auto workers = start_workers(c.url(), dir, dir + "/keys", lease_ms, acks, 2000, stop);
  std::this_thread::sleep_for(sanitized ? 1500ms : 600ms);
  const std::int64_t kill_ns = now_ns();
  const auto t_kill = std::chrono::steady_clock::now();
  c.kill_master(victim);
  const std::size_t promoted = c.wait_failover(victim);
  const double failover_s = seconds_since(t_kill);
  c.restart_node(victim);  // the promoted master gets a replica again (min_replica_acks 1 needs it)
  const double rejoin_s = seconds_since(t_kill);
  std::this_thread::sleep_for(1s);
  std::ofstream(stop).put('\n');
  WorkerReport rep = finish_workers(workers);
  const double workers_s = seconds_since(t_kill);

  Events ev;
  for (int w = 0; w < 4; ++w) read_log(ev, dir + "/w" + std::to_string(w) + ".log", w);
  int verify_errors = 0;
  const int duplicates = verify_all_duplicate(c, keys, ev, verify_errors);
  int once = 0, twice = 0, missing = 0, verify_runs = 0;
  for (const auto& k : keys) {
    int runs = 0;
    for (const auto& e : ev[k]) {
      runs += e.type == 'E';
      verify_runs += e.type == 'E' && e.worker == 4;
    }
    if (runs == 0) ++missing;
    else if (runs == 1) ++once;
    else ++twice;
  }
  const Doubles d = classify(ev, std::chrono::milliseconds(lease_ms), kill_ns);
  std::printf(
      "cluster failover min_replica_acks=%d: keys=%d killed=%s promoted=%s failover=%.1f s rejoined=%.1f s "
      "workers_done=%.1f s redirects %s errors=%s executed_once=%d executed_twice=%d missing=%d "
      "(i) unconfirmed_takeover=%d (ii) completed_rerun=%d fence_not_higher=%d concurrent=%d "
      "completed_before_kill_rerun=%d verify_runs=%d verify_duplicates=%d/%zu outcomes",
      acks, total, c.addr(victim).c_str(), c.addr(promoted).c_str(), failover_s, rejoin_s, workers_s,
      stats_text(rep).c_str(), rep.errors_text().c_str(), once, twice, missing, d.unconfirmed_takeover,
      d.completed_rerun, d.fence_not_higher, d.concurrent, d.completed_before_kill_rerun, verify_runs, duplicates,
      keys.size());
  for (const auto& [k, n] : rep.outcomes) std::printf(" %s=%lld", k.c_str(), n);
  std::printf(" wall=%.1f s\n", seconds_since(t_start));
  for (const auto& [type, msg] : rep.messages) std::printf("  first %s:%s\n", type.c_str(), msg.c_str());

  // The idle client follows too: after a few calls its masters are the new ones.
  int watcher_errors = 0;
  for (int i = 0; i < 60; ++i) {
    try {
      (void)watcher.inspect(keys[static_cast<std::size_t>(i)]);
    } catch (const idem::error&) {
      ++watcher_errors;
    }
  }
  const std::string watcher_addr = watcher.client()->address();
  INFO("idle client's address() after the failover: " << watcher_addr << " (" << watcher_errors << " errors)");
  CHECK(watcher_addr.find(c.addr(promoted)) != std::string::npos);
  CHECK(watcher_addr.find(c.addr(victim)) == std::string::npos);
  CHECK(watcher_errors == 0);
  if (acks >= 1) {
    // min_replica_acks per node: with the promoted master's only replica (the old master) gone,
    // a write there is refused as durability_error, one on another master is not.
    c.kill_node(victim);
    std::string on_promoted, elsewhere;
    for (int i = 0; on_promoted.empty() || elsewhere.empty(); ++i) {
      const std::string k = "dur-" + ns + "-" + std::to_string(i);
      const bool there = c.master_of(idem::redis_hash_slot(watcher.redis_key(k))) == promoted;
      (there ? on_promoted : elsewhere) = k;
    }
    try {
      (void)watcher.acquire(on_promoted, params(31));
      FAIL("an acquire on a master without its replica was acknowledged");
    } catch (const idem::durability_error& e) {
      CHECK(e.retryable());
      CHECK(e.code() == "WAIT");
    }
    CHECK(watcher.acquire(elsewhere, params(32)).status == idem::AcquireStatus::acquired);
  }

  CHECK(rep.done == 4);
  CHECK(rep.left == 0);
  check_typed(rep);
  CHECK(missing == 0);                       // every key ran (nothing lost for good)
  CHECK(rep.stat("map_refreshes") >= 8);  // each worker read the map at start and again after the kill
  long long errors = 0;
  for (const auto& [k, n] : rep.errors) errors += n;
  CHECK(errors > 0);  // the window was seen, as typed errors (check_typed)
  if (acks >= 1) {
    CHECK(d.completed_before_kill_rerun == 0);
    CHECK(d.second_kind() == 0);
    CHECK(verify_runs == 0);
    CHECK(duplicates == static_cast<int>(keys.size()));
  }
}

}  // namespace

TEST_CASE("redis cluster: a master SIGKILLed under 4 workers with min_replica_acks 1 runs no completed key again",
          "[redis][cluster][process][failover]") {
  failover_run(1);
}

TEST_CASE("redis cluster: a master SIGKILLed under 4 workers with min_replica_acks 0 counts what runs twice",
          "[redis][cluster][process][failover]") {
  failover_run(0);
}
