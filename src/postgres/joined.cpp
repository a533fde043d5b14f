// PostgresJoined: transactional mode on the application's connection. The claim is the store's
// own claiming statement, run behind a savepoint so that a busy key (55P03 / 40001) or any other
// refusal leaves the application's transaction usable; the completion is the store's, without
// the COMMIT, which is the application's.

#include "idem/postgres/joined.hpp"

#include <charconv>
#include <cstdlib>
#include <cstring>
#include <utility>

#include <fmt/format.h>

#include "idem/core/error.hpp"
#include "idem/core/validate.hpp"
#include "store_impl.hpp"

namespace idem {

namespace {

constexpr const char* kSavepoint = "SAVEPOINT idem_claim";
constexpr const char* kRollbackTo = "ROLLBACK TO SAVEPOINT idem_claim";
constexpr const char* kRelease = "RELEASE SAVEPOINT idem_claim";

// Our Params as the connection's parameters (views into `p`, which must outlive them).
std::vector<JoinedConnection::Param> joined_params(const detail::Params& p) {
  std::vector<JoinedConnection::Param> out(static_cast<std::size_t>(p.size()));
  for (int i = 0; i < p.size(); ++i) {
    const char* v = p.values()[i];
    const bool binary = p.formats()[i] == 1;
    if (v != nullptr)
      out[static_cast<std::size_t>(i)].value =
          std::string_view(v, binary ? static_cast<std::size_t>(p.lengths()[i]) : std::strlen(v));
    out[static_cast<std::size_t>(i)].binary = binary;
  }
  return out;
}

std::int64_t int_cell(const JoinedConnection::Row& row, std::size_t i) {
  if (i >= row.size() || !row[i]) throw corrupt_record_error("idem: postgres claim returned a NULL or missing column");
  const std::string& s = *row[i];
  std::int64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc{} || end != s.data() + s.size())
    throw corrupt_record_error(fmt::format("idem: postgres claim returned '{}' for a number", s.substr(0, 32)));
  return v;
}

// bytea's text form (hex, or the old escape form when bytea_output says so), as its bytes.
std::string bytea_cell(const JoinedConnection::Row& row, std::size_t i) {
  if (i >= row.size() || !row[i]) throw corrupt_record_error("idem: postgres claim returned a NULL or missing column");
  std::size_t n = 0;
  unsigned char* raw = PQunescapeBytea(reinterpret_cast<const unsigned char*>(row[i]->c_str()), &n);
  if (raw == nullptr) throw corrupt_record_error("idem: postgres claim returned an unreadable bytea");
  std::string out(reinterpret_cast<const char*>(raw), n);
  PQfreemem(raw);
  return out;
}

// The claim's decision from its one text row: status, fence, takeover, attempts, retry_after, payload.
AcquireResult decode_text_acquire(const std::vector<JoinedConnection::Row>& rows, std::uint64_t token) {
  if (rows.size() != 1 || rows[0].size() != 6)
    throw corrupt_record_error("idem: postgres claim returned an unexpected shape");
  const auto& r = rows[0];
  AcquireResult a;
  const auto st = int_cell(r, 0);
  if (st < 0 || st > 5) throw corrupt_record_error(fmt::format("idem: postgres claim returned status {}", st));
  a.status = st == 5 ? AcquireStatus::duplicate : static_cast<AcquireStatus>(st);
  a.result_unavailable = st == 5;
  if (!r[2] || (*r[2] != "t" && *r[2] != "f"))
    throw corrupt_record_error("idem: postgres claim returned an unreadable boolean");
  a.takeover = *r[2] == "t";
  a.attempts = static_cast<std::uint32_t>(int_cell(r, 3));
  a.retry_after = millis{std::max<std::int64_t>(0, int_cell(r, 4))};
  a.payload = bytea_cell(r, 5);
  if (a.status == AcquireStatus::acquired) a.holder = {static_cast<std::uint64_t>(int_cell(r, 1)), token};
  return a;
}

}  // namespace

// --- LibpqConnection --------------------------------------------------------------------------

