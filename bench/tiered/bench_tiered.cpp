// Messages per second through IdempotencyGuard on TieredStore and on each of its tiers alone.
//   idem_bench_tiered --conninfo CI --redis-port P --store tiered|redis|pgtx --mode new|dup
//                     --clients N --seconds S [--accounts N]
// new: each message a fresh key; on tiered and pgtx the handler runs one business UPDATE through
//      ctx.tx (the claim, the UPDATE and the completion commit together); on redis it does nothing.
// dup: each message a duplicate of a key completed before the clock starts (the redelivery path).
// Prints "tps <messages per second>", "errors <n>" and, for tiered, where the decisions were taken.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <type_traits>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <libpq-fe.h>

#include "idem/tiered.hpp"

using namespace std::chrono_literals;

namespace {

struct Args {
  std::string conninfo, store = "tiered", mode = "new";
  int redis_port = 6379, clients = 1, seconds = 5, accounts = 10'000;
};

bool setup_accounts(const Args& a) {
  PGconn* c = PQconnectdb(a.conninfo.c_str());
  PQsetNoticeProcessor(c, [](void*, const char*) {}, nullptr);
  PGresult* r = PQexec(c, ("CREATE TABLE IF NOT EXISTS bench_account (id int PRIMARY KEY, balance bigint NOT NULL); "
                           "INSERT INTO bench_account SELECT g, 0 FROM generate_series(1, " +
                           std::to_string(a.accounts) + ") g ON CONFLICT DO NOTHING")
                              .c_str());
  const bool ok = PQresultStatus(r) == PGRES_COMMAND_OK;
  if (!ok) std::cerr << PQerrorMessage(c);
  PQclear(r);
  PQfinish(c);
  return ok;
}

template <class Store>
int measure(Store& store, const Args& a, const std::function<void()>& report = {}) {
  idem::GuardOptions go;
  go.lease = 30s;
  go.retention = 24h;
  idem::IdempotencyGuard guard(store, go);
  const bool dup = a.mode == "dup";
  const std::string run = std::to_string(std::chrono::system_clock::now().time_since_epoch().count());
  constexpr long dup_keys = 1000;  // per client, completed before the clock starts
  const auto key_of = [&](int t, long n) {
    return dup ? "d" + run + ":" + std::to_string(t) + ":" + std::to_string(n % dup_keys)
               : "n" + run + ":" + std::to_string(t) + ":" + std::to_string(n);
  };
  using Ctx = typename idem::IdempotencyGuard<Store>::context_type;
  const auto write = [](const Ctx& ctx, int account) {
    if constexpr (!std::is_same_v<Ctx, idem::Context>) {
      if (ctx.tx) ctx.tx->exec("UPDATE bench_account SET balance = balance + 1 WHERE id = $1", account);
    } else {
      (void)ctx;
      (void)account;
    }
  };
  for (int t = 0; dup && t < a.clients; ++t)
    for (long n = 0; n < dup_keys; ++n) guard.run(key_of(t, n), [&](const Ctx& ctx) { write(ctx, 1); return 1; });
  std::atomic<bool> go_flag{false}, stop{false};
  std::atomic<long> done{0}, errors{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < a.clients; ++t) {
    ts.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t + 1));
      std::uniform_int_distribution<int> acct(1, a.accounts);
      while (!go_flag.load()) std::this_thread::yield();
      long n = 0;
      while (!stop.load(std::memory_order_relaxed)) {
        try {
          auto out = guard.run(key_of(t, n++), [&](const Ctx& ctx) {
            write(ctx, acct(rng));
            return 1;
          });
          if (out.status == (dup ? idem::Status::duplicate : idem::Status::executed))
            done.fetch_add(1, std::memory_order_relaxed);
        } catch (const std::exception& e) {
          if (errors.fetch_add(1) < 3) std::cerr << "error: " << e.what() << "\n";
        }
      }
    });
  }
  const auto t0 = std::chrono::steady_clock::now();
  go_flag = true;
  std::this_thread::sleep_for(std::chrono::seconds(a.seconds));
  stop = true;
  for (auto& t : ts) t.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("tps %.1f\nerrors %ld\n", static_cast<double>(done.load()) / secs, errors.load());
  if (report) report();
  return errors.load() == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--conninfo") a.conninfo = v;
    else if (k == "--redis-port") a.redis_port = std::stoi(v);
    else if (k == "--store") a.store = v;
    else if (k == "--mode") a.mode = v;
    else if (k == "--clients") a.clients = std::stoi(v);
    else if (k == "--seconds") a.seconds = std::stoi(v);
    else if (k == "--accounts") a.accounts = std::stoi(v);
    else {
      std::cerr << "unknown option " << k << "\n";
      return 2;
    }
  }
  if ((a.store != "tiered" && a.store != "redis" && a.store != "pgtx") || (a.mode != "new" && a.mode != "dup") ||
      a.clients < 1 || a.seconds < 1) {
    std::cerr << "usage: idem_bench_tiered --conninfo CI --redis-port P --store tiered|redis|pgtx --mode new|dup "
                 "--clients N --seconds S\n";
    return 2;
  }
  try {
    idem::RedisOptions ro;
    ro.port = a.redis_port;
    ro.key_prefix = "bench:" + a.store + ":";
    ro.pool.size = static_cast<std::size_t>(a.clients);
    idem::PostgresOptions po;
    po.conninfo = a.conninfo;
    po.pool.size = static_cast<std::size_t>(a.clients);
    idem::PostgresStoreOptions so;
    so.schema = "idem_bench";
    so.table = a.store == "tiered" ? "records_tiered" : "records_tx";
    so.mode = idem::PostgresMode::transactional;
    if (a.store == "redis") {
      idem::RedisStore store(ro);
      return measure(store, a);
    }
    if (!setup_accounts(a)) return 1;
    idem::PostgresStore pg(po, so);
    pg.migrate();
    if (a.store == "pgtx") return measure(pg, a);
    idem::TieredStore store(ro, pg);
    return measure(store, a, [&] {
      const auto s = store.stats();
      std::printf("fast_duplicates %llu truth_decisions %llu\n", static_cast<unsigned long long>(s.fast_duplicates),
                  static_cast<unsigned long long>(s.truth_decisions));
    });
  } catch (const std::exception& e) {
    std::cerr << "idem_bench_tiered: " << e.what() << "\n";
    return 1;
  }
}
