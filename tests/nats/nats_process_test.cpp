// A NatsConsumer process (nats_worker.cpp) SIGKILLed with its batch fetched, partly run and
// unacked, sharing a RedisStore with the test's own consumer: after AckWait JetStream redelivers the
// batch to the survivor, which answers what had completed as duplicates and runs the rest once.
#include <catch2/catch.hpp>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <stop_token>
#include <string>
#include <thread>

#include "idem/idem.hpp"
#include "idem/nats/consumer.hpp"
#include "idem/redis.hpp"
#include "nats_server.hpp"
#include "redis_server.hpp"

using namespace std::chrono_literals;

TEST_CASE("NatsConsumer: a consumer process SIGKILLed with unacked messages: redelivered, each effect once") {
  idem::test::nats::NatsServer nats;
  idem::test::RedisServer redis;
  idem::test::nats::Client client(nats.url());
  const std::string stream = "KILL", subject = "kill.in";
  client.add_stream(stream, subject);
  for (const char* key : {"k0", "k1", "k2", "hang", "k4", "k5"}) client.publish(subject, key, "payload");
  const std::string effects = (std::filesystem::temp_directory_path() / ("idem-nats-effects-" + std::to_string(::getpid()))).string();
  std::filesystem::remove(effects);

  int out[2];
  REQUIRE(::pipe(out) == 0);
  const pid_t worker = idem::test::nats::spawn(
      {IDEM_NATS_WORKER, nats.url(), stream, subject, std::to_string(redis.port()), effects}, out[1]);
  ::close(out[1]);
  std::string line;
  for (char ch; ::read(out[0], &ch, 1) == 1 && ch != '\n';) line += ch;
  ::close(out[0]);
  REQUIRE(line == "hanging");  // k0..k2 ran and completed; `hang` holds its lease; nothing is acked
  ::kill(worker, SIGKILL);
  CHECK(idem::test::nats::reap(worker) == 128 + SIGKILL);
  CHECK(client.consumer(stream, "workers").ack_pending == 6);

  idem::RedisStore store(redis.options());
  idem::GuardOptions go;
  go.lease = 1500ms;
  idem::IdempotencyGuard guard(store, go);
  std::mutex mu;
  std::map<std::string, std::vector<idem::Status>> outcomes;
  idem::NatsConsumerOptions o;
  o.url = nats.url();
  o.stream = stream;
  o.durable = "workers";
  o.subject = subject;
  o.fetch_wait = 100ms;
  o.ack_wait = 1000ms;
  idem::NatsConsumer survivor(o);
  {
    std::jthread t([&](std::stop_token st) {
      survivor.run(st, [&](const idem::NatsMessage& m) {
        const std::string key = *m.header("Idem-Key");
        auto r = guard.run(key, [&] { std::ofstream(effects, std::ios::app) << key << "\n"; });
        std::lock_guard lock(mu);
        outcomes[key].push_back(r.status);
        return idem::NatsConsumer::decide(r);
      });
    });
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    for (;;) {
      const auto st = client.consumer(stream, "workers");
      if ((st.pending == 0 && st.ack_pending == 0) || std::chrono::steady_clock::now() > deadline) break;
      std::this_thread::sleep_for(50ms);
    }
  }
  CHECK(client.consumer(stream, "workers").ack_pending == 0);
  std::map<std::string, int> ran;
  std::ifstream in(effects);
  for (std::string k; std::getline(in, k);) ++ran[k];
  std::filesystem::remove(effects);
  CHECK(ran.size() == 6);
  for (const auto& [k, n] : ran) CHECK(n == 1);
  std::lock_guard lock(mu);
  for (const char* k : {"k0", "k1", "k2"}) {
    REQUIRE(!outcomes[k].empty());
    for (const auto s : outcomes[k]) CHECK(s == idem::Status::duplicate);
  }
  // k4 and k5 run once; a copy JetStream redelivered because AckWait (1 s) lapsed before a slow
  // (sanitized) batch acked it answers duplicate, which is the guarantee, not a failure of it.
  for (const char* k : {"k4", "k5"}) {
    REQUIRE(!outcomes[k].empty());
    CHECK(outcomes[k].front() == idem::Status::executed);
    for (std::size_t i = 1; i < outcomes[k].size(); ++i) CHECK(outcomes[k][i] == idem::Status::duplicate);
  }
  REQUIRE(!outcomes["hang"].empty());  // in_flight until the dead worker's lease lapsed, then taken over
  CHECK(outcomes["hang"].back() == idem::Status::executed);
}
