// The store contract on a Redis Cluster (3 masters + 3 replicas). Every case shares the cluster of
// the CTest fixture (redis_cluster_fixture.cpp) instead of forming one of its own: the keys are
// per case (RedisFactoryBase), so the cases cannot see each other's records.
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>

#include "contract/contract_suite.hpp"
#include "idem/redis.hpp"
#include "redis_factory.hpp"

namespace {

idem::RedisOptions fixture_options() {
  const char* state = std::getenv("IDEM_REDIS_CLUSTER_STATE");
  std::ifstream in(std::string(state ? state : "") + "/url");
  std::string url((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!state || url.empty())
    throw std::runtime_error("the Redis cluster fixture did not start (IDEM_REDIS_CLUSTER_STATE has no url): run "
                             "the case through ctest, which starts it first");
  idem::RedisOptions o;
  o.url = url;
  o.connect_timeout = idem::millis{2000};
  o.command_timeout = idem::millis{5000};
  o.pool.size = 16;
  return o;
}

}  // namespace

struct RedisClusterFactory : idem::test::RedisFactoryBase {
  using store_type = idem::RedisStore;
  idem::RedisStore s{fixture_options()};
  store_type& store() { return s; }
};
IDEM_CONTRACT_SUITE(RedisClusterFactory, "[redis][cluster]")
