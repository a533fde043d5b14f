// SqliteStore beyond the contract: transactional mode (the handler's writes commit with the record,
// roll back with an exception, the claim seen in flight from another store on the file), batches,
// purge, the schema and its migration, and bad files and bad conditions (corrupt, foreign,
// read-only, full, locked), each a typed error that decides nothing.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "idem/idem.hpp"
#include "sqlite_support.hpp"

using namespace std::chrono_literals;
using idem::AcquireStatus;
using idem::SqliteMode;
using idem::SqliteOptions;
using idem::SqliteStore;
using idem::Status;
using idem::WriteStatus;
using sqlitetest::ap;
using sqlitetest::fresh_path;
using sqlitetest::Raw;

namespace {

template <class E, class F>
E capture(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e;
  }
  FAIL("expected exception was not thrown");
  throw std::logic_error("unreachable");
}

// The exit status of a forked child running f (which returns its own exit code); the child
// never returns into Catch2 and never runs the parent's exit handlers.
template <class F>
int in_child(F&& f) {
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    int code = 99;
    try {
      code = f();
    } catch (...) {
      code = 98;
    }
    _exit(code);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

struct TxStore {
  std::string path = fresh_path("tx");
  SqliteStore store{SqliteOptions{.path = path, .mode = SqliteMode::transactional, .busy_timeout = 150ms}};
  idem::IdempotencyGuard<SqliteStore> guard{store, idem::GuardOptions{.lease = 30s, .retention = 600s}};
  TxStore() { Raw(path).exec("CREATE TABLE effect (k TEXT PRIMARY KEY, n INTEGER NOT NULL)"); }
  std::string effect(const std::string& k) { return Raw(path).scalar("SELECT n FROM effect WHERE k = '" + k + "'"); }
};

}  // namespace

TEST_CASE("sqlite store: the file is in WAL mode with the durability asked for", "[sqlite]") {
  const std::string path = fresh_path("wal");
  SqliteStore full{SqliteOptions{.path = path}};
  REQUIRE(full.acquire("k", ap(1)).status == AcquireStatus::acquired);
  CHECK(Raw(path).scalar("PRAGMA journal_mode") == "wal");
  CHECK(Raw(path).scalar("SELECT version FROM idem_schema WHERE table_name = 'idem_records'") ==
        std::to_string(SqliteStore::schema_version));
  CHECK(full.limits().max_key_bytes == SqliteStore::max_key_bytes);
  CHECK_THROWS_AS(full.acquire(std::string(SqliteStore::max_key_bytes + 1, 'k'), ap(2)), idem::invalid_key_error);
  CHECK_FALSE(full.transactional());
}

TEST_CASE("sqlite store: transactional mode commits the handler's write with the completion", "[sqlite][transactional]") {
  TxStore t;
  auto out = t.guard.run("order-1", [&](const auto& ctx) {
    CHECK(ctx.tx->is_open());
    CHECK(ctx.tx->key() == "order-1");
    CHECK(ctx.tx->exec("INSERT INTO effect (k, n) VALUES (?, ?)", "order-1", 1) == 1);
    CHECK(ctx.tx->exec("UPDATE effect SET n = n + ? WHERE k = ?", std::int64_t{41}, std::string("order-1")) == 1);
    // Inside the transaction, its own writes are visible through the handle.
    sqlite3_stmt* s = nullptr;
    REQUIRE(sqlite3_prepare_v2(ctx.tx->handle(), "SELECT n FROM effect WHERE k = 'order-1'", -1, &s, nullptr) == SQLITE_OK);
    REQUIRE(sqlite3_step(s) == SQLITE_ROW);
    CHECK(sqlite3_column_int(s, 0) == 42);
    sqlite3_finalize(s);
    // Not visible to anyone else before the commit.
    CHECK(t.effect("order-1").empty());
    // A write of its own store from inside the transaction would wait for itself: refused.
    CHECK_THROWS_AS(t.store.acquire("nested", ap(9)), idem::usage_error);
    return std::string("credited");
  });
  CHECK(out.status == Status::executed);
  CHECK(t.effect("order-1") == "42");
  auto dup = t.guard.run("order-1", [&](const auto&) -> std::string {
    FAIL("a completed key ran again");
    return "";
  });
  CHECK(dup.status == Status::duplicate);
  CHECK(*dup.value == "credited");
  auto rec = t.store.inspect("order-1");
  REQUIRE(rec);
  CHECK(rec->state == idem::State::completed);
}

