#pragma once
/// @file postgres/store.hpp PostgresStore: the durable StateStore on PostgreSQL, in lease mode
/// and in transactional mode (the handler's writes commit with the record).

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "idem/core/batch_store.hpp"
#include "idem/core/record.hpp"
#include "idem/core/store.hpp"
#include "idem/postgres/client.hpp"
#include "idem/postgres/result.hpp"

namespace idem {

class PostgresJoined;

/// How IdempotencyGuard drives a PostgresStore.
enum class PostgresMode : std::uint8_t {
  lease,          ///< short transactions per transition, like the Redis store; any handler
  transactional,  ///< the handler runs inside the claiming transaction; for database side effects
};

/// What a claim does when another transaction holds the key (docs/postgres.md, "How a claim locks").
enum class PostgresClaimWait : std::uint8_t {
  /// Answer in_flight at once: the claim takes a transaction-scoped advisory lock on a 64-bit hash
  /// of (table, key) with pg_try_advisory_xact_lock before its INSERT, and the row with
  /// FOR UPDATE NOWAIT. A hash collision between two keys claimed at the same moment (odds 2^-64
  /// per pair) answers in_flight for one of them; never a wrong acquire.
  none,
  /// Wait up to lock_timeout for the holder (no advisory lock): a duplicate of a key whose holder
  /// finishes within lock_timeout gets the holder's outcome instead of in_flight, at the cost of
  /// blocking the consumer thread for up to lock_timeout per duplicate of a held key.
  bounded,
};

/// Options of one PostgresStore (the connection is PostgresOptions). Durations are milliseconds.
struct PostgresStoreOptions {
  /// Schema of the table: [a-z_][a-z0-9_]*, at most 63 bytes, not pg_*; created if missing.
  std::string schema = "idem";
  /// Table of records: [a-z_][a-z0-9_]*, at most 40 bytes (derived index and function names add suffixes).
  std::string table = "idem_records";
  /// What the guard does with this store; the lease-mode members work in both modes.
  PostgresMode mode = PostgresMode::lease;
  /// A claim of a key another transaction holds: in_flight at once (none) or after up to lock_timeout.
  PostgresClaimWait claim_wait = PostgresClaimWait::none;
  /// claim_wait bounded: how long acquire waits for a lock held by another transaction before
  /// answering in_flight; none: the bound of waits the claim does not expect (a claimant of an
  /// older library, the application's own locks on the table). The claim's only, not the handler's; > 0.
  millis lock_timeout{100};
  /// Create or upgrade the schema on first use; false = run migrate() from a deploy step instead.
  bool auto_migrate = true;
  /// Isolation of transactional-mode transactions: "read committed", "repeatable read" or "serializable".
  std::string isolation = "read committed";
  /// Transactional mode: end a session idle inside its transaction for longer than the lease
  /// (paused or stuck holder), which rolls back its claim; false = hold until the session dies.
  bool idle_timeout_is_lease = true;
  /// Longest encoded result the store takes (limits()); the guard completes a key whose result is
  /// larger without it (result_unavailable) instead of sending it. 64 MiB: far below bytea's 1 GB,
  /// and a write that size still finishes well inside the default 30 s statement_timeout.
  std::size_t max_result_bytes = std::size_t{64} << 20;
  /// Lease-mode batches (run_batch): sessions a batch spreads its completions over, so commits
  /// waiting for the disk at once share one WAL flush; each stays its own durable transaction.
  /// Extra sessions are taken only when the pool has them free and held until the batch ends
  /// (size pool.size for threads x this). 1..64; 1 = every completion on one session.
  std::size_t batch_sessions = 4;
  /// Transactional outbox (docs/outbox.md): migrate() also creates `<table>_outbox`, and handlers
  /// may send messages with ctx.outbox(); false = no outbox table, ctx.outbox().send() is a usage_error.
  bool outbox = false;
};

class OutboxWriter;

namespace detail {
class StoreImpl;
struct Connection;
}  // namespace detail

/**
 * The durable StateStore on PostgreSQL. Thread-safe: calls share the sessions of its
 * PostgresClient (built with one look at the server, PostgresClient) and creates its versioned
 * schema on first use unless auto_migrate is false. Every transition is one round trip on the
 * server clock. In lease mode, a call whose session dies under it is sent again on another
 * session as the same holder until it is answered or PostgresOptions::settle_wait has passed (a
 * lost reply is settled, never re-run); then, if the request may have run, outcome_unknown_error.
 *
 * In transactional mode the guard claims the key with begin(), runs the handler with the open
 * transaction in ctx.tx (write through ctx.tx->exec), and commits the completion together with
 * those writes: a crash or a handler exception leaves no trace of either.
 *
 * @code
 * idem::PostgresStore store{{.conninfo = "postgresql://app@db/app"}, {.mode = idem::PostgresMode::transactional}};
 * idem::IdempotencyGuard guard{store};
 * guard.run(msg.id, [&](const auto& ctx) {
 *   ctx.tx->exec("UPDATE account SET balance = balance + $1 WHERE id = $2", msg.amount, msg.account);
 * });
 * @endcode
 */
class PostgresStore {
 public:
  /// The schema version this library installs and expects (2: acquire reports a result that
  /// was not stored; a version-1 table is upgraded in place by migrate()).
  static constexpr int schema_version = 2;
  /// Longest key the store takes: keys live in a btree whose entries must stay below ~2.7 kB.
  static constexpr std::size_t max_key_bytes = 2048;

