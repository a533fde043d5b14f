// The worker processes of the Kafka pipeline test (kafka_pipeline_test.cpp), one process each,
// which the driver SIGKILLs at random and starts again:
//
//   idem_kafka_pipeline_worker producer BROKERS INDEX PRODUCERS EVENTS DUP_PERCENT SEED PACE_MS DIR
//   idem_kafka_pipeline_worker payments BROKERS CONNINFO SCHEMA NAME DIR
//   idem_kafka_pipeline_worker ledger   BROKERS CONNINFO SCHEMA NAME DIR
//
// producer (stage 0): walks its share of the payment events (pipeline_plan.hpp, duplicates
// included) from its progress file on and produces each to topic `payments` with librdkafka's
// idempotent producer (acks=all), Kafka key = the event id, value = the payload. Every 8 messages
// it waits for their delivery reports, then writes its progress: a producer killed in between
// produces them again (the stage 1 guard answers duplicate). Exits 0 when its share is acked.
//
// payments (stage 1): idem::consume over an idem::kafka::Source (group `pipe-payments`, topic
// `payments`, keyed by default: the Kafka key, the event id) with a transactional-mode
// PostgresStore guard (SCHEMA.up_records, outbox on) whose handler INSERTs the payment row and
// sends one message to topic `ledger` through ctx.outbox(), in the same transaction.
//
// ledger (stage 3): idem::consume over an idem::kafka::Source (group `pipe-ledger`, topic `ledger`,
// keyed by default: the `idem-outbox-id` header the relay sets) with a transactional-mode
// PostgresStore guard (SCHEMA.down_records) whose handler appends the message to SCHEMA.ledger (no
// uniqueness: a double effect is a second row) and adds the amount to the account's row of
// SCHEMA.balances. Runs until SIGTERM, as stage 1.
//
// Each appends its outcomes to DIR/stats-<role>-<pid> (pipeline_plan.hpp's Stats); the producer
// one 'P' per acknowledged message.

#include <librdkafka/rdkafka.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "idem/kafka/source.hpp"
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
using pipeline::StatsObserver;

constexpr const char* kPaymentsTopic = "payments";
constexpr const char* kLedgerTopic = "ledger";

// ---------------------------------------------------------------------------------------------
// Stage 0: the producer.

struct DeliveryCount {
  std::atomic<long> ok{0}, failed{0};
};

void set(rd_kafka_conf_t* conf, const char* k, const std::string& v) {
  char err[512];
  if (rd_kafka_conf_set(conf, k, v.c_str(), err, sizeof err) != RD_KAFKA_CONF_OK)
    throw std::runtime_error(std::string("producer: ") + k + ": " + err);
}

