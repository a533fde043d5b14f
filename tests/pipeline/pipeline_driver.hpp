#pragma once
// What the drivers of the pipeline tests share (nats_pipeline_test.cpp, rabbitmq_pipeline_test.cpp):
// the driver's own PostgreSQL session on the fixture server, the fleet of child processes it
// SIGKILLs and starts again (every one stopped by PID on every way out), the work dir, and the
// readers of the workers' stats files and of the children's log.

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <libpq-fe.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../support/process.hpp"  // spawn

#ifndef IDEM_PG_CONNINFO_FILE_DEFAULT
#error "IDEM_PG_CONNINFO_FILE_DEFAULT must name the PostgreSQL fixture's conninfo file"
#endif

namespace pipeline {

using Clock = std::chrono::steady_clock;

inline double secs(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// 12 hex digits, for a schema name of this run's own on the shared fixture server.
inline std::string random_hex() {
  std::random_device rd;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%08x%04x", rd(), rd() & 0xffffu);
  return buf;
}

// ---------------------------------------------------------------------------------------------
// The driver's own PostgreSQL session (setup and the final counts).

class Pg {
public:
  explicit Pg(const std::string& conninfo) : c_(PQconnectdb((conninfo + " connect_timeout=5").c_str())) {
    if (PQstatus(c_) != CONNECTION_OK) {
      const std::string m = PQerrorMessage(c_);
      PQfinish(c_);
      throw std::runtime_error("pipeline: cannot connect to the PostgreSQL fixture: " + m);
    }
  }
  ~Pg() { PQfinish(c_); }
  Pg(const Pg&) = delete;
  Pg& operator=(const Pg&) = delete;

  // The rows of `sql`, every value as text.
  std::vector<std::vector<std::string>> rows(const std::string& sql) {
    std::unique_ptr<PGresult, decltype(&PQclear)> r(PQexec(c_, sql.c_str()), &PQclear);
    const auto st = r ? PQresultStatus(r.get()) : PGRES_FATAL_ERROR;
    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK)
      throw std::runtime_error("pipeline: SQL failed: " + sql + ": " + PQerrorMessage(c_));
    std::vector<std::vector<std::string>> out(static_cast<std::size_t>(PQntuples(r.get())));
    for (int i = 0; i < PQntuples(r.get()); ++i)
      for (int j = 0; j < PQnfields(r.get()); ++j) out[static_cast<std::size_t>(i)].emplace_back(PQgetvalue(r.get(), i, j));
    return out;
  }
  void exec(const std::string& sql) { (void)rows(sql); }
  long long count(const std::string& sql) {
    const auto r = rows(sql);
    return r.empty() ? 0 : std::atoll(r[0][0].c_str());
  }

private:
  PGconn* c_;
};

inline std::string fixture_conninfo() {
  const char* file = std::getenv("IDEM_PG_CONNINFO_FILE");
  if (file == nullptr || *file == '\0') file = IDEM_PG_CONNINFO_FILE_DEFAULT;
  std::ifstream in(file);
  std::string line;
  if (!in || !std::getline(in, line) || line.empty())
    throw std::runtime_error(std::string("pipeline: no conninfo in ") + file + ": the PostgreSQL fixture (idem_pg) did not start");
  return line;
}

// A schema of the run's own on the shared fixture server, dropped on the way out (unless kept).
struct SchemaGuard {
  std::string conninfo, name;
  bool keep;
  ~SchemaGuard() {
    if (keep) return;
    try {
      Pg(conninfo).exec("SET client_min_messages = warning; DROP SCHEMA IF EXISTS " + name + " CASCADE");
    } catch (const std::exception&) {
    }
  }
};

// The run's temp dir (removed on the way out unless kept) and the children's log in it.
struct WorkDir {
  std::string path;
  bool keep = false;
  int log_fd = -1;
  explicit WorkDir(bool keep_it) : keep(keep_it) {
    char tmpl[] = "/tmp/idem-pipeline-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) throw std::runtime_error("pipeline: mkdtemp failed");
    path = tmpl;
    log_fd = ::open(log().c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  }
  ~WorkDir() {
    if (log_fd >= 0) ::close(log_fd);
    std::error_code ec;
    if (!keep) std::filesystem::remove_all(path, ec);
  }
  WorkDir(const WorkDir&) = delete;
  WorkDir& operator=(const WorkDir&) = delete;
  [[nodiscard]] std::string log() const { return path + "/children.log"; }
};

// IDEM_PIPELINE_KEEP=1
inline bool keep_requested() {
  const char* k = std::getenv("IDEM_PIPELINE_KEEP");
  return k != nullptr && std::string(k) == "1";
}

// ---------------------------------------------------------------------------------------------
// The processes: every one started here is stopped here, by PID, on every way out.

struct Proc {
  int stage;  // the driver's own numbering of its stages
  int slot;
  pid_t pid = -1;
  bool done = false;  // finished its work (exit 0): not started again
};

// How a Fleet starts a process: argv, the fd its stdout/stderr go to; returns its PID.
using Spawner = std::function<pid_t(const std::vector<std::string>&, int)>;

class Fleet {
public:
  Fleet(std::function<std::vector<std::string>(const Proc&)> args, int log_fd) : args_(std::move(args)), log_fd_(log_fd) {}
  // With a spawner of the driver's own (the Kafka pipeline's closes the fds the driver's mock
  // cluster holds, kafka_pipeline_test.cpp).
  Fleet(std::function<std::vector<std::string>(const Proc&)> args, int log_fd, Spawner spawner)
      : args_(std::move(args)), log_fd_(log_fd), spawner_(std::move(spawner)) {}
  ~Fleet() {
    for (auto& p : procs_)
      if (p.pid > 0) {
        ::kill(p.pid, SIGKILL);
        wait_for(p.pid);
        p.pid = -1;
      }
  }
  Fleet(const Fleet&) = delete;
  Fleet& operator=(const Fleet&) = delete;

