// Failovers under load, counted: four worker processes (idem_redis_failover_worker) run guarded
// messages through one redis-sentinel:// store each (three RedisStore, the last AsyncRedisStore:
// both faces of the engine), on the same keys at the same time, while the
// test kills the master again and again and lets the sentinels promote the replica. Afterwards
// every key that ran twice is classified from what the workers wrote down:
//   (i)  the documented window: the effect ran, its completion was never confirmed (the guard
//        threw or said lease_lost), and the next run came after the first one's lease, with a
//        higher fence: a takeover, as after any consumer crash;
//   (ii) anything else: the completion had been confirmed, or the next run's fence is not higher
//        (the claim was lost in the failover), or it started inside the first one's lease (two
//        holders at once). That is what min_replica_acks 1 exists to prevent, so it must be 0
//        there; with min_replica_acks 0 the counts are printed, not asserted.
// No key may be lost (started and never run), and every error must be a typed idem error.
//
// By hand: IDEM_FAILOVER_ROUNDS sets the failovers per run (default IDEM_FAILOVER_DEFAULT_ROUNDS:
// 5, or 3 in sanitizer builds, from CMake), IDEM_FAILOVER_ACKS=0|1 runs one setting only, and
// IDEM_TEST_KEEP_TOPOLOGY=1 keeps the sentinel logs and the workers' files (redis_topology.hpp).
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "redis_factory.hpp"
#include "redis_topology.hpp"

#ifndef IDEM_FAILOVER_DEFAULT_ROUNDS
#define IDEM_FAILOVER_DEFAULT_ROUNDS 5
#endif

using namespace std::chrono_literals;
using idem::test::SentinelTopology;

namespace {

constexpr int workers = 4;
constexpr long long lease_ms = 1000;
// How long a worker may take to finish its block once told to stop. A block is 64 keys of
// milliseconds each when the master is up; only a hang takes longer.
constexpr long long grace_ms = 30'000;

long long real_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

int rounds() {
  if (const char* v = std::getenv("IDEM_FAILOVER_ROUNDS"); v != nullptr && std::atoi(v) > 0) return std::atoi(v);
  return IDEM_FAILOVER_DEFAULT_ROUNDS;
}

// The worker processes, SIGKILLed by pid if the test leaves early (a failed REQUIRE, a topology
// that did not settle).
struct Workers {
  std::vector<pid_t> pids;
  std::vector<std::string> logs;  // each one's stderr
  ~Workers() {
    for (pid_t& p : pids) reap(p, SIGKILL);
  }
  static int reap(pid_t& pid, int sig) {
    if (pid <= 0) return -1;
    if (sig != 0) ::kill(pid, sig);
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    pid = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  // Exit codes, waiting at most `bound` for all; a worker still running then is killed (137).
  std::vector<int> wait(std::chrono::milliseconds bound) {
    const auto deadline = std::chrono::steady_clock::now() + bound;
    std::vector<int> codes(pids.size(), -1);
    for (std::size_t i = 0; i < pids.size(); ++i) {
      int status = 0;
      while (pids[i] > 0 && std::chrono::steady_clock::now() < deadline) {
        if (::waitpid(pids[i], &status, WNOHANG) == pids[i]) {
          codes[i] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
          pids[i] = -1;
        } else {
          std::this_thread::sleep_for(20ms);
        }
      }
      if (pids[i] > 0) codes[i] = reap(pids[i], SIGKILL);
    }
    return codes;
  }
};

struct Execution {
  std::string key;
  std::uint64_t fence = 0;
  long long before = 0;  // just before the acquire (worker's CLOCK_REALTIME ms)
  long long start = 0;   // handler start
  int worker = 0;
  std::string master;  // where the worker's store sent new connections then
  bool confirmed = false;  // "C": the guard returned executed
  std::string failed;      // "F": the error thrown after the handler ran
};

std::string describe(const Execution& e) {
  return "worker " + std::to_string(e.worker) + " fence " + std::to_string(e.fence) + " on " + e.master + " at " +
         std::to_string(e.start) + " (acquire " + std::to_string(e.start - e.before) + " ms, " +
         (e.confirmed ? "confirmed" : e.failed.empty() ? "unconfirmed" : "unconfirmed: " + e.failed) + ")";
}

struct Tally {
  std::vector<Execution> executions;
  std::map<std::string, int> errors;  // by kind (X and F lines)
  int failed_after_handler = 0, lease_lost = 0, unexpected = 0, untyped = 0, non_retryable = 0, malformed = 0;
  long long blocks = 0;  // the most any worker walked
  std::vector<std::string> notes;
};

// Reads one worker's lines. C, F and L belong to that worker's latest E of the same key.
void read_worker(const std::string& path, int worker, Tally& t) {
  std::ifstream in(path);
  std::map<std::string, std::size_t> latest;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string tag, key;
    ls >> tag >> key;
    if (tag == "E") {
      Execution e;
      e.key = key;
      e.worker = worker;
      ls >> e.fence >> e.before >> e.start >> e.master;
      latest[key] = t.executions.size();
      t.executions.push_back(e);
    } else if (tag == "C" || tag == "F" || tag == "L") {
      std::uint64_t fence = 0;
      ls >> fence;
      const auto it = latest.find(key);
      if (it == latest.end() || t.executions[it->second].fence != fence) {
        t.notes.push_back("worker " + std::to_string(worker) + ": '" + line + "' follows no matching E");
        ++t.malformed;
        continue;
      }
      Execution& e = t.executions[it->second];
      if (tag == "C") e.confirmed = true;
      if (tag == "L") ++t.lease_lost;
      if (tag == "F") {
        ls >> e.failed;
        ++t.failed_after_handler;
        ++t.errors[e.failed.substr(0, e.failed.rfind('/'))];
        if (e.failed.rfind("untyped", 0) == 0) ++t.untyped;
        if (e.failed.back() == 'n') ++t.non_retryable;
      }
    } else if (tag == "X") {
      std::string kind;
      ls >> kind;
      ++t.errors[kind.substr(0, kind.rfind('/'))];
      if (kind.rfind("untyped", 0) == 0) ++t.untyped;
      if (!kind.empty() && kind.back() == 'n') ++t.non_retryable;
    } else if (tag == "U") {
      ++t.unexpected;
      t.notes.push_back("worker " + std::to_string(worker) + ": " + line);
    } else if (tag == "D") {
      t.blocks = std::max(t.blocks, std::stoll(key));
    } else {
      t.notes.push_back("worker " + std::to_string(worker) + ": unreadable line '" + line + "'");
      ++t.malformed;
    }
  }
}

struct Result {
  int doubles_i = 0, doubles_ii = 0, lost = 0, untyped = 0, unexpected = 0;
  std::string summary;
};

Result run_failovers(int acks, int failovers) {
  const auto wall0 = std::chrono::steady_clock::now();
  SentinelTopology topo;
  const std::string work = topo.dir() + "/work";
  std::filesystem::create_directories(work);
  const std::string ns = "fo-" + idem::test::random_hex() + ":";
  const std::string stop_file = work + "/stop";
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);

