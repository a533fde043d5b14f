#pragma once
// Runs idem_outbox_broker_worker (kafka_rabbitmq_relay_worker.cpp): one relay batch in another
// process, SIGKILLed once its publisher has the broker's acknowledgement and before the relay
// marks the rows sent. Exec'd right away (posix_spawn): forking a threaded, sanitized test process
// and going on without exec is unsafe.

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#ifndef IDEM_OUTBOX_BROKER_WORKER
#error "IDEM_OUTBOX_BROKER_WORKER must name the idem_outbox_broker_worker executable"
#endif

extern char** environ;

namespace idem::test {

// Returns the batch size the killed relay had published (from its marker file).
inline int relay_killed_after_publish(const std::string& broker, const std::string& conninfo, const std::string& schema,
                                      const std::string& table, const std::string& address) {
  const std::string marker = "/tmp/idem-outbox-marker." + std::to_string(::getpid()) + "." + table;
  ::unlink(marker.c_str());
  std::vector<std::string> args = {IDEM_OUTBOX_BROKER_WORKER, broker, conninfo, schema, table, address, marker};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (::posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0)
    throw std::runtime_error("cannot spawn " + args[0]);
  int batch = -1;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < end) {
    std::ifstream in(marker);
    if (in >> batch) break;
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) throw std::runtime_error("the worker exited before publishing");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  ::unlink(marker.c_str());
  if (batch < 0) throw std::runtime_error("the worker did not publish within 60 s");
  return batch;
}

}  // namespace idem::test
