// PostgresStore: connection pool, schema migration, the lease-mode transitions and the
// transactional-mode claim/commit, with libpq errors mapped to idem's typed errors.

#include "idem/postgres/store.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "idem/detail/validate.hpp"
#include "idem/core/error.hpp"

#include "pg_common.hpp"

namespace idem {
namespace detail {

extern const char* const pg_schema_v1_sql;  // generated from schema_v1.sql at build time

namespace {

// Keys sit in a btree whose entries must stay below ~2.7 kB; longer keys are refused up front
// with a typed error rather than by the server halfway through a transition.
constexpr std::size_t max_pg_key_bytes = 2048;

constexpr const char* kAcquire = "idem_acquire";             // transactional-mode claim (begin)
constexpr const char* kAcquireLease = "idem_acquire_lease";  // lease mode (acquire): $8 is always ''
constexpr const char* kComplete = "idem_complete";
constexpr const char* kFail = "idem_fail";
constexpr const char* kExtend = "idem_extend";
constexpr const char* kInspect = "idem_inspect";
constexpr const char* kPurge = "idem_purge";
constexpr const char* kTxComplete = "idem_tx_complete";
constexpr const char* kRecordFailure = "idem_record_failure";

std::string quote_ident(std::string_view s) { return "\"" + std::string(s) + "\""; }

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  for (std::size_t pos = 0; (pos = s.find(from, pos)) != std::string::npos; pos += to.size())
    s.replace(pos, from.size(), to);
}

std::string first_line(const char* msg) {
  std::string s = msg ? msg : "";
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

constexpr MissingSchemaHint store_missing{
    "; the idem schema is missing: call PostgresStore::migrate() or set auto_migrate", true};

[[noreturn]] void throw_result(std::string_view what, const PGresult* r, PGconn* c) {
  const char* m = r ? PQresultErrorMessage(r) : nullptr;
  if (!m || !*m) m = c ? PQerrorMessage(c) : "no connection";
  throw_mapped("idem: postgres " + std::string(what) + " failed: " + first_line(m), sqlstate_of(r), c,
               store_missing);
}

// Binary-format decoding of the values our own statements return; a length that does not fit
// the type means the row (or the function) is not what we wrote, which must fail closed.
std::int64_t be_int(const PGresult* r, int row, int col, int bytes) {
  if (PQgetisnull(r, row, col) || PQgetlength(r, row, col) != bytes)
    throw corrupt_record_error("idem: postgres returned an unreadable value in column " +
                               std::string(PQfname(r, col)));
  const auto* p = reinterpret_cast<const unsigned char*>(PQgetvalue(r, row, col));
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v = (v << 8) | p[i];
  if (bytes < 8 && (p[0] & 0x80)) v |= ~std::uint64_t{0} << (8 * bytes);  // sign-extend
  return static_cast<std::int64_t>(v);
}
std::string bytes_of(const PGresult* r, int row, int col) {
  if (PQgetisnull(r, row, col))
    throw corrupt_record_error("idem: postgres returned NULL in column " + std::string(PQfname(r, col)));
  return std::string(PQgetvalue(r, row, col), static_cast<std::size_t>(PQgetlength(r, row, col)));
}
bool bool_of(const PGresult* r, int row, int col) { return be_int(r, row, col, 1) != 0; }

// Parameters of our prepared statements: bytea in binary (keys are arbitrary bytes), the rest as text.
class Params {
public:
  Params& bin(std::string_view v) {
    vals_[n_] = v.data() ? v.data() : "";
    lens_[n_] = static_cast<int>(v.size());
    fmts_[n_] = 1;
    ++n_;
    return *this;
  }
  Params& text(std::string v) {
    store_[n_] = std::move(v);
    vals_[n_] = store_[n_].c_str();
    lens_[n_] = 0;
    fmts_[n_] = 0;
    ++n_;
    return *this;
  }
  Params& num(std::int64_t v) { return text(std::to_string(v)); }
  Params& boolean(bool v) { return text(v ? "t" : "f"); }
  int size() const { return n_; }
  const char* const* values() const { return vals_.data(); }
  const int* lengths() const { return lens_.data(); }
  const int* formats() const { return fmts_.data(); }

private:
  static constexpr int cap = 12;
  std::array<std::string, cap> store_{};
  std::array<const char*, cap> vals_{};
  std::array<int, cap> lens_{};
  std::array<int, cap> fmts_{};
  int n_ = 0;
};

std::int64_t as_i64(std::uint64_t v) { return static_cast<std::int64_t>(v); }
std::uint64_t as_u64(std::int64_t v) { return static_cast<std::uint64_t>(v); }

// Owner ids are diagnostics in a text column; bytes that are not printable ASCII (or NUL, which
// text cannot hold) become '?', so an odd hostname can never make acquire fail.
std::string clean_owner(std::string_view o) {
  std::string s(o.substr(0, 200));
  for (char& ch : s)
    if (static_cast<unsigned char>(ch) < 0x20 || static_cast<unsigned char>(ch) > 0x7e) ch = '?';
  return s;
}

AcquireResult decode_acquire(const PGresult* r, std::uint64_t token) {
  if (PQntuples(r) != 1 || PQnfields(r) != 6)
    throw corrupt_record_error("idem: postgres acquire returned an unexpected shape");
  AcquireResult a;
  const auto st = be_int(r, 0, 0, 2);
  if (st < 0 || st > 4) throw corrupt_record_error("idem: postgres acquire returned status " + std::to_string(st));
  a.status = static_cast<AcquireStatus>(st);
  a.takeover = bool_of(r, 0, 2);
  a.attempts = static_cast<std::uint32_t>(be_int(r, 0, 3, 4));
  a.retry_after = millis{std::max<std::int64_t>(0, be_int(r, 0, 4, 8))};
  a.payload = bytes_of(r, 0, 5);
  if (a.status == AcquireStatus::acquired) a.holder = {as_u64(be_int(r, 0, 1, 8)), token};
  return a;
}

// kAcquireLease answers a new key with no row at all (the INSERT took it) and any other decision
// with the function's one row.
AcquireResult decode_acquire_lease(const PGresult* r, std::uint64_t token) {
  if (PQntuples(r) != 0 || PQnfields(r) != 6) return decode_acquire(r, token);
  AcquireResult a;
  a.status = AcquireStatus::acquired;
  a.attempts = 1;
  a.holder = {1, token};
  return a;
}

}  // namespace

class PgStoreImpl {
public:
  explicit PgStoreImpl(PostgresOptions o) : opt(std::move(o)) {
    if (!valid_identifier(opt.schema, 63) || opt.schema.rfind("pg_", 0) == 0)
      throw invalid_options_error("idem: PostgresOptions::schema '" + opt.schema.substr(0, 80) +
                                  "' is not a plain identifier; use [a-z_][a-z0-9_]* (max 63, not pg_*)");
    if (!valid_identifier(opt.table, 40))
      throw invalid_options_error("idem: PostgresOptions::table '" + opt.table.substr(0, 80) +
                                  "' is not a plain identifier; use [a-z_][a-z0-9_]* (max 40)");
    if (opt.pool_size == 0) throw invalid_options_error("idem: PostgresOptions::pool_size must be > 0");
    if (opt.lock_timeout <= millis{0})
      throw invalid_options_error("idem: PostgresOptions::lock_timeout must be > 0; it bounds how long a duplicate waits");
    if (opt.statement_timeout < millis{0} || opt.pool_wait < millis{0})
      throw invalid_options_error("idem: PostgresOptions timeouts must be >= 0 (0 = no limit)");
    if (opt.isolation == "read committed" || opt.isolation == "repeatable read" || opt.isolation == "serializable")
      begin_sql = "BEGIN ISOLATION LEVEL " + opt.isolation;
    else
      throw invalid_options_error("idem: PostgresOptions::isolation must be \"read committed\", "
                                  "\"repeatable read\" or \"serializable\"");
    if (opt.conninfo.find('\0') != std::string::npos)
      throw invalid_options_error("idem: PostgresOptions::conninfo contains a NUL byte");
    qs = quote_ident(opt.schema);
    qt = qs + "." + quote_ident(opt.table);
    lock_timeout_text = std::to_string(opt.lock_timeout.count());
  }

