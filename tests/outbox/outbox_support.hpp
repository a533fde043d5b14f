#pragma once
// Test support for the outbox: a store with an outbox on the PostgreSQL fixture server (a table of
// its own per test), the relay worker (outbox_worker.cpp) SIGKILLed between publish and mark-sent,
// the Redis stream read back, and a downstream idem consumer of the stream.

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "idem/outbox/outbox.hpp"
#include "idem/redis.hpp"
#include "postgres/pg_support.hpp"
#include "redis/redis_server.hpp"

#ifndef IDEM_OUTBOX_WORKER
#error "IDEM_OUTBOX_WORKER must name the idem_outbox_worker executable (outbox_worker.cpp)"
#endif

extern char** environ;

namespace outboxtest {

using namespace std::chrono_literals;

// A transactional store with an outbox, on a table of its own.
struct Env {
  std::string table = "ob" + pgtest::random_hex(10);
  idem::PostgresStore store{idem::PostgresOptions{.conninfo = pgtest::conninfo(), .pool = {.size = 8}},
                            idem::PostgresStoreOptions{.schema = "idem_test",
                                                       .table = table,
                                                       .mode = idem::PostgresMode::transactional,
                                                       .outbox = true}};
  idem::IdempotencyGuard<idem::PostgresStore> guard{
      store, {.lease = 10s, .retention = 1h, .failure = {.mode = idem::FailureMode::release}}};

  [[nodiscard]] idem::OutboxRelayOptions relay_options() const {
    idem::OutboxRelayOptions o;
    o.postgres.conninfo = pgtest::conninfo();
    o.schema = "idem_test";
    o.table = table;
    o.backoff_initial = 20ms;
    o.backoff_max = 200ms;
    return o;
  }
  [[nodiscard]] std::string outbox() const { return "idem_test.\"" + table + "_outbox\""; }
  [[nodiscard]] std::string scope() const { return "idem_test." + table; }
  // Handlers of incoming messages 0..count-1, committed one by one: message `n` sends one outbox
  // message to `destination`, key `prefix(n % keys)`, payload "key:index-within-key" so a consumer
  // can check per-key order.
  void write(const std::string& destination, int count, int keys, const std::string& prefix = "key-") {
    for (int n = 0; n < count; ++n) {
      const std::string key = prefix + std::to_string(n % keys);
      const std::string payload = key + ":" + std::to_string(n / keys);
      guard.run(prefix + "in-" + std::to_string(n), [&](const auto& ctx) { ctx.outbox().send(destination, key, payload); });
    }
  }
};

// Runs idem_outbox_worker (outbox_worker.cpp) with the `publisher` it names (redis, kafka,
// rabbitmq) at `address`: one relay batch in another process, SIGKILLed once its publisher has the
// broker's acknowledgement and before the relay marks the rows sent. Exec'd right away
// (posix_spawn): forking a threaded, sanitized test process and going on without exec is unsafe.
// Returns the batch size the killed relay had published (from its marker file).
inline int relay_killed_after_publish(const std::string& publisher, const Env& env, const std::string& address) {
  const std::string marker = "/tmp/idem-outbox-marker." + std::to_string(::getpid()) + "." + env.table;
  ::unlink(marker.c_str());
  std::vector<std::string> args = {IDEM_OUTBOX_WORKER, publisher, pgtest::conninfo(), "idem_test", env.table,
                                   address, marker};
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

// One stream entry as the publisher wrote it.
struct Entry {
  std::string id, key, payload;
  std::map<std::string, std::string> fields;
};

inline std::unique_ptr<redisContext, void (*)(redisContext*)> connect(int port) {
  timeval tv{5, 0};
  std::unique_ptr<redisContext, void (*)(redisContext*)> c(redisConnectWithTimeout("127.0.0.1", port, tv), redisFree);
  if (!c || c->err) throw std::runtime_error("test: cannot connect to redis");
  return c;
}

// Every entry of `stream`, in stream order.
inline std::vector<Entry> read_stream(int port, const std::string& stream) {
  auto c = connect(port);
  auto r = idem::test::command_argv(c.get(), {"XRANGE", stream, "-", "+"});
  if (!r || r->type != REDIS_REPLY_ARRAY) throw std::runtime_error("test: XRANGE failed");
  std::vector<Entry> out;
  for (std::size_t i = 0; i < r->elements; ++i) {
    const redisReply* e = r->element[i];
    const redisReply* f = e->element[1];
    Entry x;
    for (std::size_t j = 0; j + 1 < f->elements; j += 2)
      x.fields[std::string(f->element[j]->str, f->element[j]->len)] =
          std::string(f->element[j + 1]->str, f->element[j + 1]->len);
    x.id = x.fields["id"];
    x.key = x.fields["key"];
    x.payload = x.fields["payload"];
    out.push_back(std::move(x));
  }
  return out;
}

// The downstream consumer: idem on Redis, keyed on the entry's outbox id. applied[id] counts effects.
struct Downstream {
  explicit Downstream(const idem::test::RedisServer& server)
      : store(server.options()), guard(store, {.lease = 10s, .retention = 1h}) {}
  void consume(const std::vector<Entry>& entries) {
    for (const auto& e : entries) {
      auto out = guard.run(e.id, [&](const idem::Context&) { ++applied[e.id]; });
      if (out.status == idem::Status::duplicate) ++duplicates;
    }
  }
  idem::RedisStore store;
  idem::IdempotencyGuard<idem::RedisStore> guard;
  std::map<std::string, int> applied;
  int duplicates = 0;
};

}  // namespace outboxtest
