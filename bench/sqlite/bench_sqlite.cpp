// Messages per second through IdempotencyGuard on a SqliteStore, each message a fresh key, beside
// raw sqlite3 prepared statements making the same writes with the same durability (WAL,
// synchronous FULL, then NORMAL), and run_batch of 100 beside one message at a time.
//   idem_bench_sqlite [--dir D] [--seconds S] [--reps R]
// Rows, per synchronous setting, one thread, a file of its own in D:
//   raw lease : BEGIN IMMEDIATE; INSERT the claim; COMMIT  +  BEGIN IMMEDIATE; UPDATE the completion; COMMIT
//   idem lease: guard.run on a fresh key (acquire + complete: two commits), empty handler
//   raw tx    : the claim's commit as above  +  BEGIN IMMEDIATE; UPDATE account; UPDATE the completion; COMMIT
//   idem tx   : guard.run in transactional mode, one UPDATE account through ctx.tx (two commits)
//   batch 100 : guard.run_batch of 100 fresh keys, lease mode (one commit for the acquisitions,
//               one for the completions), against idem lease one message at a time
// Each figure is the median of R interleaved samples of S seconds. Prints one table.
#include <sqlite3.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "idem/idem.hpp"
#include "idem/sqlite.hpp"

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

std::int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void check(int rc, sqlite3* db, const char* what) {
  if (rc != SQLITE_OK && rc != SQLITE_DONE && rc != SQLITE_ROW)
    throw std::runtime_error(std::string(what) + ": " + sqlite3_errmsg(db));
}

// The raw baseline: one connection, WAL, the synchronous setting given, statements prepared once;
// its table has the store's columns, so each row costs what a record costs.
class Raw {
 public:
  Raw(const std::string& path, bool full) {
    check(sqlite3_open(path.c_str(), &db_), db_, "open");
    exec("PRAGMA journal_mode=WAL");
    exec(full ? "PRAGMA synchronous=FULL" : "PRAGMA synchronous=NORMAL");
    exec("CREATE TABLE IF NOT EXISTS raw (key BLOB NOT NULL PRIMARY KEY, state INTEGER NOT NULL, fence INTEGER NOT NULL, "
         "token INTEGER NOT NULL, owner BLOB NOT NULL, lease_until INTEGER NOT NULL, retry_at INTEGER NOT NULL, "
         "attempts INTEGER NOT NULL, permanent INTEGER NOT NULL, fingerprint BLOB NOT NULL, result BLOB NOT NULL, "
         "error BLOB NOT NULL, expires_at INTEGER NOT NULL)");
    exec("CREATE INDEX IF NOT EXISTS raw_expires ON raw (expires_at)");
    ins_ = prepare("INSERT INTO raw VALUES (?1, 1, 1, ?2, ?3, ?4, 0, 1, 0, x'', x'', x'', ?5)");
    done_ = prepare("UPDATE raw SET state = 2, result = ?2, lease_until = 0, expires_at = ?3 WHERE key = ?1 AND state = 1 "
                    "AND fence = 1 AND token = ?4");
    acct_ = prepare("UPDATE account SET balance = balance + 1 WHERE id = ?1");
  }
  ~Raw() {
    for (auto* s : {ins_, done_, acct_}) sqlite3_finalize(s);
    sqlite3_close(db_);
  }
  Raw(const Raw&) = delete;
  Raw& operator=(const Raw&) = delete;

