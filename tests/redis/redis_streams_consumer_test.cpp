// StreamsConsumer (include/idem/redis/streams_consumer.hpp) on a real redis-server: the decisions
// of a read, dead letters written once, requeued entries taken over after claim_idle, bad options
// refused; and the Redis Streams template (examples/redis_streams_consumer.cpp) as real consumer
// processes, one SIGKILLed mid-run: every payment applied exactly once, the poison one dead-lettered.
#include <catch2/catch.hpp>

#include <chrono>
#include <exception>
#include <stdexcept>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <csignal>

#include "idem/redis/streams_consumer.hpp"
#include "redis_factory.hpp"

using namespace std::chrono_literals;
using idem::test::RedisServer;

namespace {

RedisServer& server() {
  static RedisServer s;
  return s;
}

// A connection of the test's own (the default user, as the consumers).
struct Conn {
  std::unique_ptr<redisContext, void (*)(redisContext*)> c{redisConnect("127.0.0.1", server().port()), redisFree};
  std::unique_ptr<redisReply, void (*)(void*)> run(const std::vector<std::string>& args) {
    auto r = idem::test::command_argv(c.get(), args);
    if (!r) throw std::runtime_error("test: redis command failed");
    return r;
  }
  long long integer(const std::vector<std::string>& args) {
    auto r = run(args);
    return r->type == REDIS_REPLY_STRING ? std::atoll(r->str) : r->integer;  // GET of a number
  }
  std::vector<std::string> list(const std::vector<std::string>& args) {
    auto r = run(args);
    std::vector<std::string> out;
    for (std::size_t i = 0; i < r->elements; ++i) out.emplace_back(r->element[i]->str, r->element[i]->len);
    return out;
  }
};

idem::StreamsConsumerOptions options(const std::string& stream, const std::string& consumer) {
  return {.redis = server().options(), .stream = stream, .group = "g", .consumer = consumer, .block = 100ms,
          .claim_idle = 300ms};
}

}  // namespace

TEST_CASE("StreamsConsumer: bad options are refused at construction, naming the field") {
  auto o = options("s-" + idem::test::random_hex(), "c");
  auto refused = [](idem::StreamsConsumerOptions x, const char* field) {
    try {
      idem::StreamsConsumer c(std::move(x));
      FAIL("accepted");
    } catch (const idem::invalid_options_error& e) {
      CHECK_THAT(e.what(), Catch::Contains(field));
    }
  };
  auto x = o;
  x.stream.clear();
  refused(x, "stream");
  x = o;
  x.consumer.clear();
  refused(x, "consumer");
  x = o;
  x.count = 0;
  refused(x, "count");
  x = o;
  x.block = x.redis.command_timeout;
  refused(x, "block");
  x = o;
  x.dead_letter = x.stream;
  refused(x, "dead_letter");
}

TEST_CASE("StreamsConsumer: ack, dead letter once, a requeued entry resumed by a restart and taken over after claim_idle") {
  const std::string s = "s-" + idem::test::random_hex();
  Conn conn;
  idem::StreamsConsumer a(options(s, "a"));
  for (const char* id : {"e1", "e2", "e3"}) conn.run({"XADD", s, "*", "event_id", id});
  const auto got = a.poll();
  REQUIRE(got.size() == 3);
  CHECK(*got[1].field("event_id") == "e2");
  CHECK(got[1].field("nope") == nullptr);
  const std::vector<idem::StreamDecision> d{{idem::BrokerAction::ack, ""},
                                            {idem::BrokerAction::dead_letter, "poison"},
                                            {idem::BrokerAction::requeue, ""}};
  a.settle(got, d);
  CHECK(conn.run({"XPENDING", s, "g"})->element[0]->integer == 1);  // only the requeued one
  const auto dlq = conn.run({"XRANGE", s + ":dlq", "-", "+"});
  REQUIRE(dlq->elements == 1);
  const auto* fields = dlq->element[0]->element[1];
  CHECK(std::string(fields->element[1]->str) == got[1].id);  // source_id
  CHECK(std::string(fields->element[3]->str) == "poison");   // error
  CHECK(a.stats().acked == 1);
  CHECK(a.stats().dead_lettered == 1);
  CHECK(a.stats().left_pending == 1);

  // A restart under the same name resumes the entry at once (its own pending entries first).
  idem::StreamsConsumer a2(options(s, "a"));
  const auto resumed = a2.poll();
  REQUIRE(resumed.size() == 1);
  CHECK(*resumed[0].field("event_id") == "e3");
  CHECK(a2.stats().resumed == 1);
  CHECK(a2.poll().empty());  // its pending entries read once; nothing new, nothing idle yet

  // Another consumer takes the requeued entry over once it has been idle for claim_idle.
  idem::StreamsConsumer b(options(s, "b"));
  CHECK(b.poll().empty());  // not idle long enough yet: nothing new either
  std::this_thread::sleep_for(400ms);
  const auto again = b.poll();
  REQUIRE(again.size() == 1);
  CHECK(*again[0].field("event_id") == "e3");
  CHECK(b.stats().claimed == 1);
  b.settle(again, std::vector<idem::StreamDecision>{{idem::BrokerAction::ack, ""}});
  CHECK(conn.run({"XPENDING", s, "g"})->element[0]->integer == 0);
  CHECK_THROWS_AS(b.settle(again, {}), idem::usage_error);
}

