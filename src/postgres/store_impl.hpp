#pragma once
// Internal to idem_postgres: what is behind PostgresStore — its prepared statements, the binary
// parameters and decoders of those statements, migration, and the transactional-mode claim.

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "client.hpp"
#include "idem/postgres/store.hpp"

namespace idem::detail {

extern const char* const pg_schema_v1_sql;  // generated from schema_v1.sql at build time
extern const char* const pg_schema_v2_sql;  // generated from schema_v2.sql at build time
extern const char* const pg_outbox_v1_sql;  // generated from outbox_v1.sql at build time

inline constexpr MissingSchemaHint store_missing{
    "; the idem schema is missing: call PostgresStore::migrate() or set auto_migrate", true};

// Keys sit in a btree whose entries must stay below ~2.7 kB; longer keys are refused up front
// with a typed error rather than by the server halfway through a transition.
inline constexpr std::size_t max_pg_key_bytes = PostgresStore::max_key_bytes;
// Keys of acquire / begin: at most max_pg_key_bytes (invalid_key_error, advising to hash).
void check_pg_key(std::string_view key);
// bytea holds at most 1 GB; the option may not promise more.
inline constexpr std::size_t max_pg_result_bytes = (std::size_t{1} << 30) - 1;

// Parameters of our prepared statements: bytea in binary (keys are arbitrary bytes), the rest as text.
// bin() keeps a view (the bytes must outlive the call); text() and owned_bin() keep a copy, and a
// copied or moved Params points at its own copies.
class Params {
 public:
  Params() = default;
  Params(const Params& o) { *this = o; }
  Params& operator=(const Params& o);
  Params& bin(std::string_view v);
  // Binary bytes the Params keeps (the arrays of acquire_many).
  Params& owned_bin(std::string v);
  Params& text(std::string v);
  Params& num(std::int64_t v) { return text(std::to_string(v)); }
  Params& boolean(bool v) { return text(v ? "t" : "f"); }
  Params& null();
  [[nodiscard]] int size() const { return n_; }
  [[nodiscard]] const char* const* values() const { return vals_.data(); }
  [[nodiscard]] const int* lengths() const { return lens_.data(); }
  [[nodiscard]] const int* formats() const { return fmts_.data(); }

