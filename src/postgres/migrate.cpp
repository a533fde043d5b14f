// PostgresStore's schema: created or upgraded under a per-schema advisory lock, versioned in
// <schema>.idem_schema_version. The SQL is rendered here only, for migrate() and for
// postgres_migration_sql() (`idem migrate --print-sql`), so what a DBA reviews is what a store runs.

#include <charconv>
#include <iterator>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "idem/core/error.hpp"
#include "idem/postgres/admin.hpp"
#include "store_impl.hpp"

namespace idem::detail {

namespace {

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  for (std::size_t pos = 0; (pos = s.find(from, pos)) != std::string::npos; pos += to.size())
    s.replace(pos, from.size(), to);
}

std::string version_table_sql(const std::string& qs) {
  return "CREATE SCHEMA IF NOT EXISTS " + qs + "; CREATE TABLE IF NOT EXISTS " + qs +
         ".idem_schema_version (table_name text PRIMARY KEY, version integer NOT NULL, "
         "installed_at timestamptz NOT NULL DEFAULT now())";
}

// `table_literal`: $1, or the quoted name for a script without parameters.
std::string version_row_sql(const std::string& qs, const std::string& table_literal) {
  const std::string version = std::to_string(PostgresStore::schema_version);
  return "INSERT INTO " + qs + ".idem_schema_version (table_name, version) VALUES (" + table_literal + ", " + version +
         ") ON CONFLICT (table_name) DO UPDATE SET version = " + version + ", installed_at = now()";
}

std::string schema_step_sql(int step, const PostgresStoreOptions& opt) {
  // Each version's script in turn: a new table gets 1 then 2, a version-1 table only 2.
  const char* const scripts[] = {pg_schema_v1_sql, pg_schema_v2_sql};
  static_assert(std::size(scripts) == PostgresStore::schema_version);
  std::string sql = scripts[step - 1];
  replace_all(sql, "@S@", quote_ident(opt.schema));
  replace_all(sql, "@T@", quote_ident(opt.table));
  replace_all(sql, "@P@", opt.table);
  return sql;
}

std::string outbox_sql(const PostgresStoreOptions& opt) {
  std::string sql = pg_outbox_v1_sql;
  replace_all(sql, "@S@", quote_ident(opt.schema));
  replace_all(sql, "@O@", quote_ident(opt.table + "_outbox"));
  replace_all(sql, "@P@", opt.table + "_outbox");
  return sql;
}

void check_names(const PostgresStoreOptions& o) {
  if (!valid_identifier(o.schema, 63) || o.schema.rfind("pg_", 0) == 0)
    throw invalid_options_error(fmt::format(
        "idem: PostgresStoreOptions::schema '{}' is not a plain identifier; use [a-z_][a-z0-9_]* (max 63, not pg_*)",
        o.schema.substr(0, 80)));
  if (!valid_identifier(o.table, 40))
    throw invalid_options_error(fmt::format(
        "idem: PostgresStoreOptions::table '{}' is not a plain identifier; use [a-z_][a-z0-9_]* (max 40)",
        o.table.substr(0, 80)));
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

void StoreImpl::ensure_ready() {
  if (!opt.auto_migrate) return;
  {
    std::lock_guard lk(migrate_mu_);
    if (migrated_) return;
  }
  Session s(client.pool());
  ensure_migrated(s.pg());
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
    exec_simple(c, version_table_sql(qs).c_str(), "migrate (version table)", store_missing);
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
    for (int step = have + 1; step <= PostgresStore::schema_version; ++step)
      exec_simple(c, schema_step_sql(step, opt).c_str(), fmt::format("migrate (schema v{})", step), store_missing);
    if (have < PostgresStore::schema_version)
      exec_checked(c, version_row_sql(qs, "$1"), opt.table, "migrate (write version)");
    // The outbox is versioned apart (its script is idempotent): a store turns it on at any time.
    if (opt.outbox) exec_simple(c, outbox_sql(opt).c_str(), "migrate (outbox)", store_missing);
    exec_simple(c, "COMMIT", "migrate (commit)", store_missing);
  } catch (...) {
    PQclear(PQexec(c, "ROLLBACK"));
    throw;
  }
}

}  // namespace idem::detail

namespace idem {

std::string postgres_migration_sql(const PostgresStoreOptions& store) {
  detail::check_names(store);
  const std::string qs = detail::quote_ident(store.schema);
  // Names are plain identifiers (checked above), so they go between quotes as they are.
  std::string out = fmt::format(
      "-- idem PostgresStore schema version {} for {}.{}: what PostgresStore::migrate() runs on a new table.\n"
      "-- Every statement is idempotent (IF NOT EXISTS, OR REPLACE): safe on a table already at this version.\n"
      "BEGIN;\nSELECT pg_advisory_xact_lock(hashtext('{}'));\n{};\n",
      PostgresStore::schema_version, qs, detail::quote_ident(store.table), detail::schema_lock_key(store.schema),
      detail::version_table_sql(qs));
  for (int step = 1; step <= PostgresStore::schema_version; ++step) out += detail::schema_step_sql(step, store) + "\n";
  out += detail::version_row_sql(qs, "'" + store.table + "'") + ";\n";
  if (store.outbox) out += detail::outbox_sql(store) + "\n";
  return out + "COMMIT;\n";
}

int postgres_schema_version(const PostgresOptions& options, const PostgresStoreOptions& store) {
  detail::check_names(store);
  detail::check_conninfo(options.conninfo);
  std::unique_ptr<PGconn, decltype(&PQfinish)> c(PQconnectdb(options.conninfo.c_str()), &PQfinish);
  if (PQstatus(c.get()) != CONNECTION_OK) throw detail::connect_failure(PQerrorMessage(c.get()));
  const std::string qs = detail::quote_ident(store.schema);
  const auto one = [&](const std::string& sql, const std::string& param) {
    PostgresResult r = detail::exec_checked(c.get(), sql, param, "schema version");
    return r.rows() == 1 ? std::string(r.get(0, 0)) : std::string();
  };
  // to_regclass: a missing schema or table is "not installed" (0), not an error.
  if (one("SELECT to_regclass($1) IS NOT NULL", qs + ".idem_schema_version") != "t") return 0;
  int have = 0;
  const std::string v = one("SELECT version FROM " + qs + ".idem_schema_version WHERE table_name = $1", store.table);
  std::from_chars(v.data(), v.data() + v.size(), have);
  return have;
}

}  // namespace idem
