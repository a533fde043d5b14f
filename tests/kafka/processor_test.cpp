// GuardedProcessor without a broker: the verdict of each guard answer, and dead letters written once.

#include "idem/kafka/processor.hpp"

#include <catch2/catch.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/test_stores.hpp"
#include "idem/idem.hpp"

using namespace std::chrono_literals;
using idem::BrokerAction;
using idem::Status;
using idem::kafka::Message;
using idem::kafka::Verdict;

namespace {

Message msg(std::int64_t offset, std::string_view value) { return {"t", 0, offset, "k", value}; }

// Keys are the value up to the first ':'; a value starting with "bad" throws; "slow" is held elsewhere.
std::string key_of(const Message& m) { return std::string(m.value.substr(0, m.value.find(':'))); }

std::vector<Verdict> run(idem::kafka::Processor& p, const std::vector<Message>& batch) {
  std::vector<Verdict> v(batch.size());
  p.process(batch, v);
  return v;
}

}  // namespace

TEST_CASE("GuardedProcessor: a verdict per guard answer", "[kafka][processor]") {
  idem::MemoryStore store;
  auto opts = idem::kafka::consumer_guard_options();
  opts.failure.backoff = 0ms;
  opts.failure.max_attempts = 2;
  idem::IdempotencyGuard<idem::MemoryStore> guard(store, opts);
  int runs = 0;
  auto p = idem::kafka::guarded(guard, key_of, [&](const Message& m, const idem::Context&) {
    ++runs;
    if (m.value.starts_with("bad")) throw std::runtime_error("rejected");
  });
  REQUIRE(idem::kafka::consumer_guard_options().failure.mode == idem::FailureMode::record);

  auto v = run(p, {msg(0, "a:1"), msg(1, "a:1"), msg(2, "bad:1"), msg(3, ":no key")});
  CHECK(v[0].action == BrokerAction::ack);
  CHECK(v[0].status == Status::executed);
  CHECK(v[1].status == Status::duplicate);  // repeated in the batch: runs once
  CHECK(v[2].action == BrokerAction::requeue);
  CHECK(v[2].handler_failed);
  CHECK(v[2].reason == "rejected");
  CHECK(v[3].action == BrokerAction::dead_letter);  // empty key: no redelivery can help
  CHECK(v[3].dead_letter_key == "t/0@3");
  CHECK(runs == 2);

  // record mode: the second failure is the last attempt; then previously_failed, to dead-letter.
  v = run(p, {msg(4, "bad:1")});
  CHECK(v[0].handler_failed);
  v = run(p, {msg(5, "bad:1")});
  CHECK(v[0].action == BrokerAction::dead_letter);
  CHECK(v[0].status == Status::previously_failed);
  CHECK(v[0].dead_letter_key == "bad:" + idem::fingerprint("bad:1"));
  // The key reused with another payload: mismatch, its own dead letter.
  v = run(p, {msg(6, "a:2")});
  CHECK(v[0].status == Status::mismatch);
  CHECK(v[0].dead_letter_key == "a:" + idem::fingerprint("a:2"));
  CHECK(runs == 3);
}

TEST_CASE("GuardedProcessor: in_flight while another holder runs the key", "[kafka][processor]") {
  idem::MemoryStore store;
  idem::IdempotencyGuard<idem::MemoryStore> guard(store, idem::kafka::consumer_guard_options());
  auto p = idem::kafka::guarded(guard, key_of, [](const Message&) {});
  std::vector<Verdict> v;
  guard.run("x", [&] { v = run(p, {msg(0, "x:1")}); });
  CHECK(v[0].action == BrokerAction::requeue);
  CHECK(v[0].status == Status::in_flight);
  CHECK(v[0].retry_after > 0ms);
  CHECK_FALSE(v[0].handler_failed);
}

TEST_CASE("GuardedProcessor: a dead letter is written once, and again after a failed write", "[kafka][processor]") {
  idem::MemoryStore store;
  idem::IdempotencyGuard<idem::MemoryStore> guard(store, idem::kafka::consumer_guard_options());
  auto p = idem::kafka::guarded(guard, key_of, [](const Message&) {});
  int writes = 0;
  auto r = p.dead_letter("k1", [&] {
    ++writes;
    throw std::runtime_error("broker refused");
  });
  CHECK_FALSE(r.written);
  CHECK(r.error == "broker refused");
  r = p.dead_letter("k1", [&] { ++writes; });  // released on failure: written now
  CHECK(r.written);
  CHECK_FALSE(r.earlier);
  r = p.dead_letter("k1", [&] { ++writes; });  // a redelivery: found written
  CHECK(r.written);
  CHECK(r.earlier);
  CHECK(writes == 2);
  // Another consumer holds the letter's key right now: tried again after the policy's wait.
  REQUIRE(store.acquire("dlq:k2", {.lease = 10s, .retention = 1h, .token = 9}).status == idem::AcquireStatus::acquired);
  r = p.dead_letter("k2", [&] { ++writes; });
  CHECK_FALSE(r.written);
  CHECK(r.error == "being written by another consumer");
  CHECK(r.retry_after <= idem::kafka::GuardedOptions{}.retry.cap);
  CHECK(writes == 2);
}

