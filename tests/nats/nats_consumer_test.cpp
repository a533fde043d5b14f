// NatsConsumer (include/idem/nats/consumer.hpp) on a real nats-server -js: bad options refused;
// every effect once with duplicates published and three consumers sharing a guard; a poison message
// dead-lettered once and Term'd; a handler slower than AckWait kept alive by InProgress; the server
// restarted mid-run with nothing lost or doubled.
#include <catch2/catch.hpp>
#include <csignal>
#include <unistd.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <stdexcept>
#include <map>
#include <mutex>
#include <random>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "idem/nats/consumer.hpp"
#include "nats_server.hpp"

using namespace std::chrono_literals;
using idem::test::nats::Client;
using idem::test::nats::NatsServer;

namespace {

NatsServer& server() {
  static NatsServer s;
  return s;
}

std::string unique(const char* prefix) {
  static std::mt19937_64 rng{std::random_device{}()};
  return prefix + std::to_string(rng() % 1'000'000'000);
}

idem::NatsConsumerOptions options(const std::string& stream, const std::string& subject) {
  idem::NatsConsumerOptions o;
  o.url = server().url();
  o.stream = stream;
  o.durable = "workers";
  o.subject = subject;
  o.batch = 4;
  o.fetch_wait = 100ms;
  o.ack_wait = 2000ms;
  o.timeout = 2000ms;
  return o;
}

// Waits until the durable has nothing undelivered and nothing unacked.
bool drained(Client& c, const std::string& stream, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    try {
      const auto st = c.consumer(stream, "workers");
      if (st.pending == 0 && st.ack_pending == 0) return true;
    } catch (const std::exception&) {  // the server restarting
    }
    std::this_thread::sleep_for(50ms);
  }
  return false;
}

// One guarded run per message, the decision from its outcome (or its exception).
template <class Guard, class Effect>
auto guarded(Guard& guard, Effect effect) {
  return [&guard, effect](const idem::NatsMessage& m) {
    const std::string key = m.header("Idem-Key") != nullptr ? *m.header("Idem-Key") : std::string();
    try {
      return idem::NatsConsumer::decide(guard.run(key, [&] { effect(key); }));
    } catch (...) {
      return idem::NatsConsumer::decide(std::current_exception());
    }
  };
}

}  // namespace

TEST_CASE("NatsConsumer: bad options are refused at construction, naming the field") {
  auto refused = [](idem::NatsConsumerOptions o, const char* field) {
    try {
      idem::NatsConsumer c(std::move(o));
      FAIL("accepted bad " << field);
    } catch (const idem::invalid_options_error& e) {
      CHECK_THAT(e.what(), Catch::Contains(field));
    }
  };
  const auto o = options("S", "s.in");
  auto x = o; x.stream = "a.b"; refused(x, "stream");
  x = o; x.durable = ""; refused(x, "durable");
  x = o; x.subject = ""; refused(x, "subject");
  x = o; x.batch = 0; refused(x, "batch");
  x = o; x.fetch_wait = 0ms; refused(x, "fetch_wait");
  x = o; x.max_deliver = 0; refused(x, "max_deliver");
  x = o; x.in_progress_every = 2000ms; refused(x, "in_progress_every");
  x = o; x.dead_letter = "s.in"; refused(x, "dead_letter");
  // A server that is not there is a retryable connection error, not a hang.
  x = o; x.url = "nats://127.0.0.1:" + std::to_string(idem::test::nats::free_port());
  try {
    idem::NatsConsumer c(x);
    FAIL("connected to nothing");
  } catch (const idem::connection_error& e) {
    CHECK(e.retryable());
  }
  // No such stream, and not asked to create it: JetStream's refusal, not retryable.
  x = o; x.stream = unique("MISSING");
  CHECK_THROWS_AS(idem::NatsConsumer(x), idem::store_error);
}