TEST_CASE("sqlite store: a thrown handler rolls back its write and the record together", "[sqlite][transactional]") {
  TxStore t;
  CHECK_THROWS_WITH(t.guard.run("order-2",
                                [&](const auto& ctx) {
                                  ctx.tx->exec("INSERT INTO effect (k, n) VALUES ('order-2', 1)");
                                  throw std::runtime_error("downstream refused");
                                }),
                    "downstream refused");
  CHECK(t.effect("order-2").empty());
  auto rec = t.store.inspect("order-2");
  REQUIRE(rec);
  CHECK(rec->state == idem::State::failed);  // released: the next delivery runs at once
  auto again = t.guard.run("order-2", [&](const auto& ctx) {
    ctx.tx->exec("INSERT INTO effect (k, n) VALUES ('order-2', 1)");
    return 2;
  });
  CHECK(again.status == Status::executed);
  CHECK(again.attempt == 2);
  CHECK(t.effect("order-2") == "1");
  // An SQL error in the handler is the handler's error (from_handler), and rolls back too.
  auto e = capture<idem::store_error>([&] {
    t.guard.run("order-3", [&](const auto& ctx) {
      ctx.tx->exec("INSERT INTO effect (k, n) VALUES ('order-3', 1)");
      ctx.tx->exec("INSERT INTO no_such_table VALUES (1)");
    });
  });
  CHECK(e.from_handler());
  CHECK(t.effect("order-3").empty());
}

TEST_CASE("sqlite store: a claim is in flight for another store on the file, and the lock stops new claims",
          "[sqlite][transactional]") {
  TxStore t;
  REQUIRE(t.guard.run("done", [](const auto&) { return 7; }).status == Status::executed);
  SqliteStore other{SqliteOptions{.path = t.path, .busy_timeout = 100ms}};
  bool ran = false;
  auto out = t.guard.run("held", [&](const auto& ctx) {
    ran = true;
    ctx.tx->exec("INSERT INTO effect (k, n) VALUES ('held', 1)");
    // The claim committed before the handler: another store (another process alike) sees it.
    auto r = other.acquire("held", ap(77));
    CHECK(r.status == AcquireStatus::in_flight);
    CHECK(r.retry_after > 0ms);
    auto rec = other.inspect("held");
    REQUIRE(rec);
    CHECK(rec->state == idem::State::in_progress);
    CHECK(rec->holder.fence == ctx.fence);
    // A duplicate is answered from a snapshot while the write lock is held.
    auto d = other.acquire("done", ap(78));
    CHECK(d.status == AcquireStatus::duplicate);
    // A new key needs the write lock: a typed, retryable timeout after busy_timeout, nothing decided.
    const auto started = std::chrono::steady_clock::now();
    auto busy = capture<idem::timeout_error>([&] { other.acquire("fresh", ap(79)); });
    CHECK(std::chrono::steady_clock::now() - started >= 90ms);
    CHECK(busy.retryable());
    CHECK(busy.code() == "SQLITE_BUSY");
    CHECK_FALSE(other.inspect("fresh").has_value());
    return 1;
  });
  CHECK(ran);
  CHECK(out.status == Status::executed);
  CHECK(t.effect("held") == "1");
  CHECK(other.acquire("fresh", ap(80)).status == AcquireStatus::acquired);
  CHECK(other.acquire("held", ap(81)).status == AcquireStatus::duplicate);
}

TEST_CASE("sqlite store: a handler cannot commit its writes without the record", "[sqlite][transactional]") {
  TxStore t;
  // The commit hook turns the handler's own COMMIT into a rollback; the completion then finds the
  // transaction gone and records nothing: the effect and the record stay together (neither).
  auto e = capture<idem::store_error>([&] {
    t.guard.run("k", [&](const auto& ctx) {
      ctx.tx->exec("INSERT INTO effect (k, n) VALUES ('k', 1)");
      CHECK(sqlite3_exec(ctx.tx->handle(), "COMMIT", nullptr, nullptr, nullptr) != SQLITE_OK);
      return 1;
    });
  });
  CHECK(e.code() == "SQLITE_TXN");
  CHECK(t.effect("k").empty());
  auto rec = t.store.inspect("k");
  REQUIRE(rec);
  CHECK(rec->state == idem::State::in_progress);  // the claim lapses after its lease
}

