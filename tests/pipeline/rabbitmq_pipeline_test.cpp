// Pipeline (b) of issue 41, end to end across processes, with crashes:
//
//   clients (2 threads of this driver) ── HTTP POST /payments, Idempotency-Key: "<event id>"
//        │                                (some twice; a POST that got no answer is sent again)
//        ▼
//   HTTP servers (2): idem::http Endpoint (cpp-httplib) on a PostgreSQL transactional guard:
//        │            payments row + ctx.outbox().send + the stored answer, one transaction
//        │            (SCHEMA.http_records, its outbox SCHEMA.http_records_outbox)
//        ▼
//   idem-outbox-relay --publisher rabbitmq (2, the real program) ──► amqps:// ──► rabbitmq-server
//        │                                      (TLS listener, the test's CA; queue pipe-payments)
//        ▼
//   consumers (2): idem::consume over idem::RabbitConsumer on amqps:// (CA verified, client
//                  certificate), keyed by default (the message_id: the outbox id), idem::RedisStore
//                  guard, the handler applying the payment into Redis with one fence-aware script
//
// Every worker is a child of this driver (http_pipeline_worker.cpp for the HTTP servers and the
// consumers, the relay program for the relays). rabbitmq-server boots (5-10 s) while redis-server,
// the schema and the HTTP servers start; once it is up the relays, the consumers and the clients
// start, and every 150-400 ms the driver SIGKILLs one process at random (a stage at random, then a
// process of it) and starts it again; the HTTP servers come back on their own ports. Once, when
// half the submissions are answered, it restarts rabbitmq-server (tests/support/rabbitmq_broker.sh
// halt, a clean stop, then resume: same node, ports, certificates and data). When the clients are
// done, the broker has been back for 3 s and Redis has 90% of the effects, it stops killing, lets
// everything drain, stops the workers and counts:
//   - every submission answered 201 in the end, a replay (Idempotent-Replayed) with the body of the
//     first answer, each event's answer naming the payment id of its one payments row;
//   - upstream: exactly one payments row per event, one outbox row per event, all sent;
//   - downstream, in Redis: each event's effect applied exactly once (pipe:effects), every
//     account's balance the sum of its payments, nothing dead-lettered. The consumers' store is a
//     lease-mode store, so the one window it leaves open (a consumer killed between the effect and
//     its completion: the takeover after the lease runs the handler again) is closed the way
//     docs/guarantees.md says, by a fence-aware effect; every handler run that reaches Redis is
//     counted, and a re-run must be a takeover (or follow a handler error), never a plain second run.
//
//   rabbitmq_pipeline_test        300 events, 25% of them submitted twice (IDEM_PIPELINE_EVENTS=N for more,
//                                 IDEM_PIPELINE_SEED=S to replay a run, IDEM_PIPELINE_KEEP=1 keeps the work
//                                 dir and the schema)
//
// Exit status 0 when every count is right; 1 otherwise, when a server cannot start (never a
// skip), or when the run does not drain within its bound. Every process started here is stopped
// by PID on the way out, failures included; the broker by its script (which stops it by PID).

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <unistd.h>

#include "idem/postgres.hpp"
#include "idem/postgres/outbox_writer.hpp"
#include "idem/rabbitmq/consumer.hpp"
#include "pipeline_driver.hpp"
#include "pipeline_plan.hpp"
#include "rabbitmq_pipeline.hpp"
#include "rabbitmq_support.hpp"  // AmqpAdmin (tests/outbox)
#include "redis_server.hpp"      // RedisServer (tests/redis)

#ifndef IDEM_HTTP_PIPELINE_WORKER
#error "IDEM_HTTP_PIPELINE_WORKER must name the idem_http_pipeline_worker program"
#endif
#ifndef IDEM_OUTBOX_RELAY_PROGRAM
#error "IDEM_OUTBOX_RELAY_PROGRAM must name the idem-outbox-relay program"
#endif
#ifndef IDEM_RABBITMQ_TLS_BROKER_SCRIPT
#error "IDEM_RABBITMQ_TLS_BROKER_SCRIPT must name tests/support/rabbitmq_tls_broker.sh"
#endif

