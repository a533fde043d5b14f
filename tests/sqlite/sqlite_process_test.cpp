// Several processes on one SQLite file in transactional mode, racing on the same keys: workers
// (sqlite_worker.cpp, fork+exec) are SIGKILLed by the test and kill themselves mid-handler and
// mid-commit, and are started again as a broker would redeliver; then two survivors finish every
// key. Each key's effect must be applied exactly once: double 0, lost 0.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "sqlite_support.hpp"

using namespace std::chrono_literals;

namespace {

pid_t spawn(const std::string& path, int keys, int seed, int chaos) {
  const std::string k = std::to_string(keys), s = std::to_string(seed), c = std::to_string(chaos);
  const pid_t pid = fork();
  if (pid == 0) {
    execl(IDEM_SQLITE_WORKER, IDEM_SQLITE_WORKER, path.c_str(), k.c_str(), s.c_str(), c.c_str(), nullptr);
    _exit(127);
  }
  return pid;
}

}  // namespace

TEST_CASE("sqlite process: workers killed mid-handler and mid-commit apply each effect exactly once",
          "[sqlite][process]") {
  const std::string path = sqlitetest::fresh_path("procs");
  {
    idem::SqliteStore s{idem::SqliteOptions{.path = path, .mode = idem::SqliteMode::transactional}};
    s.migrate();
    sqlitetest::Raw(path).exec("CREATE TABLE effect (k TEXT PRIMARY KEY, n INTEGER NOT NULL)");
  }
  constexpr int keys = 120;
  constexpr int chaos = 60;  // permille of handler runs that kill their own process
  std::mt19937 rng(12345);
  int seed = 1, killed_by_test = 0, killed_themselves = 0, finished = 0, failed = 0;
  std::vector<pid_t> running;
  std::vector<pid_t> shot;  // pids the test killed itself
  for (int i = 0; i < 4; ++i) running.push_back(spawn(path, keys, seed++, chaos));

  // Chaos: kill at random moments and let workers kill themselves; each death is redelivered (a
  // new worker), a worker that finished every key is not replaced.
  const auto chaos_end = std::chrono::steady_clock::now() + 3s;
  while (!running.empty() && std::chrono::steady_clock::now() < chaos_end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20 + rng() % 60));
    if (rng() % 3 == 0) {
      const pid_t victim = running[rng() % running.size()];
      if (kill(victim, SIGKILL) == 0) shot.push_back(victim);
    }
    for (auto it = running.begin(); it != running.end();) {
      int st = 0;
      const pid_t pid = *it;
      if (waitpid(pid, &st, WNOHANG) == 0) {
        ++it;
        continue;
      }
      it = running.erase(it);
      const bool by_test = std::find(shot.begin(), shot.end(), pid) != shot.end();
      if (WIFSIGNALED(st)) {
        ++(by_test ? killed_by_test : killed_themselves);
        running.push_back(spawn(path, keys, seed++, chaos));
        break;  // `running` changed under the iterator
      }
      if (WIFEXITED(st) && WEXITSTATUS(st) == 0) ++finished;
      else ++failed;
    }
  }
  // Stop the chaos: the remaining workers die, two survivors without chaos finish every key.
  for (pid_t pid : running) {
    kill(pid, SIGKILL);
    int st = 0;
    waitpid(pid, &st, 0);
  }
  std::vector<pid_t> survivors{spawn(path, keys, seed++, 0), spawn(path, keys, seed++, 0)};
  for (pid_t pid : survivors) {
    int st = 0;
    waitpid(pid, &st, 0);
    CHECK(WIFEXITED(st));
    CHECK(WEXITSTATUS(st) == 0);
  }

  sqlitetest::Raw raw(path);
  const int rows = std::stoi(raw.scalar("SELECT count(*) FROM effect"));
  const int doubles = std::stoi(raw.scalar("SELECT count(*) FROM effect WHERE n > 1"));
  const int completed =
      std::stoi(raw.scalar("SELECT count(*) FROM idem_records WHERE state = 2 AND key IN (SELECT CAST(k AS BLOB) FROM effect)"));
  UNSCOPED_INFO("kills by the test " << killed_by_test << ", self-kills (mid-handler / mid-commit) "
                                     << killed_themselves << ", chaos workers finished " << finished << ", failed "
                                     << failed);
  CHECK(failed == 0);
  CHECK(killed_by_test > 0);
  CHECK(killed_themselves > 0);
  CHECK(doubles == 0);
  CHECK(rows == keys);  // lost 0
  CHECK(completed == keys);
  CHECK(raw.scalar("PRAGMA integrity_check") == "ok");
}
