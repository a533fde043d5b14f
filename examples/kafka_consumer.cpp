// kafka_consumer: a starting template for a Kafka consumer with exactly-once effects. The consumer
// loop is idem::kafka::Consumer (include/idem/kafka/consumer.hpp): it commits only settled
// offsets, retries a message by pausing and seeking back its own partition, writes dead letters
// once, and handles eager and cooperative rebalances. What is left here is configuration and the
// handler: put your logic in Ledger::apply(). docs/consuming.md explains the loop's choices.
//
//   idem_kafka_consumer --brokers HOST:PORT [--topic payments] [--group payments-svc] [--dlq T]
//                       [--cooperative] [--workers N]
//
// SIGINT / SIGTERM stop it: it commits what is settled, leaves the group and prints a summary.
// CTest runs it against librdkafka's mock cluster through tests/kafka/example_driver.cpp.
//
// The guard runs on idem::MemoryStore: per process, so it only dedupes what this process sees.
// With more than one consumer process, construct it on idem::RedisStore or idem::PostgresStore
// (the `Store` alias below); nothing else changes.

#include <csignal>
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "idem/idem.hpp"
#include "idem/kafka/consumer.hpp"

namespace {

using Store = idem::MemoryStore;

// A payment event, "id;account;amount". The idempotency key is the producer's event id, not the
// message's coordinates: a message re-published by a retrying producer has other ones.
struct Payment {
  std::string id, account;
  long amount = 0;
};

std::optional<Payment> parse(std::string_view s) {
  const auto a = s.find(';');
  const auto b = a == std::string_view::npos ? a : s.find(';', a + 1);
  if (b == std::string_view::npos || a == 0) return std::nullopt;
  try {
    return Payment{std::string(s.substr(0, a)), std::string(s.substr(a + 1, b - a - 1)),
                   std::stol(std::string(s.substr(b + 1)))};
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// Stands in for your database. apply() is the effect that must happen once per payment.
class Ledger {
 public:
  // ---- YOUR LOGIC GOES HERE. It runs at most once per payment id (docs/guarantees.md has the
  // crash window between the effect and the completion; ctx.fence can fence downstream writes).
  // Throwing retries the payment; after the guard's max_attempts it goes to the dead-letter topic.
  void apply(const Payment& p, const idem::Context& /*ctx*/) {
    if (p.amount == 0) throw std::runtime_error("payment " + p.id + " rejected: amount is zero");
    std::lock_guard lock(mu_);
    balances_[p.account] += p.amount;
    ++applied_;
    sum_ += p.amount;
  }
  void print() const {
    std::lock_guard lock(mu_);
    std::printf("applied %ld payments, amount %ld, %zu accounts\n", applied_, sum_, balances_.size());
  }

 private:
  mutable std::mutex mu_;
  std::map<std::string, long> balances_;
  long applied_ = 0, sum_ = 0;
};

idem::kafka::Consumer* g_consumer = nullptr;
extern "C" void on_signal(int) { g_consumer->stop(); }

std::string arg(int argc, char** argv, const char* name, const std::string& dflt) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == name) return argv[i + 1];
  return dflt;
}
bool flag(int argc, char** argv, const char* name) {
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == name) return true;
  return false;
}

}  // namespace

int main(int argc, char** argv) try {
  idem::kafka::ConsumerOptions o;
  o.brokers = arg(argc, argv, "--brokers", "");
  o.group = arg(argc, argv, "--group", "payments-svc");
  o.topics = {arg(argc, argv, "--topic", "payments")};
  o.dead_letter_topic = arg(argc, argv, "--dlq", "");  // empty: <topic>.dlq
  o.workers = static_cast<std::size_t>(std::stoul(arg(argc, argv, "--workers", "4")));
  if (o.brokers.empty()) {
    std::fprintf(stderr,
                 "usage: idem_kafka_consumer --brokers HOST:PORT [--topic T] [--group G] [--dlq T] "
                 "[--cooperative] [--workers N]\n");
    return 2;
  }
  // TUNE: session.timeout.ms / heartbeat.interval.ms decide how fast a dead consumer's partitions
  // move; cooperative-sticky moves only the partitions that change owner. max.poll.interval.ms
  // needs no headroom for slow handlers: the poll thread never runs them.
  if (flag(argc, argv, "--cooperative")) o.properties["partition.assignment.strategy"] = "cooperative-sticky";
  o.log = [](std::string_view line) { std::fprintf(stderr, "%.*s\n", static_cast<int>(line.size()), line.data()); };

  // TUNE: lease above the handler's worst case (or heartbeat = true); retention above the longest
  // redelivery horizon (consumer lag, replays from the DLQ). consumer_guard_options() records
  // failures (3 attempts, then the dead-letter topic): FailureMode::release would retry a poison
  // message for ever and hold its partition's commits back (docs/consuming.md).
  idem::GuardOptions g = idem::kafka::consumer_guard_options();
  g.failure.backoff = idem::millis{200};  // doubling: a poison message is dead-lettered within a second
  Store store;
  idem::IdempotencyGuard<Store> guard(store, g);
  Ledger ledger;
  // The key is the payload's event id. On a topic the outbox relay feeds, drop this function:
  // guarded(guard, handler) keys on the header idem-outbox-id (outbox_id_or(f): that header, else f).
  auto processor = idem::kafka::guarded(
      guard,
      // An unreadable payload gets an empty key, which the guard refuses: it goes to the dead-letter topic.
      [](const idem::kafka::Message& m) {
        const auto p = parse(m.value);
        return p ? p->id : std::string();
      },
      [&](const idem::kafka::Message& m, const idem::Context& ctx) { ledger.apply(*parse(m.value), ctx); });

  idem::kafka::Consumer consumer(o, processor);
  g_consumer = &consumer;
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  consumer.run();

  const auto st = consumer.stats();
  std::printf(
      "executed %llu, duplicates %llu, retried %llu, dead-lettered %llu (%llu found written), "
      "rebalances %llu\n",
      static_cast<unsigned long long>(st.executed), static_cast<unsigned long long>(st.duplicates),
      static_cast<unsigned long long>(st.requeued), static_cast<unsigned long long>(st.dead_lettered),
      static_cast<unsigned long long>(st.dead_letters_earlier), static_cast<unsigned long long>(st.rebalances));
  ledger.print();
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "idem_kafka_consumer: %s\n", e.what());
  return 1;
}