  void exec(const char* sql) { check(sqlite3_exec(db_, sql, nullptr, nullptr, nullptr), db_, sql); }
  sqlite3_stmt* prepare(const char* sql) {
    sqlite3_stmt* s = nullptr;
    check(sqlite3_prepare_v3(db_, sql, -1, SQLITE_PREPARE_PERSISTENT, &s, nullptr), db_, sql);
    return s;
  }
  static void run(sqlite3_stmt* s, sqlite3* db) {
    check(sqlite3_step(s), db, "step");
    sqlite3_reset(s);
  }
  // One message; `business`: the transactional row (an account UPDATE in the completion's commit).
  void message(const std::string& key, bool business, int account) {
    const std::int64_t now = now_ms();
    exec("BEGIN IMMEDIATE");
    sqlite3_bind_blob(ins_, 1, key.data(), static_cast<int>(key.size()), SQLITE_STATIC);
    sqlite3_bind_int64(ins_, 2, 42);
    sqlite3_bind_blob(ins_, 3, "bench", 5, SQLITE_STATIC);
    sqlite3_bind_int64(ins_, 4, now + 30'000);
    sqlite3_bind_int64(ins_, 5, now + 3'600'000);
    run(ins_, db_);
    exec("COMMIT");
    exec("BEGIN IMMEDIATE");
    if (business) {
      sqlite3_bind_int(acct_, 1, account);
      run(acct_, db_);
    }
    sqlite3_bind_blob(done_, 1, key.data(), static_cast<int>(key.size()), SQLITE_STATIC);
    sqlite3_bind_blob(done_, 2, "", 0, SQLITE_STATIC);
    sqlite3_bind_int64(done_, 3, now + 3'600'000);
    sqlite3_bind_int64(done_, 4, 42);
    run(done_, db_);
    exec("COMMIT");
  }

 private:
  sqlite3* db_ = nullptr;
  sqlite3_stmt *ins_ = nullptr, *done_ = nullptr, *acct_ = nullptr;
};

void make_accounts(const std::string& path) {
  sqlite3* db = nullptr;
  sqlite3_open(path.c_str(), &db);
  sqlite3_busy_timeout(db, 5000);
  sqlite3_exec(db,
               "PRAGMA journal_mode=WAL; CREATE TABLE IF NOT EXISTS account (id INTEGER PRIMARY KEY, balance INTEGER NOT "
               "NULL); WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < 10000) "
               "INSERT OR IGNORE INTO account SELECT i, 0 FROM g;",
               nullptr, nullptr, nullptr);
  sqlite3_close(db);
}

// Messages per second of `one` (which handles `per_call` messages) over `secs`.
double rate(double secs, int per_call, const std::function<void()>& one) {
  const auto t0 = Clock::now();
  const auto end = t0 + std::chrono::duration<double>(secs);
  long n = 0;
  while (Clock::now() < end) {
    one();
    n += per_call;
  }
  return static_cast<double>(n) / std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = std::filesystem::temp_directory_path().string();
  double seconds = 2;
  int reps = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == "-h" || a == "--help")) {
      std::cout << "usage: idem_bench_sqlite [--dir D] [--seconds S] [--reps R]\n";
      return 0;
    }
    if (i + 1 >= argc) {
      std::cerr << "option " << a << " needs a value\n";
      return 2;
    }
    const std::string v = argv[++i];
    if (a == "--dir") dir = v;
    else if (a == "--seconds") seconds = std::stod(v);
    else if (a == "--reps") reps = std::stoi(v);
    else {
      std::cerr << "unknown option " << a << "\n";
      return 2;
    }
  }
  if (seconds <= 0 || reps < 1) {
    std::cerr << "usage: idem_bench_sqlite [--dir D] [--seconds S>0] [--reps R>=1]\n";
    return 2;
  }
  std::string work = dir + "/idem-bench-sqlite-XXXXXX";
  if (!mkdtemp(work.data())) {
    std::cerr << "mkdtemp in " << dir << " failed\n";
    return 1;
  }
  struct Cleanup {
    std::string p;
    ~Cleanup() {
      std::error_code ec;
      std::filesystem::remove_all(p, ec);
    }
  } cleanup{work};

  std::mt19937_64 rng{std::random_device{}()};
  long serial = 0;
  const std::string run_id = std::to_string(rng() % 1'000'000);
  auto key = [&] { return "k" + run_id + ":" + std::to_string(++serial); };

  std::printf("SQLite %s, WAL, one thread, fresh keys, median of %d x %.1f s; files in %s\n", sqlite3_libversion(), reps,
              seconds, dir.c_str());
  std::printf("\n%-10s | %10s | %10s | %6s | %10s | %10s | %6s | %12s | %11s\n", "synchronous", "raw lease", "idem lease",
              "ratio", "raw tx", "idem tx", "ratio", "batch 100", "batch/msg");
  std::printf("%s\n", std::string(106, '-').c_str());
  for (const bool full : {true, false}) {
    const std::string file = work + (full ? "/full.db" : "/normal.db");
    make_accounts(file);
    const auto sync = full ? idem::SqliteSync::full : idem::SqliteSync::normal;
    idem::SqliteStore lease_store({.path = file, .table = "records_lease", .synchronous = sync});
    idem::SqliteStore tx_store(
        {.path = file, .table = "records_tx", .mode = idem::SqliteMode::transactional, .synchronous = sync});
    idem::SqliteStore batch_store({.path = file, .table = "records_batch", .synchronous = sync});
    lease_store.migrate();
    tx_store.migrate();
    batch_store.migrate();
    idem::IdempotencyGuard lease_guard(lease_store, {.lease = 30s, .retention = 1h});
    idem::IdempotencyGuard tx_guard(tx_store, {.lease = 30s, .retention = 1h});
    idem::IdempotencyGuard batch_guard(batch_store, {.lease = 30s, .retention = 1h});
    Raw raw(file, full);
    std::uniform_int_distribution<int> acct(1, 10000);

    auto raw_lease = [&] { raw.message(key(), false, 0); };
    auto idem_lease = [&] { lease_guard.run(key(), [] {}); };
    auto raw_tx = [&] { raw.message(key(), true, acct(rng)); };
    auto idem_tx = [&] {
      const int a = acct(rng);
      tx_guard.run(key(), [&](const auto& ctx) { ctx.tx->exec("UPDATE account SET balance = balance + 1 WHERE id = ?", a); });
    };
    auto batch = [&] {
      std::vector<std::string> keys;
      for (int i = 0; i < 100; ++i) keys.push_back(key());
      std::vector<idem::BatchItem> items;
      for (const auto& k : keys) items.push_back({k, {}});
      batch_guard.run_batch(items, [](const idem::BatchItem&) {});
    };
    // Warm-up: caches, the first pages of each table, the WAL's first frames.
    rate(0.2, 1, raw_lease);
    rate(0.2, 1, idem_lease);
    rate(0.2, 1, raw_tx);
    rate(0.2, 1, idem_tx);
    rate(0.2, 100, batch);
    std::vector<double> rl, il, rt, it, b;
    for (int r = 0; r < reps; ++r) {
      rl.push_back(rate(seconds, 1, raw_lease));
      il.push_back(rate(seconds, 1, idem_lease));
      rt.push_back(rate(seconds, 1, raw_tx));
      it.push_back(rate(seconds, 1, idem_tx));
      b.push_back(rate(seconds, 100, batch));
    }
    const double RL = median(rl), IL = median(il), RT = median(rt), IT = median(it), B = median(b);
    std::printf("%-10s | %10.0f | %10.0f | %6.2f | %10.0f | %10.0f | %6.2f | %12.0f | %10.1fx\n", full ? "FULL" : "NORMAL",
                RL, IL, IL / RL, RT, IT, IT / RT, B, B / IL);
    std::fflush(stdout);
  }
  std::printf("\nmessages/s. ratio = idem / raw sqlite3 making the same writes (goal >= 0.8); batch/msg = run_batch of "
              "100 / idem lease one message at a time (goal >= 5x).\n");
  return 0;
}
