// The HTTP servers and the consumers of the HTTP / RabbitMQ pipeline test
// (rabbitmq_pipeline_test.cpp), one process each, which the driver SIGKILLs at random and starts
// again:
//
//   idem_http_pipeline_worker http CONNINFO SCHEMA PORT NAME DIR
//   idem_http_pipeline_worker consumer AMQPS_URL CERT_DIR REDIS_PORT NAME DIR
//
// http: a cpp-httplib server on 127.0.0.1:PORT serving `POST /payments` through an idem::http
// Endpoint on a transactional-mode PostgresStore (SCHEMA.http_records, outbox on): the handler
// INSERTs the payment row (with a payment id of its own, which the 201 answer carries) and sends
// the payment through ctx.outbox() to the queue pipe-payments, in the transaction that stores the
// answer. The Idempotency-Key is the event id. Runs until SIGTERM.
//
// consumer: idem::consume over an idem::RabbitConsumer on amqps:// (the test CA verified, a client
// certificate; keyed by default: no idem-outbox-id header, so the AMQP message_id, which is the
// relay's outbox id) with an idem::RedisStore guard whose handler applies the payment into Redis
// with one script (rabbitmq_pipeline.hpp names the hashes). RedisStore is a lease-mode store: a
// consumer killed after the effect and before its completion leaves the key to a takeover after
// the lease, which runs the handler again (docs/guarantees.md, "not promised"). The effect is
// fence-aware, as that section says to make it: it refuses a run whose fence is not above the
// last writer's (a holder that lost its key), and a run of a key that already wrote (the takeover
// after such a crash) writes its fence but not the payment a second time. Every run that reaches
// the script is counted, so the driver sees each re-run and whether a takeover explains it.
// Runs until SIGTERM.
//
// Both append each guard outcome to DIR/stats-<role>-<pid> (pipeline_plan.hpp's Stats); a
// consumer also a 'C' for each time it could not reach the broker.

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>

#include <hiredis/hiredis.h>
#include <unistd.h>

#include "idem/http/httplib.hpp"
#include "idem/idem.hpp"
#include "idem/postgres.hpp"
#include "idem/postgres/outbox_writer.hpp"
#include "idem/rabbitmq/consumer.hpp"
#include "idem/redis.hpp"
#include "pipeline_plan.hpp"
#include "pipeline_worker.hpp"
#include "rabbitmq_pipeline.hpp"

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

using pipeline::g_stop;
using pipeline::guard_options;
using pipeline::pg_client;
using pipeline::StatsObserver;
namespace rmq = pipeline::rmq;

std::string payment_id() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  char id[32];
  std::snprintf(id, sizeof id, "pm_%016llx", static_cast<unsigned long long>(rng()));
  return id;
}