using namespace std::chrono_literals;
using pipeline::at;
using pipeline::Clock;
using pipeline::fixture_conninfo;
using pipeline::Fleet;
using pipeline::Pg;
using pipeline::Proc;
using pipeline::random_hex;
using pipeline::read_stats;
using pipeline::secs;
using pipeline::tail_of;
namespace rmq = pipeline::rmq;

namespace {

constexpr int kServers = 2, kRelays = 2, kConsumers = 2, kClients = 2;
constexpr int kDupPercent = 25;

// The stages, as pipeline::Fleet numbers them.
enum Stage { http = 0, relay = 1, consumer = 2 };
const char* const kStageNames[] = {"HTTP server", "relay", "consumer"};

std::string quote(const std::string& s) { return "'" + s + "'"; }

// ---------------------------------------------------------------------------------------------
// rabbitmq-server with a TLS listener: tests/support/rabbitmq_tls_broker.sh (certificates, node),
// its restart through rabbitmq_broker.sh halt / resume. The scripts' output goes to the children's
// log; each runs on a thread of its own (std::async) so that the driver goes on meanwhile.

class TlsBroker {
public:
  TlsBroker(std::string state, std::string log) : state_(std::move(state)), log_(std::move(log)) {}
  ~TlsBroker() {
    if (pending_.valid()) pending_.wait();
    if (started_) std::system((line(IDEM_RABBITMQ_TLS_BROKER_SCRIPT, "stop") + " >/dev/null 2>&1").c_str());
  }
  TlsBroker(const TlsBroker&) = delete;
  TlsBroker& operator=(const TlsBroker&) = delete;

  void start_async() {
    started_ = true;
    run_async(line(IDEM_RABBITMQ_TLS_BROKER_SCRIPT, "start"));
  }
  // The node stopped cleanly (SIGTERM) and started again: same node, ports, certificates and data.
  void halt_async() { run_async(line(script_dir() + "/rabbitmq_broker.sh", "halt")); }
  void resume_async() { run_async(line(script_dir() + "/rabbitmq_broker.sh", "resume")); }
  // The script in flight finished: true once; throws when it failed (the test fails).
  bool finished(const char* what) {
    if (!pending_.valid() || pending_.wait_for(0s) != std::future_status::ready) return false;
    const int status = pending_.get();
    if (status != 0)
      throw std::runtime_error(std::string("pipeline: rabbitmq-server ") + what + " failed (see the log below):\n" + tail_of(log_, 3000));
    if (port_ == 0) {
      port_ = read_port("port");
      tls_port_ = read_port("tls_port");
    }
    return true;
  }
  [[nodiscard]] bool busy() const { return pending_.valid(); }

