// Child process of the Redis Cluster process tests (redis_cluster_test.cpp; fork+exec'ed, never
// merely forked). One consumer over a key space it shares with the other workers:
//
//   idem_redis_cluster_worker --url=redis-cluster://h:p,h:p --keys=FILE --log=FILE [options]
//     --mode=single|batch|async  single: IdempotencyGuard::run per key; batch: acquire_batch /
//                          complete_batch of --batch keys at a time; async: IdempotencyGuard::run per
//                          key on AsyncRedisStore (the engine's other face: one multiplexed
//                          connection per master, its own MOVED / ASK handling) (default single)
//     --lease-ms=N         lease of every claim (default 5000)
//     --acks=N             RedisOptions::min_replica_acks (default 0)
//     --handler-us=N       time the "effect" of one key takes (default 0; a batch sleeps it per key)
//     --seed=N             shuffles the key order
//     --stop-file=PATH     after every key is done, keep passing over all keys (expecting
//                          duplicates) until PATH exists
//     --deadline-s=N       give up after N seconds (default 120)
//
// Every key is retried (in_flight and errors re-queued, 5 ms pause after an error) until this worker sees it executed,
// duplicate or lease_lost. The effect appends "E <key> <fence> <t>" to the log (O_APPEND, one
// write(2) per line, before the completion is sent), a confirmed completion "C <key> <fence> <t>",
// a lease_lost "L <key> <fence> <t>", a completion that threw "X <key> <fence> <t>"; t is
// CLOCK_MONOTONIC in ns (the test's steady_clock). Prints "ready" once connected; at exit:
//   stats discoveries=.. map_refreshes=.. moved=.. ask=.. tryagain=..
//   outcomes executed=.. duplicate=.. in_flight=.. lease_lost=.. other=..
//   errors <type>=<n> ...      (type: connection_error, timeout_error, durability_error,
//                               outcome_unknown_error, capacity_error, store_error:<code>,
//                               corrupt_record_error, usage_error, idem_error, untyped;
//                               "/final" appended when not retryable)
//   errmsg <type> <first message of that type>
//   left <keys not done>
//   done
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <time.h>
#include <unistd.h>

// IDEM_WORKER_ASYNC: built with idem::asio (not in the fuzz build, which has no Boost): the async
// mode exists, and the tests ask for it only then.
#if IDEM_WORKER_ASYNC
#include "worker_io.hpp"

#include "idem/asio/redis_store.hpp"
#endif
#include "idem/detail/random.hpp"
#include "idem/idem.hpp"
#include "idem/redis.hpp"

namespace {

struct Args {
  std::string url, keys, log, mode = "single", stop_file;
  int lease_ms = 5000, acks = 0, handler_us = 0, batch = 16, deadline_s = 120;
  unsigned seed = 1;
};

std::optional<Args> parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    const auto eq = s.find('=');
    if (s.rfind("--", 0) != 0 || eq == std::string::npos) return std::nullopt;
    const std::string k = s.substr(2, eq - 2), v = s.substr(eq + 1);
    if (k == "url") a.url = v;
    else if (k == "keys") a.keys = v;
    else if (k == "log") a.log = v;
    else if (k == "mode") a.mode = v;
    else if (k == "stop-file") a.stop_file = v;
    else if (k == "lease-ms") a.lease_ms = std::atoi(v.c_str());
    else if (k == "acks") a.acks = std::atoi(v.c_str());
    else if (k == "handler-us") a.handler_us = std::atoi(v.c_str());
    else if (k == "batch") a.batch = std::atoi(v.c_str());
    else if (k == "deadline-s") a.deadline_s = std::atoi(v.c_str());
    else if (k == "seed") a.seed = static_cast<unsigned>(std::strtoul(v.c_str(), nullptr, 10));
    else return std::nullopt;
  }
  if (a.url.empty() || a.keys.empty() || a.log.empty() || (a.mode != "single" && a.mode != "batch" && (a.mode != "async" || !IDEM_WORKER_ASYNC)))
    return std::nullopt;
  return a;
}

std::int64_t now_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

class Log {
public:
  explicit Log(const std::string& path) : fd_(::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600)) {
    if (fd_ < 0) throw std::runtime_error("cannot open log " + path);
  }
  ~Log() { ::close(fd_); }
  Log(const Log&) = delete;
  Log& operator=(const Log&) = delete;
  void line(char what, std::string_view key, std::uint64_t fence) const {
    std::string s(1, what);
    s += ' ';
    s += key;
    s += ' ' + std::to_string(fence) + ' ' + std::to_string(now_ns()) + '\n';
    if (::write(fd_, s.data(), s.size()) != static_cast<ssize_t>(s.size())) std::abort();
  }

private:
  int fd_;
};