  ~PgStoreImpl() {
    for (PGconn* c : idle) PQfinish(c);
  }

  // --- pool ---------------------------------------------------------------------------------

  // A pooled connection, ready for the prepared statements unless `prepared` is false (migrate()
  // must work on a database where the functions the statements call do not exist yet).
  PGconn* checkout(bool prepared = true) {
    PGconn* c = checkout_raw();
    if (!prepared) return c;
    {
      std::lock_guard lk(mu);
      if (ready.count(c)) return c;
    }
    try {
      if (opt.auto_migrate) ensure_migrated(c);
      prepare_all(c);
    } catch (...) {
      checkin(c, false);  // some statements may be prepared: start afresh on a new connection
      throw;
    }
    std::lock_guard lk(mu);
    ready.insert(c);
    return c;
  }

  PGconn* checkout_raw() {
    {
      std::unique_lock lk(mu);
      const auto deadline = std::chrono::steady_clock::now() + opt.pool_wait;
      for (;;) {
        if (!idle.empty()) {
          PGconn* c = idle.back();
          idle.pop_back();
          lk.unlock();
          // A server restart leaves a FATAL message and EOF on idle sockets; reading them now
          // lets the pool replace the connection before a statement is sent on it.
          if (PQconsumeInput(c) != 0 && PQstatus(c) == CONNECTION_OK && !PQisBusy(c)) return c;
          lk.lock();
          ready.erase(c);
          PQfinish(c);
          --open;
          continue;
        }
        if (open < opt.pool_size) {
          ++open;
          break;
        }
        if (opt.pool_wait.count() == 0) {
          cv.wait(lk);
        } else if (cv.wait_until(lk, deadline) == std::cv_status::timeout && idle.empty() &&
                   open >= opt.pool_size) {
          throw timeout_error("idem: no free PostgreSQL connection within pool_wait (" +
                                  std::to_string(opt.pool_wait.count()) + " ms); raise pool_size",
                              "POOL", true);
        }
      }
    }
    try {
      return connect();
    } catch (...) {
      std::lock_guard lk(mu);
      --open;
      cv.notify_one();
      throw;
    }
  }

