// PostgresClient: connect and set up sessions, the pool's health checks, statement-set ids.

#include "client.hpp"

#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "idem/core/error.hpp"
#include "idem/detail/warning_relay.hpp"

namespace idem {
namespace detail {

namespace {
// Whether the server reported the session read-only: in recovery (in_hot_standby) or with
// default_transaction_read_only on. PostgreSQL 14+ reports both at connect and on every change.
bool read_only_session(const PGconn* c) {
  for (const char* name : {"in_hot_standby", "default_transaction_read_only"}) {
    const char* v = PQparameterStatus(c, name);
    if (v != nullptr && std::string_view(v) == "on") return true;
  }
  return false;
}
// Notices of a pooled session: only the server's "canceling wait for synchronous replication"
// matters (its text, since PostgreSQL gives that warning no SQLSTATE of its own; the detail says
// "already committed locally").
void notice(void* arg, const PGresult* r) {
  const char* sev = PQresultErrorField(r, PG_DIAG_SEVERITY_NONLOCALIZED);
  if (sev == nullptr || std::string_view(sev) != "WARNING") return;
  const char* msg = PQresultErrorField(r, PG_DIAG_MESSAGE_PRIMARY);
  const char* detail = PQresultErrorField(r, PG_DIAG_MESSAGE_DETAIL);
  const bool cut = (msg != nullptr && std::string_view(msg).find("synchronous replication") != std::string_view::npos) ||
                   (detail != nullptr && std::string_view(detail).find("committed locally") != std::string_view::npos);
  if (cut) static_cast<Connection*>(arg)->sync_cancelled = true;
}
}  // namespace

void throw_sync_cancelled(std::string_view what, millis cancelled_after) {
  if (cancelled_after > millis{0})
    throw durability_error(
        fmt::format("idem: postgres {}: no synchronous standby confirmed the commit within {} ms (statement_timeout + "
                    "PostgresOptions::sync_replication_wait), so idem cancelled the wait: the write is committed on "
                    "the primary but may be on no standby, so a failover could lose it; do not ack: a redelivery "
                    "finds the record, or runs again if a failover lost it. To fix: attach a synchronous standby, or "
                    "change synchronous_standby_names to name only standbys that are connected",
                    what, cancelled_after.count()),
        0, 1);
  throw durability_error(
      fmt::format("idem: postgres {}: the server cancelled its wait for a synchronous standby (pg_cancel_backend, "
                  "or a shutdown): the write is committed on the primary but may be on no standby, so a failover "
                  "could lose it; do not ack: a redelivery finds the record, or runs again if a failover lost it",
                  what),
      0, 1);
}

millis commit_bound(const PostgresOptions& o) {
  if (o.sync_replication_wait <= millis{0}) return millis{0};
  // Capped so that now() + bound cannot overflow: a year is no bound in practice.
  constexpr millis cap = std::chrono::hours(24 * 365);
  return std::min(cap, std::min(cap, o.statement_timeout) + std::min(cap, o.sync_replication_wait));
}

bool await_answer(Connection& conn, millis bound) {
  if (bound <= millis{0}) return true;
  using clock = std::chrono::steady_clock;
  PGconn* c = conn.pg;
  constexpr int max_cancels = 2;
  int cancels = 0;
  auto deadline = conn.cancelled_after > millis{0} ? clock::now() : clock::now() + bound;
  for (;;) {
    // A broken connection is not busy: PQgetResult then says what happened.
    if (PQconsumeInput(c) == 0 || !PQisBusy(c)) return true;
    const auto now = clock::now();
    if (now >= deadline) {
      if (cancels == max_cancels) return false;  // not even a cancel is answered: the session is lost
      // Only a cancel ends the wait for a synchronous standby: statement_timeout stops before the
      // commit, and closing the session would leave the backend waiting with the row locked.
      if (PGcancel* k = PQgetCancel(c)) {
        char err[256];
        (void)PQcancel(k, err, sizeof err);  // when it fails, the next expiry tries again, then gives up
        PQfreeCancel(k);
      }
      ++cancels;
      if (conn.cancelled_after <= millis{0}) conn.cancelled_after = bound;
      deadline = clock::now() + bound;
      continue;
    }
    pollfd p{PQsocket(c), POLLIN, 0};
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - now).count();
    const int rc = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 60'000)));
    if (rc < 0 && errno != EINTR) return true;  // PQgetResult blocks as it would have
  }
}

bool Connection::prepared(std::uint32_t set) const noexcept {
  return std::find(sets.begin(), sets.end(), set) != sets.end();
}

bool read_answer(Connection& conn, millis bound, PostgresResult& out) {
  for (;;) {
    if (!await_answer(conn, bound)) return false;
    PGresult* r = PQgetResult(conn.pg);
    if (!r) return true;
    if (ResultAccess::native(out) == nullptr)
      out = ResultAccess::wrap(r);
    else
      PQclear(r);
  }
}

ConnectionTraits::connection ConnectionTraits::connect() {
  const char* keys[] = {"dbname", "fallback_application_name", nullptr};
  const char* vals[] = {conninfo.c_str(), "idem", nullptr};
  PGconn* raw = PQconnectdbParams(keys, vals, 1);
  if (!raw) throw connection_error("idem: postgres: out of memory creating a connection", "08001", true);
  auto c = std::make_unique<Connection>(raw);
  if (PQstatus(raw) != CONNECTION_OK)
    throw connect_failure(PQerrorMessage(raw));
  // Every decision writes (a duplicate's acquire too), so a session that cannot would only fail
  // later: refused here, retryable, so the pool keeps trying until a primary answers.
  if (read_only_session(raw))
    throw connection_error(fmt::format("idem: cannot use PostgreSQL at {}:{}: the server is read-only (a standby, or "
                                       "a primary being demoted); list every node in conninfo with "
                                       "target_session_attrs=read-write so libpq picks the primary",
                                       PQhost(raw), PQport(raw)),
                           "25006", true);
  // Server notices (IF NOT EXISTS skips, ...) are not the caller's business: no stderr noise.
  // One warning is: a cancelled wait for synchronous replication leaves the commit on the
  // primary only, and the statement still answers success.
  PQsetNoticeReceiver(raw, &notice, c.get());
  if (!transaction_pooler) {
    const std::string set = "SET statement_timeout = " + std::to_string(statement_timeout.count());
    exec_simple(raw, set.c_str(), "session setup");
  }
  return c;
}

bool ConnectionTraits::alive(connection& c) noexcept {
  // An idle session has nothing to read: readable means the server ended it (restart, idle
  // timeout, pg_terminate_backend left a FATAL message and EOF), so the pool replaces it before
  // a statement is sent on it.
  if (PQstatus(c->pg) != CONNECTION_OK) return false;
  pollfd p{PQsocket(c->pg), POLLIN, 0};
  int rc = 0;
  do rc = ::poll(&p, 1, 0);
  while (rc < 0 && errno == EINTR);
  return rc == 0;
}

bool ConnectionTraits::reusable(connection& c) noexcept {
  // A server that turned read-only under the session (ALTER SYSTEM + reload) said so with its
  // last answer: the session would only fail again. A cancel idem sent could hit its next statement.
  if (PQstatus(c->pg) != CONNECTION_OK || read_only_session(c->pg) || c->cancelled_after > millis{0}) return false;
  const auto ts = PQtransactionStatus(c->pg);
  if (ts == PQTRANS_IDLE) return true;
  if (ts != PQTRANS_INTRANS && ts != PQTRANS_INERROR) return false;
  PGresult* r = PQexec(c->pg, "ROLLBACK");  // a transaction given back open (or failed) ends here
  const bool ok = result_ok(r);
  PQclear(r);
  return ok;
}

namespace {
PostgresOptions checked(PostgresOptions o) {
  check_pool_options(o.pool, "PostgresOptions");
  if (o.statement_timeout < millis{0})
    throw invalid_options_error("idem: PostgresOptions::statement_timeout must be >= 0 (0 = no limit)");
  if (o.settle_wait < millis{0})
    throw invalid_options_error("idem: PostgresOptions::settle_wait must be >= 0 (0 = ask for a lost outcome once)");
  if (o.sync_replication_wait < millis{0})
    throw invalid_options_error(
        "idem: PostgresOptions::sync_replication_wait must be >= 0 (0 = a commit waits for a synchronous standby as "
        "long as the server does)");
  check_conninfo(o.conninfo);
  return o;
}
}  // namespace

ClientImpl::ClientImpl(PostgresOptions options)
    : opt_(checked(std::move(options))),
      pool_(opt_.pool, ConnectionTraits{opt_.conninfo, opt_.statement_timeout, opt_.transaction_pooler}, "PostgreSQL") {
  opt_.observer = WarningRelay::wrap(std::move(opt_.observer));
  pool_.observe(opt_.observer.get(), "postgres");
  check_durability();
}

void ClientImpl::check_durability() {
  // How many hosts the conninfo lists, and whether it bounds a connection attempt.
  std::size_t hosts = 1;
  bool timeout = false;
  char* err = nullptr;
  if (PQconninfoOption* parsed = PQconninfoParse(opt_.conninfo.c_str(), &err)) {
    for (PQconninfoOption* o = parsed; o->keyword; ++o) {
      if (!o->val || !*o->val) continue;
      const std::string_view k = o->keyword;
      if (k == "host" || k == "hostaddr")
        hosts = std::max<std::size_t>(hosts, 1 + std::count(o->val, o->val + std::strlen(o->val), ','));
      if (k == "connect_timeout") timeout = true;
    }
    PQconninfoFree(parsed);
  }
  if (err) PQfreemem(err);
  // One look at the server when the client is built; a server that cannot be reached now is not
  // an error here (the first call says so, retryable), and the look is bounded by 5 s.
  const char* keys[] = {"dbname", "fallback_application_name", timeout ? nullptr : "connect_timeout", nullptr};
  const char* vals[] = {opt_.conninfo.c_str(), "idem", "5", nullptr};
  std::unique_ptr<PGconn, void (*)(PGconn*)> c(PQconnectdbParams(keys, vals, 1), &PQfinish);
  if (!c || PQstatus(c.get()) != CONNECTION_OK) return;
  PQsetNoticeProcessor(
      c.get(), [](void*, const char*) {}, nullptr);
  Durability d;
  try {
    d = read_durability(c.get());
  } catch (const error&) {
    return;  // a role that may not read the settings: `idem doctor` tells
  }
  const std::string where = fmt::format("{}:{}", PQhost(c.get()), PQport(c.get()));
  if (d.in_recovery && hosts == 1)
    throw invalid_options_error(fmt::format(
        "idem: the only host in PostgresOptions::conninfo, {}, is a standby (pg_is_in_recovery() is true) and every "
        "store call writes; give the primary, or list every node with target_session_attrs=read-write",
        where));
  if (!opt_.observer) return;
  if (d.in_recovery)
    opt_.observer->on_warning(fmt::format("idem: PostgreSQL conninfo reached the standby {} first: sessions there are "
                                          "refused (25006); add target_session_attrs=read-write so libpq picks the "
                                          "primary",
                                          where));
  else if (!d.synchronous() || d.sync_standbys == 0)
    opt_.observer->on_warning(fmt::format("idem: PostgreSQL at {}: {}. {}", where, d.summary(), d.meaning()));
}

std::uint32_t ClientImpl::statement_set(const std::string& key) {
  std::lock_guard lk(sets_mu_);
  return sets_.try_emplace(key, static_cast<std::uint32_t>(sets_.size() + 1)).first->second;
}

ClientImpl& ClientAccess::of(const std::shared_ptr<PostgresClient>& c, const char* owner) {
  if (!c) throw invalid_options_error(fmt::format("idem: {} needs a PostgresClient, got a null pointer", owner));
  return *c->impl_;
}

void exec_simple(PGconn* c, const char* sql, std::string_view what, const MissingSchemaHint& missing) {
  PostgresResult r = ResultAccess::wrap(PQexec(c, sql));
  if (!result_ok(ResultAccess::native(r))) throw_result(what, ResultAccess::native(r), c, missing);
}

PostgresResult exec_text(PGconn* c, const std::string& sql, const char* const* values, int n) {
  return ResultAccess::wrap(PQexecParams(c, sql.c_str(), n, nullptr, values, nullptr, nullptr, 0));
}

}  // namespace detail

PostgresClient::PostgresClient(PostgresOptions options)
    : impl_(std::make_unique<detail::ClientImpl>(std::move(options))) {}
PostgresClient::~PostgresClient() = default;
const PostgresOptions& PostgresClient::options() const noexcept { return impl_->options(); }

}  // namespace idem