TEST_CASE("sqlite store: Transaction by hand: in flight, lease_lost, abandon releases", "[sqlite][transactional]") {
  auto clock = std::make_shared<idem::ManualClock>(1'700'000'000'000);
  const std::string path = fresh_path("byhand");
  SqliteStore s{SqliteOptions{.path = path, .mode = SqliteMode::transactional, .clock = clock}};
  {
    auto tx = s.begin("k1", ap(5));
    REQUIRE(tx.is_open());
    REQUIRE(tx.decision().status == AcquireStatus::acquired);
    CHECK(tx.exec("CREATE TABLE t (x)") == 0);
    CHECK_THROWS_AS(tx.exec("INSERT INTO t VALUES (1); INSERT INTO t VALUES (2)"), idem::usage_error);
    CHECK_THROWS_AS(tx.exec("INSERT INTO t VALUES (?)"), idem::usage_error);  // one parameter, no value
  }  // abandoned open: rolled back, the key released at once
  CHECK(Raw(path).scalar("SELECT count(*) FROM sqlite_master WHERE name = 't'") == "0");
  auto again = s.begin("k1", ap(6));
  REQUIRE(again.decision().status == AcquireStatus::acquired);
  CHECK(again.decision().holder.fence == 2);
  CHECK(again.commit("v", 60s) == WriteStatus::ok);
  CHECK_FALSE(again.is_open());
  CHECK_THROWS_AS(again.commit("v", 60s), idem::usage_error);
  auto dup = s.begin("k1", ap(7));
  CHECK_FALSE(dup.is_open());
  CHECK(dup.decision().status == AcquireStatus::duplicate);
  CHECK(dup.decision().payload == "v");
  CHECK(dup.handle() == nullptr);
  // A claim whose lease lapsed and was taken over (by a lease-mode call here) cannot commit.
  REQUIRE(s.acquire("k2", ap(8, 1s)).status == AcquireStatus::acquired);
  clock->advance(2s);
  auto late = s.acquire("k2", ap(9));
  REQUIRE(late.status == AcquireStatus::acquired);
  CHECK(late.takeover);
  CHECK(s.complete("k2", idem::Holder{1, 8}, "stale", 60s) == WriteStatus::lease_lost);
}

TEST_CASE("sqlite store: run_batch takes its keys in one transaction and writes them in another", "[sqlite]") {
  const std::string path = fresh_path("batch");
  SqliteStore s{SqliteOptions{.path = path}};
  idem::IdempotencyGuard guard(s, idem::GuardOptions{.lease = 30s, .retention = 600s});
  std::vector<std::string> keys;
  for (int i = 0; i < 100; ++i) keys.push_back("b-" + std::to_string(i));
  std::vector<idem::BatchItem> items;
  for (const auto& k : keys) items.push_back({k, ""});
  int ran = 0;
  auto r = guard.run_batch(items, [&](const idem::BatchItem&) { return ++ran; });
  CHECK(ran == 100);
  CHECK(r.executed() == 100);
  auto again = guard.run_batch(items, [&](const idem::BatchItem&) { return ++ran; });
  CHECK(ran == 100);
  for (std::size_t i = 0; i < items.size(); ++i) {
    CHECK(again.outcomes[i].status == Status::duplicate);
    CHECK(again.outcomes[i].value == r.outcomes[i].value);
  }
  // The writer keeps its writes until finish(): nothing is visible before, all of it after.
  auto acquired = s.acquire_many(std::vector<idem::AcquireRequest>{{"w-1", ap(11)}, {"w-2", ap(12)}});
  REQUIRE(acquired.size() == 2);
  auto w = s.batch_writer();
  w.complete("w-1", acquired[0].holder, "one", 60s);
  w.complete("w-2", idem::Holder{acquired[1].holder.fence, 999}, "wrong holder", 60s);
  CHECK(s.inspect("w-1")->state == idem::State::in_progress);
  CHECK_THROWS_AS(w.complete("w-1", acquired[0].holder, std::string(s.options().max_result_bytes + 1, 'x'), 60s),
                  idem::usage_error);
  CHECK(w.finish() == std::vector<WriteStatus>{WriteStatus::ok, WriteStatus::lease_lost});
  CHECK(s.inspect("w-1")->state == idem::State::completed);
  CHECK(s.inspect("w-2")->state == idem::State::in_progress);
}

