// Pipeline (c) of issue 41, end to end across processes, with crashes:
//
//   producers (2) ── PostgreSQL transactional guard: payments row + ctx.outbox().send, one transaction
//        │            (SCHEMA.up_records, its outbox SCHEMA.up_records_outbox)
//        ▼
//   idem-outbox-relay --publisher nats (2, the real program) ──► nats-server -js, stream PIPE (file storage)
//        │
//        ▼
//   consumers (2): idem::consume over idem::NatsConsumer, keyed by default (Nats-Msg-Id = the outbox
//                  id), PostgreSQL transactional guard (SCHEMA.down_records) appending to SCHEMA.ledger
//
// Every process is a child of this driver (pipeline_worker.cpp for the producers and consumers,
// the relay program for the relays). Every 150-400 ms the driver SIGKILLs one of them at random
// (a stage at random, then a process of it) and starts it again; once, when half the submissions
// are done, it restarts nats-server (SIGTERM, then start on the same port and store dir). When the
// producers are done and the ledger has 90% of the events it stops killing, lets everything drain,
// stops the workers and counts in the final store: each event has exactly one payments row upstream and exactly one ledger row
// downstream (the ledger has no uniqueness, so a double effect is a second row), the outbox has no
// unsent row, nothing was dead-lettered.
//
// The stream's duplicate window is 100 ms (1 ms is refused as an invalid stream config), not the
// default 2 min: JetStream does not drop a relay's re-publication (a relay killed after publishing,
// before marking sent, whose rows another relay claims later), so the consumers' guard is what
// answers it, as it answers the redeliveries of a killed consumer's batch.
//
//   nats_pipeline_test            400 events, 25% of them submitted twice (IDEM_PIPELINE_EVENTS=N for more,
//                                 IDEM_PIPELINE_SEED=S to replay a run, IDEM_PIPELINE_KEEP=1 keeps the work
//                                 dir and the schema)
//
// Exit status 0 when every count is right; 1 otherwise, when a server cannot start (never a
// skip), or when the run does not drain within its bound. Every process started here is stopped
// by PID on the way out, failures included.

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <fcntl.h>
#include <libpq-fe.h>
#include <nats/nats.h>
#include <sys/wait.h>
#include <unistd.h>

#include "idem/postgres.hpp"
#include "idem/postgres/outbox_writer.hpp"
#include "nats/nats_server.hpp"
#include "pipeline_driver.hpp"
#include "pipeline_plan.hpp"

#ifndef IDEM_PIPELINE_WORKER
#error "IDEM_PIPELINE_WORKER must name the idem_pipeline_worker program"
#endif
#ifndef IDEM_OUTBOX_RELAY_PROGRAM
#error "IDEM_OUTBOX_RELAY_PROGRAM must name the idem-outbox-relay program"
#endif

using namespace std::chrono_literals;
using pipeline::Clock;
using pipeline::Fleet;
using pipeline::Pg;
using pipeline::Proc;
using pipeline::at;
using pipeline::fixture_conninfo;
using pipeline::random_hex;
using pipeline::read_stats;
using pipeline::secs;
using pipeline::tail_of;

namespace {

constexpr int kProducers = 2, kRelays = 2, kConsumers = 2;
constexpr int kDupPercent = 25;
constexpr std::int64_t kDuplicateWindowNs = 100'000'000;  // 100 ms: JetStream's own dedup mostly out of the way

// ---------------------------------------------------------------------------------------------
// JetStream: the streams (created here, before any process), and what the driver reads of them.

class Js {
public:
  explicit Js(const std::string& url) {
    natsOptions* o = nullptr;
    natsOptions_Create(&o);
    natsOptions_SetURL(o, url.c_str());
    natsOptions_SetTimeout(o, 2000);
    natsOptions_SetMaxReconnect(o, -1);
    natsOptions_SetReconnectWait(o, 100);
    const natsStatus s = natsConnection_Connect(&nc_, o);
    natsOptions_Destroy(o);
    if (s != NATS_OK) throw std::runtime_error(std::string("pipeline: cannot connect to ") + url + ": " + natsStatus_GetText(s));
    jsOptions jo;
    jsOptions_Init(&jo);
    jo.Wait = 2000;
    if (natsConnection_JetStream(&js_, nc_, &jo) != NATS_OK) throw std::runtime_error("pipeline: no JetStream context");
  }
  ~Js() {
    jsCtx_Destroy(js_);
    natsConnection_Destroy(nc_);
  }
  Js(const Js&) = delete;
  Js& operator=(const Js&) = delete;

