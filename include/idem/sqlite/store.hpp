#pragma once
/// @file sqlite/store.hpp SqliteStore: the durable StateStore in one SQLite file, with no server,
/// in lease mode and in transactional mode (the handler's writes commit with the record).

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>
#include <vector>

#include "idem/core/batch_store.hpp"
#include "idem/core/clock.hpp"
#include "idem/core/record.hpp"
#include "idem/core/store.hpp"

struct sqlite3;  // <sqlite3.h>'s connection; no idem header includes sqlite3.h

namespace idem {

/// How IdempotencyGuard drives a SqliteStore.
enum class SqliteMode : std::uint8_t {
  lease,          ///< one short write transaction per transition; any handler
  transactional,  ///< the handler writes through the store's transaction; its writes commit with the completion
};

/// SQLite's `PRAGMA synchronous` for the store's connections (docs/sqlite.md, "Durability").
enum class SqliteSync : std::uint8_t {
  full,    ///< every commit reaches the disk before it returns: a power cut loses nothing committed
  normal,  ///< WAL commits reach the disk at checkpoints: a power cut (not a process crash) can lose the last ones
};

/// Options of one SqliteStore. Durations are milliseconds.
struct SqliteOptions {
  /// The database file (created if missing; its directory must exist). A local file system only:
  /// SQLite's locks do not hold on NFS or SMB, which the store refuses. Not ":memory:".
  std::string path;
  /// Table of records: [a-z_][a-z0-9_]*, at most 40 bytes, not sqlite_* nor idem_schema.
  std::string table = "idem_records";
  /// What the guard does with this store; the lease-mode members work in both modes.
  SqliteMode mode = SqliteMode::lease;
  /// Durability of a commit: full (default) or normal (faster; a power cut may lose the last commits).
  SqliteSync synchronous = SqliteSync::full;
  /// How long a write waits for the file's write lock held by another connection or process
  /// before answering a retryable timeout_error (nothing decided); 0 = at once; >= 0.
  millis busy_timeout{5'000};
  /// Create or upgrade the schema on first use; false = run migrate() from a deploy step instead.
  bool auto_migrate = true;
  /// Longest encoded result the store takes (limits()); the guard completes a key whose result is
  /// larger without it (result_unavailable). At most 512 MiB (SQLite's own limit is 1 GB).
  std::size_t max_result_bytes = std::size_t{64} << 20;
  /// Idle connections kept open for reuse (each thread in a call uses one); >= 1.
  std::size_t max_idle_connections = 8;
  /// The clock leases are judged by; null = the OS wall clock (system_clock, ms since the epoch),
  /// which every process on the host shares. Inject one only in tests of a single process.
  std::shared_ptr<const Clock> clock;
};

/// A value bound to a `?` of SqliteStore::Transaction::exec: NULL, an integer, a real, text.
using SqliteValue = std::variant<std::nullptr_t, std::int64_t, double, std::string_view>;

namespace detail {
class SqliteStoreImpl;
struct SqliteTxState;

/// The SqliteValue of one exec argument: integers, floating point, strings, nullptr, optionals.
template <class T>
SqliteValue sqlite_value(const T& v) {
  if constexpr (std::is_same_v<T, std::nullptr_t> || std::is_same_v<T, std::nullopt_t>) {
    return nullptr;
  } else if constexpr (std::is_same_v<T, bool>) {
    return std::int64_t{v ? 1 : 0};
  } else if constexpr (std::is_integral_v<T>) {
    return static_cast<std::int64_t>(v);
  } else if constexpr (std::is_floating_point_v<T>) {
    return static_cast<double>(v);
  } else if constexpr (std::is_convertible_v<const T&, std::string_view>) {
    return std::string_view(v);
  } else {
    static_assert(requires { v.has_value(); }, "idem: exec takes integers, reals, strings, nullptr or optionals");
    return v.has_value() ? sqlite_value(*v) : SqliteValue{nullptr};
  }
}
}  // namespace detail

/**
 * The durable StateStore in one SQLite file: no server, survives restarts, shared by the threads
 * and the processes of one host. Every transition is one `BEGIN IMMEDIATE` transaction in WAL
 * mode on the OS wall clock; a write that cannot get the file's write lock within busy_timeout
 * answers a retryable timeout_error and decides nothing. Acquire reads first: a duplicate, an
 * in-flight key or a failure is answered from a snapshot, without the write lock.
 *
 * Thread-safe: calls take a pooled connection each, and the writes of one store take an
 * in-process mutex before the file lock (so threads queue, and only other processes wait in
 * SQLite's busy loop). docs/sqlite.md has the guarantees, the modes and the failure modes.
 *
 * In transactional mode the guard claims the key with begin() (a committed `in_progress` claim,
 * visible to every process as in flight), then opens a write transaction the handler writes
 * through (ctx.tx->exec, or ctx.tx->handle() for sqlite3 calls of its own); the completion
 * commits with those writes, and a crash or a handler exception rolls them back.
 *
 * @code
 * idem::SqliteStore store{{.path = "/var/lib/app/idem.db", .mode = idem::SqliteMode::transactional}};
 * idem::IdempotencyGuard guard{store};
 * guard.run(msg.id, [&](const auto& ctx) {
 *   ctx.tx->exec("UPDATE account SET balance = balance + ? WHERE id = ?", msg.amount, msg.account);
 * });
 * @endcode
 */
class SqliteStore {
 public:
  /// The schema version this library installs and expects (2: the expiry index purge uses; a
  /// version-1 table is upgraded in place by migrate()).
  static constexpr int schema_version = 2;
  /// Longest key the store takes: keys are a unique index's entries, kept well inside one page.
  static constexpr std::size_t max_key_bytes = 2048;

