// The transactional outbox, measured:
//   1. the cost per handler of one ctx.outbox().send (one INSERT in the claiming transaction),
//      next to the same handler in transactional mode without it;
//   2. the relay's throughput to Redis Streams (rows published and marked sent per second).
//
//   idem_bench_outbox --conninfo CI --redis URL [--clients 4] [--seconds 5] [--messages 50000] [--batch 256]
//
// Uses schema idem_bench (dropped and recreated). Prints one line per measurement.

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <libpq-fe.h>

#include "idem/idem.hpp"
#include "idem/outbox/outbox.hpp"
#include "idem/postgres.hpp"

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

namespace {

void sql(const std::string& conninfo, const std::string& q) {
  PGconn* c = PQconnectdb(conninfo.c_str());
  PQsetNoticeProcessor(c, [](void*, const char*) {}, nullptr);
  PGresult* r = PQexec(c, q.c_str());
  const auto st = PQresultStatus(r);
  const std::string err = PQresultErrorMessage(r);
  PQclear(r);
  PQfinish(c);
  if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) throw std::runtime_error(q + ": " + err);
}

struct Rate {
  double per_second, micros_per_op;
};

// Handlers per second over `clients` threads for `seconds`, each one UPDATE (+ one send).
Rate handlers(const std::string& conninfo, int clients, int seconds, bool with_outbox) {
  idem::PostgresStore store{{.conninfo = conninfo, .pool = {.size = static_cast<std::size_t>(clients) + 1}},
                            {.schema = "idem_bench", .table = with_outbox ? "with_outbox" : "without_outbox",
                             .mode = idem::PostgresMode::transactional, .outbox = with_outbox}};
  idem::IdempotencyGuard<idem::PostgresStore> guard{store, {.lease = 30s, .retention = 1h}};
  std::atomic<long> done{0};
  std::atomic<bool> stop{false};
  const std::string run_id = std::to_string(Clock::now().time_since_epoch().count());
  std::vector<std::thread> ts;
  for (int t = 0; t < clients; ++t)
    ts.emplace_back([&, t] {
      for (long i = 0; !stop; ++i) {
        const std::string key = run_id + ":" + std::to_string(t) + ":" + std::to_string(i);
        guard.run(key, [&](const auto& ctx) {
          ctx.tx->exec("UPDATE idem_bench.accounts SET balance = balance + 1 WHERE id = $1", (t * 7919 + i) % 1000);
          if (with_outbox)
            ctx.outbox().send("bench", std::to_string((t * 7919 + i) % 1000), R"({"delta":1,"reason":"bench"})");
        });
        ++done;
      }
    });
  const auto t0 = Clock::now();
  std::this_thread::sleep_for(std::chrono::seconds(seconds));
  stop = true;
  for (auto& th : ts) th.join();
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  const double rate = static_cast<double>(done.load()) / secs;
  return {rate, 1e6 * clients / rate};
}

}  // namespace

int main(int argc, char** argv) try {
  std::string conninfo, redis;
  int clients = 4, seconds = 5, messages = 50'000, batch = 256;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--conninfo") conninfo = v;
    else if (a == "--redis") redis = v;
    else if (a == "--clients") clients = std::atoi(v.c_str());
    else if (a == "--seconds") seconds = std::atoi(v.c_str());
    else if (a == "--messages") messages = std::atoi(v.c_str());
    else if (a == "--batch") batch = std::atoi(v.c_str());
  }
  if (conninfo.empty() || redis.empty() || clients < 1 || seconds < 1 || messages < 1 || batch < 1) {
    std::fprintf(stderr, "usage: idem_bench_outbox --conninfo CI --redis URL [--clients 4] [--seconds 5] "
                         "[--messages 50000] [--batch 256]\n");
    return 2;
  }
  sql(conninfo, "DROP SCHEMA IF EXISTS idem_bench CASCADE");
  sql(conninfo, "CREATE SCHEMA idem_bench");
  sql(conninfo, "CREATE TABLE idem_bench.accounts (id int PRIMARY KEY, balance bigint NOT NULL DEFAULT 0)");
  sql(conninfo, "INSERT INTO idem_bench.accounts SELECT g, 0 FROM generate_series(0, 999) g");

  // 1. Per-handler cost, without then with the outbox (warm-up runs first, not counted).
  handlers(conninfo, clients, 1, false);
  handlers(conninfo, clients, 1, true);
  const Rate without = handlers(conninfo, clients, seconds, false);
  const Rate with = handlers(conninfo, clients, seconds, true);
  std::printf("handler, transactional mode, %d clients: without outbox %.0f/s (%.0f us each), with one "
              "ctx.outbox().send %.0f/s (%.0f us each): +%.0f us per handler (%.1f%%)\n",
              clients, without.per_second, without.micros_per_op, with.per_second, with.micros_per_op,
              with.micros_per_op - without.micros_per_op,
              100.0 * (with.micros_per_op - without.micros_per_op) / without.micros_per_op);

  // 2. Relay throughput: `messages` rows written straight into the outbox, then drained.
  sql(conninfo, "TRUNCATE idem_bench.with_outbox_outbox");
  sql(conninfo, "INSERT INTO idem_bench.with_outbox_outbox (id, destination, message_key, payload, headers, created_at) "
                "SELECT 'bench-' || g, 'bench:relay', convert_to((g % 1000)::text, 'UTF8'), "
                "convert_to('{\"delta\":1,\"reason\":\"bench\"}', 'UTF8'), ''::bytea, 0 FROM generate_series(1, " +
                    std::to_string(messages) + ") g");
  idem::RedisStreamsPublisher pub{{.redis = {.url = redis}}};
  idem::OutboxRelayOptions ro;
  ro.postgres.conninfo = conninfo;
  ro.schema = "idem_bench";
  ro.table = "with_outbox";
  ro.batch = static_cast<std::size_t>(batch);
  idem::OutboxRelay relay{pub, ro};
  relay.run_once();  // connects (and checks the table) outside the timing
  const auto t0 = Clock::now();
  while (relay.run_once() > 0) {
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  const auto st = relay.stats();
  std::printf("relay -> redis-streams, batch %d: %llu messages in %.2f s: %.0f messages/s (%llu batches)\n", batch,
              static_cast<unsigned long long>(st.published), secs, static_cast<double>(st.published) / secs,
              static_cast<unsigned long long>(st.batches));
  sql(conninfo, "DROP SCHEMA IF EXISTS idem_bench CASCADE");
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "idem_bench_outbox: %s\n", e.what());
  return 1;
}