  void add_stream(const char* name, const char* subject, std::int64_t duplicate_window_ns) {
    jsStreamConfig cfg;
    jsStreamConfig_Init(&cfg);
    const char* subjects[] = {subject};
    cfg.Name = name;
    cfg.Subjects = subjects;
    cfg.SubjectsLen = 1;
    cfg.Storage = js_FileStorage;  // in the server's store dir: the restart keeps every message
    cfg.Duplicates = duplicate_window_ns;
    jsStreamInfo* si = nullptr;
    jsErrCode code{};
    const natsStatus s = js_AddStream(&si, js_, &cfg, nullptr, &code);
    if (si != nullptr) jsStreamInfo_Destroy(si);
    if (s != NATS_OK)
      throw std::runtime_error(std::string("pipeline: cannot add stream ") + name + ": " + natsStatus_GetText(s) + " (" +
                               std::to_string(code) + ")");
  }

  std::uint64_t messages(const char* stream) {
    jsStreamInfo* si = nullptr;
    jsErrCode code{};
    const natsStatus s = js_GetStreamInfo(&si, js_, stream, nullptr, &code);
    if (s != NATS_OK) throw std::runtime_error(std::string("pipeline: no stream info for ") + stream + ": " + natsStatus_GetText(s));
    const std::uint64_t n = si->State.Msgs;
    jsStreamInfo_Destroy(si);
    return n;
  }