 private:
  static constexpr int cap = 12;  // the widest statement, record_failure, has 11
  std::array<bool, cap> owned_{};  // vals_[i] points into store_[i]
  std::array<std::string, cap> store_{};
  std::array<const char*, cap> vals_{};
  std::array<int, cap> lens_{};
  std::array<int, cap> fmts_{};
  int n_ = 0;
};

// Binary-format decoding of the values our own statements return; a length that does not fit
// the type means the row (or the function) is not what we wrote, which must fail closed.
std::int64_t be_int(const PGresult* r, int row, int col, int bytes);
std::string bytes_of(const PGresult* r, int row, int col);
inline bool bool_of(const PGresult* r, int row, int col) { return be_int(r, row, col, 1) != 0; }
AcquireResult decode_acquire(const PGresult* r, std::uint64_t token);
// kAcquireLease / kAcquireAgain answer a new key with no row at all (the INSERT took it) and any
// other decision with the function's one row.
AcquireResult decode_acquire_lease(const PGresult* r, std::uint64_t token);
// The decision in columns col..col+5 of `row` (status, fence, takeover, attempts, retry_after, payload).
AcquireResult decode_acquire_row(const PGresult* r, int row, int col, std::uint64_t token);
// The record of kInspect's row (no row: absent); corrupt_record_error on any other shape or value.
std::optional<Record> decode_inspect(const PGresult* r, std::string_view key);

// Binary-format one-dimensional arrays, the parameters of acquire_many's statement.
std::string bytea_array(const std::vector<std::string_view>& v);
std::string int8_array(const std::vector<std::int64_t>& v);
std::string text_array(const std::vector<std::string>& v);

// Owner ids are diagnostics in a text column; bytes that are not printable ASCII (or NUL, which
// text cannot hold) become '?', so an odd hostname can never make acquire fail.
std::string clean_owner(std::string_view o);

inline std::int64_t as_i64(std::uint64_t v) { return static_cast<std::int64_t>(v); }

// Hashed into every prepared statement's name with its text: a new way of binding or decoding the
// same SQL changes it, so a session never runs a statement prepared by another version of idem.
inline constexpr std::string_view kStatementFormat = "idem-statement-v1";

// The prepared statements of a store, by index into StoreImpl::names. A *Again statement is what
// a lease-mode call sends on a second session when the first died under it: the same request,
// which also recognises this holder's own earlier write as done (so a lost reply settles).
enum Stmt : std::size_t {
  kAcquire,       // transactional-mode claim (begin)
  kAcquireLease,  // lease mode (acquire): $8 is always ''
  kAcquireAgain,  // kAcquireLease, or acquired with the live row's fence when its token is ours
  kComplete,
  kCompleteAgain,
  kUnavailable,  // complete_unavailable
  kUnavailableAgain,
  kFail,
  kFailAgain,
  kExtend,
  kInspect,
  kPurge,
  kTxComplete,
  kRecordFailure,
  kAcquireMany,       // lease mode, up to acquire_many_chunk keys in one statement (batch.cpp)
  kAcquireManyAgain,  // kAcquireMany, or acquired with the live row's fence where the token is ours
  kStatementCount
};

// Keys per kAcquireMany statement: each holds one claim lock (an entry of the server's shared lock
// table, max_locks_per_transaction x max_connections) until its statement commits.
inline constexpr std::size_t acquire_many_chunk = 128;

// What became of one request sent on a session.
enum class Fate {
  answered,  // the server's answer (success or an error) arrived, and with it the end of its transaction
  unsent,    // libpq could not send the request: the server certainly did not run it
  in_doubt,  // sent, then the session died before the answer: the server may have run it
};

struct Reply {
  PostgresResult result;
  Fate fate = Fate::answered;
  std::string why;  // unsent / in_doubt: libpq's message
  bool sync_cut = false;  // answered after the server cancelled its commit's wait for a synchronous standby
  millis cancelled_after{0};  // sync_cut: idem cancelled that wait after this long (0: someone else did)
};

// One request of exchange_many: prepared statement `st`, and `again`, what is sent instead on a
// second session when the first died under it (store_impl.hpp, the *Again statements). `params`
// must outlive the call.
struct Call {
  Stmt st;
  Stmt again;
  const Params* params;
};

class StoreImpl;

// A pooled, prepared session in libpq pipeline mode with a sync after every request, so each
// request is its own implicit transaction (an error ends only its own) and commits as soon as the
// server reaches it; the client reads the answers when it wants them, in order (call.cpp).
class Pipeline {
 public:
  explicit Pipeline(StoreImpl& s);  // throws what checkout / preparation throws: nothing sent
  // On a session the caller checked out (non-null); preparation throws as above, the session dropped.
  Pipeline(StoreImpl& s, std::unique_ptr<Connection> session);
  ~Pipeline();                      // reads what is unread, leaves pipeline mode, returns the session
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  // Sends `st` and a sync (flushed). False when the session broke: the request did not leave,
  // and nothing more can be sent here (next() answers unsent for it).
  bool send(Stmt st, const Params& p);
  // The answer to the oldest request not read yet (sent or refused by send()).
  Reply next();
  // Requests sent (or refused) whose answers were not read yet.
  [[nodiscard]] std::size_t unread() const noexcept { return queued_.size() - read_; }
  // Reads what is unread and gives the session back (kept when it is idle and sound).
  void close() noexcept;

 private:
  StoreImpl* store_;
  std::unique_ptr<Connection> conn_;
  std::vector<bool> queued_;  // per request: whether it left (false: send() refused it)
  std::size_t read_ = 0;
  bool broken_ = false;     // the session died or libpq lost track: no more sends, the rest in doubt
  bool read_only_ = false;  // a request answered 25006: the session is dropped at close()
  std::string why_;
};

class StoreImpl {
 public:
  StoreImpl(std::shared_ptr<PostgresClient> client, PostgresStoreOptions options);

