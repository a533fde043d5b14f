// PostgresStore's lease-mode calls: one prepared statement on a pooled session, and what happens
// when that session dies under the call. The pool checks idle sessions before use, but a server
// can end one between that check and the send, or the reply can be lost after the server ran the
// statement. Either way the request goes once more on another session, as the same holder: the
// *Again statements recognise this holder's own earlier write (store_impl.hpp), so the answer is
// the one the lost reply carried, never a blind second write, a false in_flight / lease_lost, or a
// re-run of the handler.

#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "idem/core/error.hpp"
#include "store_impl.hpp"

namespace idem::detail {

namespace {

// A pooled session ready for the store's statements (prepared, schema migrated when asked).
class Ready : public Session {
 public:
  explicit Ready(StoreImpl& s) : Session(s.client.pool()) {
    try {
      s.prepare(*get());
    } catch (...) {
      healthy(false);  // some statements may be prepared: never reuse it
      throw;
    }
  }
};

Reply send(StoreImpl& store, Stmt st, const Params& p, std::string_view what) {
  Ready s(store);
  PGconn* c = s.pg();
  Reply out;
  s.get()->sync_cancelled = false;
  if (store.send_statement(c, st, p) != 1) {
    s.healthy(false);
    out.fate = Fate::unsent;
    out.why = first_line(PQerrorMessage(c));
    return out;
  }
  // One statement, one result; read to the end so the session is idle again when returned. It
  // commits (every store statement writes, an acquire too): its answer is bounded, not left to a
  // wait for a synchronous standby that may never end.
  const millis bound = commit_bound(store.client.options());
  if (!read_answer(*s.get(), bound, out.result)) {
    s.healthy(false);
    out.result = PostgresResult{};
    out.fate = Fate::in_doubt;
    out.why = fmt::format("no answer {} ms after a cancel", bound.count());
    return out;
  }
  const PGresult* r = ResultAccess::native(out.result);
  // A write whose commit stopped waiting for its synchronous standby answered success (or the
  // session died right after, on a shutdown): either way it may be on the primary alone.
  if (s.get()->sync_cancelled) {
    s.healthy(PQstatus(c) == CONNECTION_OK);
    throw_sync_cancelled(what, s.get()->cancelled_after);
  }
  if (PQstatus(c) == CONNECTION_OK) {
    // An error without a SQLSTATE on a live session is libpq's own (out of memory, ...).
    if (!result_ok(r) && sqlstate_of(r).empty()) throw_result(what, r, c, store_missing);
    if (read_only_answer(r)) s.healthy(false);  // never given back, whatever the server reports
    return out;
  }
  s.healthy(false);
  // A success that arrived before the session died is the answer; anything else (a FATAL such
  // as 57P01 from a server shutting down, or no answer at all) leaves the outcome open.
  if (result_ok(r)) return out;
  out.fate = Fate::in_doubt;
  out.why = first_line(r && *PQresultErrorMessage(r) ? PQresultErrorMessage(r) : PQerrorMessage(c));
  return out;
}

[[noreturn]] void throw_unknown(std::string_view what, const std::string& first, const std::string& second) {
  throw outcome_unknown_error(fmt::format("idem: postgres {}: the connection was lost after the request was sent ({}) "
                                          "and asking again as the same holder failed ({}); the outcome is unknown: "
                                          "inspect the key before redelivering",
                                          what, first, second),
                              "08006");
}

}  // namespace

Pipeline::Pipeline(StoreImpl& s) : Pipeline(s, s.client.pool().checkout()) {}

Pipeline::Pipeline(StoreImpl& s, std::unique_ptr<Connection> session) : store_(&s), conn_(std::move(session)) {
  try {
    s.prepare(*conn_);
  } catch (...) {
    s.client.pool().checkin(std::move(conn_), false);  // some statements may be prepared: never reuse it
    throw;
  }
  conn_->sync_cancelled = false;
  if (PQenterPipelineMode(conn_->pg) != 1) {
    broken_ = true;
    why_ = first_line(PQerrorMessage(conn_->pg));
  }
}

Pipeline::~Pipeline() { close(); }

bool Pipeline::send(Stmt st, const Params& p) {
  bool sent = false;
  if (!broken_) {
    PGconn* c = conn_->pg;
    // PQpipelineSync flushes (libpq 14-16): the request has left when it returns. libpq reads
    // the answers arriving meanwhile whenever a send would block, so a long pipeline cannot
    // deadlock against a server blocked on writing its answers.
    sent = store_->send_statement(c, st, p) == 1 &&
           PQpipelineSync(c) == 1;
    if (!sent) {
      broken_ = true;
      why_ = first_line(PQerrorMessage(c));
    }
  }
  queued_.push_back(sent);
  return sent;
}

Reply Pipeline::next() {
  Reply out;
  const bool sent = queued_.at(read_++);
  if (!sent) {
    out.fate = Fate::unsent;
    out.why = why_;
    return out;
  }
  if (broken_) {
    out.fate = Fate::in_doubt;
    out.why = why_;
    return out;
  }
  PGconn* c = conn_->pg;
  // The request's result, the null that ends it, then its sync: only with the sync has its
  // transaction ended (committed, or rolled back after an error). Its commit runs at the sync, so
  // the wait for a synchronous standby (and the server's warning that it was cut) comes before it.
  const millis bound = commit_bound(store_->client.options());
  bool gave_up = !await_answer(*conn_, bound);
  PGresult* r = gave_up ? nullptr : PQgetResult(c);
  if (r) {
    out.result = ResultAccess::wrap(r);
    for (int guard = 0; guard < 4; ++guard) {  // one statement, one result: more would be a protocol surprise
      PGresult* extra = PQgetResult(c);
      if (!extra) break;
      PQclear(extra);
    }
  }
  if (r && !await_answer(*conn_, bound)) gave_up = true;
  PGresult* sync = r && !gave_up ? PQgetResult(c) : nullptr;
  const bool synced = sync && PQresultStatus(sync) == PGRES_PIPELINE_SYNC;
  PQclear(sync);
  if (conn_->sync_cancelled) {  // this request's commit
    out.sync_cut = true;
    out.cancelled_after = conn_->cancelled_after;
    conn_->sync_cancelled = false;
  }
  const PGresult* res = ResultAccess::native(out.result);
  // An error without a SQLSTATE on a live session is libpq's own (out of memory, ...): the
  // pipeline's state is unknown, so the session is given up like a dead one.
  const bool libpq_error = res && !result_ok(res) && sqlstate_of(res).empty();
  if (read_only_answer(res)) read_only_ = true;
  if (synced && !libpq_error) return out;  // (even if the session died just after)
  broken_ = true;
  why_ = gave_up ? fmt::format("no answer {} ms after a cancel", bound.count())
                 : first_line(res && *PQresultErrorMessage(res) ? PQresultErrorMessage(res) : PQerrorMessage(c));
  out.fate = Fate::in_doubt;
  out.why = why_;
  out.result = PostgresResult{};
  return out;
}

void Pipeline::close() noexcept {
  if (!conn_) return;
  try {
    while (unread() > 0 && !broken_) (void)next();
  } catch (...) {
    broken_ = true;
  }
  bool healthy = !broken_ && !read_only_ && PQstatus(conn_->pg) == CONNECTION_OK;
  if (healthy) healthy = PQexitPipelineMode(conn_->pg) == 1;
  store_->client.pool().checkin(std::move(conn_), healthy);
}

void StoreImpl::settle(std::span<const Call> calls, std::span<Reply> replies, std::string_view what, bool writes) {
  std::vector<std::size_t> open;
  for (std::size_t i = 0; i < replies.size(); ++i)
    if (replies[i].fate != Fate::answered) open.push_back(i);
  if (open.empty()) return;
  const auto deadline = std::chrono::steady_clock::now() + client.options().settle_wait;
  std::vector<bool> doubt(replies.size(), false);
  for (std::size_t i : open) doubt[i] = writes && replies[i].fate == Fate::in_doubt;
  auto any_doubt = [&] {
    for (std::size_t i : open)
      if (doubt[i]) return true;
    return false;
  };
  // Once more, on another session, as the same holders (the dead one was dropped); while a write
  // that may have run is unsettled, again until settle_wait has passed (exchange does the same).
  std::vector<Reply> second;
  for (int round = 0;; ++round) {
    if (round > 0) std::this_thread::sleep_for(std::chrono::milliseconds(round < 10 ? 20 : 100));
    second.clear();
    second.resize(open.size());
    try {
      Pipeline p(*this);
      for (std::size_t i : open) p.send(calls[i].again, *calls[i].params);
      for (Reply& r : second) r = p.next();
      p.close();
    } catch (const store_error& e) {
      if (any_doubt() && e.retryable() && std::chrono::steady_clock::now() < deadline) continue;
      for (std::size_t i : open)
        if (doubt[i]) throw_unknown(what, replies[i].why, e.what());
      throw;
    }
    std::vector<std::size_t> still;
    for (std::size_t k = 0; k < open.size(); ++k) {
      const std::size_t i = open[k];
      if (second[k].fate == Fate::answered) {
        replies[i] = std::move(second[k]);
        continue;
      }
      doubt[i] = doubt[i] || (writes && second[k].fate == Fate::in_doubt);
      if (replies[i].why.empty()) replies[i].why = second[k].why;
      still.push_back(i);
    }
    if (still.empty()) return;
    std::vector<Reply> last;
    for (std::size_t k = 0; k < open.size(); ++k)
      if (second[k].fate != Fate::answered) last.push_back(std::move(second[k]));
    open = std::move(still);
    if (any_doubt() && std::chrono::steady_clock::now() < deadline) continue;
    for (std::size_t k = 0; k < open.size(); ++k)
      if (doubt[open[k]]) throw_unknown(what, replies[open[k]].why, last[k].why);
    throw connection_error(fmt::format("idem: postgres {} failed: {} (connection lost)", what, last.front().why),
                           "08006", true);
  }
}

std::vector<PostgresResult> StoreImpl::exchange_many(std::span<const Call> calls, std::string_view what, bool writes) {
  std::vector<Reply> replies(calls.size());
  {
    Pipeline p(*this);
    for (const Call& c : calls) p.send(c.st, *c.params);
    for (Reply& r : replies) r = p.next();
  }  // given back (or dropped) before settle checks out another
  for (const Reply& r : replies)
    if (r.sync_cut) throw_sync_cancelled(what, r.cancelled_after);
  settle(calls, replies, what, writes);
  std::vector<PostgresResult> out;
  out.reserve(replies.size());
  for (Reply& r : replies) {
    if (r.sync_cut) throw_sync_cancelled(what, r.cancelled_after);
    out.push_back(std::move(r.result));
  }
  return out;
}

PostgresResult StoreImpl::exchange(Stmt st, Stmt again, const Params& p, std::string_view what, bool writes) {
  Reply first = send(*this, st, p, what);
  if (first.fate == Fate::answered) return std::move(first.result);
  // The session died under the call: once more, on another session (the dead one is dropped).
  // A write that may have run is asked again until settle_wait has passed: during a failover no
  // primary answers for a while, and the new one has the row if the write reached it.
  bool doubt = writes && first.fate == Fate::in_doubt;
  const auto deadline = std::chrono::steady_clock::now() + client.options().settle_wait;
  Reply second;
  for (int round = 0;; ++round) {
    const bool more = doubt && std::chrono::steady_clock::now() < deadline;
    if (round > 0) std::this_thread::sleep_for(std::chrono::milliseconds(round < 10 ? 20 : 100));
    try {
      second = send(*this, again, p, what);
    } catch (const durability_error&) {
      throw;  // answered, on the primary alone: asking again would hide that
    } catch (const store_error& e) {
      if (more && e.retryable()) continue;
      if (doubt) throw_unknown(what, first.why, e.what());
      throw;
    }
    if (second.fate == Fate::answered) return std::move(second.result);
    doubt = doubt || (writes && second.fate == Fate::in_doubt);
    if (!(doubt && std::chrono::steady_clock::now() < deadline)) break;
  }
  if (doubt) throw_unknown(what, first.why, second.why);
  throw connection_error(fmt::format("idem: postgres {} failed: {} (connection lost)", what, second.why), "08006",
                         true);
}

PostgresResult StoreImpl::run(Stmt st, Stmt again, const Params& p, std::string_view what, bool writes) {
  PostgresResult r = exchange(st, again, p, what, writes);
  if (!result_ok(ResultAccess::native(r))) throw_result(what, ResultAccess::native(r), nullptr, store_missing);
  return r;
}

WriteStatus StoreImpl::write(Stmt st, Stmt again, const Params& p, std::string_view what) {
  return run(st, again, p, what, true).affected() == 1 ? WriteStatus::ok : WriteStatus::lease_lost;
}

}  // namespace idem::detail
