// The store contract again, as a least-privilege ACL user with a password given in the URL.
#include "contract/contract_suite.hpp"
#include "redis_factory.hpp"

using idem::test::RedisAclFactory;
IDEM_CONTRACT_SUITE(RedisAclFactory, "[redis][acl]")
