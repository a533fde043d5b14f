// PostgresStore's lease-mode calls: one prepared statement on a pooled session, and what happens
// when that session dies under the call. The pool checks idle sessions before use, but a server
// can end one between that check and the send, or the reply can be lost after the server ran the
// statement. Either way the request goes once more on another session, as the same holder: the
// *Again statements recognise this holder's own earlier write (store_impl.hpp), so the answer is
// the one the lost reply carried, never a blind second write, a false in_flight / lease_lost, or a
// re-run of the handler.

#include "idem/core/error.hpp"
#include "store_impl.hpp"

namespace idem::detail {

namespace {

// What became of one send.
enum class Fate {
  answered,  // the server's answer (success or an error) arrived
  unsent,    // libpq could not send the request: the server certainly did not run it
  in_doubt,  // sent, then the session died before the answer: the server may have run it
};

struct Reply {
  PostgresResult result;
  Fate fate = Fate::answered;
  std::string why;  // unsent / in_doubt: libpq's message
};

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
  if (PQsendQueryPrepared(c, store.names[st].c_str(), p.size(), p.values(), p.lengths(), p.formats(), 1) != 1) {
    s.healthy(false);
    out.fate = Fate::unsent;
    out.why = first_line(PQerrorMessage(c));
    return out;
  }
  // One statement, one result; read to the end so the session is idle again when returned.
  while (PGresult* r = PQgetResult(c)) {
    if (ResultAccess::native(out.result) == nullptr)
      out.result = ResultAccess::wrap(r);
    else
      PQclear(r);
  }
  const PGresult* r = ResultAccess::native(out.result);
  if (PQstatus(c) == CONNECTION_OK) {
    // An error without a SQLSTATE on a live session is libpq's own (out of memory, ...).
    if (!result_ok(r) && sqlstate_of(r).empty()) throw_result(what, r, c, store_missing);
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
  throw outcome_unknown_error("idem: postgres " + std::string(what) + ": the connection was lost after the request was sent (" +
                                  first + ") and asking again as the same holder failed (" + second +
                                  "); the outcome is unknown: inspect the key before redelivering",
                              "08006");
}

}  // namespace

PostgresResult StoreImpl::exchange(Stmt st, Stmt again, const Params& p, std::string_view what, bool writes) {
  Reply first = send(*this, st, p, what);
  if (first.fate == Fate::answered) return std::move(first.result);
  // The session died under the call: once more, on another session (the dead one is dropped).
  const bool doubt = writes && first.fate == Fate::in_doubt;
  Reply second;
  try {
    second = send(*this, again, p, what);
  } catch (const store_error& e) {
    if (doubt) throw_unknown(what, first.why, e.what());
    throw;
  }
  if (second.fate == Fate::answered) return std::move(second.result);
  if (doubt || (writes && second.fate == Fate::in_doubt)) throw_unknown(what, first.why, second.why);
  throw connection_error("idem: postgres " + std::string(what) + " failed: " + second.why + " (connection lost)",
                         "08006", true);
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
