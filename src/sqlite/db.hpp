#pragma once
// The file a SqliteStore and its SqliteSequenceStores share: the connection pool, the in-process
// write mutex, the clock, SQLite's codes mapped to idem's errors, the versioned schema. Private to
// src/sqlite.

#include <sqlite3.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <unordered_map>
#include <vector>

#include "idem/core/clock.hpp"
#include "idem/core/error.hpp"
#include "idem/sqlite/store.hpp"

namespace idem::detail {

/// SQLite's name of a result code's primary part ("SQLITE_BUSY"), the code of idem's errors.
std::string_view sqlite_code_name(int rc);
/// Throws the idem error for SQLite code `rc` met by `what` on the file `path` (`c` may be null;
/// then `sys` is the OS errno SQLite saw): every connection of the store and of SqliteAdmin
/// classifies a failure here, once.
[[noreturn]] void raise_sqlite(sqlite3* c, int rc, std::string_view what, const std::string& path, millis busy,
                               int sys = 0);

/// One open sqlite3 connection with its prepared statements.
struct SqliteConn {
  sqlite3* db = nullptr;
  std::unordered_map<std::string, sqlite3_stmt*> stmts;
  // True while a transactional-mode handler owns the open transaction: the commit hook then turns
  // a COMMIT it runs itself into a rollback, so its writes can never commit without the record.
  bool in_handler = false;

  SqliteConn() = default;
  SqliteConn(const SqliteConn&) = delete;
  SqliteConn& operator=(const SqliteConn&) = delete;
  ~SqliteConn();
  sqlite3_stmt* prepare(const std::string& sql);
};

/// What a failed COMMIT may have done, for the error it becomes.
enum class CommitKind : std::uint8_t {
  decision,    // an acquire / claim: in doubt it ran no handler, so a redelivery is safe
  completion,  // a completion or failure: in doubt it must be reconciled, never retried blindly
  plain,       // migration, purge, sequences
};

class SqliteDb;

/// The in-process write mutex, held; remembers its thread so the same thread asking again (a
/// transactional handler calling a write of its own store) is refused instead of locking twice.
class WriterLock {
 public:
  WriterLock(std::timed_mutex& m, std::atomic<std::thread::id>& owner) : lk_(m, std::adopt_lock), owner_(&owner) {
    owner.store(std::this_thread::get_id());
  }
  WriterLock(WriterLock&& o) noexcept : lk_(std::move(o.lk_)), owner_(std::exchange(o.owner_, nullptr)) {}
  WriterLock& operator=(WriterLock&&) = delete;
  WriterLock(const WriterLock&) = delete;
  WriterLock& operator=(const WriterLock&) = delete;
  ~WriterLock() {
    if (owner_ && lk_.owns_lock()) owner_->store(std::thread::id{});
  }

 private:
  std::unique_lock<std::timed_mutex> lk_;
  std::atomic<std::thread::id>* owner_ = nullptr;
};

/// A prepared statement of a connection's cache, reset and unbound when it goes out of scope.
class Stmt {
 public:
  Stmt(const SqliteDb& db, SqliteConn& c, const std::string& sql, std::string_view what);
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;
  ~Stmt();
  Stmt& bind(int i, std::int64_t v);
  Stmt& bind_blob(int i, std::string_view v);
  Stmt& bind_text(int i, std::string_view v);
  /// Steps once: true when a row is ready, false when done; throws the mapped error.
  bool step();
  /// Steps to the end (a write); the rows it changed.
  std::int64_t run();
  std::int64_t col_int(int i) const;
  std::string col_blob(int i) const;
  bool col_is_int(int i) const;
  [[nodiscard]] sqlite3_stmt* raw() const noexcept { return s_; }

 private:
  const SqliteDb* db_;
  SqliteConn* c_;
  sqlite3_stmt* s_;
  std::string_view what_;
};

/// The shared file: connections, write mutex, clock and error mapping.
class SqliteDb {
 public:
  /// Options already validated.
  explicit SqliteDb(const SqliteOptions& o);
  ~SqliteDb();

  struct Returner {
    SqliteDb* db;
    void operator()(SqliteConn* c) const noexcept;
  };
  using ConnPtr = std::unique_ptr<SqliteConn, Returner>;

  /// An idle connection, or a new one.
  ConnPtr checkout();
  /// The in-process write mutex, waited for up to busy_timeout (else timeout_error).
  WriterLock lock_writer(std::string_view what);
  /// Milliseconds on the store clock.
  [[nodiscard]] std::int64_t now_ms() const;

  /// Throws the idem error for SQLite code `rc` met by `what` on `c` (c may be null; then `sys`
  /// is the OS errno SQLite saw, read before the connection moved on).
  [[noreturn]] void raise(sqlite3* c, int rc, std::string_view what, int sys = 0) const;
  /// Runs SQL without parameters (BEGIN, COMMIT, DDL).
  void exec(SqliteConn& c, const char* sql, std::string_view what) const;
  void begin_immediate(SqliteConn& c, std::string_view what) const;
  /// COMMIT; on failure rolls back what is left and throws what `kind` says the failure means.
  void commit(SqliteConn& c, CommitKind kind, std::string_view what) const;
  /// ROLLBACK if a transaction is open; never throws.
  static void rollback_quietly(SqliteConn& c) noexcept;

  /// f(conn) in one BEGIN IMMEDIATE transaction under the write mutex; committed if f returns.
  template <class F>
  auto write(std::string_view what, CommitKind kind, F&& f) {
    auto lk = lock_writer(what);
    ConnPtr c = checkout();
    begin_immediate(*c, what);
    try {
      if constexpr (std::is_void_v<decltype(f(*c))>) {
        f(*c);
        commit(*c, kind, what);
      } else {
        auto r = f(*c);
        commit(*c, kind, what);
        return r;
      }
    } catch (...) {
      rollback_quietly(*c);
      throw;
    }
  }

  /// Creates or upgrades `table` (of `kind`, "records" or "sequences") to `version` by running
  /// scripts[v-1] for each missing version, in one write transaction. Refuses a table idem did
  /// not create, one of another kind and a newer version.
  void ensure_schema(const std::string& table, std::string_view kind, int version,
                     const std::vector<std::string>& scripts);
  /// The installed version of `table` (0 when none), read without the write lock.
  int installed_version(SqliteConn& c, const std::string& table, std::string_view kind);

  [[nodiscard]] const std::string& path() const noexcept { return path_; }
  [[nodiscard]] millis busy_timeout() const noexcept { return busy_; }

 private:
  std::unique_ptr<SqliteConn> open();

  std::string path_;
  SqliteSync sync_;
  millis busy_;
  std::size_t max_idle_;
  std::shared_ptr<const Clock> clock_;
  std::mutex pool_mu_;
  std::vector<std::unique_ptr<SqliteConn>> idle_;
  std::timed_mutex write_mu_;
  std::atomic<std::thread::id> writer_{};
};

/// "a b" → "\"a b\"" (names are validated identifiers; quoted all the same).
std::string sqlite_quote(std::string_view name);
/// Throws invalid_options_error unless `name` is [a-z_][a-z0-9_]*, at most 40 bytes, not reserved.
void check_sqlite_table(std::string_view name, std::string_view option);

}  // namespace idem::detail
