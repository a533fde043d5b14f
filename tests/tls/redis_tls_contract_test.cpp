// The store contract over TLS: rediss://, server certificate checked against the test CA and the
// host name, as a least-privilege ACL user.
#include "contract/contract_suite.hpp"
#include "tls_factory.hpp"

using idem::tlstest::RedisTlsFactory;
IDEM_CONTRACT_SUITE(RedisTlsFactory, "[redis][tls]")
