// Pipeline (a) of issue 41, "Kafka payments", end to end across processes, with crashes:
//
//   producers (2 processes) ── librdkafka idempotent producer ──► topic `payments` (4 partitions)
//        │                     key = the event id; 25% of the events produced twice, and a chunk
//        │                     not yet checkpointed produced again after a kill
//        ▼
//   payments consumers (2): idem::consume over idem::kafka::Source (group pipe-payments), keyed by
//        │                  default (the Kafka key: the event id), PostgreSQL transactional guard:
//        │                  payments row + ctx.outbox().send("ledger", ...), one transaction
//        │                  (SCHEMA.up_records, its outbox SCHEMA.up_records_outbox)
//        ▼
//   idem-outbox-relay --publisher kafka (2, the real program) ──► topic `ledger` (4 partitions),
//        │                                header idem-outbox-id
//        ▼
//   ledger consumers (2): idem::consume over idem::kafka::Source (group pipe-ledger), keyed by
//                         default (the idem-outbox-id header), PostgreSQL transactional guard
//                         (SCHEMA.down_records): a SCHEMA.ledger row and the account's balance
//
// Kafka is librdkafka's mock cluster (3 brokers), hosted by this driver process and reached by the
// children over TCP on 127.0.0.1 (rd_kafka_mock_cluster_bootstraps()). Every process is a child of
// this driver (kafka_pipeline_worker.cpp for the producers and consumers, the relay program for the
// relays). The driver SIGKILLs them at random and starts them again: a producer or a relay every
// 400-900 ms, a consumer every 4-6 s while the producers run (each group in turn, each at least
// once): each kill of a group member stalls its partitions for several seconds with the mock
// coordinator, at the faster rate no group would ever settle. "The broker restarted once": when half the submissions
// are acknowledged, the brokers that lead every partition (2 and 3; broker 1 coordinates the
// groups) are set down (rd_kafka_mock_broker_set_down: connections dropped and refused) for 3 s,
// then up again (rd_kafka_mock_broker_set_up); the mock keeps its topics, offsets and groups
// meanwhile, as a restarted broker keeps its log. The coordinator stays up because librdkafka
// 2.0.2's mock can abort this process when a client re-sends a JoinGroup after its coordinator
// connection failed (`rd_kafka_mock_cgrp_member_add: Assertion !member->resp`, seen once with
// every broker down). When the
// producers are done, the brokers have been back for 2 s and the ledger has 90% of the events it
// stops killing, lets everything drain (the outbox sent, the ledger complete, both groups'
// committed offsets at the topics' ends), stops the workers and counts in PostgreSQL:
//   - stage 1: exactly one payments row per event; one outbox row per event, all sent;
//   - stage 3: exactly one ledger row per event, under the id of its outbox message (the ledger
//     has no uniqueness: a double effect is a second row), every account's balance the sum of its
//     payments; nothing in the dead-letter topics.
//
//   kafka_pipeline_test           300 events, 25% of them produced twice (IDEM_PIPELINE_EVENTS=N for more,
//                                 IDEM_PIPELINE_SEED=S to replay a run, IDEM_PIPELINE_KEEP=1 keeps the work
//                                 dir and the schema; for diagnosis, IDEM_PIPELINE_NO_KILLS=1 kills nothing
//                                 and IDEM_PIPELINE_KAFKA_DEBUG=cgrp,... sets the consumers' librdkafka
//                                 `debug`, into the work dir's children.log)
//
// Exit status 0 when every count is right; 1 otherwise, when the mock cluster cannot start (never a
// skip), or when the run does not drain within its bound. Every process started here is stopped by
// PID on the way out, failures included.

#include <fcntl.h>
#include <librdkafka/rdkafka.h>
#include <librdkafka/rdkafka_mock.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "idem/postgres.hpp"
#include "idem/postgres/outbox_writer.hpp"
#include "pipeline_driver.hpp"
#include "pipeline_plan.hpp"

#ifndef IDEM_KAFKA_PIPELINE_WORKER
#error "IDEM_KAFKA_PIPELINE_WORKER must name the idem_kafka_pipeline_worker program"
#endif
#ifndef IDEM_OUTBOX_RELAY_PROGRAM
#error "IDEM_OUTBOX_RELAY_PROGRAM must name the idem-outbox-relay program"
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

