// The store contract of DESIGN.md §1, run against PostgresStore in lease mode on a real server.
#include "contract/contract_suite.hpp"
#include "pg_support.hpp"

IDEM_CONTRACT_SUITE(pgtest::PgFactory, "[postgres]")
