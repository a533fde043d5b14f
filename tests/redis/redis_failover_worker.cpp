// Child process of redis_failover_process_test.cpp (fork+exec'ed, never merely forked): a
// consumer that runs guarded messages through a redis-sentinel:// store while the test fails the
// master over under it.
//
//   idem_redis_failover_worker <url> <ns> <out_file> <stop_file> <seed> <acks> <lease_ms> <grace_ms> [async]
//
// With "async" the store is AsyncRedisStore (the engine's async face: one multiplexed connection,
// its own Sentinel rediscovery) and <master> in the E lines is "async".
//
// Keys are "<ns><n>", walked in blocks of 64 (n = 64 * block + i), each block in an order shuffled
// by <seed>, so the workers meet on the same keys at the same time. Each key is retried until the
// guard answers executed or duplicate. Every line is one write() to <out_file> (O_APPEND), so a
// line is whole whenever this process dies:
//   E <key> <fence> <t_before_acquire_ms> <t_handler_start_ms> <master>   the effect, before
//                                  completing (<master>: where the store sends new connections)
//   C <key> <fence>                the guard returned executed: the completion is confirmed
//   F <key> <fence> <error> <t_ms> the guard threw after the handler ran
//   L <key> <fence>                the guard returned lease_lost after the handler ran
//   X <key> <error> <t_ms>         the guard threw before any handler ran
//   U <key> <status>               an outcome that cannot happen here (the test fails on it)
//   D <blocks>                     stopped cleanly after walking keys 0 .. 64 * <blocks> - 1
// Times are CLOCK_REALTIME milliseconds, the clock Redis's TIME (and so every lease) runs on.
// <error> is "<kind>[:<code>]/<r|n>", r when retryable.
//
// Once <stop_file> exists the worker finishes its block and exits 0; if that takes more than
// <grace_ms>, it exits 3 (a hang is a failure, not something to wait out), and if it never got
// a store at all, 4.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <typeinfo>
#include <vector>

// IDEM_WORKER_ASYNC: built with idem::asio (not in the fuzz build, which has no Boost): the async
// face exists, and the test asks for it only then.
#if IDEM_WORKER_ASYNC
#include "worker_io.hpp"

#include "idem/asio/redis_store.hpp"
#endif
#include "idem/idem.hpp"
#include "idem/redis.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

long long now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

class Out {
public:
  explicit Out(const char* path) : fd_(::open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600)) {
    if (fd_ < 0) throw std::runtime_error(std::string("cannot open ") + path);
  }
  ~Out() { ::close(fd_); }
  // One write() per line: O_APPEND keeps lines whole and in order, whatever kills the process.
  void line(const std::string& s) const {
    const std::string l = s + "\n";
    if (::write(fd_, l.data(), l.size()) != static_cast<ssize_t>(l.size())) std::abort();
  }

private:
  int fd_;
};

std::string kind(const std::exception& ex) {
  const auto* e = dynamic_cast<const idem::error*>(&ex);
  if (e == nullptr) return std::string("untyped:") + typeid(ex).name() + "/n";
  const auto* s = dynamic_cast<const idem::store_error*>(e);
  std::string name = dynamic_cast<const idem::durability_error*>(e)        ? "durability"
                     : dynamic_cast<const idem::outcome_unknown_error*>(e) ? "outcome_unknown"
                     : dynamic_cast<const idem::connection_error*>(e)      ? "connection"
                     : dynamic_cast<const idem::timeout_error*>(e)         ? "timeout"
                     : dynamic_cast<const idem::capacity_error*>(e)        ? "capacity"
                     : s != nullptr                                        ? "store_error"
                     : dynamic_cast<const idem::corrupt_record_error*>(e)  ? "corrupt_record"
                                                                           : "idem_error";
  if (s != nullptr && !s->code().empty()) name += ":" + s->code();
  return name + (e->retryable() ? "/r" : "/n");
}

const char* status_name(idem::Status s) {
  switch (s) {
    case idem::Status::executed: return "executed";
    case idem::Status::duplicate: return "duplicate";
    case idem::Status::in_flight: return "in_flight";
    case idem::Status::previously_failed: return "previously_failed";
    case idem::Status::stale: return "stale";
    case idem::Status::lease_lost: return "lease_lost";
    case idem::Status::mismatch: return "mismatch";
  }
  return "?";
}

struct Stop {
  std::string file;
  std::chrono::milliseconds grace;
  std::optional<clock_type::time_point> seen;
  clock_type::time_point checked{};

