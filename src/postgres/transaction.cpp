// PostgresStore's transactional mode: the claim opens a transaction (BEGIN and the claim in one
// pipeline) that the handler writes through, and its completion commits in the same pipeline as
// COMMIT, so the record and the handler's writes commit together or not at all.

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/core/error.hpp"
#include "idem/core/validate.hpp"
#include "store_impl.hpp"

namespace idem {
namespace detail {

namespace {

// Reads `n` query results and the sync of a pipeline, each awaited within `bound` (await_answer);
// false when the connection broke or no answer came.
bool read_pipeline(Connection& conn, PostgresResult* out, std::size_t n, millis bound) {
  PGconn* c = conn.pg;
  for (std::size_t i = 0; i < n; ++i) {
    if (!await_answer(conn, bound)) return false;
    PGresult* r = PQgetResult(c);
    if (!r) return false;
    out[i] = ResultAccess::wrap(r);
    // Each query's results end with a null; a second non-null would be a protocol surprise.
    for (int guard = 0; guard < 4; ++guard) {
      PGresult* extra = PQgetResult(c);
      if (!extra) break;
      PQclear(extra);
    }
    if (PQstatus(c) != CONNECTION_OK) return false;
  }
  if (!await_answer(conn, bound)) return false;
  PGresult* s = PQgetResult(c);
  const bool synced = s && PQresultStatus(s) == PGRES_PIPELINE_SYNC;
  PQclear(s);
  return synced && PQstatus(c) == CONNECTION_OK;
}

}  // namespace

PostgresStore::Transaction StoreImpl::begin(std::string_view key, const AcquireParams& ap) {
  // A claim whose session died under it committed nothing (COMMIT is never in its pipeline, and
  // the server rolls back a dead session's transaction): it is sent once more on another session.
  std::optional<PostgresStore::Transaction> tx = try_begin(key, ap, false);
  if (!tx) tx = try_begin(key, ap, true);
  return std::move(*tx);
}

std::optional<PostgresStore::Transaction> StoreImpl::try_begin(std::string_view key, const AcquireParams& ap,
                                                               bool last) {
  PostgresStore::Transaction tx;
  tx.store_ = this;
  const std::string owner = clean_owner(ap.owner);
  auto conn = client.pool().checkout();
  PGconn* c = conn->pg;
  bool healthy = true;
  PostgresResult res_xid;
  try {
    prepare(*conn);
    Params p = acquire_params(key, ap, owner, true);
    // BEGIN and the claim travel in one pipeline: one round trip for both.
    if (PQenterPipelineMode(c) != 1) throw_result("begin (pipeline)", nullptr, c, store_missing);
    const bool sent =
        PQsendQueryParams(c, begin_sql.c_str(), 0, nullptr, nullptr, nullptr, nullptr, 0) == 1 &&
        send_statement(c, kAcquire, p) == 1 &&
        PQsendQueryParams(c, "SELECT pg_current_xact_id_if_assigned()::text, pg_backend_pid()", 0, nullptr, nullptr,
                          nullptr, nullptr, 0) == 1 &&
        PQpipelineSync(c) == 1;
    // The claim's transaction id (assigned by its write) and its server process ride along: a
    // COMMIT whose answer is lost is settled by asking the server what became of it (settle.cpp).
    std::array<PostgresResult, 3> res;
    // Unbounded: the claim commits nothing, and statement_timeout bounds its statements.
    const bool complete = sent && read_pipeline(*conn, res.data(), res.size(), millis{0});
    PQexitPipelineMode(c);
    const PGresult* r0 = ResultAccess::native(res[0]);
    const PGresult* r1 = ResultAccess::native(res[1]);
    if (!complete) {
      healthy = false;
      if (!last && PQstatus(c) != CONNECTION_OK) {
        client.pool().checkin(std::move(conn), false);
        return std::nullopt;
      }
      throw_result("begin", !result_ok(r0) ? r0 : r1, c, store_missing);
    }
    if (!result_ok(r0)) throw_result("begin", r0, c, store_missing);
    if (!result_ok(r1)) {
      const std::string code = sqlstate_of(r1);
      // 55P03: the key is claimed by an open transaction. 40001 under repeatable read /
      // serializable: the row changed under the snapshot; either way someone else is on it.
      if (code == "55P03" || code == "40001") {
        client.pool().checkin(std::move(conn), true);  // rolls back
        tx.decision_ = lock_busy(ap);
        return tx;
      }
      healthy = !read_only_answer(r1);  // never given back, whatever the server reports
      throw_result("acquire", r1, c, store_missing);
    }
    tx.decision_ = decode_acquire(r1, ap.token);
    res_xid = std::move(res[2]);
  } catch (...) {
    // A session whose statements failed to prepare may hold some of them: never reuse it.
    const bool keep = healthy && conn->prepared(statement_set);
    client.pool().checkin(std::move(conn), keep);
    throw;
  }
  if (tx.decision_.status != AcquireStatus::acquired) {
    client.pool().checkin(std::move(conn), true);  // rolls back
    return tx;
  }
  if (const PGresult* x = ResultAccess::native(res_xid); result_ok(x) && PQntuples(x) == 1 && !PQgetisnull(x, 0, 0)) {
    tx.xid_ = PQgetvalue(x, 0, 0);
    tx.server_pid_ = std::atoi(PQgetvalue(x, 0, 1));
  }
  tx.conn_ = std::move(conn);
  tx.key_ = std::string(key);
  tx.fingerprint_ = std::string(ap.fingerprint);
  tx.owner_ = owner;
  return tx;
}

}  // namespace detail

using detail::Params;
using detail::ResultAccess;

PostgresStore::Transaction::Transaction() noexcept = default;

PostgresStore::Transaction::Transaction(Transaction&& o) noexcept = default;

PostgresStore::Transaction& PostgresStore::Transaction::operator=(Transaction&& o) noexcept {
  if (this != &o) {
    release(true);
    store_ = o.store_;
    conn_ = std::move(o.conn_);
    decision_ = std::move(o.decision_);
    key_ = std::move(o.key_);
    fingerprint_ = std::move(o.fingerprint_);
    owner_ = std::move(o.owner_);
    outbox_sent_ = o.outbox_sent_;
    xid_ = std::move(o.xid_);
    server_pid_ = o.server_pid_;
  }
  return *this;
}

PostgresStore::Transaction::~Transaction() { release(true); }

void PostgresStore::Transaction::release(bool healthy) noexcept {
  if (conn_) store_->client.pool().checkin(std::move(conn_), healthy);  // checkin rolls back
}

int PostgresStore::Transaction::backend_pid() const noexcept {
  if (!conn_) return 0;
  return server_pid_ != 0 ? server_pid_ : PQbackendPID(conn_->pg);
}

PostgresResult PostgresStore::Transaction::exec_params(std::string_view sql, const detail::TextParam* params,
                                                       std::size_t n) {
  if (!conn_) throw usage_error("idem: exec on a transaction that is not open (not acquired, or already ended)");
  std::vector<const char*> vals(n);
  for (std::size_t i = 0; i < n; ++i) vals[i] = params[i].text ? params[i].text->c_str() : nullptr;
  PostgresResult r = detail::exec_text(conn_->pg, std::string(sql), vals.data(), static_cast<int>(n));
  if (!detail::result_ok(ResultAccess::native(r)))
    detail::throw_result("statement", ResultAccess::native(r), conn_->pg, detail::store_missing);
  return r;
}

WriteStatus PostgresStore::Transaction::commit(std::string_view result, millis retention) {
  if (!conn_) throw usage_error("idem: commit on a transaction that is not open (not acquired, or already ended)");
  detail::check_lease(retention, "retention");
  PGconn* c = conn_->pg;
  Params p;
  p.bin(key_).num(detail::as_i64(decision_.holder.fence)).num(detail::as_i64(decision_.holder.token));
  p.bin(result).num(retention.count());
  std::array<PostgresResult, 2> res;
  bool sent = false, complete = false;
  conn_->sync_cancelled = false;
  // The server stops statement_timeout before it commits, so that timer never cuts the wait for a
  // synchronous standby: await_answer bounds it (commit_bound), cancelling it past the bound.
  if (PQenterPipelineMode(c) == 1) {
    sent = store_->send_statement(c, detail::kTxComplete, p) == 1 &&
           PQsendQueryParams(c, "COMMIT", 0, nullptr, nullptr, nullptr, nullptr, 0) == 1 && PQpipelineSync(c) == 1;
    complete = sent && detail::read_pipeline(*conn_, res.data(), res.size(),
                                             detail::commit_bound(store_->client.options()));
    PQexitPipelineMode(c);
  }
  const PGresult* r0 = ResultAccess::native(res[0]);
  const PGresult* r1 = ResultAccess::native(res[1]);
  const bool ok0 = detail::result_ok(r0), ok1 = detail::result_ok(r1);
  if (complete && ok0 && ok1 && std::strcmp(PQcmdStatus(ResultAccess::native(res[1])), "COMMIT") == 0) {
    const bool sync_cut = conn_->sync_cancelled;
    const millis cancelled_after = conn_->cancelled_after;
    release(true);  // (dropped instead when idem sent it a cancel: ConnectionTraits::reusable)
    if (sync_cut) detail::throw_sync_cancelled("commit", cancelled_after);  // committed here, maybe on no standby
    return WriteStatus::ok;
  }
  const std::string code0 = detail::sqlstate_of(r0), code1 = detail::sqlstate_of(r1);
  const bool healthy = PQstatus(c) == CONNECTION_OK;
  // The server ended the session for idling in the transaction past the lease (a paused
  // holder): the claim and the writes were rolled back before our COMMIT arrived.
  if (code0 == "25P03" || code1 == "25P03") {
    release(false);
    return WriteStatus::lease_lost;
  }
  // The completion failed with an answer from the server: COMMIT then either was never processed
  // (the session died) or turned into a rollback. Either way nothing was committed, and we know it.
  if (r0 && !ok0 && !code0.empty()) {
    release(healthy);
    if (code0 == "22012") return WriteStatus::lease_lost;  // the claim was gone (see kTxComplete)
    detail::throw_result("commit (record result)", r0, nullptr, detail::store_missing);
  }
  // COMMIT itself answered with an ERROR (serialization failure, deferred constraint): rolled back.
  // A FATAL there, or no answer at all, may have come after the commit record was written.
  const char* sev = r1 ? PQresultErrorField(r1, PG_DIAG_SEVERITY_NONLOCALIZED) : nullptr;
  if (ok0 && r1 && !ok1 && !code1.empty() && sev && std::strcmp(sev, "ERROR") == 0) {
    release(healthy);
    detail::throw_result("commit", r1, nullptr, detail::store_missing);
  }
  if (ok0 && ok1) {  // COMMIT answered ROLLBACK: the transaction had failed before
    release(healthy);
    throw store_error("idem: postgres COMMIT rolled the transaction back", "40000", true);
  }
  std::string m = detail::first_line(r1 && PQresultErrorMessage(r1)[0] ? PQresultErrorMessage(r1) : PQerrorMessage(c));
  if (m.empty() && conn_->cancelled_after > millis{0})
    m = fmt::format("no answer {} ms after a cancel", conn_->cancelled_after.count());
  const bool sync_cut = conn_->sync_cancelled;
  const millis cancelled_after = conn_->cancelled_after;
  const int pid = server_pid_;
  release(false);
  if (!sent && r0 == nullptr && healthy)
    throw connection_error(fmt::format("idem: postgres commit could not be sent: {}", m), "08006", true);
  // The answer is lost, not the transaction: read what became of it rather than guess.
  if (sync_cut) detail::throw_sync_cancelled("commit", cancelled_after);
  return store_->settle_commit(key_, decision_.holder, xid_, pid, m, code1.empty() ? "08006" : code1);
}

WriteStatus PostgresStore::Transaction::fail(const FailParams& f) {
  if (!conn_) throw usage_error("idem: fail on a transaction that is not open (not acquired, or already ended)");
  detail::check_lease(f.retention, "retention");
  PGconn* c = conn_->pg;
  PostgresResult rb = ResultAccess::wrap(PQexec(c, "ROLLBACK"));
  const bool rolled_back = detail::result_ok(ResultAccess::native(rb));
  if (f.release || !rolled_back) {
    // Release: the rollback already freed the key. A failed rollback means the session is gone,
    // and the server rolls back a dead session's transaction itself.
    release(rolled_back);
    return WriteStatus::ok;
  }
  const Params p = store_->failure_record(key_, fingerprint_, owner_, decision_, f);
  conn_->sync_cancelled = false;
  // It commits on its own (the rollback ended the transaction): bounded as every write is.
  PostgresResult r;
  const millis bound = detail::commit_bound(store_->client.options());
  if (store_->send_statement(c, detail::kRecordFailure, p) != 1 || !detail::read_answer(*conn_, bound, r)) {
    const std::string why = conn_->cancelled_after > millis{0}
                                ? fmt::format("no answer {} ms after a cancel", bound.count())
                                : detail::first_line(PQerrorMessage(c));
    release(false);
    throw connection_error(fmt::format("idem: postgres record failure failed: {} (connection lost)", why), "08006",
                           true);
  }
  if (!detail::result_ok(ResultAccess::native(r))) {
    const bool busy = detail::sqlstate_of(ResultAccess::native(r)) == "55P03";
    release(PQstatus(c) == CONNECTION_OK);
    if (busy) return WriteStatus::lease_lost;  // someone else holds the key now
    detail::throw_result("record failure", ResultAccess::native(r), nullptr, detail::store_missing);
  }
  const bool written = r.rows() == 1 && detail::bool_of(ResultAccess::native(r), 0, 0);
  const bool sync_cut = conn_->sync_cancelled;
  const millis cancelled_after = conn_->cancelled_after;
  release(true);
  if (sync_cut) detail::throw_sync_cancelled("record failure", cancelled_after);
  return written ? WriteStatus::ok : WriteStatus::lease_lost;
}

}  // namespace idem
