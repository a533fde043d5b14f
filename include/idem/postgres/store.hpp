#pragma once
/// @file postgres_store.hpp PostgresStore: the durable StateStore on PostgreSQL (libpq), in lease
/// mode and in transactional mode (the handler's writes commit with the record).

#include <array>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include <libpq-fe.h>

#include "idem/core/record.hpp"
#include "idem/core/store.hpp"

namespace idem {

/// How IdempotencyGuard drives a PostgresStore.
enum class PgMode : std::uint8_t {
  lease,          ///< short transactions per transition, like the Redis store; any handler
  transactional,  ///< the handler runs inside the claiming transaction; for database side effects
};

/// Options of PostgresStore. Durations are milliseconds.
struct PostgresOptions {
  /// libpq conninfo ("host=db port=5432 sslmode=verify-full") or URI ("postgresql://u@db/app");
  /// every libpq parameter passes through; empty = libpq defaults and the PG* environment.
  std::string conninfo;
  /// Schema of the table: [a-z_][a-z0-9_]*, at most 63 bytes, not pg_*; created if missing.
  std::string schema = "idem";
  /// Table of records: [a-z_][a-z0-9_]*, at most 40 bytes (derived index and function names add suffixes).
  std::string table = "idem_records";
  /// What the guard does with this store; the lease-mode members work in both modes.
  PgMode mode = PgMode::lease;
  /// Most connections open at once; > 0. A call waits for a free one (see pool_wait).
  std::size_t pool_size = 8;
  /// How long a call waits for a free pooled connection before timeout_error; 0 = no limit.
  millis pool_wait{10'000};
  /// Session statement_timeout of pooled connections (store calls and handler writes); 0 = none.
  millis statement_timeout{30'000};
  /// How long acquire waits for a row lock held by another transaction before answering
  /// in_flight (lock_timeout of the claim only, not of the handler's writes); > 0.
  millis lock_timeout{100};
  /// Create or upgrade the schema on first use; false = run migrate() from a deploy step instead.
  bool auto_migrate = true;
  /// Isolation of transactional-mode transactions: "read committed", "repeatable read" or "serializable".
  std::string isolation = "read committed";
  /// Transactional mode: end a session idle inside its transaction for longer than the lease
  /// (paused or stuck holder), which rolls back its claim; false = hold until the session dies.
  bool idle_timeout_is_lease = true;
};

/// The result of a statement run through a PostgresStore transaction; owns the PGresult.
class PgResult {
public:
  /// Takes ownership of `r` (may be null).
  explicit PgResult(PGresult* r = nullptr) noexcept : r_(r) {}
  PgResult(PgResult&& o) noexcept : r_(o.r_) { o.r_ = nullptr; }  ///< Move-only.
  PgResult& operator=(PgResult&& o) noexcept {                     ///< Move-only.
    if (this != &o) {
      if (r_) PQclear(r_);
      r_ = o.r_;
      o.r_ = nullptr;
    }
    return *this;
  }
  PgResult(const PgResult&) = delete;
  PgResult& operator=(const PgResult&) = delete;
  ~PgResult() {  ///< Frees the PGresult.
    if (r_) PQclear(r_);
  }
  /// Number of rows returned.
  [[nodiscard]] int rows() const noexcept { return r_ ? PQntuples(r_) : 0; }
  /// Number of columns returned.
  [[nodiscard]] int columns() const noexcept { return r_ ? PQnfields(r_) : 0; }
  /// True when the value is SQL NULL.
  [[nodiscard]] bool is_null(int row, int col) const noexcept { return PQgetisnull(r_, row, col) != 0; }
  /// The value in PostgreSQL's text format; valid while this result lives.
  [[nodiscard]] std::string_view get(int row, int col) const noexcept {
    return {PQgetvalue(r_, row, col), static_cast<std::size_t>(PQgetlength(r_, row, col))};
  }
  /// Rows inserted, updated or deleted by the statement.
  [[nodiscard]] std::uint64_t affected() const noexcept {
    const char* s = r_ ? PQcmdTuples(r_) : "";
    std::uint64_t n = 0;
    std::from_chars(s, s + std::char_traits<char>::length(s), n);
    return n;
  }
  /// The underlying libpq result, for anything this wrapper does not cover.
  [[nodiscard]] PGresult* native() const noexcept { return r_; }

private:
  PGresult* r_;
};

namespace detail {
class PgStoreImpl;

// Text-format parameters for PostgresStore::transaction::exec: strings as they are, numbers in
// decimal, bool as t/f, nullopt as NULL.
struct PgParam {
  std::optional<std::string> text;
};
inline PgParam pg_param(std::string_view s) { return {std::string(s)}; }
inline PgParam pg_param(const char* s) { return s ? PgParam{std::string(s)} : PgParam{}; }
inline PgParam pg_param(const std::string& s) { return {s}; }
inline PgParam pg_param(bool b) { return {std::string(b ? "t" : "f")}; }
inline PgParam pg_param(std::nullopt_t) { return {}; }
template <class T>
  requires std::is_arithmetic_v<T>
PgParam pg_param(T v) {
  std::array<char, 64> buf{};
  auto res = std::to_chars(buf.data(), buf.data() + buf.size(), v);
  return {std::string(buf.data(), res.ptr)};
}
template <class T>
PgParam pg_param(const std::optional<T>& v) {
  return v ? pg_param(*v) : PgParam{};
}
}  // namespace detail

/**
 * The durable StateStore on PostgreSQL. Thread-safe: calls share a pool of libpq connections.
 * Connects lazily (the constructor only validates options) and creates its versioned schema on
 * first use unless auto_migrate is false. Every transition is one round trip on the server clock.
 *
 * In transactional mode the guard claims the key with begin(), runs the handler with the open
 * transaction in ctx.tx (write through ctx.tx->exec), and commits the completion together with
 * those writes: a crash or a handler exception leaves no trace of either.
 *
 * @code
 * idem::PostgresStore store{{.conninfo = "postgresql://app@db/app", .mode = idem::PgMode::transactional}};
 * idem::IdempotencyGuard guard{store};
 * guard.run(msg.id, [&](const auto& ctx) {
 *   ctx.tx->exec("UPDATE account SET balance = balance + $1 WHERE id = $2", msg.amount, msg.account);
 * });
 * @endcode
 */
class PostgresStore {
public:
  /// The schema version this library installs and expects.
  static constexpr int schema_version = 1;

  /// An open claiming transaction (transactional mode); move-only; rolls back if destroyed open.
  class transaction {
  public:
    transaction(transaction&& o) noexcept;             ///< Move-only.
    transaction& operator=(transaction&& o) noexcept;  ///< Move-only.
    transaction(const transaction&) = delete;
    transaction& operator=(const transaction&) = delete;
    ~transaction();  ///< Rolls back if still open; the store must outlive its transactions.

    /// The acquire decision; only when it is acquired is the transaction open.
    [[nodiscard]] const AcquireResult& decision() const noexcept { return decision_; }
    /// True while the claim is held and neither commit nor fail was called.
    [[nodiscard]] bool is_open() const noexcept { return conn_ != nullptr; }
    /// The transaction's connection, for libpq calls of your own; null when not open.
    [[nodiscard]] PGconn* connection() const noexcept { return conn_; }
    /// Records the result and commits it with the handler's writes; lease_lost if the claim was
    /// ended first (nothing committed). Throws outcome_unknown_error if the commit's fate is unknown.
    WriteStatus commit(std::string_view result, millis retention);
    /// Rolls back the handler's writes; unless params.release, records the failure afresh.
    WriteStatus fail(const FailParams& params);

    /// Runs one statement inside the transaction with $1.. bound to `args` (text format; strings,
    /// numbers, bool, std::optional / std::nullopt for NULL); throws store_error with the SQLSTATE.
    template <class... Args>
    PgResult exec(std::string_view sql, const Args&... args) {
      std::array<detail::PgParam, sizeof...(Args)> params{detail::pg_param(args)...};
      return exec_params(sql, params.data(), params.size());
    }

  private:
    friend class detail::PgStoreImpl;
    transaction() = default;
    PgResult exec_params(std::string_view sql, const detail::PgParam* params, std::size_t n);
    void release(bool healthy) noexcept;

    detail::PgStoreImpl* impl_ = nullptr;
    PGconn* conn_ = nullptr;
    AcquireResult decision_;
    std::string key_, fingerprint_, owner_;
  };

  /// Validates the options (invalid_options_error); connects on first use.
  explicit PostgresStore(PostgresOptions options = {});
  ~PostgresStore();  ///< Closes the pooled connections.
  PostgresStore(PostgresStore&&) noexcept;             ///< Movable; not copyable.
  PostgresStore& operator=(PostgresStore&&) noexcept;  ///< Movable; not copyable.

  /// Atomic acquire of DESIGN §1 in one round trip; see AcquireStatus.
  AcquireResult acquire(std::string_view key, const AcquireParams& params);
  /// Records the result if `holder` still holds the key; else lease_lost and nothing changes.
  WriteStatus complete(std::string_view key, const Holder& holder, std::string_view result, millis retention);
  /// Releases or records a failure if `holder` still holds the key; else lease_lost.
  WriteStatus fail(std::string_view key, const Holder& holder, const FailParams& params);
  /// Pushes the lease of a live holder to now + lease; lease_lost if taken over or gone.
  WriteStatus extend(std::string_view key, const Holder& holder, millis lease);
  /// A snapshot of the live record, or nullopt if absent or expired; corrupt_record_error if unreadable.
  std::optional<Record> inspect(std::string_view key);

  /// Claims `key` in a new transaction (transactional mode); see TransactionalStore.
  transaction begin(std::string_view key, const AcquireParams& params);

  /// Deletes expired records in batches of `batch` rows (each its own short transaction, skipping
  /// rows locked by others), at most `max_batches` batches; returns how many rows it removed.
  std::size_t purge_expired(std::size_t batch = 1000, std::size_t max_batches = 1000);

  /// Creates or upgrades the schema now (idempotent; serialised by an advisory lock).
  void migrate();

  /// True in transactional mode: the guard then runs handlers inside begin()'s transaction.
  [[nodiscard]] bool transactional() const noexcept;
  /// The options in force.
  [[nodiscard]] const PostgresOptions& options() const noexcept;
  /// The schema-qualified, quoted table name, for queries of your own.
  [[nodiscard]] const std::string& qualified_table() const noexcept;

private:
  std::unique_ptr<detail::PgStoreImpl> impl_;
};

static_assert(StateStore<PostgresStore>);
static_assert(TransactionalStore<PostgresStore>);

}  // namespace idem
