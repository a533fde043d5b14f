#pragma once
/// @file postgres_sequence.hpp PostgresSequenceStore: idem::SequenceStore on PostgreSQL — one row
/// per entity, advanced by one `INSERT … ON CONFLICT … DO UPDATE … WHERE` statement — and
/// run_sequenced(), which advances inside a transactional-mode transaction so the advance commits
/// with the business write (or not at all). docs/ordering.md ("Redis and PostgreSQL, as built").

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "idem/core/error.hpp"
#include "idem/postgres/store.hpp"
#include "idem/sequence/sequence_store.hpp"

namespace idem {

/// Options of PostgresSequenceStore. Durations are milliseconds.
struct PostgresSequenceOptions {
  /// libpq conninfo or URI, as PostgresOptions::conninfo (use the PostgresStore's own).
  std::string conninfo;
  /// Schema of the table: [a-z_][a-z0-9_]*, at most 63 bytes, not pg_*; created if missing.
  std::string schema = "idem";
  /// Table of sequences: [a-z_][a-z0-9_]*, at most 63 bytes, not pg_*.
  std::string table = "idem_sequences";
  /// Most connections of the store's own pool (lease-mode calls; the in-transaction advance uses
  /// the transaction's connection); > 0.
  std::size_t pool_size = 4;
  /// How long a call waits for a free pooled connection before timeout_error; 0 = no limit.
  millis pool_wait{10'000};
  /// Session statement_timeout of the pooled connections; 0 = none.
  millis statement_timeout{30'000};
  /// Create the schema and table on first use; false = call migrate() from a deploy step.
  bool auto_migrate = true;
};

/**
 * SequenceStore on PostgreSQL (libpq). Table `<schema>.<table> (entity bytea PRIMARY KEY,
 * last_seq numeric(20,0) NOT NULL)`: bytea keeps entity ids binary-safe, numeric(20,0) the full
 * uint64 range. `advance` is one statement, atomic by itself:
 *
 * @code{.sql}
 * INSERT INTO t AS s (entity, last_seq) VALUES ($1, $2)
 * ON CONFLICT (entity) DO UPDATE SET last_seq = EXCLUDED.last_seq WHERE s.last_seq < EXCLUDED.last_seq
 * RETURNING …
 * @endcode
 *
 * The store owns a small pool of its own (PostgresStore's is private to it); give it the same
 * conninfo. Thread-safe; move-only. Errors fail closed with the SQLSTATE as code(), mapped like
 * PostgresStore's: connection_error (08…), timeout_error (57014, 55P03), capacity_error (53…),
 * store_error (retryable for 40…/55…/57…), invalid_entity_error, corrupt_record_error.
 *
 * In transactional mode, advance(tx, entity, seq) runs the same statement on the guard's open
 * transaction: the row lock it takes serialises the entity's events until commit, and a rollback
 * (handler exception) undoes it with the business writes. run_sequenced() packages that.
 */
class PostgresSequenceStore {
public:
  /// Validates the options (invalid_options_error); connects on first use.
  explicit PostgresSequenceStore(PostgresSequenceOptions options = {});
  ~PostgresSequenceStore();                                                 ///< Closes the pooled connections.
  PostgresSequenceStore(PostgresSequenceStore&&) noexcept;                  ///< Movable; not copyable.
  PostgresSequenceStore& operator=(PostgresSequenceStore&&) noexcept;       ///< Movable; not copyable.
  PostgresSequenceStore(const PostgresSequenceStore&) = delete;             ///< A pool has one owner.
  PostgresSequenceStore& operator=(const PostgresSequenceStore&) = delete;  ///< A pool has one owner.

  /// The last applied sequence of `entity`, or nullopt when none was applied.
  std::optional<std::uint64_t> last_applied(std::string_view entity);
  /// Atomic compare-and-set in its own (implicit) transaction: sets `entity` to `seq` iff none
  /// applied yet or the stored value is strictly lower. When advanced, `previous` is the value the
  /// statement's snapshot saw (under a concurrent advance it can be lower than the value replaced).
  AdvanceResult advance(std::string_view entity, std::uint64_t seq);
  /// The same compare-and-set inside an open transactional-mode transaction (`*ctx.tx`): commits
  /// or rolls back with it. The entity's row stays locked until then, so concurrent events of the
  /// entity wait (statement_timeout / lock_timeout bound the wait). Throws usage_error if `tx` is
  /// not open. The caller decides what "not advanced" means; run_sequenced() answers stale.
  AdvanceResult advance(PostgresStore::transaction& tx, std::string_view entity, std::uint64_t seq);
  /// Deletes the entity's row (its next event of any sequence applies); true if it existed.
  /// For tests and deleting an entity for good, never to "fix" a stale event.
  bool erase(std::string_view entity);

  /// Creates the schema and table now (idempotent; serialised by an advisory lock).
  void migrate();
  /// The options in force.
  [[nodiscard]] const PostgresSequenceOptions& options() const;
  /// The schema-qualified, quoted table name, for queries of your own.
  [[nodiscard]] const std::string& qualified_table() const;

private:
  struct Impl;
  Impl& impl() const;
  std::unique_ptr<Impl> impl_;
};

static_assert(SequenceStore<PostgresSequenceStore>);

}  // namespace idem
