#pragma once
// SqliteStore's internals shared by its translation units (store.cpp, transaction.cpp) and the
// sequence store (sequence_store.cpp).

#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "db.hpp"
#include "idem/sqlite/store.hpp"

namespace idem::detail {

/// One record row as stored (times in ms on the store clock).
struct Row {
  State state = State::in_progress;
  std::uint64_t fence = 0, token = 0;
  std::string owner;
  std::int64_t lease_until = 0, retry_at = 0;
  std::uint32_t attempts = 0;
  bool permanent = false;
  std::string fingerprint, result, error;
  std::int64_t expires_at = 0;
};

/// A holder-checked write: complete, complete_unavailable, fail or extend.
struct HeldWrite {
  enum Kind : std::uint8_t { complete, complete_unavailable, fail, extend };
  Kind kind;
  std::string_view key;
  Holder holder;
  std::string_view text;  // result, reason or error
  millis duration{0};     // retention, or the lease for extend
  bool release = false;
  bool permanent = false;
  millis backoff{0};
};

/// The schema scripts of a records table, one per version (scripts[v-1] makes version v); the
/// admin's sqlite_migration_sql prints the same.
std::vector<std::string> record_schema_scripts(const std::string& table);

class SqliteStoreImpl {
 public:
  explicit SqliteStoreImpl(SqliteOptions o);

  /// Creates, upgrades or checks the schema once per store.
  void ensure_ready();
  void migrate();

  /// The live row of `key` (nullopt: absent or expired); corrupt_record_error if unreadable.
  std::optional<Row> read_row(SqliteConn& c, std::string_view key, std::int64_t now) const;
  /// acquire's answer from a snapshot when it writes nothing; nullopt when a claim is due.
  std::optional<AcquireResult> snapshot_decision(std::string_view key, const AcquireParams& p);
  /// acquire inside an open write transaction: decides on the row it reads and writes the claim.
  AcquireResult claim(SqliteConn& c, std::string_view key, const AcquireParams& p);
  /// A holder-checked write inside an open write transaction.
  WriteStatus held_write(SqliteConn& c, const HeldWrite& w);
  /// Validates a holder-checked write's inputs (nothing is written on a bad one).
  void check_write(const HeldWrite& w) const;
  /// A holder-checked write in its own transaction.
  WriteStatus write_one(const HeldWrite& w);
  /// begin(): the claim, then the handler's transaction.
  SqliteStore::Transaction begin(std::string_view key, const AcquireParams& p);

  SqliteOptions opt;
  std::shared_ptr<SqliteDb> db;
  std::vector<std::string> scripts;
  std::string sel_sql, insert_sql, reclaim_sql, complete_sql, fail_sql, extend_sql, purge_sql;

 private:
  std::atomic<bool> ready{false};
  std::mutex ready_mu;
};

/// An open transactional-mode transaction: the connection and the in-process write lock it holds.
struct SqliteTxState {
  SqliteStoreImpl* store = nullptr;
  std::shared_ptr<SqliteDb> db;             // keeps the file open for a sequence store's advance
  std::optional<WriterLock> lock;           // released after the connection is given back
  SqliteDb::ConnPtr conn;
  std::string key;
  Holder holder;
  millis retention{0};
};

}  // namespace idem::detail
