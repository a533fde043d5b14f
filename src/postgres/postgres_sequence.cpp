// PostgresSequenceStore: a small libpq pool of its own (PostgresStore's is private to it), the
// table created under an advisory lock, and the compare-and-set as one INSERT … ON CONFLICT.
// Entities travel as hex text decoded to bytea on the server, so the same statement runs through
// PostgresStore::transaction::exec (text parameters) and binary entity ids stay exact.

#include "idem/postgres/sequence_store.hpp"

#include <charconv>
#include <condition_variable>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <cerrno>

#include <libpq-fe.h>
#include <poll.h>

#include "idem/detail/hex.hpp"
#include "idem/core/error.hpp"

#include "pg_common.hpp"

namespace idem {

namespace {

bool valid_ident(std::string_view s) { return s.substr(0, 3) != "pg_" && detail::valid_identifier(s, 63); }

std::string first_line(const char* msg) {
  std::string s = msg ? msg : "";
  if (auto nl = s.find('\n'); nl != std::string::npos) s.resize(nl);
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

// The same SQLSTATE mapping as PostgresStore's, so both stores fail the same way.
constexpr detail::MissingSchemaHint sequence_missing{
    "; the sequence table is missing: call PostgresSequenceStore::migrate() or set auto_migrate", false};

using detail::printable;
using detail::result_ok;
using detail::sqlstate_of;

std::string hex_of(std::string_view s) { return detail::to_hex(s); }

std::string decimal(std::uint64_t v) {
  char tmp[24];
  auto res = std::to_chars(tmp, tmp + sizeof tmp, v);
  return std::string(tmp, res.ptr);
}

std::uint64_t parse_seq(std::string_view s, std::string_view entity) {
  std::uint64_t v = 0;
  auto res = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || res.ec != std::errc{} || res.ptr != s.data() + s.size())
    throw corrupt_record_error("idem: the PostgreSQL sequence of entity '" + printable(entity) + "' holds '" +
                               printable(s, 32) + "', not a uint64; inspect and repair the row");
  return v;
}

struct PgFree {
  void operator()(PGconn* c) const noexcept { PQfinish(c); }
};

}  // namespace

struct PostgresSequenceStore::Impl {
  PostgresSequenceOptions opt;
  std::string qualified;
  std::string sql_advance, sql_get, sql_erase, sql_migrate;

  std::mutex mu;
  std::condition_variable cv;
  std::vector<PGconn*> idle;
  std::size_t open = 0;

  std::mutex migrate_mu;
  bool migrated = false;

  explicit Impl(PostgresSequenceOptions o) : opt(std::move(o)) {
    auto bad = [](const std::string& why) { throw invalid_options_error("idem: PostgresSequenceOptions: " + why); };
    if (!valid_ident(opt.schema))
      bad("schema '" + printable(opt.schema) + "' must match [a-z_][a-z0-9_]*, at most 63 bytes, not pg_*");
    if (!valid_ident(opt.table))
      bad("table '" + printable(opt.table) + "' must match [a-z_][a-z0-9_]*, at most 63 bytes, not pg_*");
    if (opt.pool_size == 0) bad("pool_size must be > 0");
    if (opt.pool_wait < millis{0}) bad("pool_wait must be >= 0");
    if (opt.statement_timeout < millis{0}) bad("statement_timeout must be >= 0");
    qualified = "\"" + opt.schema + "\".\"" + opt.table + "\"";
    // $1 entity as hex text, $2 seq as decimal text. Column 0: 1 advanced / 0 not; column 1: the
    // value the statement's snapshot saw (NULL = none).
    sql_advance = "WITH up AS (INSERT INTO " + qualified +
                  " AS s (entity, last_seq) VALUES (decode($1::text, 'hex'), $2::numeric)"
                  " ON CONFLICT (entity) DO UPDATE SET last_seq = EXCLUDED.last_seq"
                  " WHERE s.last_seq < EXCLUDED.last_seq RETURNING 1)"
                  " SELECT (SELECT count(*) FROM up)::int,"
                  " (SELECT last_seq::text FROM " + qualified + " WHERE entity = decode($1::text, 'hex'))";
    sql_get = "SELECT last_seq::text FROM " + qualified + " WHERE entity = decode($1::text, 'hex')";
    sql_erase = "DELETE FROM " + qualified + " WHERE entity = decode($1::text, 'hex')";
    // The lock PostgresStore's migration takes for the same schema: a store and a sequence store
    // starting together on a fresh database would otherwise race on CREATE SCHEMA IF NOT EXISTS
    // (which is not safe against itself) and one of them would fail with 23505.
    sql_migrate = "BEGIN; SELECT pg_advisory_xact_lock(hashtext('idem:" + opt.schema + "')); "
                  "CREATE SCHEMA IF NOT EXISTS \"" + opt.schema + "\"; "
                  "CREATE TABLE IF NOT EXISTS " + qualified +
                  " (entity bytea PRIMARY KEY, last_seq numeric(20,0) NOT NULL"
                  " CHECK (last_seq >= 0 AND last_seq <= 18446744073709551615)); COMMIT";
  }