int http_main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: idem_http_pipeline_worker http CONNINFO SCHEMA PORT NAME DIR\n");
    return 2;
  }
  const std::string conninfo = argv[2], schema = argv[3], name = argv[5], dir = argv[6];
  const int port = std::atoi(argv[4]);
  const pipeline::Stats stats(dir + "/stats-http-" + std::to_string(::getpid()));
  const auto observer = std::make_shared<StatsObserver>(stats);

  idem::PostgresStore store(pg_client(conninfo, 8), {.schema = schema, .table = rmq::kUpTable,
                                                     .mode = idem::PostgresMode::transactional,
                                                     .auto_migrate = false, .outbox = true});
  idem::IdempotencyGuard<idem::PostgresStore> guard(store, guard_options(name, observer));
  idem::http::Endpoint<idem::PostgresStore> endpoint(guard);
  using Ctx = idem::http::Endpoint<idem::PostgresStore>::context_type;

  // YOUR LOGIC, once per Idempotency-Key: the payment row and its message, in the transaction that
  // stores the answer (a rollback takes all three back). A few ms of "card network" in the
  // transaction, so that the driver's kills land inside some of them.
  auto create_payment = [&](const httplib::Request& req, httplib::Response& res, const Ctx& ctx) {
    const rmq::Body b = rmq::parse_body(req.body);
    if (!b.ok()) {
      res.status = 400;
      res.set_content(R"({"error":"body is event;account;amount"})", "application/json");
      return;
    }
    std::this_thread::sleep_for(3ms);
    const std::string id = payment_id();
    ctx.tx->exec("INSERT INTO " + schema + ".payments(event_id, account, amount, payment_id) VALUES ($1, $2::int, $3::bigint, $4)",
                 b.event, std::to_string(b.account), std::to_string(b.amount), id);
    ctx.outbox().send(rmq::kQueue, "account-" + std::to_string(b.account), req.body,
                      {{"type", "PaymentCaptured"}, {"payment-id", id}});
    res.status = 201;
    res.set_header("Location", std::string(rmq::kRoute) + "/" + id);
    res.set_content(R"({"payment":")" + id + R"(","event":")" + b.event + "\"}", "application/json");
  };

  httplib::Server server;
  server.Post(rmq::kRoute, idem::http::idempotent(endpoint, create_payment));
  // The port of this slot: the same after every restart (a moment may pass before it is free).
  const auto bind_until = Clock::now() + 10s;
  while (!server.bind_to_port("127.0.0.1", port)) {
    if (Clock::now() > bind_until || g_stop.stop_requested()) {
      std::fprintf(stderr, "http %s: cannot listen on 127.0.0.1:%d\n", name.c_str(), port);
      return 1;
    }
    std::this_thread::sleep_for(50ms);
  }
  std::jthread stopper([&](std::stop_token done) {
    while (!done.stop_requested() && !g_stop.stop_requested()) std::this_thread::sleep_for(20ms);
    server.stop();
  });
  const bool ok = server.listen_after_bind();
  return ok || g_stop.stop_requested() ? 0 : 1;
}

// The consumers' effect: one script on the effect server (see the file's comment).
constexpr const char* kEffectScript = R"lua(
local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
local fence = tonumber(ARGV[5])
if fence <= last then
  redis.call('HINCRBY', KEYS[6], ARGV[1], 1)
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[5])
if last == 0 then
  redis.call('HINCRBY', KEYS[3], ARGV[2], 1)
  redis.call('HINCRBY', KEYS[4], ARGV[3], ARGV[4])
  return 1
end
if ARGV[6] == '1' then
  redis.call('HINCRBY', KEYS[5], ARGV[1], 1)
else
  redis.call('HINCRBY', KEYS[7], ARGV[1], 1)
end
return 2
)lua";

class Effect {
public:
  explicit Effect(int port) : port_(port) {}
  ~Effect() {
    if (c_) redisFree(c_);
  }
  Effect(const Effect&) = delete;
  Effect& operator=(const Effect&) = delete;

  // Applies one payment; throws (the handler fails, the message is requeued) when Redis does not
  // answer, after dropping the connection.
  void apply(const std::string& key, const rmq::Body& b, std::uint64_t fence, bool takeover) {
    if (!c_) {
      timeval tv{2, 0};
      c_ = redisConnectWithTimeout("127.0.0.1", port_, tv);
      if (!c_ || c_->err) {
        const std::string why = c_ ? c_->errstr : "out of memory";
        drop();
        throw std::runtime_error("effect: cannot connect to redis: " + why);
      }
      timeval cmd{5, 0};
      redisSetTimeout(c_, cmd);
    }
    const std::string account = std::to_string(b.account), amount = std::to_string(b.amount), f = std::to_string(fence);
    const char* argv[] = {"EVAL", kEffectScript, "7", rmq::kFence, rmq::kRuns, rmq::kEffects, rmq::kBalance, rmq::kAgain,
                          rmq::kStale, rmq::kAgainNoTakeover, key.c_str(), b.event.c_str(), account.c_str(),
                          amount.c_str(), f.c_str(), takeover ? "1" : "0"};
    auto* r = static_cast<redisReply*>(redisCommandArgv(c_, static_cast<int>(std::size(argv)), argv, nullptr));
    if (r == nullptr) {
      const std::string why = c_->errstr;
      drop();
      throw std::runtime_error("effect: redis: " + why);
    }
    const bool error = r->type == REDIS_REPLY_ERROR;
    const std::string text = error ? std::string(r->str, r->len) : std::string();
    freeReplyObject(r);
    if (error) throw std::runtime_error("effect: script: " + text);
  }

private:
  void drop() {
    if (c_) redisFree(c_);
    c_ = nullptr;
  }
  int port_;
  redisContext* c_ = nullptr;
};

