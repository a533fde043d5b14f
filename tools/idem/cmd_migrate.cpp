// idem migrate: a PostgresStore table's schema as SQL for a DBA (--print-sql), applied as the
// library's migrate() does (--apply), or its installed version (--status). All three go through
// idem::postgres, so the tool has no SQL of its own.

#include <iostream>

#include <fmt/format.h>

#include "common.hpp"
#include "idem/core/error.hpp"
#include "idem/postgres/admin.hpp"

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
      "exit 1 when an upgrade is pending.");
  sub->add_flag("--print-sql", o->print_sql, "write the SQL to stdout (needs no server)");
  sub->add_flag("--apply", o->apply, "create or upgrade the table now (needs DDL rights)");
  sub->add_flag("--status", o->status, "the table's schema version and whether an upgrade is pending");
  sub->add_flag("--outbox", o->outbox, "also the transactional outbox table <table>_outbox (PostgresStoreOptions::outbox)");
  sub->add_flag("--json", o->json, "--apply, --status: one JSON object");
  sub->callback([&g, o] {
    idem::tool::guarded(g, [&] {
      if (o->print_sql + o->apply + o->status != 1)
        throw idem::usage_error("idem: migrate: give one of --print-sql, --apply, --status");
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
        throw idem::usage_error("idem: migrate: only PostgreSQL stores have a schema (postgresql://...); Redis needs none");
      idem::PostgresOptions po;
      po.conninfo = url;
      constexpr int expected = idem::PostgresStore::schema_version;
      if (o->apply) {
        const int before = idem::postgres_schema_version(po, s);
        idem::PostgresStore store(po, s);
        store.migrate();
        if (o->json) {
          idem::tool::Json j = idem::tool::Json::object();
          j["migrated"] = true;
          j["table"] = table;
          j["from_version"] = before;
          j["version"] = expected;
          idem::tool::print_json(j);
        } else if (before == expected) {
          std::cout << table << " already at schema version " << expected << (o->outbox ? " (outbox checked)" : "")
                    << "\n";
        } else {
          std::cout << "migrated " << table << " from schema version " << before << " to " << expected << "\n";
        }
        return idem::tool::exit_ok;
      }
      const int have = idem::postgres_schema_version(po, s);
      const bool pending = have < expected;
      if (o->json) {
        idem::tool::Json j = idem::tool::Json::object();
        j["table"] = table;
        j["version"] = have;
        j["expected"] = expected;
        j["pending"] = pending;
        idem::tool::print_json(j);
      } else if (have == 0) {
        std::cout << table << ": not installed; this idem's schema version is " << expected
                  << " (idem migrate --apply, or --print-sql for a DBA)\n";
      } else if (pending) {
        std::cout << table << ": schema version " << have << ", this idem's is " << expected
                  << ": upgrade pending (idem migrate --apply, or --print-sql for a DBA)\n";
      } else if (have > expected) {
        std::cout << table << ": schema version " << have << ", newer than this idem's " << expected
                  << ": stores of this version refuse it; upgrade idem\n";
      } else {
        std::cout << table << ": schema version " << have << " (current)\n";
      }
      return have == expected ? idem::tool::exit_ok : idem::tool::exit_refused;
    });
  });
}
