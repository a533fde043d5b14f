// rabbitmq_consumer: a starting template for a RabbitMQ consumer with exactly-once effects.
// idem::RabbitConsumer consumes the queue (prefetch, reconnects) as an idem::Source; idem::consume
// runs each polled batch through IdempotencyGuard and settles every delivery with its verdict:
// ack, a dead letter with its reason (the queue's dead-letter exchange), or a requeue after a
// delay (a TTL queue). Copy it and put your logic in Ledger::apply().
//
//   idem_rabbitmq_consumer [--url amqp[s]://user:password@host:port/vhost] [--host 127.0.0.1]
//                          [--port 5672] [--queue payments] [--prefetch 50]
//
// Messages: the idempotency key is the `idem-outbox-id` header (the outbox relay's) when present,
// else the AMQP message-id property (a message with neither is dead-lettered, never guessed); the
// body "account;amount". The guard runs on MemoryStore, which dedupes what this process sees; with
// several consumer processes use RedisStore or PostgresStore (transactional mode: the effect and
// its record commit together). On SIGINT or SIGTERM it finishes the batch in hand, prints what it
// applied and exits. docs/consuming.md has the failure modes.

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <string_view>

#include <fmt/core.h>

#include "idem/idem.hpp"
#include "idem/rabbitmq/consumer.hpp"

namespace {

std::stop_source g_stop;
extern "C" void on_signal(int) { g_stop.request_stop(); }

// "--name value" pairs; "--help" alone.
std::map<std::string, std::string> parse_flags(int argc, char** argv) {
  std::map<std::string, std::string> f;
  for (int i = 1; i < argc; ++i) {
    const std::string name = argv[i];
    f[name] = name != "--help" && i + 1 < argc ? argv[++i] : "";
  }
  return f;
}

// ---- YOUR LOGIC: the effect of one payment. Here an in-memory ledger; a poison payment (account
// "poison") always fails, so the failure policy ends it in the dead-letter queue.
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
  auto flags = parse_flags(argc, argv);
  auto flag = [&](const char* name, const char* def) { return flags.count(name) ? flags[name] : std::string(def); };
  if (flags.count("--help")) {
    std::puts("usage: idem_rabbitmq_consumer [--url amqp[s]://...] [--host H] [--port P] [--queue Q] [--prefetch N]\n"
              "Consumes queue Q (declaring Q, Q.dlx -> Q.dlq and the delay queue Q.delay) and applies each\n"
              "payment exactly once, until SIGINT or SIGTERM; then prints what it applied. --url (amqps:// for\n"
              "TLS, the system's CA bundle) replaces --host and --port.");
    return 0;
  }
  idem::RabbitConsumerOptions ro;
  ro.url = flag("--url", "");
  ro.host = flag("--host", "127.0.0.1");
  ro.port = std::stoi(flag("--port", "5672"));
  ro.queue = flag("--queue", "payments");
  ro.prefetch = static_cast<std::uint16_t>(std::stoi(flag("--prefetch", "50")));
  idem::RabbitConsumer consumer(ro);

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
  // The consumer's requeue waits (cap 1 s): its delay queue expires from its head only.
  co.retry = consumer.options().retry;
  // The body is the fingerprint: a reused key with another body answers mismatch (a dead letter).
  idem::consume(consumer, guard, g_stop.get_token(),
                [&](const idem::Delivery& m) { return ledger.apply(m.payload); }, co);
  const auto st = consumer.stats();
  fmt::print("applied {} payments to {} accounts; delivered {}, acked {}, dead-lettered {}, requeued {}\n",
             ledger.applied, ledger.balance.size(), st.delivered, st.acked, st.dead_lettered, st.requeued);
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "idem_rabbitmq_consumer: {}\n", e.what());
  return 1;
}
