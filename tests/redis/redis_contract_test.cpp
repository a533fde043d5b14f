// The store contract on a real redis-server, connected as the default user over TCP.
#include "contract/contract_suite.hpp"
#include "redis_factory.hpp"

using idem::test::RedisFactory;
IDEM_CONTRACT_SUITE(RedisFactory, "[redis]")