  // Whether the stop file exists (looked at every 100 ms at most); exits 3 past the grace.
  bool requested() {
    const auto now = clock_type::now();
    if (!seen && now - checked >= std::chrono::milliseconds(100)) {
      checked = now;
      struct stat st {};
      if (::stat(file.c_str(), &st) == 0) seen = now;
    }
    if (seen && now - *seen > grace) {
      std::fprintf(stderr, "idem_redis_failover_worker: still busy %lld ms after the stop file\n",
                   static_cast<long long>(grace.count()));
      std::exit(3);
    }
    return seen.has_value();
  }
};

// The guard on `store` (RedisStore or AsyncRedisStore) walks the keys; `where` names the master
// new connections go to, for the E lines.
template <class Store, class Where>
int walk(const std::string& ns, const Out& out, Stop& stop, std::mt19937& rng, idem::millis lease, Store& store,
         Where where);

int run(char** argv, bool async) {
  const std::string ns = argv[2];
  const Out out(argv[3]);
  Stop stop{argv[4], std::chrono::milliseconds(std::atoll(argv[8])), std::nullopt};
  std::mt19937 rng(static_cast<unsigned>(std::atoll(argv[5])));
  idem::RedisOptions o;
  o.url = argv[1];
  o.connect_timeout = idem::millis{500};
  o.command_timeout = idem::millis{1000};
  o.min_replica_acks = std::atoi(argv[6]);
  o.replica_ack_timeout = idem::millis{300};
  o.pool.size = 2;
  const idem::millis lease{std::atoll(argv[7])};

  // The test starts workers on a settled topology, but a store is built again if that fails.
#if IDEM_WORKER_ASYNC
  idem_test::WorkerIo io(async);
  std::optional<idem::AsyncRedisStore> async_store;
#else
  const bool async_store = false;
  (void)async;
#endif
  std::optional<idem::RedisStore> store;
  while (!store && !async_store) {
    try {
#if IDEM_WORKER_ASYNC
      if (async) async_store.emplace(io.executor(), o);
      else
#endif
        store.emplace(o);
    } catch (const std::exception& e) {
      out.line("X - " + kind(e) + " " + std::to_string(now_ms()));
      if (stop.requested()) return 4;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
#if IDEM_WORKER_ASYNC
  if (async) return walk(ns, out, stop, rng, lease, *async_store, [] { return std::string("async"); });
#endif
  return walk(ns, out, stop, rng, lease, *store, [&] { return store->client()->address(); });
}

template <class Store, class Where>
int walk(const std::string& ns, const Out& out, Stop& stop, std::mt19937& rng, idem::millis lease, Store& store,
         Where where) {
  idem::GuardOptions go;
  go.lease = lease;
  go.retention = idem::millis{600'000};
  go.wait_for_in_flight = idem::millis{0};
  idem::IdempotencyGuard guard(store, go);

  std::vector<int> order(64);
  long long block = 0;
  for (; !stop.requested(); ++block) {
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (int i : order) {
      const std::string key = ns + std::to_string(block * 64 + i);
      for (bool done = false; !done;) {
        (void)stop.requested();  // exits past the grace
        bool ran = false;
        std::uint64_t fence = 0;
        const long long before = now_ms();
        try {
          const auto r = guard.run(key, [&](const idem::Context& ctx) {
            ran = true;
            fence = ctx.fence;
            out.line("E " + key + " " + std::to_string(fence) + " " + std::to_string(before) + " " +
                     std::to_string(now_ms()) + " " + where());
            return static_cast<int>(fence);
          });
          switch (r.status) {
            case idem::Status::executed:
              out.line("C " + key + " " + std::to_string(fence));
              done = true;
              break;
            case idem::Status::duplicate: done = true; break;
            case idem::Status::in_flight:
              // Another worker holds it (or a claim lost its reply): poll, the holder is quick.
              std::this_thread::sleep_for(std::min(r.retry_after, idem::millis{20}) + idem::millis{1});
              break;
            case idem::Status::lease_lost: out.line("L " + key + " " + std::to_string(fence)); break;
            default:
              out.line("U " + key + " " + status_name(r.status));
              done = true;
              break;
          }
        } catch (const std::exception& e) {
          if (ran)
            out.line("F " + key + " " + std::to_string(fence) + " " + kind(e) + " " + std::to_string(now_ms()));
          else
            out.line("X " + key + " " + kind(e) + " " + std::to_string(now_ms()));
          std::this_thread::sleep_for(std::chrono::milliseconds(20 + rng() % 20));
        }
      }
    }
  }
  out.line("D " + std::to_string(block));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 9 && !(IDEM_WORKER_ASYNC && argc == 10 && std::string(argv[9]) == "async")) {
    std::fprintf(stderr,
                 "usage: idem_redis_failover_worker <url> <ns> <out> <stop> <seed> <acks> <lease_ms> <grace_ms> [async]\n");
    return 2;
  }
  try {
    return run(argv, argc == 10);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "idem_redis_failover_worker: %s\n", e.what());
    return 5;
  }
}
