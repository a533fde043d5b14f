// The store contract of PostgresStore over TLS: the fixture's server takes TLS connections only,
// and the conninfo says sslmode=verify-full (the CA and the host name checked by libpq).
#include "contract/contract_suite.hpp"
#include "postgres/pg_support.hpp"

IDEM_CONTRACT_SUITE(pgtest::PgFactory, "[postgres][tls]")
