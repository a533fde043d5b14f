// Memory-store benchmark: the guard with a no-op handler next to the cheapest thing that could
// possibly do its job — one insert into a sharded, mutex-guarded hash map — in the same run.
//
//   idem_bench_memory [--ops N] [--reps R]     (release preset: scripts/bench memory)

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "idem/idem.hpp"

namespace {

using Clock = std::chrono::steady_clock;

// The baseline: 64 shards, a mutex each, std::string keys — what a hand-rolled "seen set" is.
class RawShardedMap {
public:
  bool insert(const std::string& key) {
    Shard& s = shards_[std::hash<std::string>{}(key) % kShards];
    std::lock_guard lock(s.mu);
    return s.map.emplace(key, 1).second;
  }

private:
  static constexpr std::size_t kShards = 64;
  struct Shard {
    std::mutex mu;
    std::unordered_map<std::string, int> map;
  };
  std::unique_ptr<Shard[]> shards_ = std::make_unique<Shard[]>(kShards);
};

template <class Op>
double ops_per_sec(int threads, long ops_per_thread, Op op) {
  std::vector<std::thread> ts;
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  Clock::time_point start;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      std::string key;
      key.reserve(32);
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      for (long i = 0; i < ops_per_thread; ++i) {
        key = "msg-";
        key += std::to_string(t);
        key += '-';
        key += std::to_string(i);
        op(key);
      }
    });
  }
  while (ready.load() < threads) std::this_thread::yield();
  start = Clock::now();
  go.store(true, std::memory_order_release);
  for (auto& th : ts) th.join();
  const double secs = std::chrono::duration<double>(Clock::now() - start).count();
  return static_cast<double>(threads) * static_cast<double>(ops_per_thread) / secs;
}

}  // namespace

int main(int argc, char** argv) {
  long ops = 400'000;  // a multiple of 200: each thread's share fills whole batches of 100
  int reps = 5;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--ops") ops = std::strtol(argv[i + 1], nullptr, 10);
    if (std::string(argv[i]) == "--reps") reps = static_cast<int>(std::strtol(argv[i + 1], nullptr, 10));
  }
  if (ops <= 0 || reps <= 0) {
    std::fprintf(stderr, "usage: idem_bench_memory [--ops N>0] [--reps R>0]\n");
    return 2;
  }
  // Each number is the median of `reps` rounds that interleave the baseline and the guard, so a
  // burst of load from elsewhere on the machine moves one sample, not the ratio.
  std::printf("%-8s %-34s %14s %14s %8s\n", "threads", "case (median of reps)", "idem ops/s", "raw map ops/s",
              "ratio");
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  for (int threads : {1, 2}) {
    const long per = ops / threads;
    std::vector<double> base, fresh, dup, hit, bfresh, bdup;
    for (int r = 0; r < reps; ++r) {
      RawShardedMap raw;
      base.push_back(ops_per_sec(threads, per, [&](const std::string& k) { raw.insert(k); }));

      idem::MemoryStore store({.shards = 64, .max_records = 0});
      idem::IdempotencyGuard guard(store, {.retention = std::chrono::hours{1}});
      fresh.push_back(ops_per_sec(threads, per, [&](const std::string& k) { guard.run(k, [] {}); }));
      // Same keys again: every run is now a duplicate answered by the store.
      dup.push_back(ops_per_sec(threads, per, [&](const std::string& k) { guard.run(k, [] {}); }));

      // The same keys through run_batch, 100 per batch (a per-thread buffer; ops per thread are a
      // multiple of 100).
      idem::MemoryStore bstore({.shards = 64, .max_records = 0});
      idem::IdempotencyGuard bguard(bstore, {.retention = std::chrono::hours{1}});
      auto batched = [&](const std::string& k) {
        thread_local std::vector<std::string> keys;
        thread_local std::vector<idem::BatchItem> items;
        keys.push_back(k);
        if (keys.size() < 100) return;
        items.clear();
        for (const auto& s : keys) items.push_back({s, {}});
        bguard.run_batch(items, [](const idem::BatchItem&) {});
        keys.clear();
      };
      bfresh.push_back(ops_per_sec(threads, per, batched));
      bdup.push_back(ops_per_sec(threads, per, batched));

      idem::MemoryStore cstore({.shards = 64, .max_records = 0});
      idem::IdempotencyGuard cached(cstore, {.retention = std::chrono::hours{1}, .cache_capacity = 1u << 20});
      ops_per_sec(threads, per, [&](const std::string& k) { cached.run(k, [] {}); });
      hit.push_back(ops_per_sec(threads, per, [&](const std::string& k) { cached.run(k, [] {}); }));
    }
    const double b = median(base);
    const struct {
      const char* name;
      double v;
    } rows[] = {{"new key (acquire+complete)", median(fresh)},
                {"duplicate (one store lookup)", median(dup)},
                {"duplicate from in-process cache", median(hit)},
                {"new key, run_batch of 100", median(bfresh)},
                {"duplicate, run_batch of 100", median(bdup)}};
    for (const auto& row : rows)
      std::printf("%-8d %-34s %14.0f %14.0f %8.2f\n", threads, row.name, row.v, b, row.v / b);
    std::printf("%-8d run_batch of 100 / run, per item: new keys %.2f, duplicates %.2f\n", threads,
                median(bfresh) / median(fresh), median(bdup) / median(dup));
  }
  return 0;
}
