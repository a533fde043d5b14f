// A COMMIT whose answer was lost (the connection broke after it was sent) is settled, never
// guessed: a fresh session (after a failover, on the new primary: the conninfo's
// target_session_attrs=read-write finds it) asks the server what became of the transaction, by
// its id, by the key's row and by the backend it ran on, until it knows or
// PostgresOptions::settle_wait has passed (docs/postgres-ha.md, "A COMMIT in doubt").

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

WriteStatus StoreImpl::settle_commit(std::string_view key, const Holder& h, const std::string& xid, int backend_pid,
                                     const std::string& why, const std::string& code) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + client.options().settle_wait;
  // A transaction id alone does not name a transaction across a failover: a promoted standby that
  // never received its WAL hands the same id (epoch included) to its own next transactions. So it
  // is asked together with what only this transaction could have left: its completion on the
  // key's row (our fence and token, state completed), and, while it runs, the backend it ran on.
  //   $1 key, $2 fence, $3 token, $4 the xid8 at BEGIN.
  // Columns: the row is ours and completed; the id's status ('future' when this server never
  // assigned it: pg_xact_status raises at or above the snapshot's xmax); whether the id had ended
  // before the statement's snapshot (its outcome and the row read are then of the same moment);
  // the pid and the wait event of a backend running that id now (SyncRep: committed here, waiting
  // for a standby).
  const std::string sql =
      "SELECT (SELECT t.state = 2 AND t.fence = $2::bigint AND t.token = $3::bigint FROM " + qt +
      " t WHERE t.key = $1::bytea), "
      "CASE WHEN $4::xid8 IS NULL THEN NULL WHEN $4::xid8 < pg_snapshot_xmax(pg_current_snapshot()) "
      "THEN pg_xact_status($4::xid8) ELSE 'future' END, "
      "pg_visible_in_snapshot($4::xid8, pg_current_snapshot()), r.pid, r.wait_event "
      "FROM (SELECT 1) one LEFT JOIN LATERAL (SELECT a.pid, a.wait_event FROM pg_stat_activity a "
      "WHERE a.backend_xid = (($4::xid8)::text::numeric % 4294967296)::text::xid LIMIT 1) r ON true";
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
      const auto text = [n](int col) { return PQgetisnull(n, 0, col) ? std::string() : std::string(PQgetvalue(n, 0, col)); };
      const bool ours = text(0) == "t";
      const std::string status = PQgetisnull(n, 0, 1) ? "unknown" : text(1);
      const bool ended_before = text(2) == "t";
      const std::string runner = text(3);
      sync_wait = text(4) == "SyncRep" && runner == std::to_string(backend_pid);
      if (ours) return WriteStatus::ok;
      if (status == "aborted" || status == "future") {
        not_committed = status == "aborted" ? "rolled back" : "absent from this primary's history";
        break;
      }
      // Our COMMIT writes the completion with our token; an id that committed before this read
      // without it there is another transaction's: this server reassigned the id (a standby
      // promoted without our WAL), and ours is not in its history.
      if (status == "committed" && ended_before) {
        not_committed = "its id was reassigned on this primary and committed without this transaction's record";
        break;
      }
      // Running on a backend that is not the one ours ran on: another transaction holds the id.
      if (status == "in progress" && !runner.empty() && backend_pid != 0 && runner != std::to_string(backend_pid)) {
        not_committed = "its id was reassigned on this primary to a transaction of backend " + runner;
        break;
      }
      // In progress on our backend (finishing, or waiting for a synchronous standby), or committed
      // after the statement's snapshot: ask again.
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
  if (sync_wait) throw_sync_cancelled("commit (answer lost while waiting for a synchronous standby)", millis{0});
  throw outcome_unknown_error(fmt::format("idem: the connection to PostgreSQL was lost during COMMIT ({}) and its "
                                          "outcome could not be read within settle_wait ({}): the transaction may or "
                                          "may not have committed: check the record (inspect) before redelivering",
                                          why, seen),
                              code);
}

}  // namespace idem::detail
