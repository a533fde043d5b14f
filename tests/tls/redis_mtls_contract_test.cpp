// The store contract over mutual TLS (tls-auth-clients yes): the client presents its certificate.
#include "contract/contract_suite.hpp"
#include "tls_factory.hpp"

using idem::tlstest::RedisMtlsFactory;
IDEM_CONTRACT_SUITE(RedisMtlsFactory, "[redis][tls][mtls]")