  void checkin(PGconn* c, bool healthy) noexcept {
    if (c && healthy && PQstatus(c) == CONNECTION_OK) {
      const auto ts = PQtransactionStatus(c);
      if (ts == PQTRANS_INTRANS || ts == PQTRANS_INERROR) {
        PGresult* r = PQexec(c, "ROLLBACK");
        healthy = result_ok(r);
        PQclear(r);
      } else if (ts != PQTRANS_IDLE) {
        healthy = false;
      }
    } else {
      healthy = false;
    }
    std::lock_guard lk(mu);
    if (healthy) {
      idle.push_back(c);
    } else {
      if (c) {
        ready.erase(c);
        PQfinish(c);
      }
      --open;
    }
    cv.notify_one();
  }

  // RAII checkout for the short lease-mode calls.
  struct Lease {
    PgStoreImpl* impl;
    PGconn* c;
    bool healthy = true;
    explicit Lease(PgStoreImpl* i, bool prepared = true) : impl(i), c(i->checkout(prepared)) {}
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { impl->checkin(c, healthy && PQstatus(c) == CONNECTION_OK); }
  };

  PGconn* connect() {
    const char* keys[] = {"dbname", "fallback_application_name", nullptr};
    const char* vals[] = {opt.conninfo.c_str(), "idem", nullptr};
    PGconn* c = PQconnectdbParams(keys, vals, 1);
    if (!c) throw connection_error("idem: postgres: out of memory creating a connection", "08001", true);
    if (PQstatus(c) != CONNECTION_OK) {
      std::string m = first_line(PQerrorMessage(c));
      PQfinish(c);
      throw connection_error("idem: cannot connect to PostgreSQL: " + m, "08001", true);
    }
    // Server notices (IF NOT EXISTS skips, ...) are not the caller's business: no stderr noise.
    PQsetNoticeProcessor(c, [](void*, const char*) {}, nullptr);
    try {
      const std::string set = "SET statement_timeout = " + std::to_string(opt.statement_timeout.count());
      exec_simple(c, set.c_str(), "session setup");
    } catch (...) {
      PQfinish(c);
      throw;
    }
    return c;
  }

  static void exec_simple(PGconn* c, const char* sql, std::string_view what) {
    PgResult r(PQexec(c, sql));
    if (!result_ok(r.native())) throw_result(what, r.native(), c);
  }

  // --- schema ---------------------------------------------------------------------------------

  void ensure_migrated(PGconn* c) {
    std::lock_guard lk(migrate_mu);
    if (migrated) return;
    migrate_on(c);
    migrated = true;
  }

  void migrate_on(PGconn* c) {
    exec_simple(c, "BEGIN", "migrate");
    try {
      // One lock per schema: concurrent starts of any number of processes serialise here,
      // and CREATE SCHEMA IF NOT EXISTS cannot race with itself.
      Params p;
      p.text("idem:" + opt.schema);
      PgResult l(PQexecParams(c, "SELECT pg_advisory_xact_lock(hashtext($1))", p.size(), nullptr, p.values(),
                              p.lengths(), p.formats(), 0));
      if (!result_ok(l.native())) throw_result("migrate (advisory lock)", l.native(), c);
      const std::string ddl = "CREATE SCHEMA IF NOT EXISTS " + qs + "; CREATE TABLE IF NOT EXISTS " + qs +
                              ".idem_schema_version (table_name text PRIMARY KEY, version integer NOT NULL, "
                              "installed_at timestamptz NOT NULL DEFAULT now())";
      exec_simple(c, ddl.c_str(), "migrate (version table)");
      Params q;
      q.text(opt.table);
      const std::string sel = "SELECT version FROM " + qs + ".idem_schema_version WHERE table_name = $1";
      PgResult v(PQexecParams(c, sel.c_str(), q.size(), nullptr, q.values(), q.lengths(), q.formats(), 0));
      if (!result_ok(v.native())) throw_result("migrate (read version)", v.native(), c);
      int have = 0;
      if (v.rows() == 1) {
        auto s = v.get(0, 0);
        std::from_chars(s.data(), s.data() + s.size(), have);
      }
      if (have > PostgresStore::schema_version)
        throw store_error("idem: table " + qt + " has schema version " + std::to_string(have) +
                              ", newer than this library's " + std::to_string(PostgresStore::schema_version) +
                              "; upgrade idem",
                          "", false);
      if (have < 1) {
        std::string sql = pg_schema_v1_sql;
        replace_all(sql, "@S@", qs);
        replace_all(sql, "@T@", quote_ident(opt.table));
        replace_all(sql, "@P@", opt.table);
        exec_simple(c, sql.c_str(), "migrate (schema v1)");
        const std::string ins = "INSERT INTO " + qs +
                                ".idem_schema_version (table_name, version) VALUES ($1, 1) "
                                "ON CONFLICT (table_name) DO UPDATE SET version = 1, installed_at = now()";
        PgResult i(PQexecParams(c, ins.c_str(), q.size(), nullptr, q.values(), q.lengths(), q.formats(), 0));
        if (!result_ok(i.native())) throw_result("migrate (write version)", i.native(), c);
      }
      exec_simple(c, "COMMIT", "migrate (commit)");
    } catch (...) {
      PGresult* r = PQexec(c, "ROLLBACK");
      PQclear(r);
      throw;
    }
  }