  void add(int stage, int slot) {
    procs_.push_back({stage, slot});
    start(procs_.back());
  }
  void start(Proc& p) { p.pid = spawner_ ? spawner_(args_(p), log_fd_) : idem::test::spawn(args_(p), log_fd_); }
  std::vector<Proc>& procs() { return procs_; }

  // Processes that ended by themselves: `finished(p, status)` says whether p is done (not started
  // again); every other one is started again. Returns how many were started again.
  long long restart_exited(const std::function<bool(const Proc&, int)>& finished) {
    long long n = 0;
    for (auto& p : procs_) {
      int st = 0;
      if (p.pid > 0 && ::waitpid(p.pid, &st, WNOHANG) == p.pid) {
        p.pid = -1;
        if (finished(p, st)) {
          p.done = true;
          continue;
        }
        ++n;
        start(p);
      }
    }
    return n;
  }

  // The killer: a stage at random (one with a live process, among `stages` of them), then one of
  // its processes: SIGKILL, reaped, started again. Returns the stage, or -1 when none is live.
  template <class Rng>
  int kill_one(Rng& rng, int stages) {
    std::vector<std::vector<Proc*>> by_stage(static_cast<std::size_t>(stages));
    for (auto& p : procs_)
      if (p.pid > 0 && p.stage >= 0 && p.stage < stages) by_stage[static_cast<std::size_t>(p.stage)].push_back(&p);
    std::vector<int> live;
    for (int s = 0; s < stages; ++s)
      if (!by_stage[static_cast<std::size_t>(s)].empty()) live.push_back(s);
    if (live.empty()) return -1;
    const int s = live[rng() % live.size()];
    auto& candidates = by_stage[static_cast<std::size_t>(s)];
    Proc& victim = *candidates[rng() % candidates.size()];
    ::kill(victim.pid, SIGKILL);
    wait_for(victim.pid);
    start(victim);
    return s;
  }

  // The same for one given stage: SIGKILL to one of its live processes (at random), reaped,
  // started again. Returns whether there was one.
  template <class Rng>
  bool kill_in(Rng& rng, int stage) {
    std::vector<Proc*> candidates;
    for (auto& p : procs_)
      if (p.pid > 0 && p.stage == stage) candidates.push_back(&p);
    if (candidates.empty()) return false;
    Proc& victim = *candidates[rng() % candidates.size()];
    ::kill(victim.pid, SIGKILL);
    wait_for(victim.pid);
    start(victim);
    return true;
  }

  // SIGTERM to every live process, SIGKILL to what is left after `grace`.
  void stop_all(Clock::duration grace) {
    for (auto& p : procs_)
      if (p.pid > 0) ::kill(p.pid, SIGTERM);
    const auto until = Clock::now() + grace;
    for (auto& p : procs_) {
      if (p.pid <= 0) continue;
      int st = 0;
      while (::waitpid(p.pid, &st, WNOHANG) == 0) {
        if (Clock::now() > until) {
          ::kill(p.pid, SIGKILL);
          wait_for(p.pid);
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      p.pid = -1;
    }
  }

  static int wait_for(pid_t pid) {
    int st = 0;
    while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
    }
    return st;
  }

private:
  std::vector<Proc> procs_;
  std::function<std::vector<std::string>(const Proc&)> args_;
  int log_fd_;
  Spawner spawner_;  // empty: idem::test::spawn
};

// ---------------------------------------------------------------------------------------------
// What the workers leave behind.

// Outcome lines of every stats file of `role` ("producer" / "consumer" / ...), by letter.
inline std::map<char, long long> read_stats(const std::string& dir, const std::string& role) {
  std::map<char, long long> out;
  for (const auto& f : std::filesystem::directory_iterator(dir)) {
    if (f.path().filename().string().rfind("stats-" + role + "-", 0) != 0) continue;
    std::ifstream in(f.path());
    std::string line;
    while (std::getline(in, line))
      if (!line.empty()) ++out[line[0]];
  }
  return out;
}

inline long long at(const std::map<char, long long>& m, char c) {
  auto it = m.find(c);
  return it == m.end() ? 0LL : it->second;
}

inline std::string tail_of(const std::string& path, std::size_t n) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string s = ss.str();
  return s.size() > n ? s.substr(s.size() - n) : s;
}

}  // namespace pipeline
