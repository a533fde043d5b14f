#pragma once
/// @file sqlite/admin.hpp SqliteAdmin: the operator's view of a SqliteStore's file (inspect, list,
/// fenced release, purge, stats, doctor, schema version), used by the `idem` command on
/// `sqlite:///path` URLs; docs/sqlite.md, "The idem tool".

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "idem/core/admin.hpp"
#include "idem/sqlite/store.hpp"

namespace idem {

/**
 * Admin access to a SqliteStore's table on one connection of its own (never a store's pool). It
 * never creates the file, switches its journal mode or migrates the schema, so `doctor` sees the
 * file as the stores left it: a missing file or table is an error that says so. Every write
 * (release, purge) is one `BEGIN IMMEDIATE` transaction, decided on the row it reads there, as the
 * store's own transitions are. Times are the OS wall clock (the stores' lease clock). Not
 * thread-safe. Errors: invalid_options_error (table name), store_error with SQLite's code name,
 * timeout_error when another connection holds the write lock past `busy_timeout`.
 */
class SqliteAdmin {
public:
  /// Opens `options.path` (which must exist) for `options.table`; only path, table and
  /// busy_timeout are read.
  explicit SqliteAdmin(SqliteOptions options);
  ~SqliteAdmin();                                     ///< Closes its connection.
  SqliteAdmin(const SqliteAdmin&) = delete;             ///< Owns a connection.
  SqliteAdmin& operator=(const SqliteAdmin&) = delete;  ///< Owns a connection.

  /// The live record of `key`, or nullopt when absent or expired (AdminRecord::bytes: the sum of
  /// the row's values, SQLite keeping no per-row size).
  std::optional<AdminRecord> inspect(std::string_view key);
  /// Calls `each` for every record `filter` selects, `filter.page` rows per query in key order
  /// (keyset pagination on the primary key), so memory does not grow with the table; `each`
  /// returns false to stop. Returns how many were passed.
  std::size_t list(const ListFilter& filter, const std::function<bool(const AdminRecord&)>& each);
  /// Frees `key` (failed, retry at once, token 0) only if its fence is still `fence`; a live lease
  /// only with `force`. One write transaction: a holder that took the key over first is never freed.
  ReleaseResult release(std::string_view key, std::uint64_t fence, bool force);
  /// Deletes expired rows `batch` at a time, each its own short write transaction;
  /// `progress(deleted so far, expired when it started)` after each batch. Returns rows deleted.
  std::size_t purge(std::size_t batch, const std::function<void(std::size_t, std::size_t)>& progress);
  /// Counts by state, sizes, stuck leases and expired rows, from one aggregate query.
  AdminStats stats();
  /// Journal mode, synchronous, file system, schema version, busy timeout, sizes, writability and
  /// expired rows, each with what to fix.
  std::vector<Finding> doctor();
  /// The installed schema version of the table; 0 when not installed.
  int schema_version();
  /// "PATH (table T)", for messages.
  [[nodiscard]] std::string where() const;

private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The SQL SqliteStore::migrate() runs to create `table` at the current schema version (each
/// version's script, then its row in idem_schema), as one transaction for the sqlite3 shell.
std::string sqlite_migration_sql(const std::string& table = "idem_records");

}  // namespace idem