  void prepare(PGconn* c, const char* name, const std::string& sql, int nparams) {
    PgResult r(PQprepare(c, name, sql.c_str(), nparams, nullptr));
    if (!result_ok(r.native())) throw_result(std::string("prepare ") + name, r.native(), c);
  }

  void prepare_all(PGconn* c) {
    const std::string fn = qs + ".";
    const std::string now = "(SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint AS ms) c";
    const std::string holder = "t.key = $1 AND t.state = 1 AND t.fence = $2 AND t.token = $3 AND t.expires_at > c.ms";
    // acquire: a new key is settled by the INSERT in this statement alone; only an existing key
    // pays for the plpgsql decision function (the one-time filter keeps it from running otherwise).
    // cfg sets the claim's lock_timeout before the INSERT can wait on a concurrent claim; fin puts
    // the caller's back (claiming transactions only: $8 <> '') and sets the idle timeout.
    prepare(c, kAcquire,
            "WITH cfg AS MATERIALIZED (SELECT current_setting('lock_timeout') AS saved, "
            "set_config('lock_timeout', $7, true) AS lt, "
            "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint AS ms), "
            "ins AS (INSERT INTO " + qt +
                " (key, state, fence, token, attempts, lease_until, expires_at, purge_after, owner, fingerprint) "
                "SELECT $1, 1, 1, $5, 1, cfg.ms + $3, cfg.ms + $4, (cfg.ms + $4 + 999) / 1000 * 1000, $6, $2 "
                "FROM cfg ON CONFLICT (key) DO NOTHING RETURNING 1 AS one), "
                "fin AS MATERIALIZED (SELECT CASE WHEN $8 <> '' THEN set_config('lock_timeout', cfg.saved, true) END AS a, "
                "CASE WHEN $8 NOT IN ('', '-') THEN set_config('idle_in_transaction_session_timeout', $8, true) END AS b "
                "FROM cfg, ins) "
                "SELECT 0::smallint, 1::bigint, false, 1, 0::bigint, ''::bytea FROM fin "
                "UNION ALL "
                "SELECT f.o_status, f.o_fence, f.o_takeover, f.o_attempts, f.o_retry_after, f.o_payload FROM cfg, " +
                fn + quote_ident(opt.table + "_acquire") +
                "($1, $2, $3, $4, $5, $6, $7, $8, cfg.saved) f WHERE NOT EXISTS (SELECT 1 FROM ins)",
            8);
    // acquire in lease mode ($8 = '' always; an implicit transaction of its own): the decisions
    // of kAcquire with what only a claiming transaction needs left out, because the executor sets
    // up every node of a statement on each call, run or not. Nothing to put back (kAcquire's fin
    // is a no-op when $8 = '', and the function restores lock_timeout only when p_idle_timeout is
    // not ''), and no row for a new key: zero rows means the INSERT took the key (fence 1, attempts
    // 1; see decode_acquire_lease), since the function, when called, returns exactly one row or
    // raises. The function is called from the target list of a one-row subquery (OFFSET 0 keeps it
    // from being flattened, so it runs at most once), cheaper to set up than a function scan; the
    // uncorrelated NOT EXISTS is a one-time filter, so it runs only when the INSERT found the key.
    prepare(c, kAcquireLease,
            "WITH cfg AS MATERIALIZED (SELECT set_config('lock_timeout', $7, true) AS lt, "
            "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint AS ms), "
            "ins AS (INSERT INTO " + qt +
                " (key, state, fence, token, attempts, lease_until, expires_at, purge_after, owner, fingerprint) "
                "SELECT $1, 1, 1, $5, 1, cfg.ms + $3, cfg.ms + $4, (cfg.ms + $4 + 999) / 1000 * 1000, $6, $2 "
                "FROM cfg ON CONFLICT (key) DO NOTHING RETURNING 1 AS one) "
                "SELECT (d).o_status, (d).o_fence, (d).o_takeover, (d).o_attempts, (d).o_retry_after, (d).o_payload "
                "FROM (SELECT " + fn + quote_ident(opt.table + "_acquire") +
                "($1, $2, $3, $4, $5, $6, $7, $8, NULL) AS d WHERE NOT EXISTS (SELECT 1 FROM ins) OFFSET 0) s",
            8);
    prepare(c, kComplete,
            "UPDATE " + qt +
                " t SET state = 2, result = $4, lease_until = 0, expires_at = c.ms + $5, "
                "purge_after = (c.ms + $5 + 999) / 1000 * 1000 FROM " +
                now +
                " WHERE " + holder,
            5);
    prepare(c, kFail,
            "UPDATE " + qt +
                " t SET state = 3, error = $4, lease_until = 0, permanent = $5, retry_at = c.ms + $6, "
                "expires_at = c.ms + $7, purge_after = (c.ms + $7 + 999) / 1000 * 1000 FROM " +
                now + " WHERE " + holder,
            7);
    prepare(c, kExtend,
            "UPDATE " + qt +
                " t SET lease_until = c.ms + $4, expires_at = greatest(t.expires_at, c.ms + $4), "
                "purge_after = (greatest(t.expires_at, c.ms + $4) + 999) / 1000 * 1000 FROM " +
                now +
                " WHERE " + holder,
            4);
    prepare(c, kInspect,
            "SELECT state, fence, token, owner, lease_until, retry_at, attempts, permanent, fingerprint, result, "
            "error FROM " +
                qt + " t, " + now + " WHERE t.key = $1 AND t.expires_at > c.ms",
            1);
    prepare(c, kPurge,
            "DELETE FROM " + qt + " d WHERE d.key IN (SELECT t.key FROM " + qt + " t, " + now +
                " WHERE t.purge_after <= c.ms LIMIT $1 FOR UPDATE OF t SKIP LOCKED)",
            1);
    // tx_complete travels in one pipeline with COMMIT, so it must fail, not match nothing, when the
    // claim is gone: 1 / count(*) raises division_by_zero (22012) on zero rows, and COMMIT then
    // rolls back instead of committing business writes without their record.
    prepare(c, kTxComplete,
            "WITH u AS (UPDATE " + qt +
                " t SET state = 2, result = $4, lease_until = 0, expires_at = c.ms + $5, "
                "purge_after = (c.ms + $5 + 999) / 1000 * 1000 FROM " +
                now + " WHERE t.key = $1 AND t.state = 1 AND t.fence = $2 AND t.token = $3 RETURNING 1) "
                      "SELECT 1 / count(*)::int FROM u",
            5);
    prepare(c, kRecordFailure,
            "SELECT o_written FROM " + fn + quote_ident(opt.table + "_record_failure") +
                "($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
            11);
  }

