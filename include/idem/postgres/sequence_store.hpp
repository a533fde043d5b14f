#pragma once
/// @file postgres/sequence_store.hpp PostgresSequenceStore: idem::SequenceStore on PostgreSQL —
/// one row per entity, advanced by one `INSERT … ON CONFLICT … DO UPDATE … WHERE` statement —
/// with an advance inside a transactional-mode transaction that commits with the business write
/// (or not at all). docs/ordering.md ("Redis and PostgreSQL, as built").

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "idem/postgres/client.hpp"
#include "idem/postgres/store.hpp"
#include "idem/sequence/sequence_store.hpp"

namespace idem {

/// Options of one PostgresSequenceStore (the connection is its client's PostgresOptions).
struct PostgresSequenceStoreOptions {
  /// Schema of the table: [a-z_][a-z0-9_]*, at most 63 bytes, not pg_*; created if missing.
  std::string schema = "idem";
  /// Table of sequences: [a-z_][a-z0-9_]*, at most 63 bytes, not pg_*.
  std::string table = "idem_sequences";
  /// Create the schema and table on first use; false = call migrate() from a deploy step.
  bool auto_migrate = true;
};

/**
 * SequenceStore on PostgreSQL. Table `<schema>.<table> (entity bytea PRIMARY KEY,
 * last_seq numeric(20,0) NOT NULL)`: bytea keeps entity ids binary-safe, numeric(20,0) the full
 * uint64 range. `advance` is one statement, atomic by itself:
 *
 * @code{.sql}
 * INSERT INTO t AS s (entity, last_seq) VALUES ($1, $2)
 * ON CONFLICT (entity) DO UPDATE SET last_seq = EXCLUDED.last_seq WHERE s.last_seq < EXCLUDED.last_seq
 * RETURNING …
 * @endcode
 *
 * The store uses the sessions of a PostgresClient, usually its PostgresStore's. Thread-safe;
 * move-only. Errors fail closed with the SQLSTATE as code(), mapped like PostgresStore's:
 * connection_error (08…), timeout_error (57014, 55P03; "POOL" for a busy pool), capacity_error
 * (53…), store_error (retryable for 40…/55…/57…), invalid_entity_error, corrupt_record_error.
 *
 * In transactional mode, advance(tx, entity, seq) runs the same statement on the guard's open
 * transaction: the row lock it takes serialises the entity's events until commit, and a rollback
 * (handler exception) undoes it with the business writes. run_sequenced() packages that.
 */
class PostgresSequenceStore {
 public:
  /// Validates the options (invalid_options_error); shares the sessions of `store`'s client.
  explicit PostgresSequenceStore(PostgresStore& store, PostgresSequenceStoreOptions options = {});
  /// Validates the options (invalid_options_error); uses the sessions of `client` (not null).
  explicit PostgresSequenceStore(std::shared_ptr<PostgresClient> client, PostgresSequenceStoreOptions options = {});
  ~PostgresSequenceStore();                                                 ///< Releases its client.
  PostgresSequenceStore(PostgresSequenceStore&&) noexcept;                  ///< Movable; not copyable.
  PostgresSequenceStore& operator=(PostgresSequenceStore&&) noexcept;       ///< Movable; not copyable.
  PostgresSequenceStore(const PostgresSequenceStore&) = delete;             ///< Movable; not copyable.
  PostgresSequenceStore& operator=(const PostgresSequenceStore&) = delete;  ///< Movable; not copyable.

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
  AdvanceResult advance(PostgresStore::Transaction& tx, std::string_view entity, std::uint64_t seq);
  /// Deletes the entity's row (its next event of any sequence applies); true if it existed.
  /// For tests and deleting an entity for good, never to "fix" a stale event.
  bool erase(std::string_view entity);

  /// Creates the schema and table now (idempotent; serialised by an advisory lock).
  void migrate();
  /// The options in force.
  [[nodiscard]] const PostgresSequenceStoreOptions& options() const;
  /// The schema-qualified, quoted table name, for queries of your own.
  [[nodiscard]] const std::string& qualified_table() const;

 private:
  struct Impl;
  Impl& impl() const;
  std::unique_ptr<Impl> impl_;
};

static_assert(SequenceStore<PostgresSequenceStore>);

}  // namespace idem
