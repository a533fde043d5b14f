#pragma once
// Internal to idem_postgres: what is behind PostgresClient — the pooled libpq sessions, their
// setup, and the access the stores have to the client and to PostgresResult.

#include <libpq-fe.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/pool.hpp"
#include "errors.hpp"
#include "idem/postgres/client.hpp"
#include "idem/postgres/result.hpp"

namespace idem::detail {

// One pooled libpq session and what has been set up on it.
struct Connection {
  explicit Connection(PGconn* c) noexcept : pg(c) {}
  ~Connection() { PQfinish(pg); }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Statement sets (ClientImpl::statement_set) prepared on this session.
  [[nodiscard]] bool prepared(std::uint32_t set) const noexcept;

  PGconn* pg;
  std::vector<std::uint32_t> sets;
  // The server warned that it cancelled a commit's wait for synchronous replication: that commit
  // is on the primary only. Set by the notice receiver; cleared before each request.
  bool sync_cancelled = false;
  // The bound after which await_answer cancelled a request here (0: never). A cancel can land on
  // whatever the session runs next, so such a session is never given back (ConnectionTraits::reusable).
  millis cancelled_after{0};
};

// The answer to a commit whose wait for a synchronous standby was cut short: durability_error,
// since the write holds on the primary alone. `cancelled_after` > 0: idem cancelled it after that
// long (await_answer); 0: someone else did (pg_cancel_backend, a server shutting down).
[[noreturn]] void throw_sync_cancelled(std::string_view what, millis cancelled_after);

// How long a round trip that can commit may go unanswered before await_answer cancels it:
// statement_timeout + sync_replication_wait (a statement running up to statement_timeout is not
// cut, a commit held in the wait for a synchronous standby is); 0 = no bound. statement_timeout 0
// (none) counts as 0: the store's own statements are short, and the bound is what keeps a consumer
// thread from waiting on a standby forever.
millis commit_bound(const PostgresOptions& o);

// Waits until the next PQgetResult on `c` will not block, for the one request (or pipelined
// request) that may commit. Past `bound` (> 0) it sends the server a cancel, which ends a wait for
// synchronous replication with a WARNING (Connection::sync_cancelled: committed on the primary
// only) and a statement still running with 57014 (rolled back); past `bound` again it cancels once
// more, and then gives up: false, the session must be dropped and the request is in doubt. A
// session already cancelled cancels at once: its call fails anyway, and each write queued behind
// the first would otherwise wait its own `bound`. bound 0: returns true at once (PQgetResult
// blocks as long as the server takes).
[[nodiscard]] bool await_answer(Connection& c, millis bound);

// Reads every result of the one request in flight on `conn` outside pipeline mode, each awaited
// with await_answer (the commit runs at the request's end, after its result), keeping the first in
// `out`; false when await_answer gave up.
[[nodiscard]] bool read_answer(Connection& conn, millis bound, PostgresResult& out);

// Pool<Traits> over libpq sessions (src/common/pool.hpp).
struct ConnectionTraits {
  using connection = std::unique_ptr<Connection>;
  connection connect();
  static bool alive(connection& c) noexcept;
  static bool reusable(connection& c) noexcept;

  std::string conninfo;
  millis statement_timeout;
  bool transaction_pooler = false;  // no session setting: the next transaction may run elsewhere
};

using SessionPool = Pool<ConnectionTraits>;

// A pooled session for one call: given back on destruction and kept unless libpq says it broke
// (ConnectionTraits::reusable), since a statement error leaves the session usable.
class Session : public SessionPool::Lease {
 public:
  explicit Session(SessionPool& pool) : SessionPool::Lease(pool) { healthy(); }
  PGconn* pg() noexcept { return get()->pg; }
};

class ClientImpl {
 public:
  explicit ClientImpl(PostgresOptions options);

  [[nodiscard]] const PostgresOptions& options() const noexcept { return opt_; }
  SessionPool& pool() noexcept { return pool_; }

  // The id of the prepared-statement set named `key` (a store's qualified table): stores of the
  // same table share their statements on a session, stores of different tables never collide.
  std::uint32_t statement_set(const std::string& key);

 private:
  // Reads the server's replication settings once (durability.cpp): refuses a standby given as the
  // only host, and warns the observer when a failover could lose acknowledged completions.
  void check_durability();

  PostgresOptions opt_;
  SessionPool pool_;
  std::mutex sets_mu_;
  std::map<std::string, std::uint32_t, std::less<>> sets_;
};

struct ClientAccess {
  // The client behind a store's pointer; invalid_options_error names `owner` when it is null.
  static ClientImpl& of(const std::shared_ptr<PostgresClient>& c, const char* owner);
};

struct ResultAccess {
  static PostgresResult wrap(PGresult* r) noexcept;
  static PGresult* native(const PostgresResult& r) noexcept { return static_cast<PGresult*>(r.r_); }
};

// durability.cpp: the settings that decide what survives a failover, and what they mean.
struct Durability {
  std::string synchronous_commit, standby_names;
  bool in_recovery = false;
  int sync_standbys = 0, standbys = 0;
  // synchronous_standby_names set and synchronous_commit on, remote_write or remote_apply.
  [[nodiscard]] bool synchronous() const;
  [[nodiscard]] std::string summary() const;  // the settings, one line
  [[nodiscard]] std::string meaning() const;  // one sentence on what they mean for the guarantee
};
Durability read_durability(PGconn* c);

// conninfo.cpp: parses a conninfo string or URI as libpq will (PQconninfoParse) and checks the
// values libpq only checks when connecting; invalid_options_error names the problem and the fix.
void check_conninfo(const std::string& conninfo);

// A statement without parameters (session setup, BEGIN/COMMIT, DDL); throws on failure.
void exec_simple(PGconn* c, const char* sql, std::string_view what, const MissingSchemaHint& missing = {});

// One statement with text parameters (null pointer = NULL), results in text; not checked.
PostgresResult exec_text(PGconn* c, const std::string& sql, const char* const* values, int n);

}  // namespace idem::detail