  // --- statements ------------------------------------------------------------------------------

  PgResult run(Lease& l, const char* name, const Params& p, std::string_view what) {
    PgResult r(PQexecPrepared(l.c, name, p.size(), p.values(), p.lengths(), p.formats(), 1));
    if (!result_ok(r.native())) {
      if (PQstatus(l.c) != CONNECTION_OK) l.healthy = false;
      throw_result(what, r.native(), l.c);
    }
    return r;
  }

  Params acquire_params(std::string_view key, const AcquireParams& ap, const std::string& owner, bool tx) const {
    Params p;
    p.bin(key).bin(ap.fingerprint).num(ap.lease.count()).num(ap.retention.count()).num(as_i64(ap.token));
    p.text(owner).text(lock_timeout_text);
    p.text(!tx ? std::string() : opt.idle_timeout_is_lease ? std::to_string(ap.lease.count()) : std::string("-"));
    return p;
  }

  static AcquireResult lock_busy(const AcquireParams& ap) {
    // Another transaction holds the row (a transactional-mode holder): its lease end is not
    // visible, so the caller is told to come back after at most one lease.
    AcquireResult a;
    a.status = AcquireStatus::in_flight;
    a.retry_after = ap.lease;
    return a;
  }

  static bool is_lock_busy(const PGresult* r) {
    const std::string s = sqlstate_of(r);
    return s == "55P03";
  }

  PostgresOptions opt;
  std::string qs, qt, begin_sql, lock_timeout_text;

  std::mutex mu;
  std::condition_variable cv;
  std::vector<PGconn*> idle;
  std::unordered_set<PGconn*> ready;  // connections whose statements are prepared
  std::size_t open = 0;

  std::mutex migrate_mu;
  bool migrated = false;

  // --- transactional mode --------------------------------------------------------------------

  PostgresStore::transaction begin(std::string_view key, const AcquireParams& ap) {
    PostgresStore::transaction tx;
    tx.impl_ = this;
    const std::string owner = clean_owner(ap.owner);
    PGconn* c = checkout();
    bool healthy = true;
    try {
      Params p = acquire_params(key, ap, owner, true);
      // BEGIN and the claim travel in one pipeline: one round trip for both.
      if (PQenterPipelineMode(c) != 1) throw_result("begin (pipeline)", nullptr, c);
      const bool sent =
          PQsendQueryParams(c, begin_sql.c_str(), 0, nullptr, nullptr, nullptr, nullptr, 0) == 1 &&
          PQsendQueryPrepared(c, kAcquire, p.size(), p.values(), p.lengths(), p.formats(), 1) == 1 &&
          PQpipelineSync(c) == 1;
      std::array<PgResult, 2> res;
      bool complete = sent && read_pipeline(c, res.data(), res.size());
      PQexitPipelineMode(c);
      if (!complete) {
        healthy = false;
        const PGresult* why = !result_ok(res[0].native()) ? res[0].native() : res[1].native();
        throw_result("begin", why, c);
      }
      if (!result_ok(res[0].native())) throw_result("begin", res[0].native(), c);
      if (!result_ok(res[1].native())) {
        const std::string code = sqlstate_of(res[1].native());
        // 55P03: the key is claimed by an open transaction. 40001 under repeatable read /
        // serializable: the row changed under the snapshot; either way someone else is on it.
        if (code == "55P03" || code == "40001") {
          checkin(c, true);
          tx.decision_ = lock_busy(ap);
          return tx;
        }
        throw_result("acquire", res[1].native(), c);
      }
      tx.decision_ = decode_acquire(res[1].native(), ap.token);
    } catch (...) {
      checkin(c, healthy && PQstatus(c) == CONNECTION_OK);
      throw;
    }
    if (tx.decision_.status != AcquireStatus::acquired) {
      checkin(c, true);  // rolls back
      return tx;
    }
    tx.conn_ = c;
    tx.key_ = std::string(key);
    tx.fingerprint_ = std::string(ap.fingerprint);
    tx.owner_ = owner;
    return tx;
  }

