#pragma once
/// @file postgres/admin.hpp PostgresAdmin: the operator's view of a PostgresStore's table (inspect,
/// list, fenced release, purge, stats, doctor), used by the `idem` command; docs/operations.md.
/// With the migration as SQL for review (postgres_migration_sql) and the installed schema version.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "idem/core/admin.hpp"
#include "idem/postgres/store.hpp"

namespace idem {

/**
 * Admin access to a PostgresStore's table on one libpq session of its own (never a store's pool).
 * It never creates or migrates the schema: a missing table is an error that says so. Every time
 * is the server's clock_timestamp(). Not thread-safe. Errors: invalid_options_error (conninfo,
 * names), connection_error, store_error with the SQLSTATE (42501 for a missing privilege).
 */
class PostgresAdmin {
public:
  /// Connects (conninfo or postgresql:// URI) to the table `store.schema`.`store.table`.
  PostgresAdmin(PostgresOptions options, PostgresStoreOptions store = {});
  ~PostgresAdmin();                                       ///< Closes its session.
  PostgresAdmin(const PostgresAdmin&) = delete;             ///< Owns a session.
  PostgresAdmin& operator=(const PostgresAdmin&) = delete;  ///< Owns a session.

  /// The live record of `key`, or nullopt when absent or expired.
  std::optional<AdminRecord> inspect(std::string_view key);
  /// Calls `each` for every record `filter` selects, read in primary-key order `filter.page` rows
  /// per query (keyset pagination: an index range from the last key seen), so memory does not grow
  /// with the table; `each` returns false to stop. Returns how many were passed.
  std::size_t list(const ListFilter& filter, const std::function<bool(const AdminRecord&)>& each);
  /// Frees `key` (failed, retry at once, token 0) in one conditional UPDATE, only if its fence is
  /// still `fence`; a live lease only with `force`.
  ReleaseResult release(std::string_view key, std::uint64_t fence, bool force);
  /// Deletes expired rows `batch` at a time (each its own transaction, locked rows skipped);
  /// `progress(deleted so far, expired when it started)` after each batch. Returns rows deleted.
  std::size_t purge(std::size_t batch, const std::function<void(std::size_t, std::size_t)>& progress);
  /// Counts by state, sizes, stuck leases and expired rows, from one aggregate query.
  AdminStats stats();
  /// Server version, schema version, retention index, durability settings, privileges and bloat.
  std::vector<Finding> doctor();
  /// The schema-qualified table.
  [[nodiscard]] std::string table() const;

private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The SQL PostgresStore::migrate() runs on a new table of `store` (also the outbox when
/// `store.outbox`), as one transaction for psql, so a DBA can apply it and stores run without DDL rights.
std::string postgres_migration_sql(const PostgresStoreOptions& store = {});

/// The schema version recorded for `store`'s table on a session of its own; 0 when not installed.
int postgres_schema_version(const PostgresOptions& options, const PostgresStoreOptions& store = {});

}  // namespace idem
