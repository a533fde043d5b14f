// One consumer process of tiered_process_test: runs every key of the set through a guard on a
// TieredStore (its own RedisStore, its own PostgreSQL sessions), in its own random order, until
// each key answered executed or duplicate; the handler appends the key to an effects table through
// ctx.tx. Prints "executed E duplicates D in_flight I errors R" and exits 0 (1 on a deadline).
//
//   idem_tiered_worker REDIS_PORT CONNINFO PREFIX KEYS EFFECTS_TABLE SEED

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "idem/tiered.hpp"

int main(int argc, char** argv) {
  if (argc < 7) {
    std::fprintf(stderr, "usage: idem_tiered_worker REDIS_PORT CONNINFO PREFIX KEYS EFFECTS_TABLE SEED\n");
    return 2;
  }
  using namespace std::chrono_literals;
  idem::RedisOptions ro;
  ro.port = std::atoi(argv[1]);
  ro.pool.size = 2;
  ro.connect_timeout = 300ms;
  ro.command_timeout = 2000ms;
  const std::string prefix = argv[3];
  const int n = std::atoi(argv[4]);
  const std::string table = argv[5];
  std::mt19937 rng(static_cast<unsigned>(std::strtoul(argv[6], nullptr, 10)));

  idem::PostgresStore pg({.conninfo = argv[2], .pool = {.size = 2, .wait = 5000ms}},
                         {.schema = "idem_test", .table = "tiered_records", .mode = idem::PostgresMode::transactional});
  idem::TieredStore store(ro, pg, {.fast_retry_after = 100ms});
  idem::IdempotencyGuard guard(store, {.lease = 2s, .retention = 600s});

  std::vector<int> todo(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) todo[static_cast<std::size_t>(i)] = i;
  long executed = 0, duplicates = 0, in_flight = 0, errors = 0;
  const auto deadline = std::chrono::steady_clock::now() + 120s;
  while (!todo.empty()) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "worker: %zu keys left at the deadline\n", todo.size());
      return 1;
    }
    std::shuffle(todo.begin(), todo.end(), rng);
    std::vector<int> again;
    for (int i : todo) {
      const std::string key = prefix + std::to_string(i);
      try {
        auto out = guard.run(key, [&](const auto& ctx) {
          ctx.tx->exec("INSERT INTO " + table + "(key, fence) VALUES ($1, $2)", key, ctx.fence);
        });
        if (out.status == idem::Status::executed) ++executed;
        else if (out.status == idem::Status::duplicate) ++duplicates;
        else {
          ++in_flight;
          again.push_back(i);
        }
      } catch (const idem::error&) {
        ++errors;
        again.push_back(i);
      }
    }
    todo = std::move(again);
    if (!todo.empty()) std::this_thread::sleep_for(20ms);
  }
  const auto s = store.stats();
  std::printf("executed %ld duplicates %ld in_flight %ld errors %ld fast_duplicates %llu truth_duplicates %llu\n",
              executed, duplicates, in_flight, errors, static_cast<unsigned long long>(s.fast_duplicates),
              static_cast<unsigned long long>(s.truth_duplicates));
  return 0;
}
