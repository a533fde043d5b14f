// The stages 1 and 3 of the NATS pipeline test (nats_pipeline_test.cpp), one process each, which
// the driver SIGKILLs at random and starts again:
//
//   idem_pipeline_worker producer CONNINFO SCHEMA INDEX PRODUCERS EVENTS DUP_PERCENT SEED PACE_MS DIR
//   idem_pipeline_worker consumer CONNINFO SCHEMA NATS_URL NAME DIR
//
// producer: walks its share of the payment events (pipeline_plan.hpp, duplicates included) from
// its progress file on; each goes through an IdempotencyGuard on a transactional-mode PostgresStore
// (SCHEMA.up_records, outbox on) whose handler INSERTs the payment row and sends one message
// through ctx.outbox(), in the same transaction. Exits 0 when its share is done.
//
// consumer: idem::consume over an idem::NatsConsumer (stream PIPE, durable "pipeline", keyed by
// default: the relay's Nats-Msg-Id, which is the outbox id) with a transactional-mode PostgresStore
// guard (SCHEMA.down_records) whose handler appends the message to SCHEMA.ledger, a table without
// any uniqueness: a double effect is a second row, counted by the driver. Runs until SIGTERM.
//
// Both append each outcome to DIR/stats-<role>-<pid> (pipeline_plan.hpp's Stats).

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>
#include <thread>

#include <unistd.h>

#include "idem/idem.hpp"
#include "idem/nats/consumer.hpp"
#include "idem/postgres.hpp"
#include "idem/postgres/outbox_writer.hpp"
#include "pipeline_plan.hpp"
#include "pipeline_worker.hpp"

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

using pipeline::g_stop;
using pipeline::guard_options;
using pipeline::pg_client;
using pipeline::status_char;
using pipeline::StatsObserver;

int producer_main(int argc, char** argv) {
  if (argc != 11) {
    std::fprintf(stderr, "usage: idem_pipeline_worker producer CONNINFO SCHEMA INDEX PRODUCERS EVENTS DUP_PERCENT SEED PACE_MS DIR\n");
    return 2;
  }
  const std::string conninfo = argv[2], schema = argv[3];
  const int index = std::atoi(argv[4]), producers = std::atoi(argv[5]), n_events = std::atoi(argv[6]);
  const int dup_percent = std::atoi(argv[7]);
  const std::uint64_t seed = std::strtoull(argv[8], nullptr, 10);
  const auto pace = std::chrono::milliseconds(std::atoi(argv[9]));
  const std::string dir = argv[10];
  const pipeline::Stats stats(dir + "/stats-producer-" + std::to_string(::getpid()));
  const std::string progress_file = dir + "/producer-" + std::to_string(index) + ".progress";

  const auto events = pipeline::events(n_events, seed);
  const auto order = pipeline::plan(n_events, dup_percent, seed, index, producers);

  std::optional<idem::PostgresStore> store;
  std::optional<idem::IdempotencyGuard<idem::PostgresStore>> guard;
  const auto hard_stop = Clock::now() + 10min;  // bounded even if the driver vanished
  for (std::size_t i = pipeline::read_progress(progress_file); i < order.size(); ++i) {
    const pipeline::Event& e = events[static_cast<std::size_t>(order[i])];
    const std::string payload = e.payload();
    for (auto pause = 20ms;; pause = std::min(pause * 2, std::chrono::milliseconds(500))) {
      if (g_stop.stop_requested() || Clock::now() > hard_stop) return 1;
      try {
        if (!store) {
          store.emplace(pg_client(conninfo), idem::PostgresStoreOptions{.schema = schema, .table = pipeline::kUpTable,
                                                                        .mode = idem::PostgresMode::transactional,
                                                                        .auto_migrate = false, .outbox = true});
          guard.emplace(*store, guard_options("producer-" + std::to_string(index), nullptr));
        }
        // The business row and the message, in the guard's transaction: both or neither.
        const auto out = guard->run(e.id, payload, [&](const idem::BasicContext<idem::PostgresStore::Transaction>& ctx) {
          ctx.tx->exec("INSERT INTO " + schema + ".payments(event_id, account, amount) VALUES ($1, $2::int, $3::bigint)",
                       e.id, std::to_string(e.account), std::to_string(e.amount));
          ctx.outbox().send("payments." + std::to_string(e.account % pipeline::kSubjects),
                            "account-" + std::to_string(e.account), payload, {{"type", "PaymentCaptured"}});
        });
        stats.note(status_char(out.status));
        if (out.status == idem::Status::executed || out.status == idem::Status::duplicate) break;
        // in_flight: a killed predecessor's transaction the server has not rolled back yet.
      } catch (const idem::error& ex) {
        stats.note('E');
        std::fprintf(stderr, "producer %d: %s\n", index, ex.what());
        if (!ex.retryable() && dynamic_cast<const idem::store_error*>(&ex) == nullptr &&
            dynamic_cast<const idem::outcome_unknown_error*>(&ex) == nullptr) {
          guard.reset();
          store.reset();
        }
      } catch (const std::exception& ex) {
        stats.note('E');
        std::fprintf(stderr, "producer %d: %s\n", index, ex.what());
        guard.reset();
        store.reset();
      }
      std::this_thread::sleep_for(pause);
    }
    // A checkpoint every 8 submissions: a producer killed after its last one submits the events
    // since again, and the guard answers duplicate for each that committed.
    if ((i + 1) % 8 == 0 || i + 1 == order.size()) pipeline::write_progress(progress_file, i + 1);
    if (pace.count() > 0) std::this_thread::sleep_for(pace);
  }
  return 0;
}

