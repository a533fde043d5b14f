// The store contract on AsyncRedisStore over a Redis Cluster (3 masters + 3 replicas, the CTest
// fixture's: redis_cluster_fixture.cpp): every case's calls routed by slot over one multiplexed
// connection per master, the races' threads all on those connections at once.
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>

#include "asio_factory.hpp"
#include "contract/contract_suite.hpp"

namespace {

idem::RedisOptions fixture_options() {
  std::ifstream in(std::string(IDEM_REDIS_CLUSTER_STATE_DIR) + "/url");
  std::string url((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (url.empty())
    throw std::runtime_error("the Redis cluster fixture did not start (" IDEM_REDIS_CLUSTER_STATE_DIR
                             " has no url): run the case through ctest, which starts it first");
  idem::RedisOptions o;
  o.url = url;
  o.connect_timeout = idem::millis{2000};
  o.command_timeout = idem::millis{5000};
  return o;
}

struct AsyncClusterFactory : idem::test::RedisFactoryBase {
  using store_type = idem::AsyncRedisStore;
  idem::test::IoThread io;
  idem::AsyncRedisStore s{io.io.get_executor(), fixture_options()};
  store_type& store() { return s; }
};

}  // namespace

IDEM_CONTRACT_SUITE(AsyncClusterFactory, "[asio][cluster]")