  ~Impl() {
    for (PGconn* c : idle) PQfinish(c);
  }

  PGconn* connect() {
    const char* keys[] = {"dbname", "fallback_application_name", nullptr};
    const char* vals[] = {opt.conninfo.c_str(), "idem", nullptr};
    std::unique_ptr<PGconn, PgFree> c(PQconnectdbParams(keys, vals, 1));
    if (!c) throw connection_error("idem: postgres: out of memory creating a connection", "08001", true);
    if (PQstatus(c.get()) != CONNECTION_OK)
      throw connection_error("idem: cannot connect to PostgreSQL: " + first_line(PQerrorMessage(c.get())), "08001",
                             true);
    PQsetNoticeProcessor(c.get(), [](void*, const char*) {}, nullptr);
    const std::string set = "SET statement_timeout = " + std::to_string(opt.statement_timeout.count());
    PgResult r(PQexec(c.get(), set.c_str()));
    if (!result_ok(r.native())) throw_result("session setup", r.native(), c.get());
    return c.release();
  }

  [[noreturn]] static void throw_result(std::string_view what, const PGresult* r, PGconn* c) {
    const char* m = r ? PQresultErrorMessage(r) : nullptr;
    if (!m || !*m) m = c ? PQerrorMessage(c) : "no connection";
    detail::throw_mapped("idem: postgres " + std::string(what) + " failed: " + first_line(m), sqlstate_of(r), c,
                         sequence_missing);
  }

  // An idle connection has nothing to read; readable means EOF or an error from the server.
  static bool looks_alive(PGconn* c) {
    if (PQstatus(c) != CONNECTION_OK) return false;
    pollfd p{PQsocket(c), POLLIN, 0};
    int rc;
    do rc = ::poll(&p, 1, 0);
    while (rc < 0 && errno == EINTR);
    return rc == 0;
  }

  PGconn* checkout() {
    std::unique_lock lock(mu);
    const auto deadline = std::chrono::steady_clock::now() + opt.pool_wait;
    for (;;) {
      if (!idle.empty()) {
        PGconn* c = idle.back();
        idle.pop_back();
        lock.unlock();
        if (looks_alive(c)) return c;
        PQfinish(c);  // closed by the server while idle (restart, idle timeout): never used
        lock.lock();
        --open;
        continue;
      }
      if (open < opt.pool_size) {
        ++open;
        lock.unlock();
        try {
          return connect();
        } catch (...) {
          lock.lock();
          --open;
          cv.notify_one();
          throw;
        }
      }
      auto ready = [&] { return !idle.empty() || open < opt.pool_size; };
      if (opt.pool_wait == millis{0}) {
        cv.wait(lock, ready);
      } else if (!cv.wait_until(lock, deadline, ready)) {
        throw timeout_error("idem: all " + std::to_string(opt.pool_size) +
                                " PostgreSQL connections of the sequence store stayed busy; raise pool_size",
                            "", true);
      }
    }
  }

  void checkin(PGconn* c, bool healthy) noexcept {
    healthy = healthy && PQstatus(c) == CONNECTION_OK && PQtransactionStatus(c) == PQTRANS_IDLE;
    if (!healthy) PQfinish(c);
    {
      std::lock_guard lock(mu);
      if (healthy)
        idle.push_back(c);
      else
        --open;
    }
    cv.notify_one();
  }

  struct Lease {
    Impl* im;
    PGconn* c;
    bool healthy = false;
    explicit Lease(Impl& i) : im(&i), c(i.checkout()) {}
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { im->checkin(c, healthy); }
  };

  void migrate_on(PGconn* c) {
    for (int attempt = 0;; ++attempt) {
      PgResult r(PQexec(c, sql_migrate.c_str()));
      if (result_ok(r.native())) return;
      const std::string code = sqlstate_of(r.native());
      PgResult rb(PQexec(c, "ROLLBACK"));
      // Another process creating the same schema outside our lock (e.g. PostgresStore's migration).
      if (attempt == 0 && code == "23505") continue;
      throw_result("sequence table migration", r.native(), c);
    }
  }

  void ensure_migrated() {
    if (!opt.auto_migrate) return;
    std::lock_guard lk(migrate_mu);
    if (migrated) return;
    Lease l(*this);
    migrate_on(l.c);
    l.healthy = true;
    migrated = true;
  }