  Workers w;
  for (int i = 0; i < workers; ++i) {
    const std::string err = work + "/worker-" + std::to_string(i) + ".err";
    const int fd = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    REQUIRE(fd >= 0);
    std::vector<std::string> args{IDEM_REDIS_FAILOVER_WORKER, topo.url(), ns,
                                  work + "/worker-" + std::to_string(i) + ".out", stop_file,
                                  std::to_string(seed + static_cast<unsigned>(i)), std::to_string(acks),
                                  std::to_string(lease_ms), std::to_string(grace_ms)};
    if (IDEM_WORKER_ASYNC && i == workers - 1) args.emplace_back("async");  // the last worker on the async face
    w.pids.push_back(idem::test::spawn(args, fd));
    ::close(fd);
    w.logs.push_back(err);
  }

  long long promote_max = 0, promote_sum = 0, sync_max = 0;
  std::string events;  // realtime ms of each kill and promotion, to place the (ii) examples
  for (int r = 0; r < failovers; ++r) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500 + rng() % 1000));
    const auto t0 = std::chrono::steady_clock::now();
    const std::string old = topo.master_address();
    events += "\n  kill " + old + " at " + std::to_string(real_ms());
    topo.kill_master();
    topo.wait_promoted();
    events += ", " + topo.master_address() + " promoted at " + std::to_string(real_ms());
    const auto t1 = std::chrono::steady_clock::now();
    topo.restart_old_master_as_replica();
    const auto t2 = std::chrono::steady_clock::now();
    const long long promote = std::chrono::duration_cast<std::chrono::milliseconds>(t1 - t0).count();
    promote_sum += promote;
    promote_max = std::max(promote_max, promote);
    sync_max = std::max<long long>(sync_max, std::chrono::duration_cast<std::chrono::milliseconds>(t2 - t1).count());
  }
  std::this_thread::sleep_for(500ms);  // some work on the last master too
  // A failover nobody asked for (a sentinel's false detection) would mix a split brain into the
  // counts: not what this test measures, so it is reported as such.
  const int switches = topo.switches();
  CHECK(switches == failovers);
  std::ofstream(stop_file) << "stop\n";
  const std::vector<int> codes = w.wait(std::chrono::milliseconds(grace_ms + 10'000));
  for (int i = 0; i < workers; ++i) {
    INFO("worker " << i << " stderr: " << idem::test::file_tail(w.logs[static_cast<std::size_t>(i)]));
    CHECK(codes[static_cast<std::size_t>(i)] == 0);
  }

  Tally t;
  for (int i = 0; i < workers; ++i) read_worker(work + "/worker-" + std::to_string(i) + ".out", i, t);
  for (const auto& n : t.notes) WARN(n);
  CHECK(t.malformed == 0);

  // Consecutive executions of each key, in the order of their claims: by fence, then by when
  // they started. Not by start alone: a worker descheduled between its acquire and its handler
  // for longer than the lease (it happens on a loaded 2-core box) starts its handler after the
  // one that took over from it, and ordered by start the pair would read as a fence going down
  // after a confirmed completion; it is the takeover of a paused holder, whose completion then
  // answers lease_lost. A fence that does go down (a record lost and created again) still shows:
  // the lower-fenced run then starts after the higher one, inside its lease or after its
  // confirmed completion.
  std::map<std::string, std::vector<const Execution*>> by_key;
  for (const auto& e : t.executions) by_key[e.key].push_back(&e);
  Result res;
  int higher = 0, equal = 0;
  std::uint64_t top_fence = 0;
  std::vector<std::string> examples;
  for (auto& [key, runs] : by_key) {
    std::sort(runs.begin(), runs.end(), [](const Execution* x, const Execution* y) {
      return std::tie(x->fence, x->start, x->before) < std::tie(y->fence, y->start, y->before);
    });
    for (const Execution* e : runs) top_fence = std::max(top_fence, e->fence);
    for (std::size_t j = 1; j < runs.size(); ++j) {
      const Execution& a = *runs[j - 1];
      const Execution& b = *runs[j];
      (b.fence > a.fence ? higher : equal) += 1;
      const bool ii = a.confirmed || b.fence <= a.fence || b.start < a.before + lease_ms;
      (ii ? res.doubles_ii : res.doubles_i) += 1;
      if (ii && examples.size() < 5)
        examples.push_back(key + ": " + describe(a) + ", then " + describe(b) + " (" +
                           std::to_string(b.start - a.before) + " ms after the first acquire began)");
    }
  }
  // Every worker that stopped cleanly walked every key below 64 * its blocks to executed or
  // duplicate, and a duplicate means some run completed it: each such key has a run.
  const long long keys = 64 * t.blocks;
  for (long long n = 0; n < keys; ++n)
    if (!by_key.count(ns + std::to_string(n))) ++res.lost;
  res.untyped = t.untyped;
  res.unexpected = t.unexpected;

  std::string errors;
  for (const auto& [kind, n] : t.errors) errors += (errors.empty() ? "" : ", ") + kind + "=" + std::to_string(n);
  std::ostringstream s;
  s << "failover: acks=" << acks << " failovers=" << failovers << " keys=" << keys
    << " executions=" << t.executions.size() << " doubles(i)=" << res.doubles_i << " doubles(ii)=" << res.doubles_ii
    << " lost=" << res.lost << " | errors: " << (errors.empty() ? "none" : errors)
    << " (after the handler: " << t.failed_after_handler << ", lease_lost " << t.lease_lost
    << ", not retryable: " << t.non_retryable << ")"
    << " | fences of the next run: higher=" << higher << " equal (record lost)=" << equal
    << " highest=" << top_fence << " | promotion avg " << (failovers ? promote_sum / failovers : 0) << " ms, max "
    << promote_max << " ms, resync max " << sync_max << " ms | wall "
    << std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now() - wall0).count()
    << " s, seed " << seed;
  for (const auto& e : examples) s << "\n  (ii) " << e;
  if (!examples.empty()) s << events;
  res.summary = s.str();
  return res;
}

}  // namespace

TEST_CASE("redis failover under load: 4 processes through a redis-sentinel URL, the master killed again and again",
          "[redis][failover][process]") {
  const int n = rounds();
  // IDEM_FAILOVER_ACKS=0 or 1 runs one setting only (by hand).
  const char* only = std::getenv("IDEM_FAILOVER_ACKS");
  // acks 0 first: its counts are only shown, so a failure of the asserted run below cannot hide them.
  if (only == nullptr || std::string(only) == "0") {
    const Result off = run_failovers(0, n);
    WARN(off.summary);
    CHECK(off.lost == 0);
    CHECK(off.untyped == 0);
    CHECK(off.unexpected == 0);
  }
  if (only != nullptr && std::string(only) != "1") return;
  const Result on = run_failovers(1, n);
  WARN(on.summary);
  CHECK(on.lost == 0);
  CHECK(on.untyped == 0);
  CHECK(on.unexpected == 0);
  REQUIRE(on.doubles_ii == 0);
}
