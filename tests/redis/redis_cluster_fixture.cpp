// The CTest fixture behind redis_cluster_contract_test: one Redis Cluster (redis_cluster.hpp) for
// every contract case, instead of one started per case (6 nodes formed with redis-cli, ~3 s each).
//
//   idem_redis_cluster_fixture start STATE_DIR   forks a holder that owns the cluster (its nodes die
//                                                 with it: PR_SET_PDEATHSIG), writes STATE_DIR/url
//                                                 and STATE_DIR/pid, and returns once it is formed
//   idem_redis_cluster_fixture stop STATE_DIR    stops the holder by its PID (SIGTERM, then SIGKILL)
//
// The holder stops by itself after an hour, so a run that never reaches "stop" leaves nothing.
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "redis_cluster.hpp"

namespace {

int usage() {
  std::fprintf(stderr, "usage: idem_redis_cluster_fixture start|stop STATE_DIR\n");
  return 2;
}

void write_file(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp) << text;
  std::filesystem::rename(tmp, path);
}

// The holder: forms the cluster, says where it is, waits for SIGTERM (or the hour), then stops it.
int hold(const std::string& state) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  try {
    idem::test::RedisCluster cluster;
    write_file(state + "/url", cluster.url());
    timespec hour{3600, 0};
    sigtimedwait(&set, nullptr, &hour);
  } catch (const std::exception& e) {
    write_file(state + "/error", e.what());
    return 1;
  }
  return 0;
}

int start(const std::string& state) {
  std::filesystem::remove_all(state);
  std::filesystem::create_directories(state);
  const pid_t holder = ::fork();
  if (holder < 0) {
    std::perror("fork");
    return 1;
  }
  if (holder == 0) {
    // Out of CTest's process group, and off its output pipe (CTest reads it until every writer is
    // gone): the holder outlives this command.
    ::setsid();
    const int log = ::open((state + "/holder.log").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    const int null = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (log >= 0) {
      ::dup2(log, STDOUT_FILENO);
      ::dup2(log, STDERR_FILENO);
    }
    if (null >= 0) ::dup2(null, STDIN_FILENO);
    std::_Exit(hold(state));
  }
  write_file(state + "/pid", std::to_string(holder));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(150);
  while (std::chrono::steady_clock::now() < deadline) {
    if (std::filesystem::exists(state + "/url")) {
      std::ifstream url(state + "/url");
      const std::string where((std::istreambuf_iterator<char>(url)), std::istreambuf_iterator<char>());
      std::printf("redis cluster fixture: %s (holder pid %d)\n", where.c_str(), static_cast<int>(holder));
      return 0;
    }
    int status = 0;
    if (::waitpid(holder, &status, WNOHANG) == holder || std::filesystem::exists(state + "/error")) {
      std::ifstream err(state + "/error");
      std::string why((std::istreambuf_iterator<char>(err)), std::istreambuf_iterator<char>());
      std::fprintf(stderr, "redis cluster fixture: the cluster did not form: %s\n", why.c_str());
      return 1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ::kill(holder, SIGKILL);
  std::fprintf(stderr, "redis cluster fixture: the cluster did not form within 150 s\n");
  return 1;
}

int stop(const std::string& state) {
  std::ifstream in(state + "/pid");
  int pid = 0;
  if (!(in >> pid) || pid <= 0) {
    std::fprintf(stderr, "redis cluster fixture: no holder recorded in %s\n", state.c_str());
    return 1;
  }
  if (::kill(pid, SIGTERM) != 0) return 0;  // already gone
  for (int i = 0; i < 200 && ::kill(pid, 0) == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  if (::kill(pid, 0) == 0) ::kill(pid, SIGKILL);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) return usage();
  const std::string cmd = argv[1], state = argv[2];
  if (cmd == "start") return start(state);
  if (cmd == "stop") return stop(state);
  return usage();
}