TEST_CASE("GuardedProcessor refuses a guard that would retry a poison message for ever", "[kafka][processor]") {
  idem::MemoryStore store;
  idem::IdempotencyGuard<idem::MemoryStore> guard(store);  // the guard's default: FailureMode::release
  auto handler = [](const Message&) {};
  CHECK_THROWS_AS(idem::kafka::guarded(guard, key_of, handler), idem::invalid_options_error);
  auto p = idem::kafka::guarded(guard, key_of, handler, {.allow_release = true});
  CHECK(run(p, {msg(0, "a:1")})[0].status == Status::executed);
}

// The verdicts come from idem::verdict under GuardedOptions::retry: a store error requeues after a
// jittered wait within its backoff (never the handler's failure), and the policy is checked.
TEST_CASE("GuardedProcessor: a store error requeues after a jittered wait from GuardedOptions::retry",
          "[kafka][processor]") {
  idem::MemoryStore inner;
  idem::test::FaultyStore store{inner};
  idem::IdempotencyGuard<idem::test::FaultyStore> guard(store, idem::kafka::consumer_guard_options());
  const idem::RetryPolicy retry{.base = 200ms, .cap = 5s};
  auto p = idem::kafka::guarded(guard, key_of, [](const Message&) {}, {.retry = retry});
  store.fail_acquire = true;
  for (int i = 0; i < 20; ++i) {
    const auto v = run(p, {msg(i, "s:1")});
    CHECK(v[0].action == BrokerAction::requeue);
    CHECK_FALSE(v[0].handler_failed);
    CHECK(v[0].retry_after >= 0ms);
    CHECK(v[0].retry_after <= retry.base);
  }
  store.fail_acquire = false;
  CHECK(run(p, {msg(20, "s:1")})[0].status == Status::executed);
  CHECK_THROWS_AS(idem::kafka::guarded(guard, key_of, [](const Message&) {}, {.retry = {.base = 2s, .cap = 1s}}),
                  idem::invalid_options_error);
}

TEST_CASE("Message::header: the last value of a name, binary-safe", "[kafka][processor]") {
  const std::string binary("x\0y", 3);
  const std::vector<idem::kafka::Header> headers{{"a", "1"}, {"b", binary}, {"a", "2"}, {"empty", ""}};
  Message m = msg(0, "v");
  CHECK_FALSE(m.header("a"));  // no headers
  m.headers = headers;
  CHECK(m.header("a") == "2");
  CHECK(m.header("b") == binary);
  CHECK(m.header("b")->size() == 3);
  CHECK(m.header("empty") == "");
  CHECK_FALSE(m.header("A"));  // names are exact
  CHECK_FALSE(m.timestamp);
}

TEST_CASE("GuardedProcessor: keyed on idem-outbox-id by default, a key function of the user's wins",
          "[kafka][processor]") {
  idem::MemoryStore store;
  idem::IdempotencyGuard<idem::MemoryStore> guard(store, idem::kafka::consumer_guard_options());
  std::vector<std::string> ran;
  auto record = [&](const Message& m) { ran.emplace_back(m.key); };
  const std::vector<idem::kafka::Header> x{{"trace", "1"}, {"idem-outbox-id", "X"}};
  const std::vector<idem::kafka::Header> x_again{{"idem-outbox-id", "old"}, {"idem-outbox-id", "X"}};
  const std::vector<idem::kafka::Header> none{{"trace", "3"}};
  // Another Kafka key, partition and offset, the same outbox id (the relay published it twice).
  Message a{"t", 0, 10, "k1", "order-1", x}, b{"t", 1, 20, "k2", "order-1", x_again}, c{"t", 0, 11, "k3", "v", none};

  auto dflt = idem::kafka::guarded(guard, record);
  auto v = run(dflt, {a, b, c});
  CHECK(v[0].status == Status::executed);
  CHECK(v[1].status == Status::duplicate);
  CHECK(v[2].action == BrokerAction::dead_letter);  // no idem-outbox-id: no key, never a guessed one
  CHECK(v[2].dead_letter_key == "t/0@11");
  CHECK(ran == std::vector<std::string>{"k1"});
  CHECK(store.inspect("X"));  // the key is the header's value

  // A key function of the user's is the whole key: the header is not read.
  auto own = idem::kafka::guarded(
      guard, [](const Message& m) { return "own:" + std::string(m.key); }, record);
  v = run(own, {a, b});
  CHECK(v[0].status == Status::executed);
  CHECK(v[1].status == Status::executed);
  CHECK(ran == std::vector<std::string>{"k1", "k1", "k2"});

  // outbox_id_or: the header when there is one, else the fallback.
  auto either = idem::kafka::guarded(
      guard, idem::kafka::outbox_id_or([](const Message& m) { return "id:" + std::string(m.value); }), record,
      {.fingerprint = false});
  v = run(either, {b, c});
  CHECK(v[0].status == Status::duplicate);
  CHECK(v[1].status == Status::executed);
  CHECK(store.inspect("id:v"));
  CHECK(ran == std::vector<std::string>{"k1", "k1", "k2", "k3"});
}