int producer_main(int argc, char** argv) {
  if (argc != 10) {
    std::fprintf(
        stderr,
        "usage: idem_kafka_pipeline_worker producer BROKERS INDEX PRODUCERS EVENTS DUP_PERCENT SEED PACE_MS DIR\n");
    return 2;
  }
  const std::string brokers = argv[2];
  const int index = std::atoi(argv[3]), producers = std::atoi(argv[4]), n_events = std::atoi(argv[5]);
  const int dup_percent = std::atoi(argv[6]);
  const std::uint64_t seed = std::strtoull(argv[7], nullptr, 10);
  const auto pace = std::chrono::milliseconds(std::atoi(argv[8]));
  const std::string dir = argv[9];
  const pipeline::Stats stats(dir + "/stats-producer-" + std::to_string(::getpid()));
  const std::string progress_file = dir + "/producer-" + std::to_string(index) + ".progress";

  const auto events = pipeline::events(n_events, seed);
  const auto order = pipeline::plan(n_events, dup_percent, seed, index, producers);

  DeliveryCount dc;
  rd_kafka_conf_t* conf = rd_kafka_conf_new();
  set(conf, "bootstrap.servers", brokers);
  set(conf, "enable.idempotence", "true");
  set(conf, "acks", "all");
  set(conf, "linger.ms", "5");
  set(conf, "message.timeout.ms", "8000");  // longer than the broker's outage
  set(conf, "client.id", "pipe-producer-" + std::to_string(index));
  set(conf, "log_level", "3");
  rd_kafka_conf_set_dr_msg_cb(conf, [](rd_kafka_t*, const rd_kafka_message_t* m, void* opaque) {
    auto* c = static_cast<DeliveryCount*>(opaque);
    (m->err ? c->failed : c->ok).fetch_add(1);
  });
  rd_kafka_conf_set_opaque(conf, &dc);
  char err[512];
  rd_kafka_t* rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, err, sizeof err);
  if (rk == nullptr) {
    rd_kafka_conf_destroy(conf);
    throw std::runtime_error(std::string("producer: ") + err);
  }
  struct Destroy {
    rd_kafka_t* rk;
    ~Destroy() { rd_kafka_destroy(rk); }
  } destroy{rk};

  const auto hard_stop = Clock::now() + 10min;  // bounded even if the driver vanished
  constexpr std::size_t kChunk = 8;
  for (std::size_t from = pipeline::read_progress(progress_file); from < order.size();) {
    const std::size_t to = std::min(order.size(), from + kChunk);
    for (auto pause = 50ms;; pause = std::min(pause * 2, std::chrono::milliseconds(500))) {
      if (g_stop.stop_requested() || Clock::now() > hard_stop) return 1;
      dc.ok = 0;
      dc.failed = 0;
      long queued = 0;
      for (std::size_t i = from; i < to; ++i) {
        const pipeline::Event& e = events[static_cast<std::size_t>(order[i])];
        const std::string payload = e.payload();
        rd_kafka_resp_err_t r;
        while ((r = rd_kafka_producev(rk, RD_KAFKA_V_TOPIC(kPaymentsTopic), RD_KAFKA_V_KEY(e.id.data(), e.id.size()),
                                      RD_KAFKA_V_VALUE(const_cast<char*>(payload.data()), payload.size()),
                                      RD_KAFKA_V_HEADER("type", "PaymentCaptured", -1),
                                      RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY), RD_KAFKA_V_END)) ==
               RD_KAFKA_RESP_ERR__QUEUE_FULL)
          rd_kafka_poll(rk, 10);
        if (r != RD_KAFKA_RESP_ERR_NO_ERROR) {
          std::fprintf(stderr, "producer %d: produce: %s\n", index, rd_kafka_err2str(r));
          break;
        }
        ++queued;
        rd_kafka_poll(rk, 0);
        if (pace.count() > 0) std::this_thread::sleep_for(pace);
      }
      // Every message of the chunk acknowledged by the broker, or the chunk again.
      rd_kafka_flush(rk, 10'000);
      if (queued == static_cast<long>(to - from) && dc.ok == queued && dc.failed == 0) {
        for (long i = 0; i < queued; ++i) stats.note('P');
        break;
      }
      stats.note('E');
      std::fprintf(stderr, "producer %d: %ld of %zu acknowledged, %ld failed: the chunk again\n", index, dc.ok.load(),
                   to - from, dc.failed.load());
      // An idempotent producer that lost track of its sequence numbers is unusable: exit, and
      // the driver starts this producer again (from its progress file).
      if (rd_kafka_fatal_error(rk, err, sizeof err) != RD_KAFKA_RESP_ERR_NO_ERROR) {
        std::fprintf(stderr, "producer %d: fatal: %s\n", index, err);
        return 3;
      }
      rd_kafka_purge(rk, RD_KAFKA_PURGE_F_QUEUE | RD_KAFKA_PURGE_F_INFLIGHT);
      rd_kafka_poll(rk, 0);
      std::this_thread::sleep_for(pause);
    }
    from = to;
    pipeline::write_progress(progress_file, from);
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Stages 1 and 3: idem::consume over kafka::Source.

struct Payment {
  std::string event;
  std::string account;
  std::string amount;
};

Payment parse(std::string_view body) {
  const auto a = body.find(';');
  const auto b = a == std::string_view::npos ? a : body.find(';', a + 1);
  if (b == std::string_view::npos) throw std::invalid_argument("not a payment: " + std::string(body));
  return {std::string(body.substr(0, a)), std::string(body.substr(a + 1, b - a - 1)), std::string(body.substr(b + 1))};
}

idem::kafka::SourceOptions source_options(const std::string& brokers, const std::string& group,
                                          const std::string& topic, const std::string& name) {
  idem::kafka::SourceOptions o;
  o.brokers = brokers;
  o.group = group;
  o.topics = {topic};
  // A SIGKILLed member stays in the group until its session times out (the mock checks once a
  // second), and the mock coordinator waits session.timeout.ms - 1 s for the members to rejoin a
  // rebalance: short, but not below 4 s. librdkafka 2.0.2's mock holds the JoinGroup of an empty
  // group's first member for a fixed 3 s (group.initial.rebalance.delay.ms) without counting it
  // as activity: with a session shorter than that, the joiners time out while they wait, their
  // JoinGroup is never answered, and the group never forms (at the start, and after the brokers'
  // outage, in which every member times out).
  // Cooperative rebalancing: the live member goes on with its partitions while a killed one's
  // are reassigned.
  o.properties = {{"session.timeout.ms", "4500"},
                  {"heartbeat.interval.ms", "300"},
                  {"partition.assignment.strategy", "cooperative-sticky"},
                  {"fetch.wait.max.ms", "100"},  // a seek back waits for the fetch in flight
                  {"topic.metadata.refresh.interval.ms", "1000"},
                  {"reconnect.backoff.max.ms", "500"},
                  {"client.id", name},
                  {"log_level", "3"}};
  if (const char* d = std::getenv("IDEM_PIPELINE_KAFKA_DEBUG"); d && *d)
    o.properties["debug"] = d;  // diagnosis: cgrp,...
  o.batch = 16;
  o.poll_timeout = idem::millis{200};
  o.commit_interval = idem::millis{500};
  o.log = [name](std::string_view line) {
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count();
    std::fprintf(stderr, "%lld.%03lld %s: %.*s\n", static_cast<long long>(ms / 1000), static_cast<long long>(ms % 1000),
                 name.c_str(), static_cast<int>(line.size()), line.data());
  };
  return o;
}

template <class Handler>
int consumer_loop(const std::string& role, const std::string& brokers, const std::string& conninfo,
                  const std::string& schema, const char* table, const std::string& group, const std::string& topic,
                  const std::string& name, const std::string& dir, bool outbox, Handler handler) {
  const pipeline::Stats stats(dir + "/stats-" + role + "-" + std::to_string(::getpid()));
  const auto observer = std::make_shared<StatsObserver>(stats);
  const auto hard_stop = Clock::now() + 10min;

  idem::PostgresStore store(pg_client(conninfo), {.schema = schema,
                                                  .table = table,
                                                  .mode = idem::PostgresMode::transactional,
                                                  .auto_migrate = false,
                                                  .outbox = outbox});
  idem::IdempotencyGuard<idem::PostgresStore> guard(store, guard_options(name, observer));
  idem::ConsumeOptions co;
  co.retry = {.base = idem::millis{100}, .cap = idem::millis{1000}};  // requeue waits (in_flight, errors), jittered

  // The source is built again after anything idem::consume throws (it backs off and retries the
  // retryable errors itself).
  while (!g_stop.stop_requested() && Clock::now() < hard_stop) {
    try {
      idem::kafka::Source source(source_options(brokers, group, topic, name + ":" + std::to_string(::getpid())));
      idem::consume(source, guard, g_stop.get_token(), handler, co);
    } catch (const std::exception& ex) {
      stats.note('E');
      std::fprintf(stderr, "%s %s: %s\n", role.c_str(), name.c_str(), ex.what());
      std::this_thread::sleep_for(200ms);
    }
  }
  return 0;
}

using Ctx = idem::IdempotencyGuard<idem::PostgresStore>::context_type;

int payments_main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: idem_kafka_pipeline_worker payments BROKERS CONNINFO SCHEMA NAME DIR\n");
    return 2;
  }
  const std::string brokers = argv[2], conninfo = argv[3], schema = argv[4], name = argv[5], dir = argv[6];
  // The business row and the message, in the guard's transaction: both or neither. About 10 ms
  // (pg_sleep, standing for real work), so a kill lands in the middle of a batch now and then.
  auto handler = [&](const idem::Delivery& d, const Ctx& ctx) {
    const Payment p = parse(d.payload);
    ctx.tx->exec("INSERT INTO " + schema +
                     ".payments(event_id, account, amount, consumer) "
                     "SELECT $1, $2::int, $3::bigint, $4 FROM pg_sleep(0.01)",
                 p.event, p.account, p.amount, name + ":" + std::to_string(::getpid()));
    ctx.outbox().send(kLedgerTopic, "account-" + p.account, std::string(d.payload), {{"type", "PaymentCaptured"}});
  };
  return consumer_loop("payments", brokers, conninfo, schema, pipeline::kUpTable, "pipe-payments", kPaymentsTopic, name,
                       dir,
                       /*outbox=*/true, handler);
}

