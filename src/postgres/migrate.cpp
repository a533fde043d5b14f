// PostgresStore's schema: created or upgraded under a per-schema advisory lock, versioned in
// <schema>.idem_schema_version.

#include <charconv>
#include <iterator>
#include <string>

#include <fmt/format.h>

#include "idem/core/error.hpp"
#include "store_impl.hpp"

namespace idem::detail {

namespace {

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  for (std::size_t pos = 0; (pos = s.find(from, pos)) != std::string::npos; pos += to.size())
    s.replace(pos, from.size(), to);
}

PostgresResult exec_checked(PGconn* c, const std::string& sql, const std::string& param, std::string_view what) {
  const char* values[] = {param.c_str()};
  PostgresResult r = exec_text(c, sql, values, 1);
  if (!result_ok(ResultAccess::native(r))) throw_result(what, ResultAccess::native(r), c, store_missing);
  return r;
}

}  // namespace

void StoreImpl::ensure_migrated(PGconn* c) {
  std::lock_guard lk(migrate_mu_);
  if (migrated_) return;
  migrate_on(c);
  migrated_ = true;
}

void StoreImpl::migrate() {
  Session s(client.pool());
  std::lock_guard lk(migrate_mu_);
  migrate_on(s.pg());
  migrated_ = true;
}

void StoreImpl::migrate_on(PGconn* c) {
  exec_simple(c, "BEGIN", "migrate", store_missing);
  try {
    // One lock per schema: concurrent starts of any number of processes serialise here,
    // and CREATE SCHEMA IF NOT EXISTS cannot race with itself.
    exec_checked(c, "SELECT pg_advisory_xact_lock(hashtext($1))", schema_lock_key(opt.schema),
                 "migrate (advisory lock)");
    const std::string ddl = "CREATE SCHEMA IF NOT EXISTS " + qs + "; CREATE TABLE IF NOT EXISTS " + qs +
                            ".idem_schema_version (table_name text PRIMARY KEY, version integer NOT NULL, "
                            "installed_at timestamptz NOT NULL DEFAULT now())";
    exec_simple(c, ddl.c_str(), "migrate (version table)", store_missing);
    const std::string sel = "SELECT version FROM " + qs + ".idem_schema_version WHERE table_name = $1";
    PostgresResult v = exec_checked(c, sel, opt.table, "migrate (read version)");
    int have = 0;
    if (v.rows() == 1) {
      auto s = v.get(0, 0);
      std::from_chars(s.data(), s.data() + s.size(), have);
    }
    if (have > PostgresStore::schema_version)
      throw store_error(fmt::format("idem: table {} has schema version {}, newer than this library's {}; upgrade idem",
                                    qt, have, PostgresStore::schema_version),
                        "", false);
    // Each version's script in turn: a new table gets 1 then 2, a version-1 table only 2.
    const char* const scripts[] = {pg_schema_v1_sql, pg_schema_v2_sql};
    static_assert(std::size(scripts) == PostgresStore::schema_version);
    for (int step = have + 1; step <= PostgresStore::schema_version; ++step) {
      std::string sql = scripts[step - 1];
      replace_all(sql, "@S@", qs);
      replace_all(sql, "@T@", quote_ident(opt.table));
      replace_all(sql, "@P@", opt.table);
      exec_simple(c, sql.c_str(), fmt::format("migrate (schema v{})", step), store_missing);
    }
    if (have < PostgresStore::schema_version) {
      const std::string version = std::to_string(PostgresStore::schema_version);
      const std::string ins = "INSERT INTO " + qs + ".idem_schema_version (table_name, version) VALUES ($1, " + version +
                              ") ON CONFLICT (table_name) DO UPDATE SET version = " + version + ", installed_at = now()";
      exec_checked(c, ins, opt.table, "migrate (write version)");
    }
    // The outbox is versioned apart (its script is idempotent): a store turns it on at any time.
    if (opt.outbox) {
      std::string sql = pg_outbox_v1_sql;
      replace_all(sql, "@S@", qs);
      replace_all(sql, "@O@", quote_ident(opt.table + "_outbox"));
      replace_all(sql, "@P@", opt.table + "_outbox");
      exec_simple(c, sql.c_str(), "migrate (outbox)", store_missing);
    }
    exec_simple(c, "COMMIT", "migrate (commit)", store_missing);
  } catch (...) {
    PQclear(PQexec(c, "ROLLBACK"));
    throw;
  }
}

}  // namespace idem::detail