int consumer_main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: idem_http_pipeline_worker consumer AMQPS_URL CERT_DIR REDIS_PORT NAME DIR\n");
    return 2;
  }
  const std::string url = argv[2], certs = argv[3], name = argv[5], dir = argv[6];
  const int redis_port = std::atoi(argv[4]);
  const pipeline::Stats stats(dir + "/stats-consumer-" + std::to_string(::getpid()));
  const auto observer = std::make_shared<StatsObserver>(stats);
  const auto hard_stop = Clock::now() + 10min;

  idem::RedisOptions ro;
  ro.host = "127.0.0.1";
  ro.port = redis_port;
  ro.connect_timeout = idem::millis{2000};
  ro.command_timeout = idem::millis{5000};
  idem::RedisStore store(ro);
  idem::IdempotencyGuard<idem::RedisStore> guard(store, guard_options(name, observer));
  idem::ConsumeOptions co;
  co.retry = {.base = idem::millis{100}, .cap = idem::millis{1000}};  // requeue waits (in_flight, errors), jittered
  Effect effect(redis_port);

  // About 10 ms of work before the effect and 10 ms after it (say, a call to another system), so
  // that a batch is in hand long enough for the driver's kills to land in the middle of one, and
  // some of them between an effect and its completion: the window a lease-mode store leaves open,
  // which the fence-aware effect closes (a takeover's re-run does not apply the payment again).
  auto handler = [&](const idem::Delivery& d, const idem::IdempotencyGuard<idem::RedisStore>::context_type& ctx) {
    const rmq::Body b = rmq::parse_body(d.payload);
    if (!b.ok()) throw std::runtime_error("consumer: malformed payload");
    std::this_thread::sleep_for(10ms);
    effect.apply(idem::key_of(d), b, ctx.fence, ctx.takeover);
    std::this_thread::sleep_for(10ms);
  };

  idem::RabbitConsumerOptions o;
  o.url = url;
  o.ca_file = certs + "/ca.pem";
  o.cert_file = certs + "/client.pem";
  o.key_file = certs + "/client.key";
  o.queue = rmq::kQueue;
  o.prefetch = 32;
  o.batch = 16;
  o.poll_wait = idem::millis{200};
  o.connect_timeout = idem::millis{2000};
  o.heartbeat_s = 10;
  // The consumer is built again after anything idem::consume throws (it backs off and retries the
  // retryable errors itself), and while the broker is down (at start, or its restart).
  while (!g_stop.stop_requested() && Clock::now() < hard_stop) {
    try {
      idem::RabbitConsumer consumer(o);
      idem::consume(consumer, guard, g_stop.get_token(), handler, co);
    } catch (const std::exception& ex) {
      stats.note('C');  // the broker unreachable (down, restarting): not one of the guard's errors
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
    if (role == "http") return http_main(argc, argv);
    if (role == "consumer") return consumer_main(argc, argv);
    std::fprintf(stderr, "usage: idem_http_pipeline_worker http|consumer ...\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "idem_http_pipeline_worker: %s\n", e.what());
    return 1;
  }
}
