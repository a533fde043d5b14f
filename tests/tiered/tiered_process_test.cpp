// 8 consumer processes (fork+exec of idem_tiered_worker) on the same keys through TieredStore,
// while the test FLUSHALLs Redis and then restarts it without persistence: every key's handler
// commits exactly once (counted from an effects table without uniqueness), fences from PostgreSQL.
#include <catch2/catch.hpp>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tiered_support.hpp"

#ifndef IDEM_TIERED_SANITIZED
#define IDEM_TIERED_SANITIZED 0
#endif

using namespace std::chrono_literals;

namespace {

int wait_exit(pid_t pid, std::chrono::seconds bound) {
  const auto until = std::chrono::steady_clock::now() + bound;
  int st = 0;
  while (::waitpid(pid, &st, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > until) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &st, 0);
      return -1;
    }
    std::this_thread::sleep_for(20ms);
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TEST_CASE("tiered processes: 8 consumers on the same keys, Redis flushed and restarted mid-run: each runs once",
          "[tiered][process]") {
  const int keys = IDEM_TIERED_SANITIZED ? 150 : 400;
  const int workers = 8;
  idem::test::RedisServer redis;  // no persistence: a restart loses every record
  const std::string table = "tiered_effects_" + pgtest::random_hex(8);
  pgtest::Raw raw;
  raw.exec("CREATE TABLE idem_test." + table + " (key text NOT NULL, fence bigint NOT NULL)");
  {  // the records table exists before 8 processes race to create it
    auto pg = pgtest::store(tieredtest::pg_options());
    pg.migrate();
  }
  const std::string prefix = "p" + pgtest::random_hex() + ":";
  char tmpl[] = "/tmp/idem-tiered-XXXXXX";
  REQUIRE(::mkdtemp(tmpl) != nullptr);
  const std::string dir = tmpl;

  std::vector<pid_t> pids;
  for (int w = 0; w < workers; ++w) {
    const std::string out = dir + "/worker-" + std::to_string(w);
    const int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    REQUIRE(fd >= 0);
    pids.push_back(idem::test::spawn({IDEM_TIERED_WORKER, std::to_string(redis.port()), pgtest::conninfo(), prefix,
                                      std::to_string(keys), "idem_test." + table, std::to_string(w + 1)},
                                     fd));
    ::close(fd);
  }
  // Mid-run: every Redis record vanishes twice, once by FLUSHALL and once by a restart.
  std::this_thread::sleep_for(IDEM_TIERED_SANITIZED ? 1500ms : 400ms);
  redis.command({"FLUSHALL"});
  std::this_thread::sleep_for(300ms);
  redis.stop(SIGKILL);
  std::this_thread::sleep_for(200ms);
  redis.start();

  std::string outputs;
  for (std::size_t w = 0; w < pids.size(); ++w) {
    CHECK(wait_exit(pids[w], std::chrono::seconds(200)) == 0);
    outputs += slurp(dir + "/worker-" + std::to_string(w));
  }
  INFO(outputs);
  // Exactly once per key, from what the handlers committed.
  CHECK(raw.scalar("SELECT count(DISTINCT key) FROM idem_test." + table) == std::to_string(keys));
  CHECK(raw.scalar("SELECT count(*) FROM (SELECT key FROM idem_test." + table +
                   " GROUP BY key HAVING count(*) > 1) d") == "0");
  raw.exec("DROP TABLE idem_test." + table);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}
