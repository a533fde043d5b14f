// A COMMIT whose answer was lost (the connection broke after it was sent) is settled, never
// guessed: a fresh session (after a failover, on the new primary: the conninfo's
// target_session_attrs=read-write finds it) asks the server what became of the transaction, by
// its id and by the key's row, until it knows or PostgresOptions::settle_wait has passed.

#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "idem/core/error.hpp"
#include "store_impl.hpp"

namespace idem::detail {

namespace {

std::string hex_bytea(std::string_view b) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s = "\\x";
  s.reserve(2 + b.size() * 2);
  for (unsigned char ch : b) {
    s += digits[ch >> 4];
    s += digits[ch & 15];
  }
  return s;
}

}  // namespace

WriteStatus StoreImpl::settle_commit(std::string_view key, const Holder& h, const std::string& xid,
                                     const std::string& why, const std::string& code) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + client.options().settle_wait;
  // Whether the row is ours and completed; the transaction's status, 'future' when this server
  // never assigned that id (a new primary the transaction did not reach: it is not in this
  // history); and what its backend waits for while it is still in progress (SyncRep: committed
  // here, waiting for a standby). pg_xact_status is only asked below the snapshot's xmax: above,
  // it raises.
  const std::string sql =
      "SELECT (SELECT t.state = 2 AND t.fence = $2::bigint AND t.token = $3::bigint FROM " + qt +
      " t WHERE t.key = $1::bytea), "
      "CASE WHEN $4::xid8 IS NULL THEN NULL WHEN $4::xid8 < pg_snapshot_xmax(pg_current_snapshot()) "
      "THEN pg_xact_status($4::xid8) ELSE 'future' END, "
      "(SELECT a.wait_event FROM pg_stat_activity a "
      "WHERE a.backend_xid = (($4::xid8)::text::numeric % 4294967296)::text::xid LIMIT 1)";
  const std::string k = hex_bytea(key), fence = std::to_string(as_i64(h.fence)), token = std::to_string(as_i64(h.token));
  const char* vals[] = {k.c_str(), fence.c_str(), token.c_str(), xid.empty() ? nullptr : xid.c_str()};
  std::string seen = "no session could be opened";
  bool sync_wait = false;
  std::string not_committed;  // why the transaction certainly did not commit
  for (int round = 0;; ++round) {
    if (round > 0) {
      if (clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(round < 10 ? 20 : 100));
    }
    try {
      Session s(client.pool());
      PostgresResult r = exec_text(s.pg(), sql, vals, 4);
      const PGresult* n = ResultAccess::native(r);
      if (!result_ok(n) || PQntuples(n) != 1) {
        seen = first_line(n ? PQresultErrorMessage(n) : PQerrorMessage(s.pg()));
        if (PQstatus(s.pg()) != CONNECTION_OK || read_only_answer(n)) s.healthy(false);
        continue;
      }
      const bool ours = !PQgetisnull(n, 0, 0) && std::string_view(PQgetvalue(n, 0, 0)) == "t";
      const std::string status = PQgetisnull(n, 0, 1) ? "unknown" : PQgetvalue(n, 0, 1);
      sync_wait = !PQgetisnull(n, 0, 2) && std::string_view(PQgetvalue(n, 0, 2)) == "SyncRep";
      if (ours) return WriteStatus::ok;
      if (status == "aborted" || status == "future") {
        not_committed = status == "aborted" ? "rolled back" : "absent from this primary's history";
        break;
      }
      // In progress (finishing, or waiting for a synchronous standby), or committed while the
      // statement's snapshot predates it: ask again.
      seen = status == "in progress" && sync_wait ? "committed on the primary, waiting for a synchronous standby"
                                                  : "transaction " + status;
    } catch (const connection_error& e) {
      seen = e.what();
    } catch (const timeout_error& e) {
      seen = e.what();
    }
  }
  if (!not_committed.empty())
    throw connection_error(
        fmt::format("idem: the connection to PostgreSQL was lost during COMMIT ({}); asked on a fresh session, the "
                    "transaction did not commit ({}): nothing was written, a redelivery runs it again",
                    why, not_committed),
        code, true);
  if (sync_wait) throw_sync_cancelled("commit (answer lost while waiting for a synchronous standby)");
  throw outcome_unknown_error(fmt::format("idem: the connection to PostgreSQL was lost during COMMIT ({}) and its "
                                          "outcome could not be read within settle_wait ({}): the transaction may or "
                                          "may not have committed: check the record (inspect) before redelivering",
                                          why, seen),
                              code);
}

}  // namespace idem::detail