namespace {

constexpr int kProducers = 2, kPaymentConsumers = 2, kRelays = 2, kLedgerConsumers = 2;
constexpr int kDupPercent = 25;
constexpr int kBrokers = 3, kPartitions = 4;
constexpr const char* kPaymentsTopic = "payments";
constexpr const char* kLedgerTopic = "ledger";
constexpr const char* kPaymentsGroup = "pipe-payments";
constexpr const char* kLedgerGroup = "pipe-ledger";
constexpr auto kBrokerOutage = 3s;

// ---------------------------------------------------------------------------------------------
// The mock cluster, in a producer handle of its own (which also reads watermarks), and a consumer
// handle per group that only reads its committed offsets (it never joins).

void set(rd_kafka_conf_t* conf, const char* k, const std::string& v) {
  char err[512];
  if (rd_kafka_conf_set(conf, k, v.c_str(), err, sizeof err) != RD_KAFKA_CONF_OK) {
    rd_kafka_conf_destroy(conf);
    throw std::runtime_error(std::string("pipeline: ") + k + ": " + err);
  }
}

// The driver's own handles stay quiet: their "connection refused" while the brokers are down is
// the point of the outage, not news.
void quiet(rd_kafka_conf_t* conf) {
  rd_kafka_conf_set_log_cb(conf, [](const rd_kafka_t*, int, const char*, const char*) {});
}

class Cluster {
 public:
  Cluster() {
    rd_kafka_conf_t* conf = rd_kafka_conf_new();
    set(conf, "test.mock.num.brokers", std::to_string(kBrokers));
    quiet(conf);
    char err[512];
    rk_ = rd_kafka_new(RD_KAFKA_PRODUCER, conf, err, sizeof err);
    if (rk_ == nullptr) {
      rd_kafka_conf_destroy(conf);
      throw std::runtime_error(std::string("pipeline: cannot start librdkafka's mock cluster: ") + err);
    }
    mc_ = rd_kafka_handle_mock_cluster(rk_);
    if (mc_ == nullptr) throw std::runtime_error("pipeline: librdkafka made no mock cluster");
    bootstraps_ = rd_kafka_mock_cluster_bootstraps(mc_);
  }
  ~Cluster() {
    for (auto& [g, c] : groups_) {
      rd_kafka_destroy(c);
    }
    rd_kafka_destroy(rk_);
  }
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  const std::string& bootstraps() const { return bootstraps_; }
  void create_topic(const std::string& topic, int partitions) {
    if (const auto e = rd_kafka_mock_topic_create(mc_, topic.c_str(), partitions, kBrokers))
      throw std::runtime_error("pipeline: cannot create topic " + topic + ": " + rd_kafka_err2str(e));
  }
  // Broker 1 coordinates the groups; brokers 2 and 3 lead every partition (the data's brokers).
  void place(const std::vector<std::pair<std::string, int>>& topics, const std::vector<std::string>& groups) {
    for (const auto& g : groups) rd_kafka_mock_coordinator_set(mc_, "group", g.c_str(), 1);
    for (const auto& [topic, partitions] : topics)
      for (int p = 0; p < partitions; ++p) rd_kafka_mock_partition_set_leader(mc_, topic.c_str(), p, 2 + p % 2);
  }
  // The data's brokers drop their connections and refuse new ones until up(): no produce, no
  // fetch, no commit reaches a partition. The coordinator stays: librdkafka 2.0.2's mock can abort
  // on a JoinGroup re-sent after a failed coordinator connection (Assertion !member->resp).
  void down() {
    for (int b = 2; b <= kBrokers; ++b) rd_kafka_mock_broker_set_down(mc_, b);
  }
  void up() {
    for (int b = 2; b <= kBrokers; ++b) rd_kafka_mock_broker_set_up(mc_, b);
  }

