// SqliteStore's transactional mode. The claim commits first, in its own write transaction, so every
// process sees the key in flight (an uncommitted claim would be invisible to them); then a second
// write transaction opens on the same connection, still under the in-process write lock, and the
// handler writes through it. The completion is written in that transaction and commits with the
// handler's writes; a handler exception, a crash or a lost claim rolls them back. While the
// transaction is open it holds the file's write lock, so no one can take the claim over: the lock
// is the lease, as PostgreSQL's row lock is.

#include <utility>

#include <fmt/format.h>

#include "db.hpp"
#include "idem/core/validate.hpp"
#include "store_impl.hpp"

namespace idem {
namespace detail {

namespace {
constexpr const char* savepoint = "SAVEPOINT idem_handler";
}  // namespace

SqliteStore::Transaction SqliteStoreImpl::begin(std::string_view key, const AcquireParams& p) {
  check_acquire(key, p);
  check_key(key, SqliteStore::max_key_bytes);
  ensure_ready();
  SqliteStore::Transaction tx;
  if (auto early = snapshot_decision(key, p)) {
    tx.decision_ = std::move(*early);
    return tx;
  }
  auto lock = db->lock_writer("begin");
  auto c = db->checkout();
  db->begin_immediate(*c, "begin (claim)");
  try {
    tx.decision_ = claim(*c, key, p);
    db->commit(*c, CommitKind::decision, "begin (claim)");
  } catch (...) {
    SqliteDb::rollback_quietly(*c);
    throw;
  }
  if (tx.decision_.status != AcquireStatus::acquired) return tx;
  // Still under the in-process lock: only another process can take the file lock in between; if
  // it holds it past busy_timeout the claim stays committed and lapses after its lease.
  db->begin_immediate(*c, "begin (handler transaction; the claim lapses after its lease)");
  try {
    db->exec(*c, savepoint, "begin (savepoint)");
  } catch (...) {
    SqliteDb::rollback_quietly(*c);
    throw;
  }
  c->in_handler = true;
  auto st = std::make_unique<SqliteTxState>();
  st->store = this;
  st->db = db;
  st->lock.emplace(std::move(lock));
  st->conn = std::move(c);
  st->key = std::string(key);
  st->holder = tx.decision_.holder;
  st->retention = p.retention;
  tx.state_ = std::move(st);
  return tx;
}

}  // namespace detail

SqliteStore::Transaction SqliteStore::begin(std::string_view key, const AcquireParams& params) {
  return impl_->begin(key, params);
}

SqliteStore::Transaction::Transaction() noexcept = default;

SqliteStore::Transaction::Transaction(Transaction&& o) noexcept
    : decision_(std::move(o.decision_)), state_(std::move(o.state_)) {}

SqliteStore::Transaction& SqliteStore::Transaction::operator=(Transaction&& o) noexcept {
  if (this != &o) {
    abandon();
    decision_ = std::move(o.decision_);
    state_ = std::move(o.state_);
  }
  return *this;
}

SqliteStore::Transaction::~Transaction() { abandon(); }

void SqliteStore::Transaction::abandon() noexcept {
  if (!is_open()) return;
  // Abandoned while open (the guard always calls commit or fail): the handler's writes roll back
  // and the key is released at once rather than held until the lease lapses.
  try {
    FailParams f;
    f.error = "transaction abandoned";
    f.release = true;
    f.retention = state_->retention;
    fail(f);
  } catch (...) {  // NOLINT(bugprone-empty-catch): rolled back; the claim lapses after its lease
  }
  state_.reset();
}

bool SqliteStore::Transaction::is_open() const noexcept { return state_ != nullptr; }

std::string_view SqliteStore::Transaction::key() const noexcept { return state_ ? std::string_view(state_->key) : ""; }

sqlite3* SqliteStore::Transaction::handle() const noexcept { return state_ ? state_->conn->db : nullptr; }

WriteStatus SqliteStore::Transaction::commit(std::string_view result, millis retention) {
  if (!is_open()) throw usage_error("idem: commit() on a SqliteStore transaction that is not open");
  auto st = std::move(state_);  // whatever happens below, the transaction ends here
  detail::SqliteDb& db = *st->db;
  detail::SqliteConn& c = *st->conn;
  const detail::HeldWrite w{detail::HeldWrite::complete, st->key, st->holder, result, retention};
  st->store->check_write(w);
  c.in_handler = false;
  if (sqlite3_get_autocommit(c.db) != 0)
    throw store_error(fmt::format("idem: sqlite commit of key '{}' on {}: the handler's transaction had ended before "
                                  "the completion (a COMMIT or ROLLBACK through handle(), or an error SQLite rolled back "
                                  "on its own); nothing was recorded and the claim lapses after its lease",
                                  st->key.substr(0, 64), db.path()),
                      "SQLITE_TXN", true);
  try {
    if (st->store->held_write(c, w) == WriteStatus::lease_lost) {
      detail::SqliteDb::rollback_quietly(c);
      return WriteStatus::lease_lost;
    }
    db.commit(c, detail::CommitKind::completion, "commit");
  } catch (...) {
    detail::SqliteDb::rollback_quietly(c);
    throw;
  }
  return WriteStatus::ok;
}

WriteStatus SqliteStore::Transaction::fail(const FailParams& params) {
  if (!is_open()) throw usage_error("idem: fail() on a SqliteStore transaction that is not open");
  auto st = std::move(state_);
  detail::SqliteDb& db = *st->db;
  detail::SqliteConn& c = *st->conn;
  const detail::HeldWrite w{detail::HeldWrite::fail, st->key,        st->holder,      params.error, params.retention,
                            params.release,          params.permanent, params.backoff};
  c.in_handler = false;
  try {
    st->store->check_write(w);
    // The handler's writes go; the claim (committed before them) stays for the failure to be
    // written on, in the same transaction when it is still open.
    if (sqlite3_get_autocommit(c.db) != 0)
      db.begin_immediate(c, "fail");
    else
      db.exec(c, "ROLLBACK TO idem_handler", "fail (rollback of the handler's writes)");
    const WriteStatus s = st->store->held_write(c, w);
    if (s == WriteStatus::lease_lost) {
      detail::SqliteDb::rollback_quietly(c);
      return s;
    }
    db.commit(c, detail::CommitKind::completion, "fail");
    return s;
  } catch (...) {
    detail::SqliteDb::rollback_quietly(c);
    throw;
  }
}

std::int64_t SqliteStore::Transaction::exec_values(std::string_view sql, std::span<const SqliteValue> values) {
  if (!is_open()) throw usage_error("idem: exec() on a SqliteStore transaction that is not open");
  detail::SqliteDb& db = *state_->db;
  sqlite3* h = state_->conn->db;
  sqlite3_stmt* raw = nullptr;
  const char* tail = nullptr;
  const int rc = sqlite3_prepare_v2(h, sql.data(), static_cast<int>(sql.size()), &raw, &tail);
  std::unique_ptr<sqlite3_stmt, int (*)(sqlite3_stmt*)> s(raw, &sqlite3_finalize);
  if (rc != SQLITE_OK) db.raise(h, rc, "exec (prepare)");
  const std::string_view rest(tail, static_cast<std::size_t>(sql.data() + sql.size() - tail));
  if (rest.find_first_not_of(" \t\r\n;") != std::string_view::npos)
    throw usage_error("idem: SqliteStore::Transaction::exec runs one statement; call it once per statement");
  if (!s) return 0;
  if (static_cast<std::size_t>(sqlite3_bind_parameter_count(s.get())) != values.size())
    throw usage_error(fmt::format("idem: exec: the statement has {} parameters, {} values were given",
                                  sqlite3_bind_parameter_count(s.get()), values.size()));
  for (std::size_t i = 0; i < values.size(); ++i) {
    const int at = static_cast<int>(i + 1);
    std::visit(
        [&](const auto& v) {
          using V = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<V, std::nullptr_t>)
            sqlite3_bind_null(s.get(), at);
          else if constexpr (std::is_same_v<V, std::int64_t>)
            sqlite3_bind_int64(s.get(), at, v);
          else if constexpr (std::is_same_v<V, double>)
            sqlite3_bind_double(s.get(), at, v);
          else
            sqlite3_bind_text64(s.get(), at, v.empty() ? "" : v.data(), v.size(), SQLITE_TRANSIENT, SQLITE_UTF8);
        },
        values[i]);
  }
  const sqlite3_int64 before = sqlite3_total_changes64(h);
  for (;;) {
    const int step = sqlite3_step(s.get());
    if (step == SQLITE_DONE) break;
    if (step != SQLITE_ROW) db.raise(h, step, "exec");
  }
  // changes() keeps the last INSERT/UPDATE/DELETE's count across other statements (DDL, SELECT).
  return sqlite3_total_changes64(h) == before ? 0 : sqlite3_changes64(h);
}

}  // namespace idem
