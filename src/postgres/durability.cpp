// What a server's settings mean for the guarantee across a failover: read once when a client is
// built (a warning to the observer, or a refusal when the only host is a standby) and by
// `idem doctor`.

#include <fmt/format.h>

#include "client.hpp"
#include "idem/core/error.hpp"

namespace idem::detail {

Durability read_durability(PGconn* c) {
  PostgresResult r = ResultAccess::wrap(
      PQexec(c,
             "SELECT current_setting('synchronous_commit'), current_setting('synchronous_standby_names'), "
             "pg_is_in_recovery(), (SELECT count(*) FROM pg_stat_replication WHERE sync_state IN ('sync', 'quorum')), "
             "(SELECT count(*) FROM pg_stat_replication)"));
  const PGresult* n = ResultAccess::native(r);
  if (!result_ok(n) || PQntuples(n) != 1) throw_result("read replication settings", n, c);
  Durability d;
  d.synchronous_commit = PQgetvalue(n, 0, 0);
  d.standby_names = PQgetvalue(n, 0, 1);
  d.in_recovery = std::string_view(PQgetvalue(n, 0, 2)) == "t";
  d.sync_standbys = std::stoi(PQgetvalue(n, 0, 3));
  d.standbys = std::stoi(PQgetvalue(n, 0, 4));
  return d;
}

bool Durability::synchronous() const {
  return !standby_names.empty() && synchronous_commit != "off" && synchronous_commit != "local";
}

std::string Durability::summary() const {
  return fmt::format("synchronous_commit = {}, synchronous_standby_names = '{}', pg_is_in_recovery() = {}, {} "
                     "standby(s) streaming, {} of them synchronous",
                     synchronous_commit, standby_names, in_recovery ? "true" : "false", standbys, sync_standbys);
}

std::string Durability::meaning() const {
  if (in_recovery) return "this server is a standby: it decides nothing (every store call writes)";
  if (synchronous() && sync_standbys == 0)
    return "a commit is acknowledged only once a synchronous standby has it, and none is connected: every write "
           "waits until one attaches";
  if (synchronous())
    return "a commit is acknowledged only once a synchronous standby has it: a failover to that standby loses no "
           "acknowledged completion";
  const std::string lost = synchronous_commit == "off"
                               ? "a crash of this server, or a failover, can lose acknowledged completions"
                               : "a failover can lose completions acknowledged before a standby had them";
  return lost + ": in lease mode such a key runs its handler again (an external effect repeats unless it is "
                "fenced or idempotent); in transactional mode the handler's writes are lost with their record, so "
                "the message runs once more and its effect is never doubled";
}

}  // namespace idem::detail
