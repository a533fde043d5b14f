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
};

// The answer to a commit whose wait for a synchronous standby was cut short (pg_cancel_backend,
// a server shutting down): durability_error, since the write holds on the primary alone.
[[noreturn]] void throw_sync_cancelled(std::string_view what);

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
