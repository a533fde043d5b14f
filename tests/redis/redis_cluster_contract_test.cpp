// The store contract on a Redis Cluster (3 masters + 3 replicas). Every case shares the cluster of
// the CTest fixture (redis_cluster_fixture.cpp) instead of forming one of its own: the keys are
// per case (RedisFactoryBase), so the cases cannot see each other's records. Below the suite, Redis
// Streams on the same cluster: the consumer and the outbox's publisher.
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>

#include "contract/contract_suite.hpp"
#include "idem/redis.hpp"
#include "idem/redis/hash_slot.hpp"
#include "idem/redis/streams_consumer.hpp"
#include "redis_factory.hpp"
#ifdef IDEM_TEST_OUTBOX
#include "idem/outbox/redis_streams_publisher.hpp"
#endif

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

// --- Redis Streams on the cluster: StreamsConsumer and (with idem::outbox) RedisStreamsPublisher ---

namespace {

// One command on the cluster the simple way a test can: to the first seed, then wherever MOVED
// points (the streams under test never migrate, so ASK does not arise).
std::unique_ptr<redisReply, void (*)(void*)> cluster_command(const std::vector<std::string>& args) {
  const std::string url = fixture_options().url;
  std::string at = url.substr(url.find("://") + 3);
  at = at.substr(0, at.find(','));
  for (int hop = 0; hop < 3; ++hop) {
    const auto colon = at.rfind(':');
    std::unique_ptr<redisContext, void (*)(redisContext*)> c{
        redisConnect(at.substr(0, colon).c_str(), std::stoi(at.substr(colon + 1))), redisFree};
    if (!c || c->err) throw std::runtime_error("test: cannot connect to the cluster node " + at);
    auto r = idem::test::command_argv(c.get(), args);
    if (!r) throw std::runtime_error("test: cluster command failed");
    const std::string text = r->str ? std::string(r->str, r->len) : std::string();
    if (r->type != REDIS_REPLY_ERROR || text.rfind("MOVED ", 0) != 0) return r;
    at = text.substr(text.rfind(' ') + 1);
  }
  throw std::runtime_error("test: MOVED more than twice");
}

std::string stream_of_slot_far_from(const std::string& prefix, std::uint16_t taken) {
  for (int i = 0;; ++i) {
    std::string s = prefix + std::to_string(i);
    if (idem::redis_hash_slot(s) / 5462 != taken / 5462) return s;  // another third of the slots
  }
}

}  // namespace

TEST_CASE("StreamsConsumer on a Redis Cluster: streams on different masters, letters in the stream's slot, a restart resumes",
          "[redis][cluster][streams]") {
  const std::string base = "cs-" + idem::test::random_hex() + "-";
  const std::string s1 = base + "a";
  const std::string s2 = stream_of_slot_far_from(base, idem::redis_hash_slot(s1));
  for (const std::string& s : {s1, s2}) {
    INFO("stream " << s << ", slot " << idem::redis_hash_slot(s));
    for (const char* id : {"e1", "e2", "e3"})
      REQUIRE(cluster_command({"XADD", s, "*", "id", std::string(id) + s, "payload", id})->type == REDIS_REPLY_STRING);
    idem::StreamsConsumerOptions o{.redis = fixture_options(), .stream = s, .group = "g", .consumer = "a",
                                   .block = std::chrono::milliseconds(100), .claim_idle = std::chrono::milliseconds(300)};
    idem::StreamsConsumer a(o);
    CHECK(a.options().dead_letter == "{" + s + "}:dlq");
    const auto got = a.poll();
    REQUIRE(got.size() == 3);
    a.settle(got, std::vector<idem::StreamDecision>{{idem::BrokerAction::ack, ""},
                                                    {idem::BrokerAction::dead_letter, "poison"},
                                                    {idem::BrokerAction::requeue, ""}});
    CHECK(cluster_command({"XPENDING", s, "g"})->element[0]->integer == 1);
    CHECK(cluster_command({"XLEN", "{" + s + "}:dlq"})->integer == 1);
    idem::StreamsConsumer again(o);  // a restart under the same name resumes the requeued entry
    const auto resumed = again.poll();
    REQUIRE(resumed.size() == 1);
    CHECK(*resumed[0].field("payload") == "e3");
    again.settle(resumed, std::vector<idem::StreamDecision>{{idem::BrokerAction::ack, ""}});
    CHECK(cluster_command({"XPENDING", s, "g"})->element[0]->integer == 0);
  }
  // A dead-letter stream of another slot cannot share the ack's script: refused, naming it.
  idem::StreamsConsumerOptions bad{.redis = fixture_options(), .stream = s1, .group = "g", .consumer = "a",
                                   .dead_letter = stream_of_slot_far_from(base + "dlq", idem::redis_hash_slot(s1))};
  CHECK_THROWS_WITH(idem::StreamsConsumer(bad), Catch::Contains("dead_letter") && Catch::Contains("hash tag"));
}

#ifdef IDEM_TEST_OUTBOX
TEST_CASE("RedisStreamsPublisher on a Redis Cluster: every message XADDed on its stream's master, in order",
          "[redis][cluster][streams][outbox]") {
  const std::string prefix = "cp-" + idem::test::random_hex() + "-";
  idem::RedisStreamsPublisher pub({.redis = fixture_options(), .stream_prefix = prefix});
  CHECK(pub.name() == "redis-streams");
  std::vector<idem::OutboxMessage> batch;
  for (int i = 0; i < 60; ++i) {
    idem::OutboxMessage m;
    m.id = std::to_string(i);
    m.destination = "d" + std::to_string(i % 6);  // six streams, spread over the masters
    m.message_key = "k";
    m.payload = "p" + std::to_string(i);
    m.headers = {{"trace", "t" + std::to_string(i)}};
    batch.push_back(std::move(m));
  }
  pub.publish(batch);
  for (int d = 0; d < 6; ++d) {
    const auto r = cluster_command({"XRANGE", prefix + "d" + std::to_string(d), "-", "+"});
    REQUIRE(r->elements == 10);
    for (std::size_t k = 0; k < r->elements; ++k) {
      const redisReply* f = r->element[k]->element[1];
      CHECK(std::string(f->element[1]->str) == std::to_string(d + 6 * static_cast<int>(k)));  // id, in order
      CHECK(std::string(f->element[7]->str) == "t" + std::to_string(d + 6 * static_cast<int>(k)));  // h:trace
    }
  }
}
#endif