  /// An open claiming transaction (transactional mode); move-only; rolls back if destroyed open.
  class Transaction {
   public:
    Transaction(Transaction&& o) noexcept;                ///< Move-only.
    Transaction& operator=(Transaction&& o) noexcept;     ///< Move-only.
    Transaction(const Transaction&) = delete;             ///< Move-only.
    Transaction& operator=(const Transaction&) = delete;  ///< Move-only.
    ~Transaction();  ///< Rolls back if still open; the store must outlive its transactions.

    /// The acquire decision; only when it is acquired is the transaction open.
    [[nodiscard]] const AcquireResult& decision() const noexcept { return decision_; }
    /// True while the claim is held and neither commit nor fail was called.
    [[nodiscard]] bool is_open() const noexcept { return conn_ != nullptr; }
    /// The server process id of the transaction's session (pg_backend_pid()); 0 when not open.
    [[nodiscard]] int backend_pid() const noexcept;
    /// Records the result and commits it with the handler's writes; lease_lost if the claim was
    /// ended first (nothing committed). A lost answer is settled on a fresh session (outcome_unknown_error
    /// if not within settle_wait); a cut wait for a synchronous standby is durability_error.
    WriteStatus commit(std::string_view result, millis retention);
    /// Rolls back the handler's writes; unless params.release, records the failure afresh.
    WriteStatus fail(const FailParams& params);

    /// Runs one statement inside the transaction with $1.. bound to `args` (text format; strings,
    /// numbers, bool, std::optional / std::nullopt for NULL); throws store_error with the SQLSTATE.
    template <class... Args>
    PostgresResult exec(std::string_view sql, const Args&... args) {
      std::array<detail::TextParam, sizeof...(Args)> params{detail::text_param(args)...};
      return exec_params(sql, params.data(), params.size());
    }

    /// The transactional outbox of this transaction (idem/postgres/outbox_writer.hpp): messages sent through
    /// it commit with the handler's writes. Needs PostgresStoreOptions::outbox.
    OutboxWriter outbox() noexcept;
    /// The key this transaction claimed ("" when not acquired).
    [[nodiscard]] std::string_view key() const noexcept { return key_; }

   private:
    friend class detail::StoreImpl;
    friend class OutboxWriter;
    Transaction() noexcept;
    PostgresResult exec_params(std::string_view sql, const detail::TextParam* params, std::size_t n);
    void release(bool healthy) noexcept;

    detail::StoreImpl* store_ = nullptr;
    std::unique_ptr<detail::Connection> conn_;
    AcquireResult decision_;
    std::string key_, fingerprint_, owner_;
    std::string xid_;                // the transaction's id (pg_current_xact_id), to settle a lost COMMIT
    int server_pid_ = 0;             // pg_backend_pid() of its server session (not libpq's: a pooler's is its own)
    std::uint32_t outbox_sent_ = 0;  // messages sent through outbox(): the next one's index
  };

  /// Validates both option sets (invalid_options_error); makes a PostgresClient of its own.
  explicit PostgresStore(PostgresOptions options = {}, PostgresStoreOptions store = {});
  /// Validates the options (invalid_options_error); shares `client` (not null) with other stores.
  explicit PostgresStore(std::shared_ptr<PostgresClient> client, PostgresStoreOptions store = {});
  ~PostgresStore();                                    ///< Releases its client (the last owner closes the sessions).
  PostgresStore(PostgresStore&&) noexcept;             ///< Movable; not copyable.
  PostgresStore& operator=(PostgresStore&&) noexcept;  ///< Movable; not copyable.

