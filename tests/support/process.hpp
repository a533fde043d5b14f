#pragma once
// Processes and ports of the tests that start real servers (Redis, NATS, ...): a free loopback port,
// and fork + exec of a child that dies with the test.

#include <csignal>
#include <stdexcept>
#include <string>
#include <vector>

#include <fcntl.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

namespace idem::test {

// A free loopback port right now (the kernel picks it); the server start retries on a clash.
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("test: socket() failed");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    throw std::runtime_error("test: cannot bind a loopback port");
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

// fork + exec of argv with stdout/stderr sent to `out_fd` (or /dev/null when -1); the child dies
// with this process. Only async-signal-safe calls happen between fork and exec.
inline pid_t spawn(const std::vector<std::string>& args, int out_fd = -1, int in_fd = -1) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("test: fork failed");
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    const int null = ::open("/dev/null", O_RDWR);
    ::dup2(in_fd >= 0 ? in_fd : null, 0);
    ::dup2(out_fd >= 0 ? out_fd : null, 1);
    ::dup2(out_fd >= 0 ? out_fd : null, 2);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}

}  // namespace idem::test
