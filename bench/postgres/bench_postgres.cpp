// Messages per second through IdempotencyGuard on a PostgresStore, each message a fresh key.
//   idem_bench_postgres --conninfo CI --mode lease|tx|dup --clients N --seconds S [--accounts N] [--batch B]
// lease: acquire + complete (two short transactions), the handler does nothing.
// tx:    BEGIN + claim, one business UPDATE inside the handler, completion + COMMIT (one commit).
// --batch B > 1: each client sends B messages at a time through guard.run_batch.
// Prints "tps <messages per second>" and "table <schema.table>".
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <libpq-fe.h>

#include "idem/idem.hpp"
#include "idem/postgres.hpp"

using namespace std::chrono_literals;

int main(int argc, char** argv) {
  std::string conninfo, mode = "lease";
  int clients = 1, seconds = 5, accounts = 10'000, batch = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--conninfo") conninfo = v;
    else if (a == "--mode") mode = v;
    else if (a == "--clients") clients = std::stoi(v);
    else if (a == "--seconds") seconds = std::stoi(v);
    else if (a == "--accounts") accounts = std::stoi(v);
    else if (a == "--batch") batch = std::stoi(v);
    else {
      std::cerr << "unknown option " << a << "\n";
      return 2;
    }
  }
  if ((mode != "lease" && mode != "tx" && mode != "dup") || clients < 1 || seconds < 1 || batch < 1 || batch > 10000) {
    std::cerr << "usage: idem_bench_postgres --conninfo CI --mode lease|tx|dup --clients N --seconds S [--batch 1..10000]\n";
    return 2;
  }
  try {
    idem::PostgresOptions o;
    o.conninfo = conninfo;
    idem::PostgresStoreOptions so;
    if (const char* v = std::getenv("IDEM_BENCH_BATCH_SESSIONS")) so.batch_sessions = std::stoul(v);
    // a batch holds up to batch_sessions sessions for its writes, and one for its acquire
    o.pool.size = static_cast<std::size_t>(clients) * (batch > 1 ? 1 + so.batch_sessions : 1);
    so.schema = "idem_bench";
    // dup: lease mode, every message a duplicate of a completed key (the redelivery path).
    const bool dup = mode == "dup";
    so.table = mode == "tx" ? "records_tx" : dup ? "records_dup" : "records_lease";
    so.mode = mode == "tx" ? idem::PostgresMode::transactional : idem::PostgresMode::lease;
    idem::PostgresStore store(o, so);
    store.migrate();
    if (mode == "tx") {
      PGconn* c = PQconnectdb(conninfo.c_str());
      PQsetNoticeProcessor(c, [](void*, const char*) {}, nullptr);
      PGresult* r = PQexec(c, ("CREATE TABLE IF NOT EXISTS bench_account (id int PRIMARY KEY, balance bigint NOT NULL); "
                               "INSERT INTO bench_account SELECT g, 0 FROM generate_series(1, " +
                               std::to_string(accounts) + ") g ON CONFLICT DO NOTHING")
                                  .c_str());
      const bool ok = PQresultStatus(r) == PGRES_COMMAND_OK;
      if (!ok) std::cerr << PQerrorMessage(c);
      PQclear(r);
      PQfinish(c);
      if (!ok) return 1;
    }
    idem::GuardOptions go;
    go.lease = 30s;
    go.retention = 24h;
    idem::IdempotencyGuard guard(store, go);
    const std::string run = std::to_string(std::chrono::system_clock::now().time_since_epoch().count());
    constexpr long dup_keys = 1000;  // per client, completed before the clock starts
    const auto key_of = [&](int t, long n) {
      return dup ? "d:" + std::to_string(t) + ":" + std::to_string(n % dup_keys)
                 : "b" + run + ":" + std::to_string(t) + ":" + std::to_string(n);
    };
    for (int t = 0; dup && t < clients; ++t)
      for (long n = 0; n < dup_keys; ++n) guard.run(key_of(t, n), [] { return 1; });
    std::atomic<bool> go_flag{false}, stop{false};
    std::atomic<long> done{0}, errors{0};
    std::vector<std::thread> ts;
    for (int t = 0; t < clients; ++t) {
      ts.emplace_back([&, t] {
        std::mt19937 rng(static_cast<unsigned>(t + 1));
        std::uniform_int_distribution<int> acct(1, accounts);
        while (!go_flag.load()) std::this_thread::yield();
        long n = 0;
        auto handler = [&](const auto&, const auto& ctx) {
          if (ctx.tx) ctx.tx->exec("UPDATE bench_account SET balance = balance + 1 WHERE id = $1", acct(rng));
          return 1;
        };
        std::vector<std::string> keys;
        std::vector<idem::BatchItem> items;
        while (batch > 1 && !stop.load(std::memory_order_relaxed)) {
          keys.clear();
          items.clear();
          for (int b = 0; b < batch; ++b) keys.push_back(key_of(t, n++));
          for (const auto& k : keys) items.push_back({k, {}});
          try {
            auto r = guard.run_batch(items, handler);
            for (std::size_t i = 0; i < items.size(); ++i)
              if (!r.errors[i] && r.outcomes[i].status == (dup ? idem::Status::duplicate : idem::Status::executed))
                done.fetch_add(1, std::memory_order_relaxed);
          } catch (const std::exception& e) {
            if (errors.fetch_add(1) < 3) std::cerr << "error: " << e.what() << "\n";
          }
        }
        while (!stop.load(std::memory_order_relaxed)) {
          const std::string key = key_of(t, n++);
          try {
            auto out = guard.run(key, [&](const auto& ctx) {
              if (ctx.tx) ctx.tx->exec("UPDATE bench_account SET balance = balance + 1 WHERE id = $1", acct(rng));
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
    std::this_thread::sleep_for(std::chrono::seconds(seconds));
    stop = true;
    for (auto& t : ts) t.join();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("tps %.1f\nerrors %ld\ntable %s\n", static_cast<double>(done.load()) / secs, errors.load(),
                store.qualified_table().c_str());
    return errors.load() == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "idem_bench_postgres: " << e.what() << "\n";
    return 1;
  }
}
