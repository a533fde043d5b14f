// idem_with_redis CMD ARGS...: starts a throwaway redis-server (tests/redis/redis_server.hpp: free
// loopback port, temp dir, dies with us), runs CMD with every "{port}" in ARGS replaced by its
// port, stops the server and exits with CMD's status. Used by the Redis Streams example's test.

#include <cerrno>
#include <cstdio>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "redis_server.hpp"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: idem_with_redis CMD [ARGS... with {port}]\n");
    return 2;
  }
  try {
    idem::test::RedisServer server;
    std::vector<std::string> args;
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      for (auto p = a.find("{port}"); p != std::string::npos; p = a.find("{port}"))
        a.replace(p, 6, std::to_string(server.port()));
      args.push_back(a);
    }
    // Inherit our stdout/stderr so the command's output reaches CTest.
    const pid_t pid = idem::test::spawn(args, STDOUT_FILENO, STDIN_FILENO);
    int st = 0;
    while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
    }
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "idem_with_redis: %s\n", e.what());
    return 1;
  }
}
