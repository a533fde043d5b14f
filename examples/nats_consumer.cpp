// nats_consumer: a starting template for a NATS JetStream consumer with exactly-once effects.
// idem::NatsConsumer pulls batches from a durable consumer (InProgress keeps a long batch alive),
// idem::consume runs each batch through IdempotencyGuard and settles every message with its
// verdict: ack, NakWithDelay (jittered), or a dead letter (publish + Term). Copy it and put your
// logic in Ledger::apply().
//
//   idem_nats_consumer [--url nats://127.0.0.1:4222] [--stream PAYMENTS] [--subject payments.>]
//                      [--durable workers]
//
// Messages: the idempotency key is the `idem-outbox-id` header (the outbox relay's), else
// `Nats-Msg-Id`; a message with neither is dead-lettered, never guessed. The body is
// "account;amount". The guard runs on MemoryStore, which dedupes what this process sees; with
// several consumer processes use RedisStore or PostgresStore. On SIGINT or SIGTERM it finishes the
// batch in hand, prints what it applied and exits. docs/nats.md has the failure modes.

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <stdexcept>
#include <stop_token>
#include <string>

#include <fmt/core.h>

#include "idem/idem.hpp"
#include "idem/nats/consumer.hpp"

namespace {

std::stop_source g_stop;
extern "C" void on_signal(int) { g_stop.request_stop(); }

// ---- YOUR LOGIC: the effect of one payment. Here an in-memory ledger; a poison payment (account
// "poison") always fails, so the failure policy ends it in the dead-letter subject.
struct Ledger {
  std::map<std::string, long> balance;
  long applied = 0;
  long apply(std::string_view body) {
    const auto semi = body.find(';');
    if (semi == std::string_view::npos || semi == 0) throw std::invalid_argument("body is not 'account;amount'");
    const std::string account(body.substr(0, semi));
    if (account == "poison") throw std::runtime_error("poison payment");
    ++applied;
    return balance[account] += std::atol(std::string(body.substr(semi + 1)).c_str());
  }
};

}  // namespace

int main(int argc, char** argv) try {
  std::map<std::string, std::string> flags;
  for (int i = 1; i < argc; ++i) {
    const std::string name = argv[i];
    flags[name] = name != "--help" && i + 1 < argc ? argv[++i] : "";
  }
  auto flag = [&](const char* name, const char* def) { return flags.count(name) ? flags[name] : std::string(def); };
  if (flags.count("--help")) {
    std::puts("usage: idem_nats_consumer [--url U] [--stream S] [--subject SUBJ] [--durable D]\n"
              "Pulls SUBJ from stream S (created when missing) through the durable D and applies each payment\n"
              "exactly once, until SIGINT or SIGTERM; then prints what it applied.");
    return 0;
  }
  idem::NatsConsumerOptions no;
  no.url = flag("--url", "nats://127.0.0.1:4222");
  no.stream = flag("--stream", "PAYMENTS");
  no.subject = flag("--subject", "payments.>");
  no.durable = flag("--durable", "workers");
  no.create_stream = true;
  no.ack_wait = std::chrono::seconds(30);  // >= the guard's lease
  idem::NatsConsumer consumer(no);

  idem::MemoryStore store;
  idem::GuardOptions go;
  go.lease = std::chrono::seconds(30);  // above the handler's worst case
  // record, not release: a poison message fails twice, then answers previously_failed and is
  // dead-lettered; release would requeue it forever.
  go.failure = {.mode = idem::FailureMode::record, .max_attempts = 2, .backoff = idem::millis{0}};
  idem::IdempotencyGuard guard(store, go);
  Ledger ledger;
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);

  idem::ConsumeOptions co;
  co.retry = {.base = idem::millis{200}, .cap = idem::millis{5'000}};  // requeue waits, jittered
  idem::consume(consumer, guard, g_stop.get_token(),
                [&](const idem::Delivery& m) { return ledger.apply(m.payload); }, co);
  const auto st = consumer.stats();
  fmt::print("applied {} payments to {} accounts; fetched {}, acked {}, dead-lettered {}, requeued {}\n",
             ledger.applied, ledger.balance.size(), st.fetched, st.acked, st.dead_lettered, st.nacked);
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "idem_nats_consumer: {}\n", e.what());
  return 1;
}
