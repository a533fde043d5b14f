#pragma once
/// @file postgres/joined.hpp PostgresJoined: transactional mode inside a transaction the application
/// opened on its own connection (bring your own transaction), through libpq or an adapter.

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "idem/postgres/store.hpp"

struct pg_conn;

namespace idem {

/**
 * The application's connection, as idem runs its statements on it: one statement at a time,
 * inside the transaction the application opened. Implementations: LibpqConnection (a `PGconn*`)
 * and idem::pqxx::Connection (idem/pqxx.hpp, a libpqxx transaction). One thread at a time.
 */
class JoinedConnection {
 public:
  /// One bound parameter: its bytes, or NULL; `binary` sends them as bytea's binary format.
  struct Param {
    std::optional<std::string_view> value;  ///< the bytes; nullopt for NULL
    bool binary = false;                    ///< binary format (bytea); text otherwise
  };
  /// A row of text cells (bytea in PostgreSQL's text form); nullopt for NULL.
  using Row = std::vector<std::optional<std::string>>;

  virtual ~JoinedConnection() = default;
  /// Runs `sql` with $1.. bound to `params` inside the application's open transaction, text
  /// results. Throws idem::store_error with the SQLSTATE when the server refuses it, and
  /// usage_error when no transaction is open (or it already failed).
  virtual std::vector<Row> exec(const std::string& sql, std::span<const Param> params) = 0;
};

/// A libpq connection (not owned) with a transaction open on it: the application sent BEGIN.
class LibpqConnection final : public JoinedConnection {
 public:
  /// Wraps `conn` (not null; usage_error otherwise); the application keeps owning it.
  explicit LibpqConnection(pg_conn* conn);
  /// See JoinedConnection::exec; refuses a connection in pipeline mode or outside a transaction.
  std::vector<Row> exec(const std::string& sql, std::span<const Param> params) override;

 private:
  pg_conn* conn_;
};

/**
 * A PostgresStore's transactional mode inside the application's own transaction: the claim runs
 * on the application's connection behind a savepoint, the handler writes with the application's
 * own data-access code, the completion is written in the same transaction, and the application
 * commits (or rolls back) all of it together. A TransactionalStore: drive it with an
 * IdempotencyGuard, one joined store and guard per transaction (both are cheap to make).
 *
 * - Decisions are the store's: a duplicate returns the stored result, a key another transaction
 *   holds answers in_flight (its claim rolled back to the savepoint, the application's transaction
 *   intact), and the guard's machine decides what follows.
 * - The outcome says executed once the completion is written in the application's transaction;
 *   it becomes durable when the application commits. A rollback, a crash before COMMIT or a
 *   COMMIT whose answer is lost leaves either both the business writes and the record or neither,
 *   so the next delivery sees the truth: a duplicate, or a fresh claim that runs the handler.
 * - A handler that throws rolls back to the savepoint: its writes since the claim are undone, the
 *   application's earlier writes stay. The failure (unless released) is recorded at once on one of
 *   the store's own sessions, whatever the application's transaction does next.
 * - No idle timeout is set on the application's session: the open transaction is the lease.
 *
 * @code
 * PQexec(conn, "BEGIN");
 * idem::LibpqConnection app{conn};
 * idem::PostgresJoined joined{store, app};
 * idem::IdempotencyGuard guard{joined};
 * auto out = guard.run(msg.id, [&] { debit(conn, msg); });   // the application's own code
 * PQexec(conn, "COMMIT");
 * @endcode
 */
class PostgresJoined {
 public:
  /// The claim in the application's transaction; move-only; rolls back to its savepoint if destroyed open.
  class Transaction {
   public:
    Transaction(Transaction&& o) noexcept;             ///< Move-only.
    Transaction& operator=(Transaction&& o) noexcept;  ///< Move-only.
    Transaction(const Transaction&) = delete;          ///< Move-only.
    Transaction& operator=(const Transaction&) = delete;  ///< Move-only.
    ~Transaction();  ///< Rolls back to the savepoint if still open (errors ignored).

    /// The acquire decision; only when it is acquired is the claim open.
    [[nodiscard]] const AcquireResult& decision() const noexcept { return decision_; }
    /// True while the claim is held and neither commit nor fail was called.
    [[nodiscard]] bool is_open() const noexcept { return open_; }
    /// The key this transaction claimed.
    [[nodiscard]] std::string_view key() const noexcept { return key_; }
    /// Writes the completion in the application's transaction and releases the savepoint; the
    /// application's COMMIT makes it durable. lease_lost if the claim is gone (nothing written).
    WriteStatus commit(std::string_view result, millis retention);
    /// Rolls back to the savepoint (the handler's writes since the claim); unless params.release,
    /// records the failure at once on a session of the store's own.
    WriteStatus fail(const FailParams& params);

   private:
    friend class PostgresJoined;
    Transaction() noexcept = default;
    void undo() noexcept;

    PostgresJoined* joined_ = nullptr;
    AcquireResult decision_;
    std::string key_, fingerprint_, owner_;
    bool open_ = false;
  };

  /// Joins `store` (not owned; must be in transactional mode, invalid_options_error otherwise) to
  /// the application's `conn` (not owned). Both must outlive the joined store.
  PostgresJoined(PostgresStore& store, JoinedConnection& conn);

  /// Claims `key` inside the application's transaction, behind a savepoint; see TransactionalStore.
  Transaction begin(std::string_view key, const AcquireParams& params);
  /// Always true: the guard runs handlers inside begin()'s claim.
  [[nodiscard]] bool transactional() const noexcept { return true; }
  /// The store's limits.
  [[nodiscard]] StoreLimits limits() const noexcept { return store_->limits(); }
  /// The store this joins.
  [[nodiscard]] PostgresStore& store() const noexcept { return *store_; }

  // The lease-mode calls of the StateStore concept, on the store's own sessions (the guard uses
  // begin() for every run; these serve inspection and tools).
  /// PostgresStore::acquire on the store's own sessions.
  AcquireResult acquire(std::string_view key, const AcquireParams& p) { return store_->acquire(key, p); }
  /// PostgresStore::complete on the store's own sessions.
  WriteStatus complete(std::string_view key, const Holder& h, std::string_view result, millis retention) {
    return store_->complete(key, h, result, retention);
  }
  /// PostgresStore::fail on the store's own sessions.
  WriteStatus fail(std::string_view key, const Holder& h, const FailParams& f) { return store_->fail(key, h, f); }
  /// PostgresStore::extend on the store's own sessions.
  WriteStatus extend(std::string_view key, const Holder& h, millis lease) { return store_->extend(key, h, lease); }
  /// PostgresStore::inspect on the store's own sessions (what is committed).
  std::optional<Record> inspect(std::string_view key) { return store_->inspect(key); }

 private:
  PostgresStore* store_;
  JoinedConnection* conn_;
};

static_assert(StateStore<PostgresJoined>);
static_assert(TransactionalStore<PostgresJoined>);

}  // namespace idem
