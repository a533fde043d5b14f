// idem::kafka::Consumer on librdkafka's mock cluster (3 brokers in-process, the real protocol):
// rebalances while a consumer holds polled, unrun messages (eager and cooperative), a dead-letter
// write the broker refuses once, a poison message, a slow handler beside a key held elsewhere.
// Every case checks that every effect happened exactly once and that the group's committed
// offsets reached the end of every partition. Catch2 is not thread-safe: consumer threads only
// record, the test thread checks.

#include "idem/kafka/consumer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "idem/kafka/processor.hpp"
#include "kafka/mock_cluster.hpp"
#include "support/sanitized.hpp"

using namespace std::chrono_literals;
using idem_test::Events;
using idem_test::Ledger;
using idem_test::MockCluster;
using idem_test::Payment;
using Clock = std::chrono::steady_clock;
using Guard = idem::IdempotencyGuard<idem::MemoryStore>;

namespace {

// The group's rebalances (heartbeats, joins) get twice the time in a sanitized build.
constexpr int slow = idem_test::sanitized ? 2 : 1;

bool eventually(const std::function<bool()>& ready, std::chrono::milliseconds limit) {
  const auto until = Clock::now() + limit;
  while (!ready()) {
    if (Clock::now() > until) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

// One consumer of the group on a thread of its own, with what its rebalance callback saw.
struct Member {
  std::unique_ptr<idem::kafka::Consumer> consumer;
  std::thread thread;
  std::atomic<long> partitions{0};
  std::atomic<long> revokes{0};
  std::atomic<Clock::rep> changed{0};
  std::atomic<bool> failed{false};
  std::string error;  // written by the thread before failed is set
  std::string name;
  std::mutex log_mu;
  std::string log;  // the consumer's warnings, shown when a check fails

  void start(idem::kafka::ConsumerOptions o, idem::kafka::Processor& processor, std::string who = "consumer") {
    name = std::move(who);
    o.log = [this](std::string_view line) {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch()).count();
      std::lock_guard lock(log_mu);
      log += fmt::format("[{} {}] {}\n", name, ms % 100'000, line);
    };
    o.on_rebalance = [this](bool assigned, std::size_t n) {
      partitions.fetch_add(assigned ? static_cast<long>(n) : -static_cast<long>(n));
      if (!assigned) revokes.fetch_add(1);
      changed.store(Clock::now().time_since_epoch().count());
    };
    consumer = std::make_unique<idem::kafka::Consumer>(std::move(o), processor);
    thread = std::thread([this] {
      try {
        consumer->run();
      } catch (const std::exception& e) {
        error = e.what();
        failed.store(true);
      }
    });
  }
  void stop() {
    if (!thread.joinable()) return;
    consumer->stop();
    thread.join();
  }
  ~Member() { stop(); }
  std::string report() {
    std::lock_guard lock(log_mu);
    return error + "\n" + log;
  }
  // No assignment change for a second: a rebalance reaches every member within a few heartbeats.
  bool quiet() const { return Clock::now() - Clock::time_point(Clock::duration(changed.load())) >= 1s; }
};

idem::kafka::ConsumerOptions options(const MockCluster& cluster, const Events& ev, const std::string& group) {
  idem::kafka::ConsumerOptions o;
  o.brokers = cluster.bootstraps();
  o.group = group;
  o.topics = {ev.topic};
  o.batch = 16;
  o.poll_timeout = 50ms;
  o.commit_interval = 200ms;
  o.min_retry = 20ms;
  o.max_retry = 300ms;
  // The mock waits session.timeout.ms - 1 s for the members to rejoin a rebalance: keep it short.
  o.properties = {
      {"session.timeout.ms", "3000"}, {"heartbeat.interval.ms", "250"}, {"topic.metadata.refresh.interval.ms", "1000"}};
  return o;
}

idem::GuardOptions guard_options() {
  auto o = idem::kafka::consumer_guard_options();
  o.failure.backoff = 20ms;  // the poison's three attempts take a moment, not seconds
  return o;
}

// The idempotency key is the producer's event id, not the coordinates (a re-published duplicate
// has other ones); an unreadable payload gets no key and is dead-lettered.
std::string key_of(const idem::kafka::Message& m) {
  const auto p = idem_test::parse(m.value);
  return p ? p->id : std::string();
}

bool committed_at_end(MockCluster& cluster, const Events& ev, const std::string& group) {
  return cluster.committed(group, ev.topic, ev.partitions) == cluster.end_offsets(ev.topic, ev.partitions);
}

}  // namespace

TEST_CASE("poison message: dead-lettered exactly once though the broker refuses the first write", "[kafka][consumer]") {
  MockCluster cluster;
  Events ev;
  ev.publish(cluster, 300, 20, /*with_poison=*/true);
  // Only the dead-letter producer sends Produce (ApiKey 0) from here on.
  rd_kafka_mock_push_request_errors(cluster.mock(), 0, 1, RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE);

  idem::MemoryStore store;
  Guard guard(store, guard_options());
  Ledger ledger;
  auto processor = idem::kafka::guarded(
      guard, key_of, [&](const idem::kafka::Message& m) { ledger.apply(*idem_test::parse(m.value)); });
  Member a;
  a.start(options(cluster, ev, "poison"), processor);
  const bool done = eventually(
      [&] { return a.failed.load() || (ledger.total() == ev.effects() && committed_at_end(cluster, ev, "poison")); },
      30s);
  a.stop();
  const auto st = a.consumer->stats();
  INFO(a.report());
  CHECK_FALSE(a.failed.load());
  CHECK(done);
  CHECK(ev.check(ledger).empty());
  CHECK(cluster.messages(ev.topic + ".dlq", 0) == 1);
  CHECK(st.dead_lettered == 1);
  CHECK(st.dead_letters_earlier >= 1);  // the poison's second copy found its letter written
  CHECK(st.dead_letter_failures >= 1);  // the refused write, retried
  CHECK(st.handler_errors >= 3);        // record mode: max_attempts runs, then previously_failed
  CHECK(committed_at_end(cluster, ev, "poison"));
}

namespace {

// A second consumer joins while the first holds polled, unrun messages (its handler blocks until
// the group has revoked its partitions), then leaves; the first takes everything over again.
void rebalance_mid_batch(const std::string& group, const std::string& strategy) {
  MockCluster cluster;
  Events ev;
  ev.publish(cluster, 600, 20, /*with_poison=*/false);

  idem::MemoryStore store;
  Guard guard(store, guard_options());
  Ledger ledger;
  Member a, b;
  // 1: consumer-a's handlers block until the group revokes partitions of it; 2: one blocks;
  // 3: released. All of them block, so every partition has polled, unrun messages queued
  // whichever ones the (cooperative) rebalance takes away.
  std::atomic<int> hold{0};
  std::atomic<long> revokes_before{0};
  auto handler = [&](const idem::kafka::Message& m) {
    if (hold.load() == 1 || hold.load() == 2) {
      int asked = 1;
      hold.compare_exchange_strong(asked, 2);
      eventually([&] { return a.revokes.load() > revokes_before.load(); }, 15s);
      hold.store(3);
    }
    std::this_thread::sleep_for(1ms);
    ledger.apply(*idem_test::parse(m.value));
  };
  auto pa = idem::kafka::guarded(guard, key_of, handler);
  auto pb = idem::kafka::guarded(guard, key_of,
                                 [&](const idem::kafka::Message& m) { ledger.apply(*idem_test::parse(m.value)); });
  auto o = options(cluster, ev, group);
  o.properties["partition.assignment.strategy"] = strategy;
  a.start(o, pa, "a");
  REQUIRE(eventually([&] { return ledger.total() >= ev.effects() / 4 || a.failed.load(); }, 20s));
  revokes_before.store(a.revokes.load());
  hold.store(1);
  REQUIRE(eventually([&] { return hold.load() >= 2; }, 10s));
  b.start(o, pb, "b");
  const bool applied = eventually(
      [&] {
        return a.failed.load() || b.failed.load() ||
               (ledger.total() == ev.effects() && committed_at_end(cluster, ev, group));
      },
      40s * slow);
  // One membership change at a time, each on a settled group: librdkafka 2.0.2 can hang or abort
  // when a consumer closes while its group rebalances.
  const bool both =
      eventually([&] { return a.partitions.load() > 0 && b.partitions.load() > 0 && a.quiet() && b.quiet(); }, 20s * slow);
  b.stop();
  const bool took_over = eventually([&] { return a.partitions.load() == ev.partitions && a.quiet(); }, 20s * slow);
  a.stop();
  const auto sa = a.consumer->stats(), sb = b.consumer->stats();
  INFO(a.report() << b.report());
  CHECK_FALSE(a.failed.load());
  CHECK_FALSE(b.failed.load());
  CHECK(applied);
  CHECK(both);
  CHECK(took_over);
  CHECK(hold.load() == 3);
  CHECK(sa.dropped_revoked > 0);  // the polled, unrun messages of the revoked partitions
  CHECK(sa.executed + sb.executed == static_cast<std::uint64_t>(ev.effects()));
  CHECK(ev.check(ledger).empty());
  CHECK(committed_at_end(cluster, ev, group));
}

}  // namespace

TEST_CASE("rebalance mid-batch, eager protocol: a second consumer joins and leaves", "[kafka][consumer]") {
  rebalance_mid_batch("eager", "range");
}

TEST_CASE("rebalance mid-batch, cooperative-sticky: a second consumer joins and leaves", "[kafka][consumer]") {
  rebalance_mid_batch("cooperative", "cooperative-sticky");
}

TEST_CASE("a handler slower than max.poll.interval.ms / batch and a key held elsewhere pause only their partition",
          "[kafka][consumer]") {
  MockCluster cluster;
  Events ev;
  ev.partitions = 4;
  cluster.create_topic(ev.topic, ev.partitions);
  // 20 messages per partition. Partition 0: slow ones, 250 ms each, above max.poll.interval.ms
  // (3 s) / batch (16): a batch takes 4 s. Partition 1: its first message's key is held by another
  // consumer until 3 s after the assignment. Partitions 2 and 3: fast.
  constexpr int per_partition = 20;
  for (int p = 0; p < ev.partitions; ++p)
    for (int i = 0; i < per_partition; ++i) {
      Payment pay{fmt::format("p{}-{}", p, i), fmt::format("acct-{}", i % 5), 1 + i};
      ev.expected[pay.account] += pay.amount;
      ev.pays.push_back(pay);
      cluster.produce(ev.topic, p, pay.account, idem_test::encode(pay));
    }
  cluster.flush();

  idem::MemoryStore store;
  Guard guard(store, guard_options());
  Ledger ledger;
  std::mutex mu;
  std::map<std::int32_t, Clock::time_point> finished;  // when each partition's last message was applied
  auto processor = idem::kafka::guarded(guard, key_of, [&](const idem::kafka::Message& m) {
    if (m.partition == 0) std::this_thread::sleep_for(250ms);
    ledger.apply(*idem_test::parse(m.value));
    std::lock_guard lock(mu);
    finished[m.partition] = Clock::now();
  });
  // The other holder: runs "p1-0" itself until 3 s after the consumer got its partitions; the
  // consumer gets in_flight meanwhile.
  Member a;
  std::atomic<bool> holding{false};
  std::thread other([&] {
    guard.run("p1-0", [&] {
      holding.store(true);
      eventually([&] { return a.partitions.load() > 0; }, 15s);
      std::this_thread::sleep_for(3s);
      ledger.apply(ev.pays[per_partition]);
    });
  });
  REQUIRE(eventually([&] { return holding.load(); }, 5s));

  auto o = options(cluster, ev, "slow");
  o.properties["max.poll.interval.ms"] = "3000";  // librdkafka's floor is session.timeout.ms
  o.batch = 16;
  a.start(o, processor);
  REQUIRE(eventually([&] { return a.partitions.load() > 0 || a.failed.load(); }, 15s));
  const auto t0 = Clock::now();
  const bool done = eventually(
      [&] { return a.failed.load() || (ledger.total() == ev.effects() && committed_at_end(cluster, ev, "slow")); },
      30s);
  const long revokes = a.revokes.load();  // before the close's own revoke
  a.stop();
  other.join();
  const auto st = a.consumer->stats();
  INFO(a.report());
  CHECK_FALSE(a.failed.load());
  CHECK(done);
  CHECK(ev.check(ledger).empty());
  CHECK(revokes == 0);  // never evicted from the group for a late poll
  CHECK(st.dropped_revoked == 0);
  CHECK(st.requeued >= 1);    // p1-0 was in_flight: partition 1 paused and sought back
  CHECK(st.duplicates >= 1);  // ...until the other holder completed it
  std::lock_guard lock(mu);
  REQUIRE(finished.size() == 4);
  // Partitions 2 and 3 neither waited for the held key nor for the slow partition.
  CHECK(finished[2] - t0 < 2500ms);
  CHECK(finished[3] - t0 < 2500ms);
  CHECK(finished[1] - t0 > 2500ms);
  CHECK(committed_at_end(cluster, ev, "slow"));
}

TEST_CASE("Consumer refuses options that would commit unsettled offsets", "[kafka][consumer]") {
  struct Nothing : idem::kafka::Processor {
    void process(std::span<const idem::kafka::Message>, std::span<idem::kafka::Verdict>) override {}
    idem::kafka::DeadLetterResult dead_letter(const std::string&, const std::function<void()>&) override { return {}; }
  } nothing;
  idem::kafka::ConsumerOptions o;
  o.brokers = "127.0.0.1:1";
  o.group = "g";
  o.topics = {"t"};
  o.properties = {{"enable.auto.offset.store", "true"}};
  CHECK_THROWS_AS(idem::kafka::Consumer(o, nothing), idem::invalid_options_error);
  o.properties = {};
  o.topics = {};
  CHECK_THROWS_AS(idem::kafka::Consumer(o, nothing), idem::invalid_options_error);
}

// Headers and timestamp reach the handler; the default key is the outbox relay's idem-outbox-id
// header, so the same id re-published under another Kafka key and partition runs once; a message
// without it is dead-lettered, its letter carrying its headers and then idem's reason and origin.
TEST_CASE(
    "headers and timestamp reach the handler, keyed on idem-outbox-id by default, a dead letter keeps the headers",
    "[kafka][consumer]") {
  MockCluster cluster;
  const std::string topic = "orders";
  cluster.create_topic(topic, 2);
  cluster.create_topic(topic + ".dlq", 1);
  const std::string binary("a\0b", 3);
  const std::int64_t t0 = 1'700'000'000'123, t1 = 1'700'000'001'456;
  cluster.produce(topic, 0, "k1", "order-1",
                  {{"idem-outbox-id", "X"}, {"trace", "t1"}, {"bin", binary}, {"trace", "t1-last"}}, t0);
  cluster.produce(topic, 1, "k2", "order-1", {{"trace", "t2"}, {"idem-outbox-id", "X"}}, t1);
  cluster.produce(topic, 0, "k3", "no-id", {{"trace", "t3"}, {"x-dup", "1"}, {"x-dup", "2"}});
  cluster.flush();

  struct Seen {
    std::int32_t partition = 0;
    std::vector<std::pair<std::string, std::string>> headers;
    std::optional<std::string> trace, bin;
    std::optional<idem::kafka::Timestamp> timestamp;
  };
  std::mutex mu;
  std::vector<Seen> seen;
  idem::MemoryStore store;
  Guard guard(store, guard_options());
  auto processor = idem::kafka::guarded(guard, [&](const idem::kafka::Message& m) {
    auto copy = [](std::optional<std::string_view> v) { return v ? std::optional<std::string>(*v) : std::nullopt; };
    Seen s{m.partition, {}, copy(m.header("trace")), copy(m.header("bin")), m.timestamp};
    for (const auto& h : m.headers) s.headers.emplace_back(h.name, h.value);
    std::lock_guard lock(mu);
    seen.push_back(std::move(s));
  });
  idem::kafka::ConsumerOptions o;
  o.brokers = cluster.bootstraps();
  o.group = "headers";
  o.topics = {topic};
  o.poll_timeout = 50ms;
  o.commit_interval = 100ms;
  o.properties = {{"session.timeout.ms", "3000"}, {"heartbeat.interval.ms", "250"}};
  Member a;
  a.start(o, processor);
  const bool done = eventually(
      [&] {
        const auto st = a.consumer->stats();
        return a.failed.load() || (st.executed + st.duplicates == 2 && st.dead_lettered == 1 &&
                                   cluster.committed("headers", topic, 2) == cluster.end_offsets(topic, 2));
      },
      15s);
  a.stop();
  const auto st = a.consumer->stats();
  INFO(a.report());
  CHECK_FALSE(a.failed.load());
  CHECK(done);
  CHECK(st.executed == 1);
  CHECK(st.duplicates == 1);  // the same idem-outbox-id on the other partition, under another Kafka key
  CHECK(st.dead_lettered == 1);

  std::lock_guard lock(mu);
  REQUIRE(seen.size() == 1);
  const Seen& s = seen[0];
  if (s.partition == 0) {
    CHECK(s.headers == std::vector<std::pair<std::string, std::string>>{
                           {"idem-outbox-id", "X"}, {"trace", "t1"}, {"bin", binary}, {"trace", "t1-last"}});
    CHECK(s.trace == "t1-last");  // the last of its name
    CHECK(s.bin == binary);       // binary-safe
  } else {
    CHECK(s.headers == std::vector<std::pair<std::string, std::string>>{{"trace", "t2"}, {"idem-outbox-id", "X"}});
  }
  REQUIRE(s.timestamp);
  CHECK(s.timestamp->type == idem::kafka::TimestampType::create_time);
  CHECK(std::chrono::duration_cast<std::chrono::milliseconds>(s.timestamp->time.time_since_epoch()).count() ==
        (s.partition == 0 ? t0 : t1));

  const auto letters = cluster.read(topic + ".dlq", 0, 1);
  REQUIRE(letters.size() == 1);
  const auto& l = letters[0];
  CHECK(l.key == "k3");
  CHECK(l.value == "no-id");
  REQUIRE(l.headers.size() == 7);
  CHECK(std::vector(l.headers.begin(), l.headers.begin() + 3) ==
        std::vector<std::pair<std::string, std::string>>{{"trace", "t3"}, {"x-dup", "1"}, {"x-dup", "2"}});
  CHECK(l.headers[3].first == "idem-reason");
  CHECK(l.headers[3].second.find("key is empty") != std::string::npos);  // no idem-outbox-id: no usable key
  CHECK(l.header("idem-topic") == topic);
  CHECK(l.header("idem-partition") == "0");
  CHECK(l.header("idem-offset") == "1");
}