  // statements.cpp: prepares this store's statements on a pooled session (migrating the schema
  // first when auto_migrate). On failure some may be prepared: the caller must drop the session.
  void prepare(Connection& c);
  // Sends (PQsendQuery*) statement `st` with binary results: by name, or by its text behind a
  // transaction-mode pooler (PostgresOptions::transaction_pooler). Its answer is awaited with
  // await_answer, which bounds a request that can commit (no blocking PQexec* for those).
  int send_statement(PGconn* c, Stmt st, const Params& p) const;
  // call.cpp: a lease-mode call. Sends prepared statement `st` on a pooled session; if the
  // session dies under it, sends `again` once on another session. `writes`: the request changes
  // the record, so a reply lost after sending that cannot be settled is outcome_unknown_error.
  // exchange returns the server's answer unchecked; run throws the mapped error for a failure.
  PostgresResult exchange(Stmt st, Stmt again, const Params& p, std::string_view what, bool writes);
  // The requests of `calls` in one pipeline on one session (one round trip), each its own
  // transaction; those whose session died under them go once more as `again`, in one pipeline on
  // another session, as exchange does for one. Answers in order, unchecked.
  std::vector<PostgresResult> exchange_many(std::span<const Call> calls, std::string_view what, bool writes);
  // The second chance of exchange_many (and of a batch's writes): the replies not answered are
  // sent again as their `again`, in one pipeline on another session; throws what cannot be settled
  // (outcome_unknown_error for a write that may have run, else connection_error).
  void settle(std::span<const Call> calls, std::span<Reply> replies, std::string_view what, bool writes);
  PostgresResult run(Stmt st, Stmt again, const Params& p, std::string_view what, bool writes);
  // A holder-checked write (complete, fail, extend, ...): ok when one row was written (or, for
  // `again`, found already written by this holder).
  WriteStatus write(Stmt st, Stmt again, const Params& p, std::string_view what);

  // migrate.cpp
  void migrate();
  void ensure_migrated(PGconn* c);
  // Migrates on a pooled session unless done already or auto_migrate is off (joined claims,
  // which run on the application's connection and never migrate there).
  void ensure_ready();

  // batch.cpp: acquire_many of requests `idx` (keys distinct), answers into out[idx[j]].
  void acquire_distinct(std::span<const AcquireRequest> requests, const std::vector<std::size_t>& idx,
                        std::vector<AcquireResult>& out);

  // settle.cpp: the outcome of a transactional COMMIT whose answer was lost (`why`, `code`), read
  // on fresh sessions within settle_wait: ok when it committed; connection_error (retryable) when
  // it did not; outcome_unknown_error (or durability_error while a synchronous standby is awaited)
  // when that cannot be told in time. `xid` (xid8 text) and `backend_pid` are the transaction's
  // id and the server process it ran on.
  WriteStatus settle_commit(std::string_view key, const Holder& h, const std::string& xid, int backend_pid,
                            const std::string& why, const std::string& code);

  // transaction.cpp
  PostgresStore::Transaction begin(std::string_view key, const AcquireParams& ap);
  // One claim; nullopt (unless `last`) when its session died under it.
  std::optional<PostgresStore::Transaction> try_begin(std::string_view key, const AcquireParams& ap, bool last);

  // The parameters of complete / complete_unavailable (key, fence, token, value, retention), checked.
  Params completion(std::string_view key, const Holder& h, std::string_view value, millis retention) const;
  Params acquire_params(std::string_view key, const AcquireParams& ap, const std::string& owner, bool tx) const;
  // kRecordFailure's parameters: the failure of a claim `d` of `key` rolled back, written afresh
  // (transactional mode and joined claims). Views into key, fingerprint and f.error.
  Params failure_record(std::string_view key, std::string_view fingerprint, const std::string& owner,
                        const AcquireResult& d, const FailParams& f) const;
  // The key's claim lock (claim_wait none): the first 8 bytes of SHA-256(qualified table, NUL,
  // key), big-endian, as the bigint of pg_try_advisory_xact_lock.
  std::int64_t claim_lock_id(std::string_view key) const;
  // A row lock held by another transaction (a transactional-mode holder): its lease end is not
  // visible, so the caller is told to come back after at most one lease.
  static AcquireResult lock_busy(const AcquireParams& ap);

  std::shared_ptr<PostgresClient> client_ptr;
  ClientImpl& client;
  PostgresStoreOptions opt;
  std::string qs, qt, begin_sql, lock_timeout_text;
  std::uint32_t statement_set;
  // On the server: idem_<kind>_<24 hex of SHA-256(kStatementFormat, NUL, text)>, so a name
  // denotes one statement on any session (see the constructor, store.cpp).
  std::array<std::string, kStatementCount> names;
  std::array<std::string, kStatementCount> texts;  // their SQL (define_all)
  std::array<int, kStatementCount> nparams{};

 private:
  void migrate_on(PGconn* c);
  void define_all();  // statements.cpp: fills texts and nparams

  std::mutex migrate_mu_;
  bool migrated_ = false;
};

}  // namespace idem::detail
