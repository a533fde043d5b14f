#pragma once
// Runs the installed-to-be `idem` binary as an operator would: a child process (fork + exec, stdin
// /dev/null so it is never a terminal), its stdout and stderr collected, its exit status and peak
// memory (wait4's ru_maxrss) reported.

#include <cerrno>
#include <cstddef>
#include <string>
#include <vector>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "redis_server.hpp"

namespace idem::test {

struct ToolRun {
  int status = -1;          // exit code, or 128 + signal
  std::string out;          // stdout and stderr, interleaved
  std::size_t lines = 0;    // newlines seen (counted as read, for outputs not worth keeping)
  long max_rss_kib = 0;     // the child's peak resident set
};

// keep_output false: only lines are counted, so a 100,000-record listing is not held here either.
inline ToolRun run_tool(const std::vector<std::string>& args, bool keep_output = true) {
  int p[2];
  if (::pipe(p) != 0) throw std::runtime_error("test: pipe failed");
  std::vector<std::string> argv{IDEM_TOOL};
  argv.insert(argv.end(), args.begin(), args.end());
  const pid_t pid = spawn(argv, p[1]);
  ::close(p[1]);
  ToolRun r;
  char buf[65536];
  ssize_t n;
  while ((n = ::read(p[0], buf, sizeof buf)) > 0 || (n < 0 && errno == EINTR)) {
    if (n <= 0) continue;
    for (ssize_t i = 0; i < n; ++i) r.lines += buf[i] == '\n';
    if (keep_output) r.out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(p[0]);
  int st = 0;
  rusage ru{};
  while (::wait4(pid, &st, 0, &ru) < 0 && errno == EINTR) {
  }
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  r.max_rss_kib = ru.ru_maxrss;
  return r;
}

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace idem::test
