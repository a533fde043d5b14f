#pragma once
// Test support: a replicated PostgreSQL pair of a test case's own (pg_pair.sh), stopped by PID
// when the case ends. A pair that cannot start fails the test.

#include <spawn.h>
#include <sys/wait.h>

#include <catch2/catch.hpp>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "pg_support.hpp"

extern char** environ;

namespace pgtest {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// pg_pair.sh with these arguments, its exit status (-1000 when it overran `limit` and was killed).
inline int run_pair(const std::vector<std::string>& args, std::chrono::seconds limit = std::chrono::seconds(90)) {
  std::vector<std::string> a{"/bin/sh", IDEM_PG_PAIR_SCRIPT};
  a.insert(a.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : a) argv.push_back(s.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  if (::posix_spawn(&pid, "/bin/sh", nullptr, nullptr, argv.data(), environ) != 0) return -1;
  const auto deadline = Clock::now() + limit;
  int st = 0;
  while (::waitpid(pid, &st, WNOHANG) != pid) {
    if (Clock::now() >= deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &st, 0);
      return -1000;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
}

// A primary and its standby of this test case's own, stopped (by PID) when the case ends.
class Pair {
 public:
  explicit Pair(const char* mode) : state_(std::string(IDEM_PG_PAIR_STATE) + "-" + random_hex(6)) {
    const auto t0 = Clock::now();
    const int rc = run_pair({"start", state_, mode});
    if (rc != 0) {
      run_pair({"stop", state_});
      FAIL("pg_pair.sh start " << mode << " failed (" << rc << "): a server that cannot start is a failure");
    }
    std::printf("pair (%s) started in %.2f s\n", mode, seconds_since(t0));
  }
  ~Pair() { run_pair({"stop", state_}); }
  Pair(const Pair&) = delete;
  Pair& operator=(const Pair&) = delete;

  // "conninfo": both slots, target_session_attrs=read-write; "a.conninfo" / "b.conninfo": one slot.
  [[nodiscard]] std::string conninfo(const char* which = "conninfo") const {
    std::ifstream in(state_ + "/" + which);
    std::string line;
    std::getline(in, line);
    REQUIRE_FALSE(line.empty());
    return line;
  }
  // "primary" (the slot, a or b), "a.port", "b.port".
  [[nodiscard]] std::string read(const char* what) const {
    std::ifstream in(state_ + "/" + what);
    std::string s;
    std::getline(in, s);
    return s;
  }
  // kill-primary, promote, attach, stop-standby or start-standby; the seconds it took.
  double step(const char* cmd) {
    const auto t0 = Clock::now();
    REQUIRE(run_pair({cmd, state_}) == 0);
    return seconds_since(t0);
  }

 private:
  std::string state_;
};

}  // namespace pgtest