// The error's type name, as the test counts them.
std::string classify(const std::exception& e) {
  std::string t;
  if (dynamic_cast<const idem::outcome_unknown_error*>(&e)) t = "outcome_unknown_error";
  else if (dynamic_cast<const idem::durability_error*>(&e)) t = "durability_error";
  else if (dynamic_cast<const idem::connection_error*>(&e)) t = "connection_error";
  else if (dynamic_cast<const idem::timeout_error*>(&e)) t = "timeout_error";
  else if (dynamic_cast<const idem::capacity_error*>(&e)) t = "capacity_error";
  else if (const auto* se = dynamic_cast<const idem::store_error*>(&e))
    t = "store_error:" + (se->code().empty() ? std::string("none") : se->code());
  else if (dynamic_cast<const idem::corrupt_record_error*>(&e)) t = "corrupt_record_error";
  else if (dynamic_cast<const idem::usage_error*>(&e)) t = "usage_error";
  else if (dynamic_cast<const idem::error*>(&e)) t = "idem_error";
  else t = "untyped";
  const auto* ie = dynamic_cast<const idem::error*>(&e);
  if (ie == nullptr || !ie->retryable()) t += "/final";
  return t;
}

struct Counters {
  std::map<std::string, int> errors;
  std::map<std::string, std::string> first_message;
  std::map<std::string, int> outcomes;
  void error(const std::exception& e) {
    const std::string t = classify(e);
    if (errors[t]++ == 0) {
      std::string m = e.what();
      for (char& c : m)
        if (c == '\n' || c == '\r') c = ' ';
      first_message[t] = m;
    }
  }
};

idem::RedisOptions options(const Args& a) {
  idem::RedisOptions o;
  o.url = a.url;
  o.pool.size = 4;
  o.connect_timeout = idem::millis{1000};
  o.command_timeout = idem::millis{2000};
  o.min_replica_acks = a.acks;
  o.replica_ack_timeout = idem::millis{500};
  return o;
}