  // Reads `n` query results and the sync of a pipeline; false when the connection broke.
  static bool read_pipeline(PGconn* c, PgResult* out, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
      PGresult* r = PQgetResult(c);
      if (!r) return false;
      out[i] = PgResult(r);
      // Each query's results end with a null; a second non-null would be a protocol surprise.
      for (int guard = 0; guard < 4; ++guard) {
        PGresult* extra = PQgetResult(c);
        if (!extra) break;
        PQclear(extra);
      }
      if (PQstatus(c) != CONNECTION_OK) return false;
    }
    PGresult* s = PQgetResult(c);
    const bool synced = s && PQresultStatus(s) == PGRES_PIPELINE_SYNC;
    PQclear(s);
    return synced && PQstatus(c) == CONNECTION_OK;
  }
};

}  // namespace detail

// --- PostgresStore ------------------------------------------------------------------------------

using detail::Params;
using detail::PgStoreImpl;

PostgresStore::PostgresStore(PostgresOptions options)
    : impl_(std::make_unique<PgStoreImpl>(std::move(options))) {}
PostgresStore::~PostgresStore() = default;
PostgresStore::PostgresStore(PostgresStore&&) noexcept = default;
PostgresStore& PostgresStore::operator=(PostgresStore&&) noexcept = default;

bool PostgresStore::transactional() const noexcept { return impl_->opt.mode == PgMode::transactional; }
const PostgresOptions& PostgresStore::options() const noexcept { return impl_->opt; }
const std::string& PostgresStore::qualified_table() const noexcept { return impl_->qt; }

void PostgresStore::migrate() {
  PgStoreImpl::Lease l(impl_.get(), false);
  try {
    std::lock_guard lk(impl_->migrate_mu);
    impl_->migrate_on(l.c);
    impl_->migrated = true;
  } catch (...) {
    l.healthy = PQstatus(l.c) == CONNECTION_OK;
    throw;
  }
}

AcquireResult PostgresStore::acquire(std::string_view key, const AcquireParams& ap) {
  detail::check_acquire(key, ap);
  detail::check_key(key, detail::max_pg_key_bytes);
  PgStoreImpl::Lease l(impl_.get());
  Params p = impl_->acquire_params(key, ap, detail::clean_owner(ap.owner), false);
  PgResult r(PQexecPrepared(l.c, detail::kAcquireLease, p.size(), p.values(), p.lengths(), p.formats(), 1));
  if (!detail::result_ok(r.native())) {
    if (PgStoreImpl::is_lock_busy(r.native())) return PgStoreImpl::lock_busy(ap);
    l.healthy = PQstatus(l.c) == CONNECTION_OK;
    detail::throw_result("acquire", r.native(), l.c);
  }
  return detail::decode_acquire_lease(r.native(), ap.token);
}

WriteStatus PostgresStore::complete(std::string_view key, const Holder& h, std::string_view result, millis retention) {
  detail::check_holder(key, h);
  detail::check_lease(retention, "retention");
  PgStoreImpl::Lease l(impl_.get());
  Params p;
  p.bin(key).num(detail::as_i64(h.fence)).num(detail::as_i64(h.token)).bin(result).num(retention.count());
  return impl_->run(l, detail::kComplete, p, "complete").affected() == 1 ? WriteStatus::ok : WriteStatus::lease_lost;
}

WriteStatus PostgresStore::fail(std::string_view key, const Holder& h, const FailParams& f) {
  detail::check_holder(key, h);
  detail::check_lease(f.retention, "retention");
  PgStoreImpl::Lease l(impl_.get());
  Params p;
  p.bin(key).num(detail::as_i64(h.fence)).num(detail::as_i64(h.token)).bin(f.error);
  p.boolean(!f.release && f.permanent).num(f.release ? 0 : std::max<std::int64_t>(0, f.backoff.count()));
  p.num(f.retention.count());
  return impl_->run(l, detail::kFail, p, "fail").affected() == 1 ? WriteStatus::ok : WriteStatus::lease_lost;
}