  // One statement with text parameters on a pooled connection. Never retried: a statement whose
  // connection broke may have run, so the error reaches the caller (fail closed).
  PgResult run(const std::string& sql, const std::vector<std::string>& params, std::string_view what) {
    ensure_migrated();
    std::vector<const char*> vals;
    for (const auto& p : params) vals.push_back(p.c_str());
    Lease l(*this);
    PgResult r(PQexecParams(l.c, sql.c_str(), static_cast<int>(vals.size()), nullptr, vals.data(), nullptr, nullptr,
                            0));
    if (!result_ok(r.native())) throw_result(what, r.native(), l.c);
    l.healthy = true;
    return r;
  }
};

PostgresSequenceStore::PostgresSequenceStore(PostgresSequenceOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}
PostgresSequenceStore::~PostgresSequenceStore() = default;
PostgresSequenceStore::PostgresSequenceStore(PostgresSequenceStore&&) noexcept = default;
PostgresSequenceStore& PostgresSequenceStore::operator=(PostgresSequenceStore&&) noexcept = default;

PostgresSequenceStore::Impl& PostgresSequenceStore::impl() const {
  if (!impl_) throw usage_error("idem: this PostgresSequenceStore was moved from; use the store it was moved to");
  return *impl_;
}

std::optional<std::uint64_t> PostgresSequenceStore::last_applied(std::string_view entity) {
  detail::check_entity(entity);
  Impl& im = impl();
  PgResult r = im.run(im.sql_get, {hex_of(entity)}, "sequence read");
  if (r.rows() == 0) return std::nullopt;
  return parse_seq(r.get(0, 0), entity);
}

namespace {
// Column 0: advanced (1/0); column 1: snapshot value or NULL. A lost CAS re-reads the value that
// beat it (a fresh snapshot; inside the transaction the row is locked by the failed update).
template <class Reread>
AdvanceResult decode_advance(const PgResult& r, std::string_view entity, std::uint64_t seq, Reread&& reread) {
  if (r.rows() != 1 || r.columns() != 2 || r.is_null(0, 0))
    throw store_error("idem: unexpected PostgreSQL reply to the sequence advance", "", false);
  AdvanceResult out;
  out.advanced = r.get(0, 0) == "1";
  if (!r.is_null(0, 1)) out.previous = parse_seq(r.get(0, 1), entity);
  if (!out.advanced && (!out.previous || *out.previous < seq)) {
    out.previous = reread();
    if (!out.previous || *out.previous < seq)
      throw store_error("idem: the PostgreSQL sequence advance of entity '" + printable(entity) +
                            "' neither advanced nor found a newer value; retry",
                        "", true);
  }
  if (out.advanced && out.previous && *out.previous >= seq) out.previous.reset();  // snapshot raced: unknown
  return out;
}
}  // namespace

AdvanceResult PostgresSequenceStore::advance(std::string_view entity, std::uint64_t seq) {
  detail::check_entity(entity);
  Impl& im = impl();
  const std::string hex = hex_of(entity);
  PgResult r = im.run(im.sql_advance, {hex, decimal(seq)}, "sequence advance");
  return decode_advance(r, entity, seq, [&]() -> std::optional<std::uint64_t> {
    PgResult g = im.run(im.sql_get, {hex}, "sequence read");
    if (g.rows() == 0) return std::nullopt;
    return parse_seq(g.get(0, 0), entity);
  });
}

AdvanceResult PostgresSequenceStore::advance(PostgresStore::transaction& tx, std::string_view entity,
                                             std::uint64_t seq) {
  detail::check_entity(entity);
  if (!tx.is_open())
    throw usage_error("idem: PostgresSequenceStore::advance(tx, ...) on a transaction that is not open");
  Impl& im = impl();
  im.ensure_migrated();
  const std::string hex = hex_of(entity);
  PgResult r = tx.exec(im.sql_advance, hex, decimal(seq));
  return decode_advance(r, entity, seq, [&]() -> std::optional<std::uint64_t> {
    PgResult g = tx.exec(im.sql_get, hex);
    if (g.rows() == 0) return std::nullopt;
    return parse_seq(g.get(0, 0), entity);
  });
}

bool PostgresSequenceStore::erase(std::string_view entity) {
  detail::check_entity(entity);
  Impl& im = impl();
  PgResult r = im.run(im.sql_erase, {hex_of(entity)}, "sequence erase");
  return r.affected() > 0;
}

void PostgresSequenceStore::migrate() {
  Impl& im = impl();
  std::lock_guard lk(im.migrate_mu);
  Impl::Lease l(im);
  im.migrate_on(l.c);
  l.healthy = true;
  im.migrated = true;
}

const PostgresSequenceOptions& PostgresSequenceStore::options() const { return impl().opt; }
const std::string& PostgresSequenceStore::qualified_table() const { return impl().qualified; }

}  // namespace idem