  /// A claimed key's open write transaction (transactional mode); move-only; one thread.
  class Transaction {
   public:
    Transaction(Transaction&& o) noexcept;                ///< Move-only.
    Transaction& operator=(Transaction&& o) noexcept;     ///< Move-only; releases an open claim first.
    Transaction(const Transaction&) = delete;             ///< Move-only.
    Transaction& operator=(const Transaction&) = delete;  ///< Move-only.
    /// Rolls back the handler's writes and releases the key if still open; the store must outlive it.
    ~Transaction();

    /// The acquire decision; only when it is acquired is the transaction open.
    [[nodiscard]] const AcquireResult& decision() const noexcept { return decision_; }
    /// True while the claim is held and neither commit nor fail was called.
    [[nodiscard]] bool is_open() const noexcept;
    /// The key this transaction claimed.
    [[nodiscard]] std::string_view key() const noexcept;
    /// The connection of the open transaction, for sqlite3 calls of the handler's own (null when
    /// not open). Never run BEGIN, COMMIT or ROLLBACK on it: a COMMIT is refused (the commit hook
    /// turns it into a rollback) and an ended transaction records nothing.
    [[nodiscard]] sqlite3* handle() const noexcept;
    /// Records the result and commits it with the handler's writes; lease_lost (nothing committed)
    /// if the claim was taken over first. A commit whose fate the disk left unknown (an I/O error
    /// during it) is outcome_unknown_error; a full disk is capacity_error with nothing committed.
    WriteStatus commit(std::string_view result, millis retention);
    /// Rolls back the handler's writes and, in the same transaction, releases the key or records
    /// the failure as `params` says.
    WriteStatus fail(const FailParams& params);

    /// Runs one statement in the transaction with its `?` bound to `args` in order (integers,
    /// reals, strings as text, nullptr / std::nullopt for NULL); returns the rows it changed.
    /// Rows a SELECT returns are skipped: read through handle(). Throws store_error (as the
    /// store's own calls map SQLite's codes) and usage_error when not open.
    template <class... Args>
    std::int64_t exec(std::string_view sql, const Args&... args) {
      const std::array<SqliteValue, sizeof...(Args)> values{detail::sqlite_value(args)...};
      return exec_values(sql, std::span<const SqliteValue>(values.data(), values.size()));
    }
    /// exec() with the values already made.
    std::int64_t exec_values(std::string_view sql, std::span<const SqliteValue> values);

   private:
    friend class detail::SqliteStoreImpl;
    friend class SqliteSequenceStore;
    Transaction() noexcept;
    void abandon() noexcept;  // releases an open claim (rollback, then the key freed)

    AcquireResult decision_;
    std::unique_ptr<detail::SqliteTxState> state_;
  };