  [[nodiscard]] int port() const { return port_; }  // plain AMQP: the driver's own admin connection
  [[nodiscard]] std::string certs() const { return state_ + "/certs"; }
  [[nodiscard]] std::string amqps() const { return "amqps://guest:guest@127.0.0.1:" + std::to_string(tls_port_) + "/%2f"; }

private:
  static std::string script_dir() {
    const std::string s = IDEM_RABBITMQ_TLS_BROKER_SCRIPT;
    return s.substr(0, s.rfind('/'));
  }
  std::string line(const std::string& script, const char* cmd) const {
    return quote(script) + " " + cmd + " " + quote(state_) + " >>" + quote(log_) + " 2>&1";
  }
  void run_async(std::string cmd) {
    pending_ = std::async(std::launch::async, [cmd = std::move(cmd)] { return std::system(cmd.c_str()); });
  }
  int read_port(const char* file) const {
    std::ifstream in(state_ + "/" + file);
    int p = 0;
    if (!(in >> p) || p <= 0) throw std::runtime_error("pipeline: the broker script wrote no " + std::string(file));
    return p;
  }
  std::string state_, log_;
  bool started_ = false;
  std::future<int> pending_;
  int port_ = 0, tls_port_ = 0;
};

// ---------------------------------------------------------------------------------------------
// The clients: threads of the driver, each walking its share of the plan (pipeline_plan.hpp,
// duplicates included) over HTTP until every submission has a 201.

struct ClientStats {
  std::atomic<long long> created{0}, replayed{0}, in_use{0}, unavailable{0}, server_errors{0}, no_answer{0}, other{0};
  std::atomic<long long> body_mismatches{0}, submitted{0};
  std::mutex mu;
  std::unordered_map<std::string, std::string> body;  // event id -> the body of the first 201 seen
  std::vector<std::string> others;                    // what the unexpected answers were
};

void client(int c, std::stop_token stop, const std::vector<pipeline::Event>& evs, const std::vector<int>& order,
            const std::vector<int>& ports, int pace_ms, Clock::time_point deadline, ClientStats& st) {
  std::mt19937_64 rng(static_cast<std::uint64_t>(c) * 7919 + 17);
  for (std::size_t j = 0; j < order.size(); ++j) {
    const pipeline::Event& e = evs[static_cast<std::size_t>(order[j])];
    const std::string body = e.payload();
    const httplib::Headers headers{{"Idempotency-Key", "\"" + e.id + "\""}};
    std::size_t server = (static_cast<std::size_t>(c) + j) % ports.size();
    for (;;) {
      if (stop.stop_requested() || Clock::now() > deadline) return;
      httplib::Client cl("127.0.0.1", ports[server]);
      cl.set_connection_timeout(1, 0);
      cl.set_read_timeout(5, 0);
      const auto res = cl.Post(rmq::kRoute, headers, body, "text/plain");
      if (!res) {  // refused, reset or cut: the server was killed; the same request again, elsewhere
        ++st.no_answer;
        server = (server + 1) % ports.size();
        std::this_thread::sleep_for(20ms);
        continue;
      }
      if (res->status == 201) {
        const bool replay = res->get_header_value("Idempotent-Replayed") == "true";
        ++(replay ? st.replayed : st.created);
        std::lock_guard lock(st.mu);
        auto [it, first] = st.body.emplace(e.id, res->body);
        if (!first && it->second != res->body) ++st.body_mismatches;
        break;
      }
      if (res->status == 409 || res->status == 503 || res->status >= 500) {
        // 409: the key is held (a killed server's transaction not rolled back yet); 503: the store
        // was unavailable; 500: counted, and sent again (the key is released on a 5xx).
        ++(res->status == 409 ? st.in_use : res->status == 503 ? st.unavailable : st.server_errors);
        std::this_thread::sleep_for(std::chrono::milliseconds(50 + static_cast<int>(rng() % 100)));
        continue;
      }
      ++st.other;  // 400, 422, ...: a bug; not sent again
      std::lock_guard lock(st.mu);
      if (st.others.size() < 10) st.others.push_back(e.id + ": " + std::to_string(res->status) + " " + res->body);
      break;
    }
    ++st.submitted;
    if (pace_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(pace_ms));
  }
}

// ---------------------------------------------------------------------------------------------

struct Setup {
  std::string conninfo, schema, dir, amqps, certs;
  std::vector<int> ports;
  int redis_port = 0;
};

std::vector<std::string> proc_args(const Proc& p, const Setup& s) {
  switch (p.stage) {
    case http:
      return {IDEM_HTTP_PIPELINE_WORKER, "http", s.conninfo, s.schema, std::to_string(s.ports[static_cast<std::size_t>(p.slot)]),
              "http-" + std::to_string(p.slot), s.dir};
    case relay:
      return {IDEM_OUTBOX_RELAY_PROGRAM, "--publisher", "rabbitmq", "--rabbitmq-url", s.amqps, "--rabbitmq-ca-file",
              s.certs + "/ca.pem", "--rabbitmq-cert-file", s.certs + "/client.pem", "--rabbitmq-key-file",
              s.certs + "/client.key", "--rabbitmq-timeout-ms", "2000", "--conninfo", s.conninfo + " connect_timeout=2",
              "--schema", s.schema, "--table", rmq::kUpTable, "--batch", "32", "--poll-ms", "200", "--backoff-max-ms",
              "500", "--claim-idle-timeout-ms", "5000"};
    case consumer:
      return {IDEM_HTTP_PIPELINE_WORKER, "consumer", s.amqps, s.certs, std::to_string(s.redis_port),
              "consumer-" + std::to_string(p.slot), s.dir};
  }
  return {};
}

// A hash of the effect server as field -> integer value.
std::map<std::string, long long> hash(const idem::test::RedisServer& redis, const char* name) {
  std::map<std::string, long long> out;
  std::istringstream in(redis.command({"HGETALL", name}));
  std::string field, value;
  while (std::getline(in, field) && std::getline(in, value)) out[field] = std::atoll(value.c_str());
  return out;
}
long long total(const std::map<std::string, long long>& m) {
  long long n = 0;
  for (const auto& [k, v] : m) n += v;
  return n;
}

// The payment id in a 201 body: {"payment":"pm_...","event":"..."}.
std::string payment_of(const std::string& body) {
  const auto at = body.find("\"payment\":\"");
  if (at == std::string::npos) return {};
  const auto from = at + 11;
  return body.substr(from, body.find('"', from) - from);
}

int run() {
  int events = 300;
  if (const char* e = std::getenv("IDEM_PIPELINE_EVENTS"); e && *e) events = std::max(1, std::atoi(e));
  std::uint64_t seed = std::random_device{}();
  if (const char* s = std::getenv("IDEM_PIPELINE_SEED"); s && *s) seed = std::strtoull(s, nullptr, 10);
  const bool keep = pipeline::keep_requested();
  // The bounds: rabbitmq-server's boot (its script gives up after 3 attempts of 60 s), then the run
  // once it is up: 90 s for the default size (about 20 s of it are used).
  const auto boot_bound = 190s;
  const auto bound = 90s + std::chrono::milliseconds(static_cast<long long>(events) * 10);

  const auto t0 = Clock::now();
  const pipeline::WorkDir work(keep);

  // The plan: what each client submits.
  const auto evs = pipeline::events(events, seed);
  std::vector<std::vector<int>> orders;
  long long submissions = 0;
  for (int c = 0; c < kClients; ++c) {
    orders.push_back(pipeline::plan(events, kDupPercent, seed, c, kClients));
    submissions += static_cast<long long>(orders.back().size());
  }
  const long long planned_dups = submissions - events;
  // Paced so that the submissions last about 8 s whatever the size (the broker's restart falls
  // inside them); no pacing for a large run.
  const int pace_ms = static_cast<int>(std::clamp<long long>(6000LL * kClients / std::max(1LL, submissions), 0, 40));

  std::printf("pipeline: seed %llu, %d events, %lld submissions (%lld duplicates), %d HTTP clients, %d HTTP servers, "
              "%d relays (idem-outbox-relay --publisher rabbitmq), %d consumers, a SIGKILL every 150-400 ms, pace %d ms, "
              "work dir %s\n",
              static_cast<unsigned long long>(seed), events, submissions, planned_dups, kClients, kServers, kRelays,
              kConsumers, pace_ms, work.path.c_str());
  std::fflush(stdout);

  // Servers: rabbitmq-server with TLS (booting meanwhile), a redis-server for the consumers' guard
  // and effect, the PostgreSQL fixture. Each fails the test when it cannot start, never skips.
  TlsBroker broker(work.path + "/rabbitmq", work.log());
  broker.start_async();
  idem::test::RedisServer redis;
  const std::string conninfo = fixture_conninfo();

  // A schema of this run's own on the shared fixture server: the HTTP servers' store (with its
  // outbox) and the payments, without any uniqueness (a double effect is a second row).
  Setup setup{conninfo, "pipeb_" + random_hex(), work.path, "", "", {}, redis.port()};
  for (int i = 0; i < kServers; ++i) setup.ports.push_back(idem::test::free_port());
  const pipeline::SchemaGuard schema_guard{conninfo, setup.schema, keep};
  {
    Pg pg(conninfo);
    pg.exec("SET client_min_messages = warning; DROP SCHEMA IF EXISTS " + setup.schema + " CASCADE; CREATE SCHEMA " + setup.schema);
    pg.exec("CREATE TABLE " + setup.schema +
            ".payments (event_id text NOT NULL, account int NOT NULL, amount bigint NOT NULL, payment_id text NOT NULL)");
    idem::PostgresStore up({.conninfo = conninfo}, {.schema = setup.schema, .table = rmq::kUpTable,
                                                    .mode = idem::PostgresMode::transactional, .outbox = true});
    up.migrate();
  }

  Fleet fleet([&setup](const Proc& p) { return proc_args(p, setup); }, work.log_fd);
  for (int i = 0; i < kServers; ++i) fleet.add(http, i);

  auto deadline = Clock::now() + boot_bound;
  ClientStats cst;
  std::vector<std::jthread> clients;  // stopped and joined (their destructor) before what they use goes

  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> gap(150, 400);
  long long kills[3] = {0, 0, 0};
  long long unexpected = 0, restarts = 0;
  enum { booting, up, halting, resuming, back } broker_state = booting;
  bool chaos = true, drained = false;
  double up_at = 0, restart_at = 0, down_at = 0, back_at = 0, chaos_end = 0;
  auto next_kill = Clock::time_point::max();  // from the broker's start on
  auto last_check = Clock::now();
  long long effects_seen = 0;

  auto effects_now = [&]() -> long long {
    try {
      return std::atoll(redis.command({"HLEN", rmq::kEffects}).c_str());
    } catch (const std::exception&) {
      return effects_seen;
    }
  };

  while (Clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
    const auto now = Clock::now();
    // Nothing ends by itself: whatever did is started again (and counted).
    unexpected += fleet.restart_exited([](const Proc&, int) { return false; });
    if (chaos && now >= next_kill) {
      if (const int s = fleet.kill_one(rng, 3); s >= 0) {
        ++kills[s];
        ++restarts;
      }
      next_kill = now + std::chrono::milliseconds(gap(rng));
    }
    // The broker booted: its queues (the consumer's own declaration: queue, dead-letter exchange
    // and queue, delay queue), then the relays and the consumers.
    if (broker_state == booting && broker.finished("start")) {
      broker_state = up;
      up_at = secs(now - t0);
      deadline = now + bound;
      setup.amqps = broker.amqps();
      setup.certs = broker.certs();
      {
        idem::RabbitConsumerOptions o;
        o.url = "amqp://guest:guest@127.0.0.1:" + std::to_string(broker.port()) + "/%2f";
        o.queue = rmq::kQueue;
        idem::RabbitConsumer declare(o);
      }
      for (int i = 0; i < kConsumers; ++i) fleet.add(consumer, i);
      for (int i = 0; i < kRelays; ++i) fleet.add(relay, i);
      // Every stage has work from now on: the clients start, and so do the kills.
      for (int c = 0; c < kClients; ++c)
        clients.emplace_back([&, c](std::stop_token stop) {
          client(c, stop, evs, orders[static_cast<std::size_t>(c)], setup.ports, pace_ms, deadline, cst);
        });
      next_kill = now + std::chrono::milliseconds(gap(rng));
      std::printf("pipeline: rabbitmq-server up at %.1f s (amqps://127.0.0.1:%s); relays, consumers and clients started\n",
                  up_at, setup.amqps.substr(setup.amqps.rfind(':') + 1).c_str());
      std::fflush(stdout);
    }
    // The broker, once, when half the submissions are answered and it has been up 2 s: a clean
    // stop of the node (SIGTERM), then the same node started again (ports, certificates, data).
    if (broker_state == up && cst.submitted * 2 >= submissions && secs(now - t0) - up_at >= 2) {
      broker_state = halting;
      restart_at = secs(now - t0);
      effects_seen = effects_now();
      broker.halt_async();
      std::printf("pipeline: rabbitmq-server stopping (SIGTERM) at %.1f s: %lld submissions answered, %lld effects applied\n",
                  restart_at, cst.submitted.load(), effects_seen);
      std::fflush(stdout);
    }
    if (broker_state == halting && broker.finished("halt")) {
      broker_state = resuming;
      down_at = secs(Clock::now() - t0);
      effects_seen = effects_now();
      broker.resume_async();
      std::printf("pipeline: rabbitmq-server stopped at %.1f s (%lld effects applied); starting it again\n", down_at, effects_seen);
      std::fflush(stdout);
    }
    if (broker_state == resuming && broker.finished("resume")) {
      broker_state = back;
      back_at = secs(Clock::now() - t0);
      std::printf("pipeline: rabbitmq-server back at %.1f s (down %.1f s)\n", back_at, back_at - down_at);
      std::fflush(stdout);
    }
    const bool restarted = broker_state == back;
    // The kills go on while there is work: they stop once the clients are done, the broker has
    // been back for 3 s (the backlog of its downtime and its redeliveries under fire) and Redis
    // has 90% of the effects.
    const bool clients_done = cst.submitted == submissions;
    if (chaos && clients_done && restarted && secs(now - t0) - back_at >= 3 && now - last_check >= 250ms) {
      last_check = now;
      effects_seen = effects_now();
      if (effects_seen * 10 >= events * 9LL) {
        chaos = false;
        chaos_end = secs(now - t0);
        std::printf("pipeline: clients done, %lld of %d effects applied at %.1f s; no more kills, draining\n",
                    effects_seen, events, chaos_end);
        std::fflush(stdout);
      }
    }
    // Drained: every effect applied, no unsent outbox row, nothing ready in the queue.
    if (!chaos && now - last_check >= 250ms) {
      last_check = now;
      try {
        effects_seen = effects_now();
        const long long unsent =
            Pg(conninfo).count("SELECT count(*) FROM " + setup.schema + "." + rmq::kUpTable + "_outbox WHERE sent_at IS NULL");
        if (unsent == 0 && effects_seen >= events && idem::test::AmqpAdmin(broker.port()).ready(rmq::kQueue) == 0) {
          drained = true;
          break;
        }
      } catch (const std::exception&) {
      }
    }
  }
  const double wall_run = secs(Clock::now() - t0);
  fleet.stop_all(5s);
  for (auto& t : clients) t.request_stop();
  for (auto& t : clients) t.join();
  clients.clear();

  // ---- The counts.
  const std::string S = setup.schema;
  Pg pg(conninfo);
  std::map<std::string, const pipeline::Event*> by_id;
  std::map<std::string, long long> expected_balance;
  for (const auto& e : evs) {
    by_id[e.id] = &e;
    expected_balance[std::to_string(e.account)] += e.amount;
  }

  // The answers: one per submission, each event's naming the payment row it made.
  long long answer_payment_mismatch = 0, unanswered = 0;
  // Upstream: one payments row per event.
  long long up_lost = 0, up_double = 0, up_rows = 0;
  {
    std::unordered_map<std::string, std::vector<std::string>> rows;  // event -> payment ids
    for (const auto& r : pg.rows("SELECT event_id, payment_id FROM " + S + ".payments")) {
      rows[r[0]].push_back(r[1]);
      ++up_rows;
    }
    std::lock_guard lock(cst.mu);
    for (const auto& e : evs) {
      const auto it = rows.find(e.id);
      const std::size_t n = it == rows.end() ? 0 : it->second.size();
      if (n == 0) ++up_lost;
      if (n > 1) up_double += static_cast<long long>(n) - 1;
      const auto b = cst.body.find(e.id);
      if (b == cst.body.end())
        ++unanswered;
      else if (n != 1 || payment_of(b->second) != it->second[0])
        ++answer_payment_mismatch;
    }
  }
  const auto ob = pg.rows("SELECT count(*), count(*) FILTER (WHERE sent_at IS NULL) FROM " + S + "." + rmq::kUpTable + "_outbox");
  const long long outbox_rows = std::atoll(ob[0][0].c_str()), outbox_unsent = std::atoll(ob[0][1].c_str());

  // Downstream, in Redis.
  const auto effects = hash(redis, rmq::kEffects), balance = hash(redis, rmq::kBalance), fence = hash(redis, rmq::kFence);
  const auto runs = hash(redis, rmq::kRuns), again = hash(redis, rmq::kAgain), again_nt = hash(redis, rmq::kAgainNoTakeover);
  const auto stale = hash(redis, rmq::kStale);
  long long down_lost = 0, down_double = 0, down_unexpected = 0, balance_wrong = 0, keys_unexpected = 0;
  for (const auto& e : evs) {
    const auto it = effects.find(e.id);
    if (it == effects.end())
      ++down_lost;
    else if (it->second > 1)
      down_double += it->second - 1;
  }
  for (const auto& [id, n] : effects)
    if (!by_id.count(id)) down_unexpected += n;
  for (const auto& [account, sum] : expected_balance) {
    const auto it = balance.find(account);
    if ((it == balance.end() ? 0 : it->second) != sum) ++balance_wrong;
  }
  if (balance.size() != expected_balance.size()) ++balance_wrong;
  {
    // Every message key the consumers saw is an event's outbox id: the relay's message_id, the
    // HTTP store's key being "http:" + the Idempotency-Key.
    std::set<std::string> expected;
    for (const auto& e : evs) expected.insert(idem::outbox_message_id(S + "." + rmq::kUpTable, "http:" + e.id, 0));
    for (const auto& [key, n] : runs)
      if (!expected.count(key)) ++keys_unexpected;
    if (fence.size() != expected.size()) ++keys_unexpected;
  }
  long long dlq = -1;
  try {
    dlq = idem::test::AmqpAdmin(broker.port()).ready(std::string(rmq::kQueue) + ".dlq");
  } catch (const std::exception& e) {
    std::printf("pipeline: cannot read the dead-letter queue: %s\n", e.what());
  }
  const auto hs = read_stats(work.path, "http");
  const auto cs = read_stats(work.path, "consumer");

  std::printf("pipeline: kills: %lld HTTP servers, %lld relays, %lld consumers (%lld SIGKILLs, each started again); "
              "unexpected exits (started again): %lld; rabbitmq-server restarts: %d\n",
              kills[http], kills[relay], kills[consumer], restarts, unexpected, broker_state == back ? 1 : 0);
  std::printf("pipeline: clients: %lld of %lld submissions answered 201 (%lld executed, %lld replayed, %lld planned "
              "duplicates); on the way: %lld without an answer (sent again), %lld 409, %lld 503, %lld other 5xx; "
              "%lld unexpected answers, %lld replays with another body, %lld answers naming another payment\n",
              cst.created + cst.replayed, submissions, cst.created.load(), cst.replayed.load(), planned_dups,
              cst.no_answer.load(), cst.in_use.load(), cst.unavailable.load(), cst.server_errors.load(), cst.other.load(),
              cst.body_mismatches.load(), answer_payment_mismatch);
  std::printf("pipeline: stage 1 (HTTP servers): %lld payments rows for %d events (double %lld, lost %lld); guard "
              "outcomes: executed %lld, duplicates %lld, in_flight %lld, errors %lld\n",
              up_rows, events, up_double, up_lost, at(hs, 'X'), at(hs, 'U'), at(hs, 'I'), at(hs, 'E'));
  std::printf("pipeline: stage 2 (relays): outbox %lld rows, %lld unsent\n", outbox_rows, outbox_unsent);
  std::printf("pipeline: stage 3 (consumers): effects for %zu events (double %lld, lost %lld, unexpected %lld), "
              "%lld account balances wrong; handler runs %lld (re-runs by a takeover %lld, without one %lld, refused "
              "as stale %lld); guard outcomes: executed %lld, duplicates %lld, in_flight %lld, lease_lost %lld, "
              "errors %lld; broker unreachable %lld times; dead letters %lld\n",
              effects.size(), down_double, down_lost, down_unexpected, balance_wrong, total(runs), total(again),
              total(again_nt), total(stale), at(cs, 'X'), at(cs, 'U'), at(cs, 'I'), at(cs, 'L'), at(cs, 'E'), at(cs, 'C'), dlq);

  std::vector<std::string> failures;
  if (broker_state == booting)
    failures.push_back("rabbitmq-server did not start within " + std::to_string(static_cast<long long>(secs(boot_bound))) + " s");
  if (!drained)
    failures.push_back("did not drain within " + std::to_string(static_cast<long long>(secs(bound))) + " s of the broker's start");
  if (cst.created + cst.replayed != submissions || unanswered)
    failures.push_back("not every submission was answered 201");
  if (cst.other || cst.body_mismatches || answer_payment_mismatch)
    failures.push_back("unexpected answers, or answers that do not match the payment stored");
  if (cst.replayed < planned_dups) failures.push_back("fewer replays than planned duplicates");
  if (up_double || up_lost || up_rows != events) failures.push_back("stage 1 effects are not exactly one per event");
  if (outbox_rows != events || outbox_unsent != 0) failures.push_back("the outbox is not one sent row per event");
  if (down_double || down_lost || down_unexpected || static_cast<long long>(effects.size()) != events || balance_wrong)
    failures.push_back("stage 3 effects are not exactly one per event");
  if (keys_unexpected) failures.push_back("the consumers saw message keys that are not the events' outbox ids");
  if (total(again_nt) > 0 && at(cs, 'E') == 0)
    failures.push_back("a handler ran again without a takeover and without a handler error before it");
  if (dlq != 0) failures.push_back("dead letters (or the dead-letter queue could not be read)");
  if (broker_state != back) failures.push_back("rabbitmq-server was not restarted");
  for (int s = 0; s < 3; ++s)
    if (kills[s] == 0) failures.push_back(std::string("no ") + kStageNames[s] + " was killed");
  std::printf("pipeline: wall %.1f s (broker up at %.1f s, stopping at %.1f s, down at %.1f s, back at %.1f s, chaos until "
              "%.1f s): %s\n",
              wall_run, up_at, restart_at, down_at, back_at, chaos_end, failures.empty() ? "PASS" : "FAIL");
  for (const auto& f : failures) std::printf("pipeline: FAILED: %s\n", f.c_str());
  {
    std::lock_guard lock(cst.mu);
    for (const auto& o : cst.others) std::printf("pipeline: unexpected answer: %s\n", o.c_str());
  }
  std::fflush(stdout);
  if (!failures.empty()) std::fprintf(stderr, "children's log (tail):\n%s\n", tail_of(work.log(), 6000).c_str());
  return failures.empty() ? 0 : 1;
}

}  // namespace

int main() {
  std::signal(SIGPIPE, SIG_IGN);
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rabbitmq_pipeline_test: FAILED: %s\n", e.what());
    return 1;
  }
}