TEST_CASE("sqlite store: purge_expired deletes expired records only, in batches", "[sqlite]") {
  auto clock = std::make_shared<idem::ManualClock>(1'700'000'000'000);
  SqliteStore s{SqliteOptions{.path = fresh_path("purge"), .clock = clock}};
  for (int i = 0; i < 25; ++i) {
    auto p = ap(static_cast<std::uint64_t>(i + 1), 1s);
    p.retention = 10s;
    auto r = s.acquire("short-" + std::to_string(i), p);
    REQUIRE(s.complete("short-" + std::to_string(i), r.holder, "x", 10s) == WriteStatus::ok);
  }
  auto keep = s.acquire("long", ap(100, 30s));
  REQUIRE(s.complete("long", keep.holder, "kept", 3600s) == WriteStatus::ok);
  CHECK(s.purge_expired() == 0);
  clock->advance(11s);
  CHECK(s.purge_expired(10) == 25);  // three batches of at most 10
  CHECK(s.purge_expired() == 0);
  CHECK(s.inspect("long")->result == "kept");
  CHECK_FALSE(s.inspect("short-3").has_value());
  CHECK_THROWS_AS(s.purge_expired(0), idem::invalid_options_error);
}

TEST_CASE("sqlite store: a version-1 table is migrated in place, a newer one refused", "[sqlite]") {
  const std::string path = fresh_path("migrate");
  {
    // What version 1 installed: the table and its version row, no expiry index.
    Raw raw(path);
    raw.exec("CREATE TABLE idem_schema (table_name TEXT PRIMARY KEY, kind TEXT NOT NULL, version INTEGER NOT NULL, "
             "installed_at INTEGER NOT NULL)");
    raw.exec("CREATE TABLE \"idem_records\" (key BLOB NOT NULL PRIMARY KEY, state INTEGER NOT NULL, fence INTEGER "
             "NOT NULL, token INTEGER NOT NULL, owner BLOB NOT NULL, lease_until INTEGER NOT NULL, retry_at INTEGER NOT "
             "NULL, attempts INTEGER NOT NULL, permanent INTEGER NOT NULL, fingerprint BLOB NOT NULL, result BLOB NOT "
             "NULL, error BLOB NOT NULL, expires_at INTEGER NOT NULL)");
    raw.exec("INSERT INTO idem_schema VALUES ('idem_records', 'records', 1, 0)");
    raw.exec("INSERT INTO idem_records VALUES (x'6f6c64', 2, 1, 5, x'', 0, 0, 1, 0, x'', x'76616c7565', x'', "
             "9000000000000)");
  }
  {
    SqliteStore noauto{SqliteOptions{.path = path, .auto_migrate = false}};
    auto e = capture<idem::store_error>([&] { noauto.acquire("k", ap(1)); });
    CHECK_FALSE(e.retryable());
    CHECK_THAT(e.what(), Catch::Contains("migrate()"));
  }
  SqliteStore s{SqliteOptions{.path = path}};
  auto d = s.acquire("old", ap(2));
  CHECK(d.status == AcquireStatus::duplicate);  // the record written under version 1 is still read
  CHECK(d.payload == "value");
  Raw raw(path);
  CHECK(raw.scalar("SELECT version FROM idem_schema WHERE table_name = 'idem_records'") == "2");
  CHECK(raw.scalar("SELECT name FROM sqlite_master WHERE type = 'index' AND name = 'idem_records_expires'") ==
        "idem_records_expires");
  raw.exec("UPDATE idem_schema SET version = 99");
  SqliteStore newer{SqliteOptions{.path = path}};
  auto e = capture<idem::store_error>([&] { newer.acquire("k", ap(3)); });
  CHECK_FALSE(e.retryable());
  CHECK_THAT(e.what(), Catch::Contains("newer"));
}

TEST_CASE("sqlite store: bad options are refused at construction", "[sqlite]") {
  CHECK_THROWS_AS(SqliteStore(SqliteOptions{}), idem::invalid_options_error);
  CHECK_THROWS_AS(SqliteStore(SqliteOptions{.path = ":memory:"}), idem::invalid_options_error);
  CHECK_THROWS_AS(SqliteStore(SqliteOptions{.path = fresh_path(), .table = "Records"}), idem::invalid_options_error);
  CHECK_THROWS_AS(SqliteStore(SqliteOptions{.path = fresh_path(), .table = "sqlite_x"}), idem::invalid_options_error);
  CHECK_THROWS_AS(SqliteStore(SqliteOptions{.path = fresh_path(), .table = "idem_schema"}), idem::invalid_options_error);
  CHECK_THROWS_AS(SqliteStore(SqliteOptions{.path = fresh_path(), .busy_timeout = -1ms}), idem::invalid_options_error);
  CHECK_THROWS_AS(SqliteStore(SqliteOptions{.path = fresh_path(), .max_result_bytes = 0}), idem::invalid_options_error);
  CHECK_THROWS_AS(SqliteStore(SqliteOptions{.path = fresh_path(), .max_idle_connections = 0}),
                  idem::invalid_options_error);
  auto e = capture<idem::store_error>([] { SqliteStore(SqliteOptions{.path = "/nonexistent-dir/x/idem.db"}); });
  CHECK(e.code() == "SQLITE_CANTOPEN");
  CHECK_FALSE(e.retryable());
}