WriteStatus PostgresStore::extend(std::string_view key, const Holder& h, millis lease) {
  detail::check_holder(key, h);
  detail::check_lease(lease);
  PgStoreImpl::Lease l(impl_.get());
  Params p;
  p.bin(key).num(detail::as_i64(h.fence)).num(detail::as_i64(h.token)).num(lease.count());
  return impl_->run(l, detail::kExtend, p, "extend").affected() == 1 ? WriteStatus::ok : WriteStatus::lease_lost;
}

std::optional<Record> PostgresStore::inspect(std::string_view key) {
  detail::check_key(key, static_cast<std::size_t>(-1));
  PgStoreImpl::Lease l(impl_.get());
  Params p;
  p.bin(key);
  PgResult r = impl_->run(l, detail::kInspect, p, "inspect");
  if (r.rows() == 0) return std::nullopt;
  const PGresult* res = r.native();
  using detail::be_int;
  Record rec;
  const auto st = be_int(res, 0, 0, 2);
  if (st < 1 || st > 3)
    throw corrupt_record_error("idem: the record of key '" + std::string(key.substr(0, 64)) + "' has state " +
                               std::to_string(st));
  rec.state = static_cast<State>(st);
  rec.holder = {detail::as_u64(be_int(res, 0, 1, 8)), detail::as_u64(be_int(res, 0, 2, 8))};
  rec.owner = detail::bytes_of(res, 0, 3);
  rec.lease_until_ms = be_int(res, 0, 4, 8);
  rec.retry_at_ms = be_int(res, 0, 5, 8);
  const auto attempts = be_int(res, 0, 6, 4);
  if (rec.holder.fence == 0 || attempts < 1 || static_cast<std::int64_t>(rec.holder.fence) < 0)
    throw corrupt_record_error("idem: the record of key '" + std::string(key.substr(0, 64)) +
                               "' has fence " + std::to_string(static_cast<std::int64_t>(rec.holder.fence)) +
                               " and attempts " + std::to_string(attempts));
  rec.attempts = static_cast<std::uint32_t>(attempts);
  rec.permanent = detail::bool_of(res, 0, 7);
  rec.fingerprint = detail::bytes_of(res, 0, 8);
  rec.result = detail::bytes_of(res, 0, 9);
  rec.error = detail::bytes_of(res, 0, 10);
  return rec;
}

std::size_t PostgresStore::purge_expired(std::size_t batch, std::size_t max_batches) {
  if (batch == 0) throw invalid_options_error("idem: purge_expired batch must be > 0");
  std::size_t total = 0;
  PgStoreImpl::Lease l(impl_.get());
  for (std::size_t i = 0; i < max_batches; ++i) {
    Params p;
    p.num(static_cast<std::int64_t>(batch));
    const std::uint64_t n = impl_->run(l, detail::kPurge, p, "purge").affected();
    total += n;
    if (n < batch) break;
  }
  return total;
}

PostgresStore::transaction PostgresStore::begin(std::string_view key, const AcquireParams& ap) {
  detail::check_acquire(key, ap);
  detail::check_key(key, detail::max_pg_key_bytes);
  return impl_->begin(key, ap);
}

// --- transaction --------------------------------------------------------------------------------

PostgresStore::transaction::transaction(transaction&& o) noexcept
    : impl_(o.impl_),
      conn_(std::exchange(o.conn_, nullptr)),
      decision_(std::move(o.decision_)),
      key_(std::move(o.key_)),
      fingerprint_(std::move(o.fingerprint_)),
      owner_(std::move(o.owner_)) {}

PostgresStore::transaction& PostgresStore::transaction::operator=(transaction&& o) noexcept {
  if (this != &o) {
    release(true);
    impl_ = o.impl_;
    conn_ = std::exchange(o.conn_, nullptr);
    decision_ = std::move(o.decision_);
    key_ = std::move(o.key_);
    fingerprint_ = std::move(o.fingerprint_);
    owner_ = std::move(o.owner_);
  }
  return *this;
}

PostgresStore::transaction::~transaction() { release(true); }

void PostgresStore::transaction::release(bool healthy) noexcept {
  if (conn_) impl_->checkin(std::exchange(conn_, nullptr), healthy);  // checkin rolls back
}

PgResult PostgresStore::transaction::exec_params(std::string_view sql, const detail::PgParam* params, std::size_t n) {
  if (!conn_) throw usage_error("idem: exec on a transaction that is not open (not acquired, or already ended)");
  const std::string text(sql);
  std::vector<const char*> vals(n);
  for (std::size_t i = 0; i < n; ++i) vals[i] = params[i].text ? params[i].text->c_str() : nullptr;
  PgResult r(PQexecParams(conn_, text.c_str(), static_cast<int>(n), nullptr, vals.data(), nullptr, nullptr, 0));
  if (!detail::result_ok(r.native())) detail::throw_result("statement", r.native(), conn_);
  return r;
}

