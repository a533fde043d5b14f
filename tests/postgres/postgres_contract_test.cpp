// The store contract of docs/design.md, run against PostgresStore in lease mode on a real server.
#include "contract/contract_suite.hpp"
#include "pg_support.hpp"

IDEM_CONTRACT_SUITE(pgtest::PgFactory, "[postgres]")