TEST_CASE("NatsConsumer: every effect once with 20% duplicates published and three consumers sharing a guard") {
  Client client(server().url());
  const std::string stream = unique("EO"), subject = "eo." + stream;
  client.add_stream(stream, subject);
  constexpr int keys = 40;
  for (int i = 0; i < keys; ++i) client.publish(subject, "k" + std::to_string(i), "payload");
  for (int i = 0; i < keys / 5; ++i) client.publish(subject, "k" + std::to_string(i * 5), "payload");  // redeliveries-to-be

  idem::MemoryStore store;
  idem::GuardOptions go;
  go.lease = 1000ms;  // an in_flight answer waits at most this before its redelivery
  idem::IdempotencyGuard guard(store, go);
  std::mutex mu;
  std::map<std::string, int> effects;
  auto effect = [&](const std::string& key) {
    std::this_thread::sleep_for(2ms);
    std::lock_guard lock(mu);
    ++effects[key];
  };
  std::vector<std::unique_ptr<idem::NatsConsumer>> consumers;
  for (int i = 0; i < 3; ++i) consumers.push_back(std::make_unique<idem::NatsConsumer>(options(stream, subject)));
  {
    std::vector<std::jthread> threads;
    for (auto& c : consumers)
      threads.emplace_back([&c, &guard, &effect](std::stop_token st) { c->run(st, guarded(guard, effect)); });
    REQUIRE(drained(client, stream, 20s));
  }
  std::lock_guard lock(mu);
  CHECK(effects.size() == keys);
  for (const auto& [k, n] : effects) CHECK(n == 1);
  std::uint64_t acked = 0;
  for (auto& c : consumers) acked += c->stats().acked;
  CHECK(acked == keys + keys / 5);  // every stream message acked once: duplicates too
}

TEST_CASE("NatsConsumer: a poison message is dead-lettered once, with why and where from, and never redelivered") {
  Client client(server().url());
  const std::string stream = unique("PO"), subject = "po." + stream;
  client.add_stream(stream, subject);
  client.add_stream(stream + "_DLQ", "idem.dlq." + stream);
  client.publish(subject, "poison", "bad");
  client.publish(subject, "fine", "good");

  idem::MemoryStore store;
  idem::GuardOptions go;
  go.lease = 2000ms;
  go.failure = {idem::FailureMode::record, 2, 50ms, 50ms};  // the second failure is permanent
  idem::IdempotencyGuard guard(store, go);
  std::atomic<int> poison_runs{0}, fine_runs{0};
  auto effect = [&](const std::string& key) {
    if (key == "poison") {
      ++poison_runs;
      throw std::runtime_error("cannot parse the order");
    }
    ++fine_runs;
  };
  auto o = options(stream, subject);
  o.ack_wait = 1000ms;
  idem::NatsConsumer consumer(o);
  {
    std::jthread t([&](std::stop_token st) { consumer.run(st, guarded(guard, effect)); });
    REQUIRE(drained(client, stream, 15s));
    std::this_thread::sleep_for(1500ms);  // past AckWait: a message not Term'd would be back by now
  }
  CHECK(poison_runs == 2);
  CHECK(fine_runs == 1);
  CHECK(consumer.stats().dead_lettered == 1);
  CHECK(client.consumer(stream, "workers").ack_pending == 0);
  REQUIRE(client.stream_messages(stream + "_DLQ") == 1);
  natsMsg* letter = client.stream_message(stream + "_DLQ", 1);
  auto header = [&](const char* name) {
    const char* v = nullptr;
    return natsMsgHeader_Get(letter, name, &v) == NATS_OK ? std::string(v) : std::string("<none>");
  };
  CHECK(std::string(natsMsg_GetData(letter), static_cast<std::size_t>(natsMsg_GetDataLength(letter))) == "bad");
  CHECK(header("Idem-Key") == "poison");  // the original headers travel with it
  CHECK_THAT(header("Idem-Reason"), Catch::Contains("cannot parse the order"));
  CHECK(header("Idem-Subject") == subject);
  CHECK(header("Idem-Stream") == stream);
  CHECK(header("Idem-Stream-Sequence") == "1");
  // Two failing runs, then the dead letter; a redelivery that came back inside the failure's
  // 50 ms backoff (a jittered requeue wait can be that short) answered in_flight and was
  // delivered once more without running: at least 3 deliveries, and still 2 runs.
  CHECK(std::stoi(header("Idem-Delivered")) >= 3);
  natsMsg_Destroy(letter);
}

