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
};

// Pool<Traits> over libpq sessions (src/common/pool.hpp).
struct ConnectionTraits {
  using connection = std::unique_ptr<Connection>;
  connection connect();
  static bool alive(connection& c) noexcept;
  static bool reusable(connection& c) noexcept;

  std::string conninfo;
  millis statement_timeout;
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

// conninfo.cpp: parses a conninfo string or URI as libpq will (PQconninfoParse) and checks the
// values libpq only checks when connecting; invalid_options_error names the problem and the fix.
void check_conninfo(const std::string& conninfo);

// A statement without parameters (session setup, BEGIN/COMMIT, DDL); throws on failure.
void exec_simple(PGconn* c, const char* sql, std::string_view what, const MissingSchemaHint& missing = {});

// One statement with text parameters (null pointer = NULL), results in text; not checked.
PostgresResult exec_text(PGconn* c, const std::string& sql, const char* const* values, int n);

}  // namespace idem::detail