int run(const Args& a) {
  std::vector<std::string> keys;
  {
    std::ifstream in(a.keys);
    std::string k;
    while (std::getline(in, k))
      if (!k.empty()) keys.push_back(k);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(a.deadline_s);
  Counters count;
#if IDEM_WORKER_ASYNC
  idem_test::WorkerIo io(a.mode == "async");
  std::optional<idem::AsyncRedisStore> async_store;
#else
  const bool async_store = false;
#endif
  std::optional<idem::RedisStore> store;
  while (!store && !async_store) {
    try {
#if IDEM_WORKER_ASYNC
      if (a.mode == "async") async_store.emplace(io.executor(), options(a));
      else
#endif
        store.emplace(options(a));
    } catch (const std::exception& e) {
      count.error(e);
      if (std::chrono::steady_clock::now() > deadline) throw;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  const Log log(a.log);
  idem::GuardOptions go;
  go.lease = idem::millis{a.lease_ms};
  go.retention = idem::millis{600'000};
  go.wait_for_in_flight = idem::millis{0};
  std::optional<idem::IdempotencyGuard<idem::RedisStore>> guard;
  if (store) guard.emplace(*store, go);
#if IDEM_WORKER_ASYNC
  std::optional<idem::IdempotencyGuard<idem::AsyncRedisStore>> async_guard;
  if (async_store) async_guard.emplace(*async_store, go);
#endif
  const std::string owner = "cluster-worker:" + std::to_string(::getpid());
  std::mt19937 rng(a.seed);
  std::printf("ready\n");
  std::fflush(stdout);

  auto effect = [&](std::size_t keys_run) {
    if (a.handler_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(a.handler_us) * keys_run);
  };
  // After an error, as a consumer would before redelivering: a failing node answers at once.
  auto backoff = [] { std::this_thread::sleep_for(std::chrono::milliseconds(5)); };
  auto stop_requested = [&] { return a.stop_file.empty() || std::filesystem::exists(a.stop_file); };

  std::size_t left = 0;
  for (int pass = 0;; ++pass) {
    std::deque<std::string> pending;
    {
      std::vector<std::string> order = keys;
      std::shuffle(order.begin(), order.end(), rng);
      pending.assign(order.begin(), order.end());
    }
    std::size_t since_progress = 0;  // in_flight / errors in a row: pause once every key had one
    auto requeue = [&](std::vector<std::string> ks) {
      for (auto& k : ks) pending.push_back(std::move(k));
      since_progress += ks.size();
      if (since_progress >= pending.size()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        since_progress = 0;
      }
    };
    while (!pending.empty() && std::chrono::steady_clock::now() < deadline) {
      if (a.mode == "single" || a.mode == "async") {
        std::string k = std::move(pending.front());
        pending.pop_front();
        std::optional<std::uint64_t> ran;  // fence of an effect this attempt ran
        try {
          auto run_one = [&](auto& g) {
            return g.run(k, [&](const idem::Context& ctx) {
              ran = ctx.fence;
              log.line('E', k, ctx.fence);
              effect(1);
              return std::string("r");
            });
          };
#if IDEM_WORKER_ASYNC
          auto out = guard ? run_one(*guard) : run_one(*async_guard);
#else
          auto out = run_one(*guard);
#endif
          ++count.outcomes[std::string(idem::to_string(out.status))];
          switch (out.status) {
            case idem::Status::executed: log.line('C', k, out.fence); since_progress = 0; break;
            case idem::Status::lease_lost: log.line('L', k, out.fence); since_progress = 0; break;
            case idem::Status::duplicate: since_progress = 0; break;
            case idem::Status::in_flight: requeue({k}); break;
            default: break;  // counted in outcomes; nothing a retry changes
          }
        } catch (const std::exception& e) {
          count.error(e);
          if (ran) log.line('X', k, *ran);
          requeue({k});
          backoff();
        }
      } else {
        std::vector<std::string> batch;
        while (!pending.empty() && static_cast<int>(batch.size()) < a.batch) {
          batch.push_back(std::move(pending.front()));
          pending.pop_front();
        }
        std::vector<std::string_view> views(batch.begin(), batch.end());
        idem::AcquireParams p;
        p.lease = idem::millis{a.lease_ms};
        p.retention = idem::millis{600'000};
        p.token = idem::detail::random_token();
        p.owner = owner;
        std::vector<idem::AcquireResult> claims;
        try {
          claims = store->acquire_batch(views, p);
        } catch (const std::exception& e) {
          count.error(e);
          requeue(std::move(batch));
          backoff();
          continue;
        }
        std::vector<std::string> retry;
        std::vector<idem::CompleteItem> items;
        std::vector<std::string> item_keys;
        for (std::size_t i = 0; i < batch.size(); ++i) {
          const auto& c = claims.at(i);
          switch (c.status) {
            case idem::AcquireStatus::acquired:
              ++count.outcomes["acquired"];
              log.line('E', batch[i], c.holder.fence);
              items.push_back({batch[i], c.holder, "r"});
              item_keys.push_back(batch[i]);
              break;
            case idem::AcquireStatus::duplicate: ++count.outcomes["duplicate"]; break;
            case idem::AcquireStatus::in_flight:
              ++count.outcomes["in_flight"];
              retry.push_back(batch[i]);
              break;
            default: ++count.outcomes["other"]; break;
          }
        }
        if (!items.empty()) {
          effect(items.size());
          try {
            const auto st = store->complete_batch(items, idem::millis{600'000});
            for (std::size_t i = 0; i < items.size(); ++i) {
              if (st.at(i) == idem::WriteStatus::ok) {
                ++count.outcomes["executed"];
                log.line('C', item_keys[i], items[i].holder.fence);
              } else {
                ++count.outcomes["lease_lost"];
                log.line('L', item_keys[i], items[i].holder.fence);
              }
            }
          } catch (const std::exception& e) {
            count.error(e);
            for (std::size_t i = 0; i < items.size(); ++i) {
              log.line('X', item_keys[i], items[i].holder.fence);
              retry.push_back(item_keys[i]);
            }
            backoff();
          }
        }
        if (retry.size() < batch.size()) since_progress = 0;
        if (!retry.empty()) requeue(std::move(retry));
      }
    }
    left = pending.size();
    if (left > 0 || stop_requested() || std::chrono::steady_clock::now() >= deadline) break;
  }

  // AsyncRedisStore does not count redirections apart: its workers report zeros here.
  const idem::RedisClientStats st = store ? store->client()->stats() : idem::RedisClientStats{};
  std::printf("stats discoveries=%llu map_refreshes=%llu moved=%llu ask=%llu tryagain=%llu\n",
              static_cast<unsigned long long>(st.discoveries), static_cast<unsigned long long>(st.map_refreshes),
              static_cast<unsigned long long>(st.moved), static_cast<unsigned long long>(st.ask),
              static_cast<unsigned long long>(st.tryagain));
  std::printf("outcomes");
  for (const auto& [k, n] : count.outcomes) std::printf(" %s=%d", k.c_str(), n);
  std::printf("\nerrors");
  for (const auto& [k, n] : count.errors) std::printf(" %s=%d", k.c_str(), n);
  std::printf("\n");
  for (const auto& [k, m] : count.first_message) std::printf("errmsg %s %s\n", k.c_str(), m.c_str());
  std::printf("left %zu\ndone\n", left);
  std::fflush(stdout);
  return left == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const auto a = parse(argc, argv);
  if (!a) {
    std::fprintf(stderr, "usage: idem_redis_cluster_worker --url=U --keys=F --log=F [--mode=single|batch] ...\n");
    return 2;
  }
  try {
    return run(*a);
  } catch (const std::exception& e) {
    std::printf("fatal %s\n", e.what());
    std::fflush(stdout);
    return 5;
  }
}
