// The store contract on AsyncRedisStore's blocking members: every case's calls, and the races'
// many threads, share the store's one multiplexed connection.
#include "asio_factory.hpp"
#include "contract/contract_suite.hpp"

using idem::test::AsyncRedisFactory;
IDEM_CONTRACT_SUITE(AsyncRedisFactory, "[asio]")
