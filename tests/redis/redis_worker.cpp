// Child process of the multi-process tests (started with fork+exec, see redis_process_test.cpp).
//   race  <port> <ns> <keys> <seed>   run the guard over keys 0..keys-1 in a shuffled order; print
//                                     "executed <i>" for every handler run, then "done"
//   hold  <port> <key> <lease_ms>     acquire through the guard, print "fence <n>", then sleep in
//                                     the handler until killed (bounded: 60 s)
//   slow  <port> <key> <lease_ms> <work_ms>  like hold, but return "old" after work_ms; exit 0 when
//                                     executed, 3 when the completion found the lease lost
//   batch <port> <ns> <items> <handler_ms>  one run_batch over keys <ns>0..<ns><items-1>: each
//                                     handler sleeps handler_ms, then prints "ran <i>" (unbuffered)
//                                     and returns i; "done" at the end
//   ordered <port> <ns> <entities> <per_entity> <combined 1|0>  SequenceGate over RedisStore:
//                                     entities "<ns>-<e>" in turn, each with seq 1..per_entity in order
//                                     (key "{<ns>-<e>}:<seq>"); combined 0 hides complete_advance, so
//                                     the gate completes and advances in two steps. Prints "ready".
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "idem/idem.hpp"
#include "idem/redis.hpp"

namespace {

idem::RedisStore connect(const char* port) {
  idem::RedisOptions o;
  o.port = std::atoi(port);
  o.pool.size = 2;
  o.command_timeout = idem::millis{5000};
  return idem::RedisStore(o);
}

int race(char** argv) {
  idem::RedisStore store = connect(argv[2]);
  const std::string ns = argv[3];
  const int keys = std::atoi(argv[4]);
  idem::GuardOptions go;
  go.lease = idem::millis{30'000};
  go.retention = idem::millis{600'000};
  go.wait_for_in_flight = idem::millis{0};
  idem::IdempotencyGuard guard(store, go);
  std::vector<int> order(static_cast<std::size_t>(keys));
  std::iota(order.begin(), order.end(), 0);
  std::mt19937 rng(static_cast<unsigned>(std::atoi(argv[5])));
  std::shuffle(order.begin(), order.end(), rng);
  std::string out;
  for (int i : order) {
    auto r = guard.run(ns + std::to_string(i), [&] {
      out += "executed " + std::to_string(i) + "\n";
      return i;
    });
    if (r.status == idem::Status::duplicate && *r.value != i) out += "wrong " + std::to_string(i) + "\n";
  }
  out += "done\n";
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

int hold(char** argv, bool slow) {
  idem::RedisStore store = connect(argv[2]);
  idem::GuardOptions go;
  go.lease = idem::millis{std::atoi(argv[4])};
  go.retention = idem::millis{600'000};
  idem::IdempotencyGuard guard(store, go);
  const int work_ms = slow ? std::atoi(argv[5]) : 60'000;
  auto r = guard.run(argv[3], [&](const idem::Context& ctx) {
    std::printf("fence %llu\n", static_cast<unsigned long long>(ctx.fence));
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::milliseconds(work_ms));
    return std::string("old");
  });
  if (r.status == idem::Status::executed) return 0;
  if (r.status == idem::Status::lease_lost) return 3;
  return 4;
}

// The same sequence store without complete_advance: SequenceGate falls back to two steps.
struct TwoStep {
  idem::RedisSequenceStore* s;
  std::optional<std::uint64_t> last_applied(std::string_view e) { return s->last_applied(e); }
  idem::AdvanceResult advance(std::string_view e, std::uint64_t seq) { return s->advance(e, seq); }
};

template <class Seq>
int ordered_run(idem::RedisStore& store, Seq& seqs, const std::string& ns, int entities, int per_entity) {
  idem::IdempotencyGuard guard(store, {.lease = idem::millis{30'000}, .retention = idem::millis{600'000}});
  idem::SequenceGate gate(seqs);
  std::printf("ready\n");
  std::fflush(stdout);
  for (int e = 0; e < entities; ++e) {
    const std::string entity = ns + "-" + std::to_string(e);
    for (int q = 1; q <= per_entity; ++q) {
      const std::string key = "{" + entity + "}:" + std::to_string(q);
      gate.run(guard, {.key = key, .entity = entity, .seq = static_cast<std::uint64_t>(q)}, [q] { return q; });
    }
  }
  std::printf("done\n");
  return 0;
}

int ordered(char** argv) {
  idem::RedisStore store = connect(argv[2]);
  idem::RedisSequenceStore seqs(store);
  if (std::string(argv[6]) == "1") return ordered_run(store, seqs, argv[3], std::atoi(argv[4]), std::atoi(argv[5]));
  TwoStep two{&seqs};
  return ordered_run(store, two, argv[3], std::atoi(argv[4]), std::atoi(argv[5]));
}

}  // namespace

int batch(char** argv) {
  idem::RedisStore store = connect(argv[2]);
  const std::string ns = argv[3];
  const int n = std::atoi(argv[4]);
  const auto pause = std::chrono::milliseconds(std::atoi(argv[5]));
  idem::IdempotencyGuard guard(store, {.lease = idem::millis{30'000}, .retention = idem::millis{600'000}});
  std::vector<std::string> keys;
  for (int i = 0; i < n; ++i) keys.push_back(ns + std::to_string(i));
  std::vector<idem::BatchItem> items;
  for (const auto& k : keys) items.push_back({k, ""});
  auto r = guard.run_batch(items, [&](const idem::BatchItem& it) {
    std::this_thread::sleep_for(pause);
    const std::string line = "ran " + std::string(it.key.substr(ns.size())) + "\n";
    (void)!::write(1, line.data(), line.size());  // before the completion is sent: the parent's cue
    return std::atoi(it.key.data() + ns.size());
  });
  std::printf("done %zu\n", r.executed());
  return 0;
}

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "race" && argc == 6) return race(argv);
    if (mode == "hold" && argc == 5) return hold(argv, false);
    if (mode == "slow" && argc == 6) return hold(argv, true);
    if (mode == "ordered" && argc == 7) return ordered(argv);
    if (mode == "batch" && argc == 6) return batch(argv);
    std::fprintf(stderr, "usage: idem_redis_worker race|hold|slow|ordered ...\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "idem_redis_worker: %s\n", e.what());
    return 5;
  }
}
