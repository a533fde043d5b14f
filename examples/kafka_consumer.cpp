// kafka_consumer: a starting template for a Kafka consumer with exactly-once effects.
// idem::kafka::Source polls batches, commits only settled offsets, requeues by pausing the
// partition and seeking back, writes dead letters with their headers and idem-reason, and handles
// eager and cooperative rebalances; idem::consume runs each batch through IdempotencyGuard and
// settles every message with its verdict. Put your logic in Ledger::apply(); docs/consuming.md.
//
//   idem_kafka_consumer --brokers HOST:PORT [--topic payments] [--group payments-svc] [--dlq T]
//                       [--cooperative] [--batch 64]
//
// Messages: "id;account;amount", keyed on the id (an unreadable payload has no key and is
// dead-lettered). SIGINT / SIGTERM: it finishes the batch in hand, prints a summary, commits what
// is settled and leaves the group. MemoryStore dedupes what this process sees; with more consumer
// processes use RedisStore or PostgresStore. CTest runs it on librdkafka's mock cluster
// (tests/kafka/example_driver.cpp).

#include <fmt/core.h>

#include <csignal>
#include <cstdio>
#include <map>
#include <optional>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <string_view>

#include "idem/guard/consume.hpp"
#include "idem/idem.hpp"
#include "idem/kafka/source.hpp"

namespace {

std::stop_source g_stop;
extern "C" void on_signal(int) { g_stop.request_stop(); }

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

// ---- YOUR LOGIC: the effect of one payment, at most once per id (ctx.fence can fence downstream
// writes). Throwing retries it; after the guard's max_attempts it goes to the dead-letter topic.
struct Ledger {
  std::map<std::string, long> balance;
  long applied = 0, sum = 0;
  void apply(const Payment& p, const idem::Context& /*ctx*/) {
    if (p.amount == 0) throw std::runtime_error("payment " + p.id + " rejected: amount is zero");
    balance[p.account] += p.amount;
    ++applied;
    sum += p.amount;
  }
};

}  // namespace

int main(int argc, char** argv) try {
  std::map<std::string, std::string> flags;
  for (int i = 1; i < argc; ++i) {
    const std::string name = argv[i];
    flags[name] = name != "--cooperative" && i + 1 < argc ? argv[++i] : "";
  }
  auto flag = [&](const char* name, const char* def) { return flags.count(name) ? flags[name] : std::string(def); };
  idem::kafka::SourceOptions o;
  o.brokers = flag("--brokers", "");
  o.group = flag("--group", "payments-svc");
  o.topics = {flag("--topic", "payments")};
  o.dead_letter_topic = flag("--dlq", "");  // empty: <topic>.dlq
  o.batch = std::stoul(flag("--batch", "64"));
  if (o.brokers.empty()) {
    fmt::print(stderr, "usage: idem_kafka_consumer --brokers HOST:PORT [--topic T] [--group G] [--dlq T] "
                       "[--cooperative] [--batch N]\n");
    return 2;
  }
  // TUNE: session.timeout.ms / heartbeat.interval.ms decide how fast a dead consumer's partitions
  // move; cooperative-sticky moves only the partitions that change owner. The handlers run on the
  // polling thread: max.poll.interval.ms must cover a whole batch of them.
  if (flags.count("--cooperative")) o.properties["partition.assignment.strategy"] = "cooperative-sticky";
  o.log = [](std::string_view line) { fmt::print(stderr, "{}\n", line); };
  idem::kafka::Source source(o);

  // TUNE: lease above the handler's worst case. consumer_guard_options() records failures (3
  // attempts, then the dead-letter topic); FailureMode::release would retry a poison message for
  // ever and hold its partition's commits back.
  idem::GuardOptions g = idem::kafka::consumer_guard_options();
  g.failure.backoff = idem::millis{200};  // doubling: a poison message is dead-lettered within a second or two
  idem::MemoryStore store;
  idem::IdempotencyGuard guard(store, g);
  Ledger ledger;
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);

  idem::ConsumeOptions co;
  co.retry = {.base = idem::millis{200}, .cap = idem::millis{5'000}};  // requeue waits, jittered
  // The payment's id, not the message's coordinates: a re-published copy has other ones. On a topic
  // the outbox relay feeds, drop key_of: the default is the idem-outbox-id header.
  co.key_of = [](const idem::Delivery& m) {
    const auto p = parse(m.payload);
    return p ? p->id : std::string();
  };
  idem::consume(source, guard, g_stop.get_token(),
                [&](const idem::Delivery& m, const idem::Context& ctx) { ledger.apply(*parse(m.payload), ctx); }, co);

  const auto st = source.stats();
  fmt::print("polled {}, acked {}, requeued {}, dead-lettered {}, rebalances {}, commits {}\n", st.polled, st.acked,
             st.requeued, st.dead_lettered, st.rebalances, st.commits);
  fmt::print("applied {} payments, amount {}, {} accounts\n", ledger.applied, ledger.sum, ledger.balance.size());
  std::fflush(stdout);
  return 0;  // ~Source: commits what is settled and leaves the group
} catch (const std::exception& e) {
  fmt::print(stderr, "idem_kafka_consumer: {}\n", e.what());
  return 1;
}
