// A consumer process of sqlite_process_test: runs every key of the file through a transactional
// guard until each one is executed or a duplicate (its view of "done"), then exits 0. Its handler
// adds 1 to the key's row in `effect` through ctx.tx, sleeping a little so kills land inside it.
// Chaos (permille): a run kills itself with SIGKILL mid-handler (after its write), or arms a
// thread that kills it a moment later, while the completion commits.
//
//   idem_sqlite_worker PATH KEYS SEED CHAOS_PERMILLE
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "idem/sqlite.hpp"

using namespace std::chrono_literals;

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s PATH KEYS SEED CHAOS_PERMILLE\n", argv[0]);
    return 2;
  }
  const std::string path = argv[1];
  const int keys = std::atoi(argv[2]);
  std::mt19937 rng(static_cast<unsigned>(std::atoi(argv[3])));
  const int chaos = std::atoi(argv[4]);
  try {
    idem::SqliteStore store{idem::SqliteOptions{.path = path, .mode = idem::SqliteMode::transactional,
                                                .busy_timeout = 2s}};
    idem::IdempotencyGuard guard(store, idem::GuardOptions{.lease = 300ms, .retention = 600s});
    std::vector<int> left(static_cast<std::size_t>(keys));
    for (int i = 0; i < keys; ++i) left[static_cast<std::size_t>(i)] = i;
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (!left.empty() && std::chrono::steady_clock::now() < deadline) {
      std::shuffle(left.begin(), left.end(), rng);
      std::vector<int> next;
      for (int i : left) {
        const std::string key = "key-" + std::to_string(i);
        const int roll = static_cast<int>(rng() % 1000);
        const int how = static_cast<int>(rng() % 2);
        const auto delay = std::chrono::microseconds(rng() % 3000);
        try {
          auto out = guard.run(key, [&](const auto& ctx) {
            ctx.tx->exec("INSERT INTO effect (k, n) VALUES (?, 1) ON CONFLICT (k) DO UPDATE SET n = n + 1", key);
            std::this_thread::sleep_for(1ms);
            if (roll < chaos) {
              if (how == 0) kill(getpid(), SIGKILL);  // mid-handler, its write made
              std::thread([delay] {                  // mid-commit: the completion is on its way
                std::this_thread::sleep_for(delay);
                kill(getpid(), SIGKILL);
              }).detach();
            }
            return 1;
          });
          if (out.status != idem::Status::executed && out.status != idem::Status::duplicate) next.push_back(i);
        } catch (const idem::store_error&) {
          next.push_back(i);  // the write lock stayed busy: redelivered below
        }
      }
      left = std::move(next);
      if (!left.empty()) std::this_thread::sleep_for(20ms);
    }
    return left.empty() ? 0 : 4;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "worker: %s\n", e.what());
    return 3;
  }
}