TEST_CASE("idem::consume over NatsConsumer: each key once, its outbox id honoured, a poison message dead-lettered") {
  Client client(server().url());
  const std::string stream = unique("CO"), subject = "co." + stream;
  client.add_stream(stream, subject);
  client.add_stream(stream + "_DLQ", "idem.dlq." + stream);
  // 30 payments, 6 of them published twice (a producer's retry), keyed by their Idem-Key header
  // through ConsumeOptions::key_of; then a poison one.
  for (int i = 0; i < 30; ++i) {
    client.publish(subject, "pay-" + std::to_string(i), std::to_string(i));
    if (i % 5 == 0) client.publish(subject, "pay-" + std::to_string(i), std::to_string(i));
  }
  client.publish(subject, "poison", "x");
  idem::MemoryStore store;
  idem::IdempotencyGuard guard{store, {.lease = 2s, .retention = 1h,
                                       .failure = {idem::FailureMode::record, 2, 10ms, 10ms}}};
  std::map<std::string, int> applied;
  auto o = options(stream, subject);
  o.ack_wait = 1000ms;
  idem::NatsConsumer consumer(o);
  static_assert(idem::Source<idem::NatsConsumer>);
  idem::ConsumeOptions co;
  co.retry = {.base = 10ms, .cap = 50ms};
  co.key_of = [](const idem::Delivery& d) { return std::string(d.header("Idem-Key").value_or("")); };
  {
    std::jthread t([&](std::stop_token st) {
      idem::consume(consumer, guard, st, [&](const idem::Delivery& d) {
        const std::string key(*d.header("Idem-Key"));
        if (key == "poison") throw std::runtime_error("cannot parse the order");
        CHECK(d.attempt >= 1);
        return ++applied[key];
      }, co);
    });
    REQUIRE(drained(client, stream, 15s));
  }
  CHECK(applied.size() == 30);
  for (const auto& [k, n] : applied) CHECK(n == 1);
  CHECK(consumer.stats().dead_lettered == 1);
  CHECK(client.stream_messages(stream + "_DLQ") == 1);
  // The default key: Nats-Msg-Id, and the outbox's header over it.
  idem::NatsMessage m;
  m.headers = {{"Nats-Msg-Id", "n-1"}};
  m.stream_sequence = 7;
  m.delivered = 2;
  const idem::Delivery d = idem::NatsConsumer::delivery(m);
  CHECK(idem::key_of(d) == "n-1");
  CHECK(d.id == "7");
  CHECK(d.attempt == 2);
  m.headers.emplace_back("idem-outbox-id", "outbox-9");
  CHECK(idem::key_of(idem::NatsConsumer::delivery(m)) == "outbox-9");
}

TEST_CASE("NatsConsumer: a batch handled for longer than AckWait is kept alive by InProgress, never redelivered mid-run") {
  Client client(server().url());
  const std::string stream = unique("SL"), subject = "sl." + stream;
  client.add_stream(stream, subject);
  client.publish(subject, "slow-1", "x");
  client.publish(subject, "slow-2", "x");

  idem::MemoryStore store;
  idem::GuardOptions go;
  go.lease = 10'000ms;
  idem::IdempotencyGuard guard(store, go);
  std::atomic<int> runs{0};
  auto effect = [&](const std::string&) {
    ++runs;
    std::this_thread::sleep_for(1300ms);  // each alone beyond AckWait; the second waits behind the first
  };
  auto o = options(stream, subject);
  o.ack_wait = 1000ms;
  o.in_progress_every = 250ms;
  idem::NatsConsumer slow(o), idle(o);  // `idle` would take any redelivery
  {
    std::jthread a([&](std::stop_token st) { slow.run(st, guarded(guard, effect)); });
    std::this_thread::sleep_for(200ms);  // `slow` fetches both first
    std::jthread b([&](std::stop_token st) { idle.run(st, guarded(guard, effect)); });
    REQUIRE(drained(client, stream, 15s));
  }
  CHECK(runs == 2);
  CHECK(slow.stats().fetched == 2);
  CHECK(idle.stats().fetched == 0);
  CHECK(slow.stats().in_progress >= 4);
  CHECK(client.consumer(stream, "workers").redelivered == 0);
}