  /// Atomic acquire of the record contract (docs/design.md) in one round trip; see AcquireStatus.
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

  /// Decides each request exactly as acquire() would (BatchStore), each with its own token,
  /// fingerprint, lease, retention and owner, in one round trip: one statement per 128 keys
  /// (docs/postgres.md, "Batches"), pipelined, each its own transaction; results in request order.
  /// A chunk that meets a row locked by another transaction is decided key by key instead (in one
  /// more round trip), so such a key answers in_flight exactly as acquire() answers it. A lost
  /// reply is asked again once as the same holders. On an error it throws after reading every
  /// answer; keys acquired by other chunks lapse after their lease (fail closed).
  std::vector<AcquireResult> acquire_many(std::span<const AcquireRequest> requests);

  /// The writes of one batch (BatchWriter): complete() and fail() send their statement at once on
  /// a session held for the batch (libpq pipeline mode, a sync after each: every write is its own
  /// transaction and commits as soon as the server reaches it) and return; finish() reads every
  /// answer, statuses in the order of the writes. Writes whose answer is lost (or that could not
  /// leave) are asked again once, as the same holder, on another session; what cannot be settled
  /// throws from finish() (outcome_unknown_error for a write that may have run). One thread.
  class BatchWriter {
   public:
    BatchWriter(BatchWriter&&) noexcept;             ///< Movable.
    BatchWriter& operator=(BatchWriter&&) noexcept;  ///< Movable.
    ~BatchWriter();  ///< Reads the answers finish() was not called for, and gives the session back.
    /// Sends the completion of `key` by `h` now (usage_error, nothing sent, over max_result_bytes).
    void complete(std::string_view key, const Holder& h, std::string_view result, millis retention);
    /// Sends the failure (or release) of `key` by `h` now.
    void fail(std::string_view key, const Holder& h, const FailParams& f);
    /// Every answer, in the order of the writes; throws what a write could not settle.
    std::vector<WriteStatus> finish();

   private:
    friend class PostgresStore;
    struct Impl;
    explicit BatchWriter(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
  };
  /// A writer for one batch (BatchStore); it holds one pooled session from its first write to finish().
  BatchWriter batch_writer();

  /// Claims `key` in a new transaction (transactional mode); see TransactionalStore.
  Transaction begin(std::string_view key, const AcquireParams& params);

  /// Deletes expired records in batches of `batch` rows (each its own short transaction, skipping
  /// rows locked by others), at most `max_batches` batches; returns how many rows it removed.
  std::size_t purge_expired(std::size_t batch = 1000, std::size_t max_batches = 1000);

  /// Creates or upgrades the schema now (idempotent; serialised by an advisory lock).
  void migrate();

  /// True in transactional mode: the guard then runs handlers inside begin()'s transaction.
  [[nodiscard]] bool transactional() const noexcept;
  /// Hands the client's advisories (PostgresOptions::observer) to `o` too; a guard attaches its own.
  void attach_observer(const std::shared_ptr<Observer>& o) const;
  /// The options in force.
  [[nodiscard]] const PostgresStoreOptions& options() const noexcept;
  /// What the store takes: keys up to max_key_bytes, results up to options().max_result_bytes.
  [[nodiscard]] StoreLimits limits() const noexcept;
  /// The client whose sessions this store uses, to share with a PostgresSequenceStore.
  [[nodiscard]] const std::shared_ptr<PostgresClient>& client() const noexcept;
  /// The schema-qualified, quoted table name, for queries of your own.
  [[nodiscard]] const std::string& qualified_table() const noexcept;

 private:
  friend class PostgresJoined;  // its claims run this store's statements on the application's connection
  std::unique_ptr<detail::StoreImpl> impl_;
};

static_assert(StateStore<PostgresStore>);
static_assert(TransactionalStore<PostgresStore>);
static_assert(HasStoreLimits<PostgresStore>);
static_assert(CompletesUnavailable<PostgresStore>);
// Lease mode's batch path; in transactional mode the guard runs a batch item by item (each
// handler's writes commit in its own claiming transaction), whatever the store offers.
static_assert(BatchStore<PostgresStore>);

}  // namespace idem

// OutboxWriter, the return type of Transaction::outbox(), needs the complete Transaction.
#define IDEM_POSTGRES_STORE_BODY
#include "idem/postgres/outbox_writer.hpp"  // IWYU pragma: export