int ledger_main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: idem_kafka_pipeline_worker ledger BROKERS CONNINFO SCHEMA NAME DIR\n");
    return 2;
  }
  const std::string brokers = argv[2], conninfo = argv[3], schema = argv[4], name = argv[5], dir = argv[6];
  // The final effect: a ledger row (no uniqueness) and the account's balance, in the guard's
  // transaction.
  auto handler = [&](const idem::Delivery& d, const Ctx& ctx) {
    const Payment p = parse(d.payload);
    ctx.tx->exec("INSERT INTO " + schema +
                     ".ledger(outbox_id, event_id, payload, consumer, position) "
                     "SELECT $1, $2, $3, $4, $5 FROM pg_sleep(0.01)",
                 idem::key_of(d), p.event, std::string(d.payload), name + ":" + std::to_string(::getpid()), d.id);
    ctx.tx->exec("UPDATE " + schema +
                     ".balances SET balance = balance + $2::bigint, payments = payments + 1 WHERE account = $1::int",
                 p.account, p.amount);
  };
  return consumer_loop("ledger", brokers, conninfo, schema, pipeline::kDownTable, "pipe-ledger", kLedgerTopic, name,
                       dir,
                       /*outbox=*/false, handler);
}

}  // namespace

int main(int argc, char** argv) {
  pipeline::install_signals();
  try {
    const std::string role = argc > 1 ? argv[1] : "";
    if (role == "producer") return producer_main(argc, argv);
    if (role == "payments") return payments_main(argc, argv);
    if (role == "ledger") return ledger_main(argc, argv);
    std::fprintf(stderr, "usage: idem_kafka_pipeline_worker producer|payments|ledger ...\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "idem_kafka_pipeline_worker: %s\n", e.what());
    return 1;
  }
}