int consumer_main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: idem_pipeline_worker consumer CONNINFO SCHEMA NATS_URL NAME DIR\n");
    return 2;
  }
  const std::string conninfo = argv[2], schema = argv[3], url = argv[4], name = argv[5], dir = argv[6];
  const pipeline::Stats stats(dir + "/stats-consumer-" + std::to_string(::getpid()));
  const auto observer = std::make_shared<StatsObserver>(stats);
  const auto hard_stop = Clock::now() + 10min;

  idem::PostgresStore store(pg_client(conninfo), {.schema = schema, .table = pipeline::kDownTable,
                                                  .mode = idem::PostgresMode::transactional, .auto_migrate = false});
  idem::IdempotencyGuard<idem::PostgresStore> guard(store, guard_options(name, observer));
  idem::ConsumeOptions co;
  co.retry = {.base = idem::millis{100}, .cap = idem::millis{1000}};  // requeue waits (in_flight, errors), jittered

  // The effect: one ledger row per execution, with no uniqueness to hide a second one. It takes
  // about 15 ms (pg_sleep, standing for real work), so a batch is in hand long enough for the
  // driver's kills to land in the middle of one: its messages committed before the kill come back
  // after AckWait and the guard answers them as duplicates.
  auto handler = [&](const idem::Delivery& d, const idem::IdempotencyGuard<idem::PostgresStore>::context_type& ctx) {
    const std::string body(d.payload);
    const std::string event = body.substr(0, body.find(';'));
    ctx.tx->exec("INSERT INTO " + schema + ".ledger(outbox_id, event_id, payload, consumer) "
                 "SELECT $1, $2, $3, $4 FROM pg_sleep(0.015)",
                 idem::key_of(d), event, body, name + ":" + std::to_string(::getpid()));
  };

  // The consumer is built again after anything idem::consume throws (it backs off and retries the
  // retryable errors itself), and while the server is down at start.
  while (!g_stop.stop_requested() && Clock::now() < hard_stop) {
    try {
      idem::NatsConsumer consumer({.url = url,
                                   .stream = pipeline::kStream,
                                   .durable = pipeline::kDurable,
                                   .subject = pipeline::kStreamSubjects,
                                   .batch = 16,
                                   .fetch_wait = idem::millis{200},
                                   .ack_wait = idem::millis{2000},  // a SIGKILLed consumer's batch comes back after 2 s
                                   .timeout = idem::millis{2000}});
      idem::consume(consumer, guard, g_stop.get_token(), handler, co);
    } catch (const std::exception& ex) {
      stats.note('E');
      std::fprintf(stderr, "consumer %s: %s\n", name.c_str(), ex.what());
      std::this_thread::sleep_for(200ms);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  pipeline::install_signals();
  try {
    const std::string role = argc > 1 ? argv[1] : "";
    if (role == "producer") return producer_main(argc, argv);
    if (role == "consumer") return consumer_main(argc, argv);
    std::fprintf(stderr, "usage: idem_pipeline_worker producer|consumer ...\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "idem_pipeline_worker: %s\n", e.what());
    return 1;
  }
}
