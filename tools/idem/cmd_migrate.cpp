// idem migrate: a PostgresStore table's (or a SqliteStore file's) schema as SQL for a DBA
// (--print-sql), applied as the library's migrate() does (--apply), or its installed version
// (--status). All three go through idem::postgres / idem::sqlite, so the tool has no SQL of its own.

#include <iostream>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "common.hpp"
#include "idem/core/error.hpp"
#include "idem/postgres/admin.hpp"
#ifdef IDEM_TOOL_SQLITE
#include "idem/sqlite/admin.hpp"
#endif

namespace {

// The URL of this run when one is given (--print-sql needs none).
std::string given_url(const idem::tool::Globals& g) {
  try {
    return idem::tool::store_url(g);
  } catch (const idem::invalid_options_error&) {
    return {};
  }
}

// --apply's report: the table moved from `before` to `expected` (or already there).
int report_applied(const std::string& table, int before, int expected, bool json, std::string_view checked = {}) {
  if (json) {
    idem::tool::Json j = idem::tool::Json::object();
    j["migrated"] = true;
    j["table"] = table;
    j["from_version"] = before;
    j["version"] = expected;
    idem::tool::print_json(j);
  } else if (before == expected) {
    std::cout << table << " already at schema version " << expected << checked << "\n";
  } else {
    std::cout << "migrated " << table << " from schema version " << before << " to " << expected << "\n";
  }
  return idem::tool::exit_ok;
}

// --status: the installed version against this idem's; refused (exit 1) unless they agree. `how`:
// what installs or upgrades it.
int report_status(const std::string& table, int have, int expected, bool json, std::string_view how) {
  if (json) {
    idem::tool::Json j = idem::tool::Json::object();
    j["table"] = table;
    j["version"] = have;
    j["expected"] = expected;
    j["pending"] = have < expected;
    idem::tool::print_json(j);
  } else if (have == 0) {
    std::cout << table << ": not installed; this idem's schema version is " << expected << " (" << how << ")\n";
  } else if (have < expected) {
    std::cout << table << ": schema version " << have << ", this idem's is " << expected << ": upgrade pending ("
              << how << ")\n";
  } else if (have > expected) {
    std::cout << table << ": schema version " << have << ", newer than this idem's " << expected
              << ": stores of this version refuse it; upgrade idem\n";
  } else {
    std::cout << table << ": schema version " << have << " (current)\n";
  }
  return have == expected ? idem::tool::exit_ok : idem::tool::exit_refused;
}

#ifdef IDEM_TOOL_SQLITE
// The same three actions on a SqliteStore's file: the SQL for the sqlite3 shell, migrate() on a
// store of the file (created if missing), or the version in idem_schema.
int migrate_sqlite(const std::string& url, const idem::tool::Globals& g, bool print_sql, bool apply, bool json) {
  const std::string path = idem::tool::sqlite_path(url);
  constexpr int expected = idem::SqliteStore::schema_version;
  const std::string table = fmt::format("{} (table {})", path, g.table);
  if (print_sql) {
    std::cout << idem::sqlite_migration_sql(g.table);
    return idem::tool::exit_ok;
  }
  if (apply) {
    int before = 0;
    try {
      before = idem::SqliteAdmin({.path = path, .table = g.table}).schema_version();
    } catch (const idem::store_error& e) {
      if (e.code() != "SQLITE_CANTOPEN") throw;  // a missing file is created by the store below
    }
    idem::SqliteStore store({.path = path, .table = g.table, .auto_migrate = false});
    store.migrate();
    return report_applied(table, before, expected, json);
  }
  const int have = idem::SqliteAdmin({.path = path, .table = g.table}).schema_version();
  return report_status(table, have, expected, json, "idem migrate --apply");
}
#endif

}  // namespace

void register_migrate(CLI::App& app, idem::tool::Globals& g) {
  struct Opts {
    bool print_sql = false, apply = false, status = false, outbox = false, json = false;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* sub = idem::tool::subcommand(
      app, g, "migrate",
      "PostgreSQL: the schema of --schema/--table. --print-sql writes what PostgresStore::migrate() runs on a new "
      "table (one transaction, idempotent) for a DBA to review and apply with psql, so stores can run without DDL "
      "rights (auto_migrate = false); --apply runs migrate() itself; --status shows the installed schema version, "
      "exit 1 when an upgrade is pending. SQLite (sqlite:///path): the same for --table in that file (--print-sql "
      "for the sqlite3 shell; --apply creates the file if missing).");
  sub->add_flag("--print-sql", o->print_sql, "write the SQL to stdout (needs no server)");
  sub->add_flag("--apply", o->apply, "create or upgrade the table now (needs DDL rights)");
  sub->add_flag("--status", o->status, "the table's schema version and whether an upgrade is pending");
  sub->add_flag("--outbox", o->outbox, "also the transactional outbox table <table>_outbox (PostgresStoreOptions::outbox)");
  sub->add_flag("--json", o->json, "--apply, --status: one JSON object");
  sub->callback([&g, o] {
    idem::tool::guarded(g, [&] {
      if (o->print_sql + o->apply + o->status != 1)
        throw idem::usage_error("idem: migrate: give one of --print-sql, --apply, --status");
      if (const std::string u = given_url(g); idem::tool::is_sqlite_url(u)) {
#ifdef IDEM_TOOL_SQLITE
        if (o->outbox) throw idem::usage_error("idem: migrate: --outbox is PostgreSQL's; SqliteStore has no outbox table");
        return migrate_sqlite(u, g, o->print_sql, o->apply, o->json);
#else
        throw idem::invalid_options_error("idem: this idem tool was built without SQLite: sqlite:// URLs cannot be opened");
#endif
      }
      idem::PostgresStoreOptions s;
      s.schema = g.schema;
      s.table = g.table;
      s.outbox = o->outbox;
      s.auto_migrate = false;
      const std::string table = fmt::format("\"{}\".\"{}\"", g.schema, g.table);
      if (o->print_sql) {
        std::cout << idem::postgres_migration_sql(s);
        return idem::tool::exit_ok;
      }
      const std::string url = idem::tool::store_url(g);
      if (!idem::tool::is_postgres_url(url))
        throw idem::usage_error("idem: migrate: only PostgreSQL (postgresql://...) and SQLite (sqlite:///path) stores "
                                "have a schema; Redis needs none");
      idem::PostgresOptions po;
      po.conninfo = url;
      constexpr int expected = idem::PostgresStore::schema_version;
      if (o->apply) {
        const int before = idem::postgres_schema_version(po, s);
        idem::PostgresStore store(po, s);
        store.migrate();
        return report_applied(table, before, expected, o->json, o->outbox ? " (outbox checked)" : "");
      }
      const int have = idem::postgres_schema_version(po, s);
      return report_status(table, have, expected, o->json, "idem migrate --apply, or --print-sql for a DBA");
    });
  });
}
