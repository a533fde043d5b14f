// sqlite_quickstart: exactly-once effects across a crash and a restart, in one SQLite file, no server.
//
// 4 worker threads take N messages, each delivered 1-3 times in shuffled order, through an
// IdempotencyGuard on a SqliteStore in transactional mode: the handler records its effect (a row
// in `effects`) through ctx.tx, in the same transaction as the key's completion. With
// --crash-after K the process SIGKILLs itself inside the K-th handler, after its INSERT and before
// the commit: nothing of that run's open transaction reaches the file. Run it again on the same
// file (the broker redelivers everything): the finished messages answer duplicate, the one the
// crash left in_progress is taken over once its lease lapses, and at the end every message has
// exactly one row in `effects`. scripts/demo runs the pair.
//
//   idem_sqlite_quickstart --db PATH [--messages N] [--crash-after K] [--lease-ms L] [--seed S]

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <sqlite3.h>

#include "idem/idem.hpp"
#include "idem/sqlite.hpp"

using namespace std::chrono_literals;

namespace {

long arg(int argc, char** argv, const char* name, long dflt) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == name) return std::strtol(argv[i + 1], nullptr, 10);
  return dflt;
}

std::string arg_text(int argc, char** argv, const char* name) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == name) return argv[i + 1];
  return {};
}

// The business table lives in the store's file, so its rows commit with the records.
void create_effects_table(const std::string& path) {
  sqlite3* db = nullptr;
  if (sqlite3_open(path.c_str(), &db) != SQLITE_OK) throw std::runtime_error(sqlite3_errmsg(db));
  sqlite3_busy_timeout(db, 5000);
  char* err = nullptr;
  const int rc = sqlite3_exec(db, "CREATE TABLE IF NOT EXISTS effects (message INTEGER NOT NULL, fence INTEGER NOT NULL)",
                              nullptr, nullptr, &err);
  const std::string why = err ? err : "";
  sqlite3_free(err);
  sqlite3_close(db);
  if (rc != SQLITE_OK) throw std::runtime_error("CREATE TABLE effects: " + why);
}

// Rows in `effects` per message: what was applied, counted from the file, not inferred.
std::vector<int> count_effects(const std::string& path, int messages) {
  std::vector<int> n(static_cast<std::size_t>(messages));
  sqlite3* db = nullptr;
  sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READONLY, nullptr);
  sqlite3_stmt* s = nullptr;
  sqlite3_prepare_v2(db, "SELECT message, count(*) FROM effects GROUP BY message", -1, &s, nullptr);
  while (sqlite3_step(s) == SQLITE_ROW) {
    const auto m = sqlite3_column_int64(s, 0);
    if (m >= 0 && m < messages) n[static_cast<std::size_t>(m)] = sqlite3_column_int(s, 1);
  }
  sqlite3_finalize(s);
  sqlite3_close(db);
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string path = arg_text(argc, argv, "--db");
  const int messages = static_cast<int>(arg(argc, argv, "--messages", 2000));
  const long crash_after = arg(argc, argv, "--crash-after", 0);
  const auto lease = idem::millis{arg(argc, argv, "--lease-ms", 300)};
  const auto seed = static_cast<unsigned>(arg(argc, argv, "--seed", 2026));
  if (path.empty() || messages <= 0 || crash_after < 0 || lease <= 0ms) {
    std::fprintf(stderr, "usage: idem_sqlite_quickstart --db PATH [--messages N>0] [--crash-after K>=0] "
                         "[--lease-ms L>0] [--seed S]\n");
    return 2;
  }
  create_effects_table(path);
  idem::SqliteStore store{{.path = path, .mode = idem::SqliteMode::transactional}};
  auto stats = std::make_shared<idem::CountingObserver>();
  idem::IdempotencyGuard guard(store, {.lease = lease, .retention = 24h, .observer = stats});

  // The broker: every message 1-3 times, shuffled; what is not acked comes back later. A restart
  // redelivers everything (nothing acked survives the crash of this toy broker).
  std::vector<int> queue;
  std::mt19937 rng(seed);
  for (int m = 0; m < messages; ++m)
    for (int c = 1 + static_cast<int>(rng() % 3); c > 0; --c) queue.push_back(m);
  std::shuffle(queue.begin(), queue.end(), rng);
  const long published = static_cast<long>(queue.size());
  std::mutex mu;
  std::atomic<long> started{0}, requeues{0};

  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> workers;
  for (int w = 0; w < 4; ++w) {
    workers.emplace_back([&] {
      for (;;) {
        int m;
        {
          std::lock_guard lk(mu);
          if (queue.empty()) return;
          m = queue.back();
          queue.pop_back();
        }
        bool redeliver = false;
        try {
          auto out = guard.run("msg-" + std::to_string(m), [&](const auto& ctx) {
            // <- your business write, through the guard's transaction:
            ctx.tx->exec("INSERT INTO effects (message, fence) VALUES (?, ?)", m, static_cast<std::int64_t>(ctx.fence));
            if (crash_after > 0 && started.fetch_add(1) + 1 == crash_after) {
              std::printf("crashing: SIGKILL inside the handler of msg-%d, its INSERT not committed\n", m);
              std::fflush(stdout);
              std::raise(SIGKILL);
            }
            return std::string("ok");
          });
          // A key another run left in_progress answers in_flight until its lease lapses.
          redeliver = out.action() == idem::BrokerAction::requeue;
        } catch (const idem::timeout_error&) {
          redeliver = true;  // the file's write lock stayed busy: nothing decided, deliver again
        }
        if (redeliver) {
          requeues.fetch_add(1);
          std::this_thread::sleep_for(20ms);
          std::lock_guard lk(mu);
          queue.insert(queue.begin(), m);
        }
      }
    });
  }
  for (auto& t : workers) t.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  const auto n = count_effects(path, messages);
  long once = 0, twice = 0, never = 0;
  for (int c : n) {
    once += c == 1;
    twice += c > 1;
    never += c == 0;
  }
  const auto count = [&](idem::Status s) { return static_cast<unsigned long long>(stats->count(s)); };
  std::printf("idem sqlite quickstart: %d messages, 4 workers, SqliteStore transactional mode on %s\n", messages,
              path.c_str());
  std::printf("  %-28s %10ld\n", "published copies", published);
  std::printf("  %-28s %10llu\n", "executed in this run", count(idem::Status::executed));
  std::printf("  %-28s %10llu\n", "duplicates suppressed", count(idem::Status::duplicate));
  std::printf("  %-28s %10ld\n", "in-flight redeliveries", requeues.load());
  std::printf("  %-28s %10llu\n", "takeovers after lease", static_cast<unsigned long long>(stats->takeovers()));
  std::printf("  %-28s %10.2f\n", "wall seconds", secs);
  std::printf("  effects applied exactly once: %ld of %d (twice or more: %ld, missing: %ld)\n", once, messages, twice,
              never);
  return once == messages ? 0 : 1;
}