TEST_CASE("NatsConsumer: the server restarted mid-run: the consumers reconnect and finish, nothing lost or doubled") {
  Client client(server().url());
  const std::string stream = unique("RS"), subject = "rs." + stream;
  client.add_stream(stream, subject);
  constexpr int keys = 30;
  for (int i = 0; i < keys; ++i) client.publish(subject, "k" + std::to_string(i), "payload");

  idem::MemoryStore store;
  idem::GuardOptions go;
  go.lease = 1000ms;
  idem::IdempotencyGuard guard(store, go);
  std::mutex mu;
  std::map<std::string, int> effects;
  auto effect = [&](const std::string& key) {
    std::this_thread::sleep_for(40ms);
    std::lock_guard lock(mu);
    ++effects[key];
  };
  auto count = [&] {
    std::lock_guard lock(mu);
    return effects.size();
  };
  auto o = options(stream, subject);
  o.batch = 2;
  idem::NatsConsumer c1(o), c2(o);
  {
    std::jthread a([&](std::stop_token st) { c1.run(st, guarded(guard, effect)); });
    std::jthread b([&](std::stop_token st) { c2.run(st, guarded(guard, effect)); });
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (count() < 8 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
    REQUIRE(count() >= 8);
    CHECK(count() < keys);  // the restart lands mid-run
    server().stop();
    std::this_thread::sleep_for(300ms);
    server().start();  // same port, same JetStream storage
    REQUIRE(drained(client, stream, 25s));
  }
  std::lock_guard lock(mu);
  CHECK(effects.size() == keys);
  for (const auto& [k, n] : effects) CHECK(n == 1);
  CHECK(client.stream_messages(stream) == keys);
}

TEST_CASE("NatsConsumer: creates its stream when asked, and a message still requeued at its last delivery is dead-lettered") {
  Client client(server().url());
  const std::string stream = unique("MD"), subject = "md." + stream;
  client.add_stream(stream + "_DLQ", "idem.dlq." + stream);
  auto o = options(stream, subject);
  o.create_stream = true;
  o.max_deliver = 2;
  idem::NatsConsumer consumer(o);
  CHECK(client.stream_messages(stream) == 0);  // created, empty
  client.publish(subject, "always-fails", "x");

  idem::MemoryStore store;
  idem::IdempotencyGuard guard(store);  // failure policy release: every delivery runs it again
  std::atomic<int> runs{0};
  auto effect = [&](const std::string&) {
    ++runs;
    throw std::runtime_error("downstream refused");
  };
  {
    std::jthread t([&](std::stop_token st) { consumer.run(st, guarded(guard, effect)); });
    REQUIRE(drained(client, stream, 10s));
  }
  CHECK(runs == 2);
  CHECK(consumer.stats().nacked == 1);
  CHECK(consumer.stats().dead_lettered == 1);
  REQUIRE(client.stream_messages(stream + "_DLQ") == 1);
  natsMsg* letter = client.stream_message(stream + "_DLQ", 1);
  const char* reason = nullptr;
  REQUIRE(natsMsgHeader_Get(letter, "Idem-Reason", &reason) == NATS_OK);
  CHECK_THAT(std::string(reason), Catch::Contains("max_deliver (2) reached") && Catch::Contains("downstream refused"));
  natsMsg_Destroy(letter);
}

// What NatsConsumer::decide answers for every status and two kinds of exception: idem::verdict,
// mapped to NakWithDelay's delay, the dead letter's reason and Term.
TEST_CASE("NatsConsumer::decide: every status and exception through idem::verdict", "[nats]") {
  auto out = [](idem::Status s, idem::millis retry_after = idem::millis{0}, std::string error = {}) {
    idem::Outcome<void> o;
    o.status = s;
    o.retry_after = retry_after;
    o.error = std::move(error);
    return o;
  };
  for (auto s : {idem::Status::executed, idem::Status::duplicate, idem::Status::stale, idem::Status::lease_lost})
    CHECK(idem::NatsConsumer::decide(out(s)).action == idem::BrokerAction::ack);
  const auto busy = idem::NatsConsumer::decide(out(idem::Status::in_flight, 2s));
  CHECK(busy.action == idem::BrokerAction::requeue);
  CHECK(busy.delay >= 2s);
  CHECK(busy.delay <= 3s);
  const auto failed = idem::NatsConsumer::decide(out(idem::Status::previously_failed, 0s, "declined"));
  CHECK(failed.action == idem::BrokerAction::dead_letter);
  CHECK(failed.reason == idem::dead_letter_reason(idem::Status::previously_failed, "declined"));
  CHECK(idem::NatsConsumer::decide(out(idem::Status::mismatch)).reason ==
        idem::dead_letter_reason(idem::Status::mismatch));
  const idem::RetryPolicy retry{.base = 100ms, .cap = 1s};
  const auto handler = idem::NatsConsumer::decide(std::make_exception_ptr(std::runtime_error("boom")), retry);
  CHECK(handler.action == idem::BrokerAction::requeue);
  CHECK(handler.delay <= retry.base);
  CHECK(handler.reason == "boom");
  const auto store = idem::NatsConsumer::decide(std::make_exception_ptr(idem::connection_error("down", "X", true)), retry);
  CHECK(store.action == idem::BrokerAction::requeue);
  CHECK(store.delay <= retry.base);
  CHECK(idem::NatsConsumer::decide(std::make_exception_ptr(idem::invalid_key_error("no key"))).action ==
        idem::BrokerAction::dead_letter);
}

#ifdef IDEM_NATS_TEMPLATE
TEST_CASE("nats_consumer template: a consumer process applies each payment once, keyed on the outbox's id") {
  Client client(server().url());
  const std::string stream = unique("TPL"), subject = "tpl." + stream;
  client.add_stream(stream, subject);
  client.add_stream(stream + "_DLQ", "idem.dlq." + stream);
  for (int i = 0; i < 60; ++i) {
    const std::string body = "acct-" + std::to_string(i % 7) + ";" + std::to_string(i);
    client.publish_with(subject, body, {{"Nats-Msg-Id", "m-" + std::to_string(i)}, {"idem-outbox-id", std::to_string(i)}});
    // The relay's re-send after a crash: a new Nats-Msg-Id (past the server's window), the same outbox id.
    if (i % 6 == 0)
      client.publish_with(subject, body, {{"Nats-Msg-Id", "again-" + std::to_string(i)}, {"idem-outbox-id", std::to_string(i)}});
  }
  client.publish_with(subject, "poison;1", {{"Nats-Msg-Id", "p"}});
  client.publish_with(subject, "acct-1;5", {});  // no key at all
  int out[2];
  REQUIRE(::pipe(out) == 0);
  const std::string url = server().url();
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::dup2(out[1], 1);
    ::execl(IDEM_NATS_TEMPLATE, IDEM_NATS_TEMPLATE, "--url", url.c_str(), "--stream", stream.c_str(), "--subject",
            subject.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(out[1]);
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (std::chrono::steady_clock::now() < deadline && client.stream_messages(stream + "_DLQ") < 2)
    std::this_thread::sleep_for(50ms);
  const bool done = drained(client, stream, 30s);
  ::kill(pid, SIGTERM);
  std::string printed;
  char buf[512];
  for (ssize_t n; (n = ::read(out[0], buf, sizeof buf)) > 0;) printed.append(buf, static_cast<std::size_t>(n));
  ::close(out[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  CHECK(done);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(client.stream_messages(stream + "_DLQ") == 2);  // the poison payment and the one without a key
  CHECK_THAT(printed, Catch::Contains("applied 60 payments to 7 accounts"));
}
#endif
