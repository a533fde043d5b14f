#pragma once
/// @file sqlite/sequence_store.hpp SqliteSequenceStore: idem::SequenceStore in the SqliteStore's
/// file — one row per entity, advanced by compare-and-set in a write transaction — with an advance
/// inside a transactional-mode transaction that commits with the business write (or not at all).

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "idem/sequence/sequence_store.hpp"
#include "idem/sqlite/store.hpp"

namespace idem {

/// Options of one SqliteSequenceStore (the file is its SqliteStore's).
struct SqliteSequenceStoreOptions {
  /// Table of sequences: [a-z_][a-z0-9_]*, at most 40 bytes, not sqlite_*, not the records' table.
  std::string table = "idem_sequences";
  /// Create the table on first use; false = call migrate() from a deploy step.
  bool auto_migrate = true;
};

/**
 * SequenceStore in a SQLite file. Table `<table> (entity BLOB PRIMARY KEY, last_seq INTEGER)`:
 * the uint64 sequence is stored with its top bit flipped (`seq ^ 2^63` as a signed integer), so
 * SQLite's signed order is the unsigned order over the whole range. `advance` reads and writes
 * in one `BEGIN IMMEDIATE` transaction: atomic across threads and processes.
 *
 * It shares its SqliteStore's file, connections and write lock. Thread-safe; move-only. In
 * transactional mode advance(tx, entity, seq) runs inside the guard's open transaction: it commits
 * or rolls back with the handler's writes. run_sequenced() (idem/sqlite/run_sequenced.hpp)
 * packages that.
 */
class SqliteSequenceStore {
 public:
  /// Validates the options (invalid_options_error); shares `store`'s file and write lock.
  explicit SqliteSequenceStore(SqliteStore& store, SqliteSequenceStoreOptions options = {});
  ~SqliteSequenceStore();                                               ///< Releases its share of the file.
  SqliteSequenceStore(SqliteSequenceStore&&) noexcept;                  ///< Movable; not copyable.
  SqliteSequenceStore& operator=(SqliteSequenceStore&&) noexcept;       ///< Movable; not copyable.
  SqliteSequenceStore(const SqliteSequenceStore&) = delete;             ///< Movable; not copyable.
  SqliteSequenceStore& operator=(const SqliteSequenceStore&) = delete;  ///< Movable; not copyable.

  /// The last applied sequence of `entity`, or nullopt when none was applied.
  std::optional<std::uint64_t> last_applied(std::string_view entity);
  /// Atomic compare-and-set in its own write transaction: sets `entity` to `seq` iff none applied
  /// yet or the stored value is strictly lower; says what it found.
  AdvanceResult advance(std::string_view entity, std::uint64_t seq);
  /// The same compare-and-set inside an open transactional-mode transaction (`*ctx.tx`): commits or
  /// rolls back with it. Throws usage_error if `tx` is not open.
  AdvanceResult advance(SqliteStore::Transaction& tx, std::string_view entity, std::uint64_t seq);
  /// Deletes the entity's row (its next event of any sequence applies); true if it existed.
  /// For tests and deleting an entity for good, never to "fix" a stale event.
  bool erase(std::string_view entity);

  /// Creates the table now (idempotent).
  void migrate();
  /// The options in force.
  [[nodiscard]] const SqliteSequenceStoreOptions& options() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

static_assert(SequenceStore<SqliteSequenceStore>);

}  // namespace idem