LibpqConnection::LibpqConnection(pg_conn* conn) : conn_(conn) {
  if (conn_ == nullptr) throw usage_error("idem: LibpqConnection needs a connection (got a null PGconn*)");
}

std::vector<JoinedConnection::Row> LibpqConnection::exec(const std::string& sql, std::span<const Param> params) {
  if (PQpipelineStatus(conn_) != PQ_PIPELINE_OFF)
    throw usage_error("idem: the application's connection is in pipeline mode; leave it (PQexitPipelineMode) first");
  switch (PQtransactionStatus(conn_)) {
    case PQTRANS_INTRANS: break;
    case PQTRANS_IDLE:
      throw usage_error("idem: no transaction is open on the application's connection: send BEGIN before the run");
    case PQTRANS_INERROR:
      throw usage_error("idem: the application's transaction already failed: roll it back and begin again");
    case PQTRANS_ACTIVE: throw usage_error("idem: the application's connection is busy with another query");
    default: throw connection_error("idem: the application's PostgreSQL connection is broken", "08006", true);
  }
  std::vector<const char*> vals(params.size());
  std::vector<int> lens(params.size()), fmts(params.size());
  std::vector<std::string> texts(params.size());  // text values need a terminating NUL
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!params[i].value) continue;
    if (params[i].binary) {
      vals[i] = params[i].value->data();
      lens[i] = static_cast<int>(params[i].value->size());
      fmts[i] = 1;
    } else {
      texts[i] = std::string(*params[i].value);
      vals[i] = texts[i].c_str();
    }
  }
  PostgresResult r = detail::ResultAccess::wrap(PQexecParams(conn_, sql.c_str(), static_cast<int>(params.size()),
                                                             nullptr, vals.data(), lens.data(), fmts.data(), 0));
  const PGresult* res = detail::ResultAccess::native(r);
  if (!detail::result_ok(res)) detail::throw_result("statement in the application's transaction", res, conn_);
  std::vector<Row> rows(static_cast<std::size_t>(PQntuples(res)));
  const int cols = PQnfields(res);
  for (int i = 0; i < PQntuples(res); ++i) {
    auto& row = rows[static_cast<std::size_t>(i)];
    row.resize(static_cast<std::size_t>(cols));
    for (int c = 0; c < cols; ++c)
      if (!PQgetisnull(res, i, c))
        row[static_cast<std::size_t>(c)] =
            std::string(PQgetvalue(res, i, c), static_cast<std::size_t>(PQgetlength(res, i, c)));
  }
  return rows;
}

// --- PostgresJoined ---------------------------------------------------------------------------

PostgresJoined::PostgresJoined(PostgresStore& store, JoinedConnection& conn) : store_(&store), conn_(&conn) {
  if (!store.transactional())
    throw invalid_options_error(
        "idem: PostgresJoined needs a store in transactional mode (PostgresStoreOptions::mode = "
        "PostgresMode::transactional)");
}

PostgresJoined::Transaction PostgresJoined::begin(std::string_view key, const AcquireParams& ap) {
  detail::check_acquire(key, ap);
  detail::check_pg_key(key);
  detail::StoreImpl& impl = *store_->impl_;
  impl.ensure_ready();
  Transaction tx;
  tx.joined_ = this;
  const std::string owner = detail::clean_owner(ap.owner);
  detail::Params p = impl.acquire_params(key, ap, owner, true);
  auto params = joined_params(p);
  // $8: a claiming transaction ("" is lease mode's), with no idle timeout set on the session: the
  // application's transaction is the application's, and so is how long it stays open.
  params[7].value = std::string_view("-");
  conn_->exec(kSavepoint, {});
  std::vector<JoinedConnection::Row> rows;
  try {
    rows = conn_->exec(impl.texts[detail::kAcquire], params);
  } catch (const store_error& e) {
    const bool busy = e.code() == "55P03" || e.code() == "40001";
    try {
      conn_->exec(kRollbackTo, {});
      conn_->exec(kRelease, {});
    } catch (...) {
      if (busy) throw;  // the application's transaction is unusable: say so rather than in_flight
    }
    if (!busy) throw;
    tx.decision_ = detail::StoreImpl::lock_busy(ap);
    return tx;
  }
  try {
    tx.decision_ = decode_text_acquire(rows, ap.token);
  } catch (...) {
    conn_->exec(kRollbackTo, {});
    conn_->exec(kRelease, {});
    throw;
  }
  if (tx.decision_.status != AcquireStatus::acquired) {
    conn_->exec(kRollbackTo, {});
    conn_->exec(kRelease, {});
    return tx;
  }
  tx.key_ = std::string(key);
  tx.fingerprint_ = std::string(ap.fingerprint);
  tx.owner_ = owner;
  tx.open_ = true;
  return tx;
}