  // The durable's undelivered and unacknowledged counts; nullopt while it does not exist yet.
  std::optional<std::pair<std::uint64_t, std::int64_t>> durable(const char* stream, const char* name) {
    jsConsumerInfo* ci = nullptr;
    jsErrCode code{};
    if (js_GetConsumerInfo(&ci, js_, stream, name, nullptr, &code) != NATS_OK) return std::nullopt;
    std::pair<std::uint64_t, std::int64_t> out{ci->NumPending, ci->NumAckPending};
    jsConsumerInfo_Destroy(ci);
    return out;
  }

private:
  natsConnection* nc_ = nullptr;
  jsCtx* js_ = nullptr;
};

// The stages, as pipeline::Fleet numbers them.
enum Stage { producer = 0, relay = 1, consumer = 2 };
const char* const kStageNames[] = {"producer", "relay", "consumer"};

struct Setup {
  std::string conninfo, schema, nats_url, dir;
  int events = 0;
  std::uint64_t seed = 0;
  int pace_ms = 0;
};

std::vector<std::string> proc_args(const Proc& p, const Setup& s) {
  switch (p.stage) {
    case producer:
      return {IDEM_PIPELINE_WORKER, "producer", s.conninfo, s.schema, std::to_string(p.slot), std::to_string(kProducers),
              std::to_string(s.events), std::to_string(kDupPercent), std::to_string(s.seed), std::to_string(s.pace_ms), s.dir};
    case relay:
      return {IDEM_OUTBOX_RELAY_PROGRAM, "--publisher", "nats", "--nats-url", s.nats_url, "--nats-expect-stream",
              pipeline::kStream, "--nats-timeout-ms", "2000", "--conninfo", s.conninfo + " connect_timeout=2", "--schema",
              s.schema, "--table", pipeline::kUpTable, "--batch", "32", "--poll-ms", "200", "--backoff-max-ms", "500",
              "--claim-idle-timeout-ms", "5000"};
    case consumer:
      return {IDEM_PIPELINE_WORKER, "consumer", s.conninfo, s.schema, s.nats_url, "consumer-" + std::to_string(p.slot), s.dir};
  }
  return {};
}

int run() {
  int events = 400;
  if (const char* e = std::getenv("IDEM_PIPELINE_EVENTS"); e && *e) events = std::max(1, std::atoi(e));
  std::uint64_t seed = std::random_device{}();
  if (const char* s = std::getenv("IDEM_PIPELINE_SEED"); s && *s) seed = std::strtoull(s, nullptr, 10);
  const bool keep = pipeline::keep_requested();
  // The bound of the whole run: 90 s for the default size (it takes about 10 s), more for a larger one.
  const auto bound = 90s + std::chrono::milliseconds(static_cast<long long>(events) * 10);

  const auto t0 = Clock::now();
  const pipeline::WorkDir work(keep);

  // The plan: what each producer submits (the same computation as the producers').
  const auto evs = pipeline::events(events, seed);
  long long submissions = 0;
  for (int p = 0; p < kProducers; ++p) submissions += static_cast<long long>(pipeline::plan(events, kDupPercent, seed, p, kProducers).size());
  const long long planned_dups = submissions - events;
  // Paced so that production lasts about 8 s whatever the size (the processes of every stage are
  // killed while there is work); no pacing for a large run.
  const int pace_ms = static_cast<int>(std::clamp<long long>(6000LL * kProducers / std::max(1LL, submissions), 0, 40));

  std::printf("pipeline: seed %llu, %d events, %lld submissions (%lld duplicates), %d producers, %d relays "
              "(idem-outbox-relay --publisher nats), %d consumers, a SIGKILL every 150-400 ms, pace %d ms, work dir %s\n",
              static_cast<unsigned long long>(seed), events, submissions, planned_dups, kProducers, kRelays, kConsumers,
              pace_ms, work.path.c_str());
  std::fflush(stdout);

  // Servers: nats-server -js of our own (fails, never skips), the PostgreSQL fixture.
  idem::test::nats::NatsServer server;
  const std::string conninfo = fixture_conninfo();
  {
    Js js(server.url());
    js.add_stream(pipeline::kStream, pipeline::kStreamSubjects, kDuplicateWindowNs);
    js.add_stream(pipeline::kDlqStream, pipeline::kDlqSubject, 0);
  }

  // A schema of this run's own on the shared fixture server: the stores of stages 1 and 3, the
  // payments (stage 1's effect) and the ledger (stage 3's effect), neither with any uniqueness.
  Setup setup{conninfo, "pipe_" + random_hex(), server.url(), work.path, events, seed, pace_ms};
  const pipeline::SchemaGuard schema_guard{conninfo, setup.schema, keep};
  {
    Pg pg(conninfo);
    pg.exec("SET client_min_messages = warning; DROP SCHEMA IF EXISTS " + setup.schema + " CASCADE; CREATE SCHEMA " + setup.schema);
    pg.exec("CREATE TABLE " + setup.schema + ".payments (event_id text NOT NULL, account int NOT NULL, amount bigint NOT NULL)");
    pg.exec("CREATE TABLE " + setup.schema + ".ledger (outbox_id text NOT NULL, event_id text NOT NULL, payload text NOT NULL, "
            "consumer text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())");
    idem::PostgresStore up({.conninfo = conninfo}, {.schema = setup.schema, .table = pipeline::kUpTable,
                                                    .mode = idem::PostgresMode::transactional, .outbox = true});
    up.migrate();
    idem::PostgresStore down({.conninfo = conninfo}, {.schema = setup.schema, .table = pipeline::kDownTable,
                                                      .mode = idem::PostgresMode::transactional});
    down.migrate();
  }

  Fleet fleet([&setup](const Proc& p) { return proc_args(p, setup); }, work.log_fd);
  for (int i = 0; i < kConsumers; ++i) fleet.add(consumer, i);
  for (int i = 0; i < kRelays; ++i) fleet.add(relay, i);
  for (int i = 0; i < kProducers; ++i) fleet.add(producer, i);

  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> gap(150, 400);
  long long kills[3] = {0, 0, 0};
  long long unexpected = 0, restarts = 0;
  bool nats_restarted = false, chaos = true, drained = false;
  double nats_restart_at = 0, nats_down = 0, chaos_end = 0;
  auto next_kill = Clock::now() + std::chrono::milliseconds(gap(rng));
  auto last_check = Clock::now();
  std::optional<Js> js;
  const auto deadline = t0 + bound;

  auto progress = [&] {
    long long done = 0;
    for (int p = 0; p < kProducers; ++p)
      done += static_cast<long long>(pipeline::read_progress(work.path + "/producer-" + std::to_string(p) + ".progress"));
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
    if (chaos && now >= next_kill) {
      if (const int s = fleet.kill_one(rng, 3); s >= 0) {
        ++kills[s];
        ++restarts;
      }
      next_kill = now + std::chrono::milliseconds(gap(rng));
    }
    // The broker, once, when half the submissions are done: SIGTERM (JetStream flushes its
    // files), then started again on the same port and store dir.
    if (!nats_restarted && progress() * 2 >= submissions) {
      nats_restarted = true;
      const auto r0 = Clock::now();
      nats_restart_at = secs(r0 - t0);
      server.stop();
      std::this_thread::sleep_for(300ms);
      server.start();  // throws (the test fails) when it does not come back
      nats_down = secs(Clock::now() - r0);
      std::printf("pipeline: nats-server stopped (SIGTERM) at %.1f s and started again on %s, same store dir; down %.1f s\n",
                  nats_restart_at, server.url().c_str(), nats_down);
      std::fflush(stdout);
    }
    // The kills go on while the consumers have a backlog (a larger run): they stop once the
    // producers are done and the ledger has 90% of the events.
    const bool producers_done = std::all_of(fleet.procs().begin(), fleet.procs().end(),
                                            [](const Proc& p) { return p.stage != producer || p.done; });
    if (chaos && producers_done && nats_restarted && now - last_check >= 250ms) {
      last_check = now;
      long long ledger = 0;
      try {
        ledger = Pg(conninfo).count("SELECT count(DISTINCT outbox_id) FROM " + setup.schema + ".ledger");
      } catch (const std::exception&) {
      }
      if (ledger * 10 >= events * 9LL) {
        chaos = false;
        chaos_end = secs(now - t0);
        std::printf("pipeline: producers done, %lld of %d events in the ledger at %.1f s; no more kills, draining\n",
                    ledger, events, chaos_end);
        std::fflush(stdout);
      }
    }
    // Drained: every event in the ledger, no unsent outbox row, nothing pending in the durable.
    if (!chaos && now - last_check >= 250ms) {
      last_check = now;
      try {
        Pg pg(conninfo);
        const long long unsent =
            pg.count("SELECT count(*) FROM " + setup.schema + "." + pipeline::kUpTable + "_outbox WHERE sent_at IS NULL");
        const long long ledger = pg.count("SELECT count(DISTINCT outbox_id) FROM " + setup.schema + ".ledger");
        if (!js) js.emplace(server.url());
        const auto d = js->durable(pipeline::kStream, pipeline::kDurable);
        if (unsent == 0 && ledger >= events && d && d->first == 0 && d->second == 0) {
          drained = true;
          break;
        }
      } catch (const std::exception&) {
        js.reset();
      }
    }
  }
  const double wall_run = secs(Clock::now() - t0);
  fleet.stop_all(5s);
  js.reset();

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
  const auto ob = pg.rows("SELECT count(*), count(*) FILTER (WHERE sent_at IS NULL) FROM " + S + "." + pipeline::kUpTable + "_outbox");
  const long long outbox_rows = std::atoll(ob[0][0].c_str()), outbox_unsent = std::atoll(ob[0][1].c_str());
  // Stage 3: one ledger row per event, under the id its message got (its handler's first send).
  long long down_lost = 0, down_double = 0, down_rows = 0, down_unexpected = 0;
  {
    std::unordered_map<std::string, std::pair<std::string, long long>> n;  // outbox id -> event, rows
    for (const auto& r : pg.rows("SELECT outbox_id, min(event_id), max(event_id), count(*) FROM " + S + ".ledger GROUP BY outbox_id")) {
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
      if (it->second.second > 1) down_double += it->second.second - 1;
    }
    for (const auto& [id, v] : n)
      if (!expected.count(id)) down_unexpected += v.second;
  }
  std::uint64_t stream_msgs = 0, dlq_msgs = 0;
  bool stream_read = false;
  try {
    Js j(server.url());
    stream_msgs = j.messages(pipeline::kStream);
    dlq_msgs = j.messages(pipeline::kDlqStream);
    stream_read = true;
  } catch (const std::exception& e) {
    std::printf("pipeline: cannot read the streams: %s\n", e.what());
  }
  const auto ps = read_stats(work.path, "producer");
  const auto cs = read_stats(work.path, "consumer");

  std::printf("pipeline: kills: %lld producers, %lld relays, %lld consumers (%lld SIGKILLs, each started again); "
              "unexpected exits (started again): %lld; nats-server restarts: %d\n",
              kills[producer], kills[relay], kills[consumer], restarts, unexpected, nats_restarted ? 1 : 0);
  std::printf("pipeline: stage 1 (producers): %lld payments rows for %d events (double %lld, lost %lld); guard outcomes: "
              "executed %lld, duplicates answered %lld (%lld planned duplicates + resubmissions after a kill), in_flight %lld, errors %lld\n",
              up_rows, events, up_double, up_lost, at(ps, 'X'), at(ps, 'U'), planned_dups, at(ps, 'I'), at(ps, 'E'));
  std::printf("pipeline: stage 2 (relays): outbox %lld rows, %lld unsent; stream %s holds %llu messages (%lld copies "
              "beyond one per event: re-published by a killed relay)\n",
              outbox_rows, outbox_unsent, pipeline::kStream, static_cast<unsigned long long>(stream_msgs),
              static_cast<long long>(stream_msgs) - events);
  std::printf("pipeline: stage 3 (consumers): %lld ledger rows, double %lld, lost %lld, unexpected %lld; guard outcomes: "
              "executed %lld, duplicates answered %lld, in_flight %lld, errors %lld; dead letters %llu\n",
              down_rows, down_double, down_lost, down_unexpected, at(cs, 'X'), at(cs, 'U'), at(cs, 'I'), at(cs, 'E'),
              static_cast<unsigned long long>(dlq_msgs));

  std::vector<std::string> failures;
  if (!drained) failures.push_back("did not drain within " + std::to_string(static_cast<long long>(secs(bound))) + " s");
  if (up_double || up_lost || up_rows != events) failures.push_back("stage 1 effects are not exactly one per event");
  if (outbox_rows != events || outbox_unsent != 0) failures.push_back("the outbox is not one sent row per event");
  if (down_double || down_lost || down_unexpected || down_rows != events)
    failures.push_back("stage 3 effects are not exactly one per event");
  if (!stream_read || dlq_msgs != 0) failures.push_back("dead letters (or the streams could not be read)");
  if (at(ps, 'U') < planned_dups) failures.push_back("the producers' guard answered fewer duplicates than were submitted");
  if (!nats_restarted) failures.push_back("nats-server was not restarted");
  for (int s = 0; s < 3; ++s)
    if (kills[s] == 0) failures.push_back(std::string("no ") + kStageNames[s] + " was killed");
  std::printf("pipeline: wall %.1f s (chaos until %.1f s, nats-server restarted at %.1f s): %s\n", wall_run, chaos_end,
              nats_restart_at, failures.empty() ? "PASS" : "FAIL");
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
    std::fprintf(stderr, "nats_pipeline_test: FAILED: %s\n", e.what());
    return 1;
  }
}
