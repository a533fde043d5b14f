// Runs examples/kafka_consumer.cpp (the template, as a process) against librdkafka's mock cluster:
// 1,500 payments by default, ~20% published twice (some on another partition), one poison payment
// published on two partitions, the broker refusing the first dead-letter write. Once the group's
// committed offsets reach the end of every partition it stops the template with SIGTERM, and
// checks the template's own summary (every payment applied once, the exact amount), that the
// dead-letter topic holds one letter per copy of the poison payment (kafka::Source writes the
// letter of each message it dead-letters: no more, no fewer), and that the final commit left the
// offsets at the end.
//
//   idem_kafka_example_driver PATH/TO/idem_kafka_consumer [--events 1500] [--time-limit 50]

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "kafka/mock_cluster.hpp"

namespace {

using Clock = std::chrono::steady_clock;

std::string arg(int argc, char** argv, const char* name, const std::string& dflt) {
  for (int i = 2; i + 1 < argc; ++i)
    if (std::string(argv[i]) == name) return argv[i + 1];
  return dflt;
}

// Starts the template with its stdout on a pipe; returns its pid and the pipe's read end.
std::pair<pid_t, int> spawn(const std::vector<std::string>& args) {
  int fds[2];
  if (pipe(fds) != 0) throw std::runtime_error("pipe failed");
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    dup2(fds[1], STDOUT_FILENO);
    close(fds[0]);
    close(fds[1]);
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(fds[1]);
  return {pid, fds[0]};
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: idem_kafka_example_driver PATH/TO/idem_kafka_consumer [--events N] [--time-limit S]\n");
    return 2;
  }
  const int events = std::stoi(arg(argc, argv, "--events", "1500"));
  const auto limit = std::chrono::seconds(std::stoi(arg(argc, argv, "--time-limit", "50")));
  const auto t0 = Clock::now();
  idem_test::MockCluster cluster;
  idem_test::Events ev;
  ev.publish(cluster, events, 20, /*with_poison=*/true);
  // Only the template's dead-letter producer sends Produce (ApiKey 0) from here on.
  rd_kafka_mock_push_request_errors(cluster.mock(), 0, 1, RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE);

  const std::string group = "example";
  auto [pid, out] = spawn({argv[1], "--brokers", cluster.bootstraps(), "--topic", ev.topic, "--group", group});
  bool at_end = false, exited = false;
  int status = 0;
  while (Clock::now() - t0 < limit) {
    if (waitpid(pid, &status, WNOHANG) == pid) {
      exited = true;
      break;
    }
    if (cluster.committed(group, ev.topic, ev.partitions) == cluster.end_offsets(ev.topic, ev.partitions)) {
      at_end = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  if (!exited) {
    kill(pid, SIGTERM);
    waitpid(pid, &status, 0);
  }
  std::string output;
  char buf[4096];
  for (ssize_t n; (n = read(out, buf, sizeof buf)) > 0;) output.append(buf, static_cast<std::size_t>(n));
  close(out);
  std::fputs(output.c_str(), stdout);

  const std::string want =
      "applied " + std::to_string(ev.effects()) + " payments, amount " + std::to_string(ev.amount()) + ",";
  const bool clean_exit = !exited && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  const bool summary_ok = output.find(want) != std::string::npos;
  const std::int64_t dead_letters = cluster.messages(ev.topic + ".dlq", 0);
  // Each letter is a copy of the poison payment.
  constexpr std::int64_t poison_copies = 2;
  bool letters_poison = true;
  for (const idem_test::Record& r : cluster.read(ev.topic + ".dlq", 0, poison_copies, std::chrono::seconds(5))) {
    const auto p = idem_test::parse(r.value);
    letters_poison = letters_poison && p && p->id == ev.poison && r.header("idem-reason").has_value();
  }
  const bool final_commit =
      cluster.committed(group, ev.topic, ev.partitions) == cluster.end_offsets(ev.topic, ev.partitions);
  std::printf(
      "driver: %d payments; committed offsets at end while running: %s; stopped cleanly: %s; "
      "effects once each (\"%s\"): %s; dead letters %lld (want %lld, the poison's: %s); final commit at end: %s; "
      "%.1f s\n",
      events, at_end ? "yes" : "NO", clean_exit ? "yes" : "NO", want.c_str(), summary_ok ? "yes" : "NO",
      static_cast<long long>(dead_letters), static_cast<long long>(poison_copies), letters_poison ? "yes" : "NO",
      final_commit ? "yes" : "NO",
      std::chrono::duration<double>(Clock::now() - t0).count());
  const bool ok = at_end && clean_exit && summary_ok && dead_letters == poison_copies && letters_poison && final_commit;
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "idem_kafka_example_driver: %s\n", e.what());
  return 1;
}