  // The high watermark of each partition; throws when the cluster does not answer.
  std::vector<std::int64_t> ends(const std::string& topic, int partitions) {
    std::vector<std::int64_t> out;
    for (int p = 0; p < partitions; ++p) {
      std::int64_t lo = 0, hi = 0;
      if (const auto e = rd_kafka_query_watermark_offsets(rk_, topic.c_str(), p, &lo, &hi, 3'000))
        throw std::runtime_error("pipeline: no watermarks of " + topic + ": " + rd_kafka_err2str(e));
      out.push_back(hi);
    }
    return out;
  }
  std::int64_t messages(const std::string& topic, int partitions) {
    std::int64_t n = 0;
    for (const auto hi : ends(topic, partitions)) n += hi;
    return n;
  }

  // The group's committed offsets (-1001 where nothing is committed); throws when not answered.
  std::vector<std::int64_t> committed(const std::string& group, const std::string& topic, int partitions) {
    rd_kafka_t*& c = groups_[group];
    if (c == nullptr) {
      rd_kafka_conf_t* conf = rd_kafka_conf_new();
      set(conf, "bootstrap.servers", bootstraps_);
      set(conf, "group.id", group);
      set(conf, "enable.auto.commit", "false");
      quiet(conf);
      char err[512];
      c = rd_kafka_new(RD_KAFKA_CONSUMER, conf, err, sizeof err);
      if (c == nullptr) {
        rd_kafka_conf_destroy(conf);
        throw std::runtime_error(std::string("pipeline: ") + err);
      }
    }
    rd_kafka_topic_partition_list_t* list = rd_kafka_topic_partition_list_new(partitions);
    for (int p = 0; p < partitions; ++p) rd_kafka_topic_partition_list_add(list, topic.c_str(), p);
    const auto e = rd_kafka_committed(c, list, 3'000);
    std::vector<std::int64_t> out;
    for (int p = 0; p < partitions && e == RD_KAFKA_RESP_ERR_NO_ERROR; ++p) out.push_back(list->elems[p].offset);
    rd_kafka_topic_partition_list_destroy(list);
    if (e != RD_KAFKA_RESP_ERR_NO_ERROR)
      throw std::runtime_error("pipeline: no committed offsets of " + group + ": " + rd_kafka_err2str(e));
    return out;
  }

 private:
  rd_kafka_t* rk_ = nullptr;
  rd_kafka_mock_cluster_t* mc_ = nullptr;
  std::string bootstraps_;
  std::map<std::string, rd_kafka_t*> groups_;
};

// idem::test::spawn, and the child closes every fd above 2 before exec. The mock cluster's
// sockets (its listeners and the connections it accepted) are not close-on-exec: a child holding a
// copy of a connection keeps it open after the mock closes its own (a killed client's, or all of
// them when the brokers go down), and its peer then waits for answers that never come.
// The parent returns only once the child has exec'd (a close-on-exec pipe reaches EOF): until
// then the child holds a copy of the mock's listeners, and a broker set down in that window cannot
// bind its port again (librdkafka aborts: "Failed to-create mock broker listener").
pid_t spawn_without_fds(const std::vector<std::string>& args, int out_fd) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();
  int exec_pipe[2];
  if (::pipe2(exec_pipe, O_CLOEXEC) != 0) throw std::runtime_error("pipeline: pipe2 failed");
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(exec_pipe[0]);
    ::close(exec_pipe[1]);
    throw std::runtime_error("pipeline: fork failed");
  }
  if (pid == 0) {  // async-signal-safe calls only until exec
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    const int null = ::open("/dev/null", O_RDWR);
    ::dup2(null, 0);
    ::dup2(out_fd >= 0 ? out_fd : null, 1);
    ::dup2(out_fd >= 0 ? out_fd : null, 2);
    const int keep = exec_pipe[1];  // closed by exec itself
    if ((keep > 3 && ::close_range(3, keep - 1, 0) != 0) || ::close_range(keep + 1, ~0U, 0) != 0)
      for (int fd = 3; fd < 65536; ++fd)  // a kernel before 5.9
        if (fd != keep) ::close(fd);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(exec_pipe[1]);
  char byte;
  while (::read(exec_pipe[0], &byte, 1) < 0 && errno == EINTR) {
  }
  ::close(exec_pipe[0]);
  return pid;
}

// ---------------------------------------------------------------------------------------------

// The stages, as pipeline::Fleet numbers them.
enum Stage { producer = 0, payments = 1, relay = 2, ledger = 3 };
constexpr int kStages = 4;
const char* const kStageNames[] = {"producer", "payments consumer", "relay", "ledger consumer"};

struct Setup {
  std::string conninfo, schema, brokers, dir;
  int events = 0;
  std::uint64_t seed = 0;
  int pace_ms = 0;
};

std::vector<std::string> proc_args(const Proc& p, const Setup& s) {
  switch (p.stage) {
    case producer:
      return {IDEM_KAFKA_PIPELINE_WORKER,
              "producer",
              s.brokers,
              std::to_string(p.slot),
              std::to_string(kProducers),
              std::to_string(s.events),
              std::to_string(kDupPercent),
              std::to_string(s.seed),
              std::to_string(s.pace_ms),
              s.dir};
    case payments:
      return {IDEM_KAFKA_PIPELINE_WORKER,           "payments", s.brokers, s.conninfo, s.schema,
              "payments-" + std::to_string(p.slot), s.dir};
    case relay:
      return {IDEM_OUTBOX_RELAY_PROGRAM,
              "--publisher",
              "kafka",
              "--kafka-brokers",
              s.brokers,
              "--kafka-timeout-ms",
              "5000",
              "--kafka-client-id",
              "pipe-relay-" + std::to_string(p.slot),
              "--kafka-property",
              "log_level=3",
              "--kafka-property",
              "reconnect.backoff.max.ms=500",
              "--conninfo",
              s.conninfo + " connect_timeout=2",
              "--schema",
              s.schema,
              "--table",
              pipeline::kUpTable,
              "--batch",
              "32",
              "--poll-ms",
              "200",
              "--backoff-max-ms",
              "500",
              "--claim-idle-timeout-ms",
              "5000"};
    case ledger:
      return {IDEM_KAFKA_PIPELINE_WORKER,         "ledger", s.brokers, s.conninfo, s.schema,
              "ledger-" + std::to_string(p.slot), s.dir};
  }
  return {};
}

std::string join(const std::vector<std::int64_t>& v) {
  std::string s;
  for (const auto x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s;
}

int run() {
  int events = 300;
  if (const char* e = std::getenv("IDEM_PIPELINE_EVENTS"); e && *e) events = std::max(1, std::atoi(e));
  std::uint64_t seed = std::random_device{}();
  if (const char* s = std::getenv("IDEM_PIPELINE_SEED"); s && *s) seed = std::strtoull(s, nullptr, 10);
  const bool keep = pipeline::keep_requested();
  // The bound of the whole run: 90 s for the default size, more for a larger one.
  const auto bound = 90s + std::chrono::milliseconds(static_cast<long long>(events) * 15);

  const auto t0 = Clock::now();
  const pipeline::WorkDir work(keep);

  // The plan: what each producer submits (the same computation as the producers').
  const auto evs = pipeline::events(events, seed);
  long long submissions = 0;
  for (int p = 0; p < kProducers; ++p)
    submissions += static_cast<long long>(pipeline::plan(events, kDupPercent, seed, p, kProducers).size());
  const long long planned_dups = submissions - events;
  std::map<int, long long> expected_balance;
  for (const auto& e : evs) expected_balance[e.account] += e.amount;
  // Paced so that production lasts about 9 s whatever the size (every stage's processes are
  // killed while there is work); less pacing for a larger run, none beyond 1,800 submissions.
  const int pace_ms = static_cast<int>(std::clamp<long long>(9000LL * kProducers / std::max(1LL, submissions), 0, 80));

  std::printf(
      "pipeline: seed %llu, %d events, %lld submissions (%lld duplicates), %d producers, %d payments consumers, "
      "%d relays (idem-outbox-relay --publisher kafka), %d ledger consumers, a SIGKILL of a producer or relay every "
      "400-900 ms and of a consumer every 4-6 s while producing, pace %d ms, "
      "work dir %s\n",
      static_cast<unsigned long long>(seed), events, submissions, planned_dups, kProducers, kPaymentConsumers, kRelays,
      kLedgerConsumers, pace_ms, work.path.c_str());

  // Kafka: librdkafka's mock cluster in this process (fails, never skips).
  Cluster cluster;
  cluster.create_topic(kPaymentsTopic, kPartitions);
  cluster.create_topic(kLedgerTopic, kPartitions);
  cluster.create_topic(std::string(kPaymentsTopic) + ".dlq", 1);
  cluster.create_topic(std::string(kLedgerTopic) + ".dlq", 1);
  cluster.place({{kPaymentsTopic, kPartitions},
                 {kLedgerTopic, kPartitions},
                 {std::string(kPaymentsTopic) + ".dlq", 1},
                 {std::string(kLedgerTopic) + ".dlq", 1}},
                {kPaymentsGroup, kLedgerGroup});
  std::printf("pipeline: librdkafka %s mock cluster, %d brokers on %s\n", rd_kafka_version_str(), kBrokers,
              cluster.bootstraps().c_str());
  std::fflush(stdout);

  // A schema of this run's own on the shared fixture server: the stores of stages 1 and 3, the
  // payments (stage 1's effect), the ledger and the balances (stage 3's), no uniqueness anywhere.
  const std::string conninfo = fixture_conninfo();
  Setup setup{conninfo, "pipe_" + random_hex(), cluster.bootstraps(), work.path, events, seed, pace_ms};
  const pipeline::SchemaGuard schema_guard{conninfo, setup.schema, keep};
  {
    Pg pg(conninfo);
    const std::string S = setup.schema;
    pg.exec("SET client_min_messages = warning; DROP SCHEMA IF EXISTS " + S + " CASCADE; CREATE SCHEMA " + S);
    pg.exec("CREATE TABLE " + S +
            ".payments (event_id text NOT NULL, account int NOT NULL, amount bigint NOT NULL, "
            "consumer text NOT NULL)");
    pg.exec("CREATE TABLE " + S +
            ".ledger (outbox_id text NOT NULL, event_id text NOT NULL, payload text NOT NULL, "
            "consumer text NOT NULL, position text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())");
    pg.exec("CREATE TABLE " + S +
            ".balances (account int PRIMARY KEY, balance bigint NOT NULL DEFAULT 0, "
            "payments int NOT NULL DEFAULT 0)");
    pg.exec("INSERT INTO " + S + ".balances(account) SELECT generate_series(0, " +
            std::to_string(pipeline::kAccounts - 1) + ")");
    idem::PostgresStore up(
        {.conninfo = conninfo},
        {.schema = S, .table = pipeline::kUpTable, .mode = idem::PostgresMode::transactional, .outbox = true});
    up.migrate();
    idem::PostgresStore down({.conninfo = conninfo},
                             {.schema = S, .table = pipeline::kDownTable, .mode = idem::PostgresMode::transactional});
    down.migrate();
  }

  Fleet fleet([&setup](const Proc& p) { return proc_args(p, setup); }, work.log_fd, spawn_without_fds);
  for (int i = 0; i < kLedgerConsumers; ++i) fleet.add(ledger, i);
  for (int i = 0; i < kRelays; ++i) fleet.add(relay, i);
  for (int i = 0; i < kPaymentConsumers; ++i) fleet.add(payments, i);
  for (int i = 0; i < kProducers; ++i) fleet.add(producer, i);

  const bool kill = std::getenv("IDEM_PIPELINE_NO_KILLS") == nullptr;  // diagnosis only
  std::mt19937_64 rng(seed);
  // Two killers. The producers and the relays: one of them every 400-900 ms, until the drain.
  // The consumers: one every 4-6 s, of each group in turn (payments, ledger, payments...), while
  // the producers run and until each group lost a member: each kill of a group member stalls the
  // partitions it had for up to about 12 s with the mock coordinator (the session of 4.5 s timing
  // out, the rejoin wait of 3.5 s, a sync the dead member never sends; kafka_pipeline_worker.cpp),
  // so at the producers' rate no group would ever settle, and a kill near the end of the run
  // would only make the run longer.
  std::uniform_int_distribution<int> gap(400, 900), consumer_gap(4000, 6000);
  long long kills[kStages] = {0, 0, 0, 0};
  long long unexpected = 0, restarts = 0;
  bool broker_down = false, broker_restarted = false, chaos = true, drained = false;
  double broker_down_at = 0, broker_up_at = 0, chaos_end = 0;
  Clock::time_point broker_up_due{}, broker_back{};
  auto next_kill = Clock::now() + std::chrono::milliseconds(gap(rng));
  auto next_consumer_kill = Clock::now() + std::chrono::milliseconds(consumer_gap(rng));
  auto last_check = Clock::now();
  const auto deadline = t0 + bound;
  std::string drain_state;

  auto progress = [&] {
    long long done = 0;
    for (int p = 0; p < kProducers; ++p)
      done +=
          static_cast<long long>(pipeline::read_progress(work.path + "/producer-" + std::to_string(p) + ".progress"));
    return done;
  };

  while (Clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
    const auto now = Clock::now();
    // Processes that ended by themselves: a producer that finished is done; anything else is
    // started again (and counted).
    unexpected += fleet.restart_exited(
        [](const Proc& p, int st) { return p.stage == producer && WIFEXITED(st) && WEXITSTATUS(st) == 0; });
    // The killer: a stage at random (one with a live process), then one of its processes.
    auto kill_one_of = [&](std::vector<int> stages) {
      std::shuffle(stages.begin(), stages.end(), rng);
      for (const int s : stages)
        if (fleet.kill_in(rng, s)) {
          ++kills[s];
          ++restarts;
          return;
        }
    };
    if (chaos && kill && now >= next_kill) {
      kill_one_of({producer, relay});
      next_kill = now + std::chrono::milliseconds(gap(rng));
    }
    const bool producers_done = std::all_of(fleet.procs().begin(), fleet.procs().end(),
                                            [](const Proc& p) { return p.stage != producer || p.done; });
    if (chaos && kill && now >= next_consumer_kill && (!producers_done || kills[payments] == 0 || kills[ledger] == 0)) {
      const int s = kills[payments] <= kills[ledger] ? payments : ledger;
      if (fleet.kill_in(rng, s)) {
        ++kills[s];
        ++restarts;
      }
      next_consumer_kill = now + std::chrono::milliseconds(consumer_gap(rng));
    }
    // The broker restart, once, when half the submissions are acknowledged: the brokers that lead
    // every partition down (connections dropped, new ones refused) for kBrokerOutage, then up.
    if (!broker_restarted && !broker_down && progress() * 2 >= submissions) {
      broker_down = true;
      broker_down_at = secs(now - t0);
      broker_up_due = now + kBrokerOutage;
      cluster.down();
      std::printf("pipeline: the partition leaders (brokers 2, 3) set down at %.1f s\n", broker_down_at);
      std::fflush(stdout);
    }
    if (broker_down && now >= broker_up_due) {
      cluster.up();
      broker_down = false;
      broker_restarted = true;
      broker_back = now;
      broker_up_at = secs(now - t0);
      std::printf("pipeline: the partition leaders set up again at %.1f s (down %.1f s)\n", broker_up_at,
                  broker_up_at - broker_down_at);
      std::fflush(stdout);
    }
    // The kills go on while there is a backlog: they stop once the producers are done, the
    // brokers have been back for 2 s and the ledger has 90% of the events.
    if (chaos && producers_done && broker_restarted && now - broker_back >= 2s && now - last_check >= 250ms) {
      last_check = now;
      long long n = 0;
      try {
        n = Pg(conninfo).count("SELECT count(DISTINCT outbox_id) FROM " + setup.schema + ".ledger");
      } catch (const std::exception&) {
      }
      if (n * 10 >= events * 9LL) {
        chaos = false;
        chaos_end = secs(now - t0);
        std::printf("pipeline: producers done, %lld of %d events in the ledger at %.1f s; no more kills, draining\n", n,
                    events, chaos_end);
        std::fflush(stdout);
      }
    }
    // Drained: every event in the ledger, no unsent outbox row, both groups committed at the end.
    if (!chaos && now - last_check >= 250ms) {
      last_check = now;
      try {
        Pg pg(conninfo);
        const long long unsent = pg.count("SELECT count(*) FROM " + setup.schema + "." + pipeline::kUpTable +
                                          "_outbox WHERE sent_at IS NULL");
        const long long n = pg.count("SELECT count(DISTINCT outbox_id) FROM " + setup.schema + ".ledger");
        const auto pe = cluster.ends(kPaymentsTopic, kPartitions),
                   pc = cluster.committed(kPaymentsGroup, kPaymentsTopic, kPartitions);
        const auto le = cluster.ends(kLedgerTopic, kPartitions),
                   lc = cluster.committed(kLedgerGroup, kLedgerTopic, kPartitions);
        drain_state = "unsent " + std::to_string(unsent) + ", ledger " + std::to_string(n) + " events, payments ends " +
                      join(pe) + " committed " + join(pc) + ", ledger ends " + join(le) + " committed " + join(lc);
        if (unsent == 0 && n >= events && pe == pc && le == lc) {
          drained = true;
          break;
        }
      } catch (const std::exception& e) {
        drain_state = e.what();
      }
    }
  }
  const double wall_run = secs(Clock::now() - t0);
  if (broker_down) cluster.up();
  fleet.stop_all(5s);

  // ---- The counts, in the final store.
  Pg pg(conninfo);
  const std::string S = setup.schema;
  std::set<std::string> event_ids;
  for (const auto& e : evs) event_ids.insert(e.id);

  // Stage 1: one payments row per event.
  long long up_lost = 0, up_double = 0, up_rows = 0;
  {
    std::unordered_map<std::string, long long> n;
    for (const auto& r : pg.rows("SELECT event_id, count(*) FROM " + S + ".payments GROUP BY event_id")) {
      n[r[0]] = std::atoll(r[1].c_str());
      up_rows += std::atoll(r[1].c_str());
    }
    for (const auto& id : event_ids) {
      const long long c = n.count(id) ? n[id] : 0;
      if (c == 0) ++up_lost;
      if (c > 1) up_double += c - 1;
    }
  }
  // The outbox: one row per event, all sent.
  const auto ob = pg.rows("SELECT count(*), count(*) FILTER (WHERE sent_at IS NULL) FROM " + S + "." +
                          pipeline::kUpTable + "_outbox");
  const long long outbox_rows = std::atoll(ob[0][0].c_str()), outbox_unsent = std::atoll(ob[0][1].c_str());
  // Stage 3: one ledger row per event, under the id its message got (its handler's first send).
  long long down_lost = 0, down_double = 0, down_rows = 0, down_unexpected = 0;
  std::vector<std::string> doubles;
  {
    std::unordered_map<std::string, std::pair<std::string, long long>> n;  // outbox id -> event, rows
    for (const auto& r :
         pg.rows("SELECT outbox_id, min(event_id), max(event_id), count(*) FROM " + S + ".ledger GROUP BY outbox_id")) {
      n[r[0]] = {r[1] == r[2] ? r[1] : std::string(), std::atoll(r[3].c_str())};
      down_rows += std::atoll(r[3].c_str());
    }
    std::set<std::string> expected;
    for (const auto& e : evs) {
      const std::string id = idem::outbox_message_id(S + "." + pipeline::kUpTable, e.id, 0);
      expected.insert(id);
      auto it = n.find(id);
      if (it == n.end()) {
        ++down_lost;
        continue;
      }
      if (it->second.first != e.id) ++down_unexpected;  // a message that carried another event
      if (it->second.second > 1) {
        down_double += it->second.second - 1;
        doubles.push_back(it->first);
      }
    }
    for (const auto& [id, v] : n)
      if (!expected.count(id)) down_unexpected += v.second;
  }
  // The balances: each account the sum of its payments, each payment counted once.
  long long accounts_wrong = 0, balance_total = 0, expected_total = 0, balance_payments = 0;
  for (const auto& r : pg.rows("SELECT account, balance, payments FROM " + S + ".balances ORDER BY account")) {
    const int account = std::atoi(r[0].c_str());
    const long long b = std::atoll(r[1].c_str());
    balance_total += b;
    balance_payments += std::atoll(r[2].c_str());
    const auto it = expected_balance.find(account);
    if (b != (it == expected_balance.end() ? 0 : it->second)) ++accounts_wrong;
  }
  for (const auto& [a, b] : expected_balance) expected_total += b;

  long long payments_msgs = -1, ledger_msgs = -1, dlq_msgs = -1;
  try {
    payments_msgs = cluster.messages(kPaymentsTopic, kPartitions);
    ledger_msgs = cluster.messages(kLedgerTopic, kPartitions);
    dlq_msgs = cluster.messages(std::string(kPaymentsTopic) + ".dlq", 1) +
               cluster.messages(std::string(kLedgerTopic) + ".dlq", 1);
  } catch (const std::exception& e) {
    std::printf("pipeline: cannot read the topics: %s\n", e.what());
  }
  const auto ps = read_stats(work.path, "producer");
  const auto cs1 = read_stats(work.path, "payments");
  const auto cs3 = read_stats(work.path, "ledger");

  std::printf(
      "pipeline: kills: %lld producers, %lld payments consumers, %lld relays, %lld ledger consumers (%lld SIGKILLs, "
      "each started again); unexpected exits (started again): %lld; broker restarts: %d\n",
      kills[producer], kills[payments], kills[relay], kills[ledger], restarts, unexpected, broker_restarted ? 1 : 0);
  std::printf(
      "pipeline: stage 0 (producers): %lld submissions; topic %s holds %lld messages (%lld produced again: after a "
      "kill, or a chunk not all acknowledged); chunk retries %lld\n",
      submissions, kPaymentsTopic, payments_msgs, payments_msgs - submissions, at(ps, 'E'));
  std::printf(
      "pipeline: stage 1 (payments consumers): %lld payments rows for %d events (double %lld, lost %lld); guard "
      "outcomes: "
      "executed %lld, duplicates answered %lld (%lld planned duplicates + redeliveries), in_flight %lld, errors %lld\n",
      up_rows, events, up_double, up_lost, at(cs1, 'X'), at(cs1, 'U'), planned_dups, at(cs1, 'I'), at(cs1, 'E'));
  std::printf(
      "pipeline: stage 2 (relays): outbox %lld rows, %lld unsent; topic %s holds %lld messages (%lld copies beyond one "
      "per event: re-published by a killed relay or a withdrawn batch)\n",
      outbox_rows, outbox_unsent, kLedgerTopic, ledger_msgs, ledger_msgs - events);
  std::printf(
      "pipeline: stage 3 (ledger consumers): %lld ledger rows, double %lld, lost %lld, unexpected %lld; balances: "
      "%lld accounts wrong, total %lld (expected %lld), %lld payments applied; guard outcomes: executed %lld, "
      "duplicates answered %lld, in_flight %lld, errors %lld; dead letters %lld\n",
      down_rows, down_double, down_lost, down_unexpected, accounts_wrong, balance_total, expected_total,
      balance_payments, at(cs3, 'X'), at(cs3, 'U'), at(cs3, 'I'), at(cs3, 'E'), dlq_msgs);
  if (!drained) std::printf("pipeline: last drain check: %s\n", drain_state.c_str());
  for (std::size_t i = 0; i < doubles.size() && i < 5; ++i) {
    std::printf("pipeline: double effect %s:\n", doubles[i].c_str());
    for (const auto& r : pg.rows("SELECT consumer, position, at FROM " + S + ".ledger WHERE outbox_id = '" +
                                 doubles[i] + "' ORDER BY at"))
      std::printf("pipeline:   by %s from %s at %s\n", r[0].c_str(), r[1].c_str(), r[2].c_str());
  }

  std::vector<std::string> failures;
  if (!drained)
    failures.push_back("did not drain within " + std::to_string(static_cast<long long>(secs(bound))) + " s");
  if (up_double || up_lost || up_rows != events) failures.push_back("stage 1 effects are not exactly one per event");
  if (outbox_rows != events || outbox_unsent != 0) failures.push_back("the outbox is not one sent row per event");
  if (down_double || down_lost || down_unexpected || down_rows != events)
    failures.push_back("stage 3 effects are not exactly one per event");
  if (accounts_wrong || balance_total != expected_total || balance_payments != events)
    failures.push_back("the balances are not the sums of the payments");
  if (dlq_msgs != 0) failures.push_back("dead letters (or the topics could not be read)");
  if (at(cs1, 'U') < planned_dups)
    failures.push_back("the payments consumers' guard answered fewer duplicates than were produced");
  if (!broker_restarted) failures.push_back("the brokers were not restarted");
  for (int s = 0; s < kStages; ++s)
    if (kills[s] == 0) failures.push_back(std::string("no ") + kStageNames[s] + " was killed");
  std::printf("pipeline: wall %.1f s (chaos until %.1f s, brokers down %.1f-%.1f s): %s\n", wall_run, chaos_end,
              broker_down_at, broker_up_at, failures.empty() ? "PASS" : "FAIL");
  for (const auto& f : failures) std::printf("pipeline: FAILED: %s\n", f.c_str());
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
    std::fprintf(stderr, "kafka_pipeline_test: FAILED: %s\n", e.what());
    return 1;
  }
}