TEST_CASE("sqlite store: a corrupt file, a foreign table and an unreadable record are typed errors", "[sqlite]") {
  const std::string junk = fresh_path("junk");
  {
    std::ofstream out(junk, std::ios::binary);
    std::mt19937 rng(7);
    for (int i = 0; i < 64 * 1024; ++i) out.put(static_cast<char>(rng()));
  }
  auto e = capture<idem::store_error>([&] { SqliteStore(SqliteOptions{.path = junk}); });
  CHECK(e.code() == "SQLITE_NOTADB");
  CHECK_FALSE(e.retryable());
  CHECK_THAT(e.what(), Catch::Contains("not an SQLite database"));

  const std::string foreign = fresh_path("foreign");
  Raw(foreign).exec("CREATE TABLE idem_records (id INTEGER PRIMARY KEY, name TEXT); INSERT INTO idem_records VALUES "
                    "(1, 'theirs')");
  SqliteStore f{SqliteOptions{.path = foreign}};
  auto fe = capture<idem::store_error>([&] { f.acquire("k", ap(1)); });
  CHECK_FALSE(fe.retryable());
  CHECK_THAT(fe.what(), Catch::Contains("idem did not create"));
  CHECK(Raw(foreign).scalar("SELECT name FROM idem_records") == "theirs");  // untouched
  // Beside it, a table name of its own works in the same file.
  SqliteStore mine{SqliteOptions{.path = foreign, .table = "idem_keys"}};
  CHECK(mine.acquire("k", ap(2)).status == AcquireStatus::acquired);

  const std::string damaged = fresh_path("damaged");
  SqliteStore d{SqliteOptions{.path = damaged}};
  REQUIRE(d.acquire("k", ap(3)).status == AcquireStatus::acquired);
  Raw(damaged).exec("UPDATE idem_records SET state = 9");
  CHECK_THROWS_AS(d.acquire("k", ap(4)), idem::corrupt_record_error);
  CHECK_THROWS_AS(d.inspect("k"), idem::corrupt_record_error);
  CHECK(d.complete("k", idem::Holder{1, 3}, "x", 60s) == WriteStatus::lease_lost);  // never written over
  CHECK(Raw(damaged).scalar("SELECT state FROM idem_records") == "9");
}

TEST_CASE("sqlite store: a locked file is a retryable timeout that decides nothing", "[sqlite]") {
  const std::string path = fresh_path("locked");
  SqliteStore s{SqliteOptions{.path = path, .busy_timeout = 200ms}};
  auto done = s.acquire("done", ap(1));
  REQUIRE(s.complete("done", done.holder, "v", 60s) == WriteStatus::ok);
  auto held = s.acquire("held", ap(2));
  REQUIRE(held.status == AcquireStatus::acquired);
  Raw other(path);
  other.exec("BEGIN IMMEDIATE");  // another process holding the write lock
  const auto started = std::chrono::steady_clock::now();
  auto e = capture<idem::timeout_error>([&] { s.acquire("new", ap(3)); });
  const auto waited = std::chrono::steady_clock::now() - started;
  CHECK(waited >= 180ms);
  CHECK(waited < 3s);
  CHECK(e.retryable());
  CHECK(e.code() == "SQLITE_BUSY");
  CHECK_THROWS_AS(s.complete("held", held.holder, "r", 60s), idem::timeout_error);
  CHECK(s.acquire("done", ap(4)).status == AcquireStatus::duplicate);  // read from a snapshot
  CHECK(s.acquire("held", ap(5)).status == AcquireStatus::in_flight);
  idem::IdempotencyGuard guard(s);
  bool ran = false;
  CHECK_THROWS_AS(guard.run("new", [&] { ran = true; }), idem::timeout_error);
  CHECK_FALSE(ran);
  other.exec("ROLLBACK");
  CHECK_FALSE(s.inspect("new").has_value());
  auto rec = s.inspect("held");
  REQUIRE(rec);
  CHECK(rec->state == idem::State::in_progress);
  CHECK(s.complete("held", held.holder, "r", 60s) == WriteStatus::ok);
  CHECK(guard.run("new", [&] { ran = true; }).status == Status::executed);
}