PostgresJoined::Transaction::Transaction(Transaction&& o) noexcept
    : joined_(o.joined_),
      decision_(std::move(o.decision_)),
      key_(std::move(o.key_)),
      fingerprint_(std::move(o.fingerprint_)),
      owner_(std::move(o.owner_)),
      open_(std::exchange(o.open_, false)) {}

PostgresJoined::Transaction& PostgresJoined::Transaction::operator=(Transaction&& o) noexcept {
  if (this != &o) {
    undo();
    joined_ = o.joined_;
    decision_ = std::move(o.decision_);
    key_ = std::move(o.key_);
    fingerprint_ = std::move(o.fingerprint_);
    owner_ = std::move(o.owner_);
    open_ = std::exchange(o.open_, false);
  }
  return *this;
}

PostgresJoined::Transaction::~Transaction() { undo(); }

void PostgresJoined::Transaction::undo() noexcept {
  if (!open_) return;
  open_ = false;
  try {
    joined_->conn_->exec(kRollbackTo, {});
    joined_->conn_->exec(kRelease, {});
  } catch (...) {
    // The application's transaction is then unusable and its COMMIT rolls back: nothing of the
    // claim survives either way.
  }
}

WriteStatus PostgresJoined::Transaction::commit(std::string_view result, millis retention) {
  if (!open_) throw usage_error("idem: commit on a joined claim that is not open (not acquired, or already ended)");
  detail::check_lease(retention, "retention");
  detail::StoreImpl& impl = *joined_->store_->impl_;
  detail::Params p;
  p.bin(key_).num(detail::as_i64(decision_.holder.fence)).num(detail::as_i64(decision_.holder.token));
  p.bin(result).num(retention.count());
  try {
    joined_->conn_->exec(impl.texts[detail::kTxComplete], joined_params(p));
  } catch (const store_error& e) {
    if (e.code() != "22012") throw;  // open_ stays: the destructor rolls back to the savepoint
    undo();
    return WriteStatus::lease_lost;  // the claim was gone (see kTxComplete)
  }
  open_ = false;
  joined_->conn_->exec(kRelease, {});
  return WriteStatus::ok;
}

WriteStatus PostgresJoined::Transaction::fail(const FailParams& f) {
  if (!open_) throw usage_error("idem: fail on a joined claim that is not open (not acquired, or already ended)");
  detail::check_lease(f.retention, "retention");
  open_ = false;
  joined_->conn_->exec(kRollbackTo, {});
  joined_->conn_->exec(kRelease, {});
  if (f.release) return WriteStatus::ok;  // the rollback freed the key
  // The failure is recorded on a session of the store's own, in a transaction of its own: the
  // rollback to the savepoint released the claim's row and lock in the application's transaction.
  detail::StoreImpl& impl = *joined_->store_->impl_;
  const detail::Params p = impl.failure_record(key_, fingerprint_, owner_, decision_, f);
  PostgresResult r = impl.exchange(detail::kRecordFailure, detail::kRecordFailure, p, "record failure", true);
  const PGresult* res = detail::ResultAccess::native(r);
  if (!detail::result_ok(res)) {
    if (detail::sqlstate_of(res) == "55P03") return WriteStatus::lease_lost;  // someone else holds the key now
    detail::throw_result("record failure", res, nullptr, detail::store_missing);
  }
  return r.rows() == 1 && detail::bool_of(res, 0, 0) ? WriteStatus::ok : WriteStatus::lease_lost;
}

}  // namespace idem