#ifdef IDEM_STREAMS_TEMPLATE
TEST_CASE("redis_streams_consumer template: a consumer SIGKILLed mid-run, every payment applied once") {
  const std::string s = "pay-" + idem::test::random_hex();
  const std::string url = "redis://127.0.0.1:" + std::to_string(server().port());
  Conn conn;
  constexpr int events = 600;
  std::mt19937_64 rng(7);
  std::map<std::string, long long> expected;
  std::vector<std::vector<std::string>> adds;
  for (int i = 0; i < events; ++i) {
    const std::string acct = "acct-" + std::to_string(rng() % 10);
    const long long amount = static_cast<long long>(rng() % 1000) - 300;
    expected[acct] += amount;
    adds.push_back({"XADD", s, "*", "event_id", "ev-" + std::to_string(i), "account", acct, "amount", std::to_string(amount)});
    if (rng() % 5 == 0) adds.push_back(adds.back());  // published twice
  }
  std::shuffle(adds.begin(), adds.end(), rng);
  adds.push_back({"XADD", s, "*", "event_id", "poison-1", "account", "poison", "amount", "1"});
  auto consumer = [&](const std::string& name) {
    return idem::test::spawn({IDEM_STREAMS_TEMPLATE, "--redis", url, "--stream", s, "--group", "g", "--consumer", name,
                              "--lease-ms", "1000", "--count", "16", "--handler-ms", "2"});
  };
  std::vector<pid_t> pids{consumer("c1"), consumer("c2"), consumer("c3")};
  for (const auto& a : adds) conn.run(a);
  // c1 dies mid-run with entries read and not acked; c4 starts in its place.
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (conn.integer({"LLEN", s + ":effects"}) < events / 3 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(10ms);
  ::kill(pids[0], SIGKILL);
  ::waitpid(pids[0], nullptr, 0);
  auto pending_of = [&](const char* name) {
    return conn.run({"XPENDING", s, "g", "-", "+", "1000", name})->elements;
  };
  const std::size_t left_by_c1 = pending_of("c1");  // read, maybe run, never acked
  pids[0] = consumer("c4");
  auto pending = [&] { return conn.run({"XPENDING", s, "g"})->element[0]->integer; };
  while ((conn.integer({"LLEN", s + ":effects"}) < events || pending() > 0 || conn.integer({"XLEN", s + ":dlq"}) < 1) &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(50ms);
  for (pid_t p : pids) ::kill(p, SIGTERM);
  for (pid_t p : pids) ::waitpid(p, nullptr, 0);

  const auto effects = conn.list({"LRANGE", s + ":effects", "0", "-1"});
  const std::set<std::string> unique(effects.begin(), effects.end());
  CHECK(effects.size() == static_cast<std::size_t>(events));  // no double effect
  CHECK(unique.size() == static_cast<std::size_t>(events));   // nothing lost
  for (const auto& [acct, sum] : expected) CHECK(conn.integer({"GET", s + ":balance:" + acct}) == sum);
  CHECK(pending() == 0);
  INFO("entries c1 left pending when it was killed: " << left_by_c1);
  CHECK(pending_of("c1") == 0);  // taken over by the others after one lease
  CHECK(conn.integer({"XLEN", s + ":dlq"}) == 1);  // the poison payment, once
}
#endif

// What StreamsConsumer::decide answers for every status and two kinds of exception: idem::verdict's
// action and reason (a requeue leaves the entry pending: no delay).
TEST_CASE("StreamsConsumer::decide: every status and exception through idem::verdict", "[redis][streams]") {
  auto out = [](idem::Status s, std::string error = {}) {
    idem::Outcome<void> o;
    o.status = s;
    o.error = std::move(error);
    return o;
  };
  for (auto s : {idem::Status::executed, idem::Status::duplicate, idem::Status::stale, idem::Status::lease_lost})
    CHECK(idem::StreamsConsumer::decide(out(s)).action == idem::BrokerAction::ack);
  CHECK(idem::StreamsConsumer::decide(out(idem::Status::in_flight)).action == idem::BrokerAction::requeue);
  const auto failed = idem::StreamsConsumer::decide(out(idem::Status::previously_failed, "declined"));
  CHECK(failed.action == idem::BrokerAction::dead_letter);
  CHECK(failed.reason == idem::dead_letter_reason(idem::Status::previously_failed, "declined"));
  CHECK(idem::StreamsConsumer::decide(out(idem::Status::mismatch)).action == idem::BrokerAction::dead_letter);
  CHECK(idem::StreamsConsumer::decide(std::make_exception_ptr(std::runtime_error("boom"))).action ==
        idem::BrokerAction::requeue);
  CHECK(idem::StreamsConsumer::decide(std::make_exception_ptr(idem::timeout_error("slow", "X", true))).action ==
        idem::BrokerAction::requeue);
  const auto bad = idem::StreamsConsumer::decide(std::make_exception_ptr(idem::invalid_key_error("no key")));
  CHECK(bad.action == idem::BrokerAction::dead_letter);
  CHECK(bad.reason == "no key");
}