  /// Validates the options (invalid_options_error) and opens the file (store_error when it cannot
  /// be opened, is read-only for this process or is not a database); the schema waits for first use.
  explicit SqliteStore(SqliteOptions options);
  ~SqliteStore();                                  ///< Closes its connections (sequence stores keep theirs).
  SqliteStore(SqliteStore&&) noexcept;             ///< Movable; not copyable.
  SqliteStore& operator=(SqliteStore&&) noexcept;  ///< Movable; not copyable.

  /// Atomic acquire of the record contract (docs/design.md) in one write transaction (or none,
  /// when a snapshot already says duplicate / in_flight / previously_failed / mismatch).
  AcquireResult acquire(std::string_view key, const AcquireParams& params);
  /// Records the result if `holder` still holds the key; else lease_lost and nothing changes.
  WriteStatus complete(std::string_view key, const Holder& holder, std::string_view result, millis retention);
  /// Completes the key without its result (CompletesUnavailable): `reason` is kept as the record's
  /// error and later acquires answer duplicate with result_unavailable; lease_lost if not held.
  WriteStatus complete_unavailable(std::string_view key, const Holder& holder, std::string_view reason,
                                   millis retention);
  /// Releases or records a failure if `holder` still holds the key; else lease_lost.
  WriteStatus fail(std::string_view key, const Holder& holder, const FailParams& params);
  /// Pushes the lease of a live holder to now + lease; lease_lost if taken over or gone.
  WriteStatus extend(std::string_view key, const Holder& holder, millis lease);
  /// A snapshot of the live record, or nullopt if absent or expired; corrupt_record_error if unreadable.
  std::optional<Record> inspect(std::string_view key);

  /// Decides each request exactly as acquire() would (BatchStore), in request order, all in one
  /// write transaction: one commit (one disk flush) for the whole batch.
  std::vector<AcquireResult> acquire_many(std::span<const AcquireRequest> requests);

  /// The writes of one batch (BatchWriter): complete() and fail() are kept in memory and return;
  /// finish() makes them all in one write transaction (one disk flush) and returns their statuses
  /// in order. A crash before finish() records none of them: their claims lapse after the lease.
  class BatchWriter {
   public:
    BatchWriter(BatchWriter&&) noexcept;             ///< Movable.
    BatchWriter& operator=(BatchWriter&&) noexcept;  ///< Movable.
    ~BatchWriter();  ///< Makes the writes finish() was not called for (errors swallowed: the claims lapse).
    /// Keeps the completion of `key` by `h` (usage_error over max_result_bytes, nothing kept).
    void complete(std::string_view key, const Holder& h, std::string_view result, millis retention);
    /// Keeps the failure (or release) of `key` by `h`.
    void fail(std::string_view key, const Holder& h, const FailParams& f);
    /// Makes every kept write in one transaction; their statuses, in the order of the writes.
    std::vector<WriteStatus> finish();

   private:
    friend class SqliteStore;
    struct Impl;
    explicit BatchWriter(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
  };
  /// A writer for one batch (BatchStore).
  BatchWriter batch_writer();

  /// Claims `key` (transactional mode; see TransactionalStore): the claim commits at once, then a
  /// write transaction opens for the handler, holding the file's write lock until commit or fail.
  Transaction begin(std::string_view key, const AcquireParams& params);

  /// Deletes expired records in batches of `batch` rows, each its own short write transaction, at
  /// most `max_batches` batches; returns how many rows it removed.
  std::size_t purge_expired(std::size_t batch = 1000, std::size_t max_batches = 1000);

  /// Creates or upgrades the schema now (idempotent; serialised across processes by the write lock).
  void migrate();

  /// True in transactional mode: the guard then runs handlers inside begin()'s transaction.
  [[nodiscard]] bool transactional() const noexcept;
  /// The options in force.
  [[nodiscard]] const SqliteOptions& options() const noexcept;
  /// What the store takes: keys up to max_key_bytes, results up to options().max_result_bytes.
  [[nodiscard]] StoreLimits limits() const noexcept;

 private:
  friend class SqliteSequenceStore;
  std::unique_ptr<detail::SqliteStoreImpl> impl_;
};

static_assert(StateStore<SqliteStore>);
static_assert(TransactionalStore<SqliteStore>);
static_assert(HasStoreLimits<SqliteStore>);
static_assert(CompletesUnavailable<SqliteStore>);
static_assert(BatchStore<SqliteStore>);

}  // namespace idem
