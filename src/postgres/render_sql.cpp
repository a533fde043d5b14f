// Writes the migration SQL of the default store (schema idem, table idem_records) to argv[1], and
// with the transactional outbox to argv[2]: the files installed under share/idem/ for a DBA who
// applies the schema with psql, Flyway or Liquibase (other names: idem migrate --print-sql).
#include <cstdio>
#include <fstream>

#include "idem/postgres/admin.hpp"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: idem_render_sql <schema.sql> <schema-with-outbox.sql>\n");
    return 2;
  }
  idem::PostgresStoreOptions plain;
  idem::PostgresStoreOptions outbox;
  outbox.outbox = true;
  std::ofstream(argv[1]) << idem::postgres_migration_sql(plain);
  std::ofstream(argv[2]) << idem::postgres_migration_sql(outbox);
  return 0;
}