TEST_CASE("sqlite store: a read-only file is refused with what to fix", "[sqlite]") {
  // Root ignores permission bits, so the child drops to nobody before it opens the 0444 file.
  const std::string sub = (sqlitetest::dir() / ("ro-" + sqlitetest::random_hex())).string();
  REQUIRE(mkdir(sub.c_str(), 0755) == 0);
  REQUIRE(chmod(sqlitetest::dir().c_str(), 0755) == 0);
  const std::string path = sub + "/idem.db";
  {
    SqliteStore s{SqliteOptions{.path = path}};
    auto r = s.acquire("k", ap(1));
    REQUIRE(s.complete("k", r.holder, "v", 60s) == WriteStatus::ok);
  }  // the last connection checkpoints and removes the -wal and -shm files
  REQUIRE(chmod(path.c_str(), 0444) == 0);
  const int code = in_child([&] {
    if (geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0)) return 20;
    try {
      SqliteStore s{SqliteOptions{.path = path}};
      return 21;  // opened for writing: wrong
    } catch (const idem::store_error& e) {
      if (e.code() != "SQLITE_READONLY" || e.retryable()) return 22;
      if (std::string(e.what()).find("writable") == std::string::npos) return 23;
      return 0;
    }
  });
  CHECK(code == 0);
  chmod(path.c_str(), 0644);
}

TEST_CASE("sqlite store: a full disk is a capacity_error and no write is half made", "[sqlite]") {
  // RLIMIT_FSIZE in a child (with SIGXFSZ ignored) stands for a full disk: writes past it fail.
  const std::string path = fresh_path("full");
  int fds[2];
  REQUIRE(pipe(fds) == 0);
  const std::string big(32 * 1024, 'r');
  const int code = in_child([&] {
    close(fds[0]);
    SqliteStore s{SqliteOptions{.path = path}};
    s.migrate();
    signal(SIGXFSZ, SIG_IGN);
    rlimit lim{};
    lim.rlim_cur = lim.rlim_max = 1'000'003;  // not a page boundary: a frame is cut short, as on a full disk
    if (setrlimit(RLIMIT_FSIZE, &lim) != 0) return 30;
    for (int i = 0; i < 1000; ++i) {
      const std::string k = "k" + std::to_string(i);
      try {
        auto r = s.acquire(k, ap(static_cast<std::uint64_t>(i + 1)));
        if (r.status != AcquireStatus::acquired) return 31;
        if (s.complete(k, r.holder, big, 60s) != WriteStatus::ok) return 32;
      } catch (const idem::capacity_error& e) {
        // SQLITE_FULL on a short write (ENOSPC); SQLITE_IOERR when SQLite retries the rest and the
        // OS says EFBIG, as the file-size limit does.
        if ((e.code() != "SQLITE_FULL" && e.code() != "SQLITE_IOERR") || !e.retryable()) return 33;
        if (std::string(e.what()).find("full") == std::string::npos) return 37;
        if (write(fds[1], &i, sizeof i) != sizeof i) return 34;
        return 0;
      } catch (const idem::error& e) {
        std::fprintf(stderr, "full-disk child: %s\n", e.what());
        return 36;
      }
    }
    return 35;
  });
  close(fds[1]);
  int failed_at = -1;
  const auto got = read(fds[0], &failed_at, sizeof failed_at);
  close(fds[0]);
  REQUIRE(code == 0);
  REQUIRE(got == sizeof failed_at);
  REQUIRE(failed_at > 0);
  SqliteStore s{SqliteOptions{.path = path}};
  CHECK(Raw(path).scalar("PRAGMA integrity_check") == "ok");
  for (int i = 0; i < failed_at; ++i) {
    auto d = s.acquire("k" + std::to_string(i), ap(5000));
    CHECK(d.status == AcquireStatus::duplicate);
    CHECK(d.payload == big);
  }
  // The write that failed decided nothing: its key is free or still held, never completed.
  auto rec = s.inspect("k" + std::to_string(failed_at));
  CHECK((!rec || rec->state == idem::State::in_progress));
}