WriteStatus PostgresStore::transaction::commit(std::string_view result, millis retention) {
  if (!conn_) throw usage_error("idem: commit on a transaction that is not open (not acquired, or already ended)");
  detail::check_lease(retention, "retention");
  PGconn* c = conn_;
  Params p;
  p.bin(key_).num(detail::as_i64(decision_.holder.fence)).num(detail::as_i64(decision_.holder.token));
  p.bin(result).num(retention.count());
  std::array<PgResult, 2> res;
  bool sent = false, complete = false;
  if (PQenterPipelineMode(c) == 1) {
    sent = PQsendQueryPrepared(c, detail::kTxComplete, p.size(), p.values(), p.lengths(), p.formats(), 1) == 1 &&
           PQsendQueryParams(c, "COMMIT", 0, nullptr, nullptr, nullptr, nullptr, 0) == 1 && PQpipelineSync(c) == 1;
    complete = sent && PgStoreImpl::read_pipeline(c, res.data(), res.size());
    PQexitPipelineMode(c);
  }
  const PGresult* r0 = res[0].native();
  const PGresult* r1 = res[1].native();
  const bool ok0 = detail::result_ok(r0), ok1 = detail::result_ok(r1);
  if (complete && ok0 && ok1 && std::strcmp(PQcmdStatus(res[1].native()), "COMMIT") == 0) {
    release(true);
    return WriteStatus::ok;
  }
  const std::string code0 = detail::sqlstate_of(r0), code1 = detail::sqlstate_of(r1);
  const bool healthy = PQstatus(c) == CONNECTION_OK;
  // The server ended the session for idling in the transaction past the lease (a paused
  // holder): the claim and the writes were rolled back before our COMMIT arrived.
  if (code0 == "25P03" || code1 == "25P03") {
    release(false);
    return WriteStatus::lease_lost;
  }
  // The completion failed with an answer from the server: COMMIT then either was never processed
  // (the session died) or turned into a rollback. Either way nothing was committed, and we know it.
  if (r0 && !ok0 && !code0.empty()) {
    release(healthy);
    if (code0 == "22012") return WriteStatus::lease_lost;  // the claim was gone (see kTxComplete)
    detail::throw_result("commit (record result)", r0, nullptr);
  }
  // COMMIT itself answered with an ERROR (serialization failure, deferred constraint): rolled back.
  // A FATAL there, or no answer at all, may have come after the commit record was written.
  const char* sev = r1 ? PQresultErrorField(r1, PG_DIAG_SEVERITY_NONLOCALIZED) : nullptr;
  if (ok0 && r1 && !ok1 && !code1.empty() && sev && std::strcmp(sev, "ERROR") == 0) {
    release(healthy);
    detail::throw_result("commit", r1, nullptr);
  }
  if (ok0 && ok1) {  // COMMIT answered ROLLBACK: the transaction had failed before
    release(healthy);
    throw store_error("idem: postgres COMMIT rolled the transaction back", "40000", true);
  }
  std::string m = detail::first_line(r1 && PQresultErrorMessage(r1)[0] ? PQresultErrorMessage(r1) : PQerrorMessage(c));
  release(false);
  if (!sent && r0 == nullptr && healthy)
    throw connection_error("idem: postgres commit could not be sent: " + m, "08006", true);
  throw outcome_unknown_error("idem: the connection to PostgreSQL was lost during COMMIT (" + m +
                                  "); the transaction may or may not have committed: check the record "
                                  "(inspect) before redelivering",
                              code1.empty() ? "08006" : code1);
}

WriteStatus PostgresStore::transaction::fail(const FailParams& f) {
  if (!conn_) throw usage_error("idem: fail on a transaction that is not open (not acquired, or already ended)");
  detail::check_lease(f.retention, "retention");
  PGconn* c = conn_;
  PgResult rb(PQexec(c, "ROLLBACK"));
  const bool rolled_back = detail::result_ok(rb.native());
  if (f.release || !rolled_back) {
    // Release: the rollback already freed the key. A failed rollback means the session is gone,
    // and the server rolls back a dead session's transaction itself.
    release(rolled_back);
    return WriteStatus::ok;
  }
  Params p;
  p.bin(key_).bin(fingerprint_).text(owner_).num(detail::as_i64(decision_.holder.fence));
  p.num(detail::as_i64(decision_.holder.token)).num(decision_.attempts).bin(f.error).boolean(f.permanent);
  p.num(std::max<std::int64_t>(0, f.backoff.count())).num(f.retention.count()).text(impl_->lock_timeout_text);
  PgResult r(PQexecPrepared(c, detail::kRecordFailure, p.size(), p.values(), p.lengths(), p.formats(), 1));
  if (!detail::result_ok(r.native())) {
    const bool busy = PgStoreImpl::is_lock_busy(r.native());
    release(PQstatus(c) == CONNECTION_OK);
    if (busy) return WriteStatus::lease_lost;  // someone else holds the key now
    detail::throw_result("record failure", r.native(), nullptr);
  }
  const bool written = r.rows() == 1 && detail::bool_of(r.native(), 0, 0);
  release(true);
  return written ? WriteStatus::ok : WriteStatus::lease_lost;
}

}  // namespace idem
