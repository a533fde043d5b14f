// Many processes on one redis-server: exactly-once across processes, and fencing of holders that
// crash (SIGKILL) or stall (SIGSTOP). Children are fork+exec'ed copies of idem_redis_worker.
#include <catch2/catch.hpp>

#include <chrono>
#include <csignal>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "idem/idem.hpp"
#include "idem/redis.hpp"
#include "redis_factory.hpp"

using namespace std::chrono_literals;
using idem::RedisStore;
using idem::test::RedisServer;

namespace {

using idem::test::Child;
Child start_worker(const std::vector<std::string>& args) { return Child::start(IDEM_REDIS_WORKER, args); }

idem::AcquireParams params(std::uint64_t token, idem::millis lease = 30s) {
  idem::AcquireParams p;
  p.lease = lease;
  p.retention = 60s;
  p.token = token;
  return p;
}

}  // namespace

TEST_CASE("redis: 8 processes on the same 500 keys execute each key exactly once", "[redis][process]") {
  RedisServer server;
  const std::string ns = "procs-" + idem::test::random_hex() + ":";
  constexpr int processes = 8, keys = 500;
  std::vector<Child> children;
  for (int i = 0; i < processes; ++i)
    children.push_back(start_worker({"race", std::to_string(server.port()), ns, std::to_string(keys),
                                     std::to_string(1000 + i)}));
  std::map<int, int> executions;
  int done = 0, wrong = 0;
  for (auto& c : children) {
    std::istringstream in(c.rest());
    std::string word;
    int i;
    while (in >> word) {
      if (word == "done") {
        ++done;
      } else if (word == "executed" && in >> i) {
        ++executions[i];
      } else if (word == "wrong" && in >> i) {
        ++wrong;
      }
    }
    CHECK(c.wait() == 0);
  }
  CHECK(done == processes);
  CHECK(wrong == 0);
  CHECK(executions.size() == static_cast<std::size_t>(keys));
  int twice = 0;
  for (const auto& [k, n] : executions) twice += n != 1;
  CHECK(twice == 0);
  RedisStore store(server.options());
  for (int i = 0; i < keys; i += 50) {
    auto rec = store.inspect(ns + std::to_string(i));
    REQUIRE(rec);
    CHECK(rec->state == idem::State::completed);
    CHECK(rec->holder.fence == 1);
  }
}

TEST_CASE("redis: a holder SIGKILLed mid-handler is taken over after its lease with fence+1", "[redis][process]") {
  RedisServer server;
  const std::string key = "killed-" + idem::test::random_hex();
  Child c = start_worker({"hold", std::to_string(server.port()), key, "300"});
  const std::string first = c.line();
  REQUIRE(first == "fence 1");
  RedisStore store(server.options());
  CHECK(store.acquire(key, params(2)).status == idem::AcquireStatus::in_flight);  // the lease is live
  ::kill(c.pid, SIGKILL);
  CHECK(c.wait() == 128 + SIGKILL);
  std::this_thread::sleep_for(400ms);
  auto r = store.acquire(key, params(3));
  REQUIRE(r.status == idem::AcquireStatus::acquired);
  CHECK(r.takeover);
  CHECK(r.holder.fence == 2);
  CHECK(store.complete(key, r.holder, "recovered", 60s) == idem::WriteStatus::ok);
}

TEST_CASE("redis: a holder SIGSTOPped past its lease gets lease_lost and the new result stays", "[redis][process]") {
  RedisServer server;
  const std::string key = "stalled-" + idem::test::random_hex();
  Child c = start_worker({"slow", std::to_string(server.port()), key, "300", "500"});
  REQUIRE(c.line() == "fence 1");
  ::kill(c.pid, SIGSTOP);
  std::this_thread::sleep_for(450ms);
  RedisStore store(server.options());
  auto r = store.acquire(key, params(7));
  REQUIRE(r.status == idem::AcquireStatus::acquired);
  CHECK(r.takeover);
  CHECK(r.holder.fence == 2);
  REQUIRE(store.complete(key, r.holder, "new", 60s) == idem::WriteStatus::ok);
  ::kill(c.pid, SIGCONT);
  CHECK(c.wait() == 3);  // the stalled holder's completion was refused: lease_lost
  auto rec = store.inspect(key);
  REQUIRE(rec);
  CHECK(rec->state == idem::State::completed);
  CHECK(rec->result == "new");
  CHECK(rec->holder == r.holder);
}

namespace {
// SIGKILLs `kills` fresh workers of mode `ordered` at random moments and counts, over what each
// left behind, the entities whose highest completed event is above their last applied sequence:
// an event recorded as done whose advance was lost with the process.
int behind_after_kills(RedisServer& srv, bool combined, int kills, std::mt19937& rng) {
  idem::RedisOptions o = srv.options();
  RedisStore store{o};
  idem::RedisSequenceStore seqs{store};
  constexpr int entities = 4000, per_entity = 4;
  int behind = 0;
  for (int k = 0; k < kills; ++k) {
    const std::string ns = "ord-" + idem::test::random_hex();
    Child c = start_worker({"ordered", std::to_string(o.port), ns, std::to_string(entities),
                            std::to_string(per_entity), combined ? "1" : "0"});
    REQUIRE(c.line() == "ready");
    std::this_thread::sleep_for(std::chrono::milliseconds(5 + rng() % 40));
    ::kill(c.pid, SIGKILL);
    CHECK(c.wait() == 128 + SIGKILL);
    for (int e = 0; e < entities; ++e) {
      const std::string entity = ns + "-" + std::to_string(e);
      std::uint64_t top = 0;
      for (int q = 1; q <= per_entity; ++q) {
        auto r = store.inspect("{" + entity + "}:" + std::to_string(q));
        if (r && r->state == idem::State::completed) top = static_cast<std::uint64_t>(q);
      }
      if (top == 0) {
        if (!store.inspect("{" + entity + "}:1")) break;  // the worker never got this far
        continue;
      }
      if (seqs.last_applied(entity).value_or(0) < top) ++behind;
    }
  }
  return behind;
}
}  // namespace

TEST_CASE("redis: SIGKILL never separates a gate's completion from its advance", "[redis][process][sequence]") {
  RedisServer server;
  std::mt19937 rng(std::random_device{}());
  const int combined = behind_after_kills(server, true, 25, rng);
  const int two_step = behind_after_kills(server, false, 25, rng);
  // Two steps leave a window (repaired later by the duplicate path); one script leaves none.
  WARN("entities left with a completed event above their sequence after 25 SIGKILLs each: one script "
       << combined << ", two steps " << two_step);
  CHECK(combined == 0);
}

TEST_CASE("redis: a batch SIGKILLed midway: every item whose handler returned is a duplicate after", "[redis][process][batch]") {
  RedisServer server;
  const std::string ns = "midbatch-" + idem::test::random_hex() + "-";
  constexpr int items = 40;
  Child c = start_worker({"batch", std::to_string(server.port()), ns, std::to_string(items), "15"});
  // Killed after a random number of handlers: each one's completion was sent as it returned.
  std::mt19937 rng(std::random_device{}());
  const int wait_for = 5 + static_cast<int>(rng() % 25);
  std::vector<int> ran;
  for (int i = 0; i < wait_for; ++i) {
    const std::string l = c.line();
    REQUIRE(l.rfind("ran ", 0) == 0);
    ran.push_back(std::stoi(l.substr(4)));
  }
  ::kill(c.pid, SIGKILL);
  CHECK(c.wait() == 128 + SIGKILL);
  // The last "ran" may not have sent its completion yet (killed between the two); every earlier
  // one did, so its record is completed now, and a redelivery of the whole batch skips it.
  RedisStore store(server.options());
  int completed = 0;
  for (std::size_t k = 0; k + 1 < ran.size(); ++k) {
    auto rec = store.inspect(ns + std::to_string(ran[k]));
    REQUIRE(rec);
    CHECK(rec->state == idem::State::completed);
    completed += rec->state == idem::State::completed;
  }
  idem::IdempotencyGuard guard(store, {.lease = 30s, .retention = 600s});
  std::vector<std::string> keys;
  for (int k : ran) keys.push_back(ns + std::to_string(k));
  std::vector<idem::BatchItem> again;
  for (std::size_t k = 0; k + 1 < keys.size(); ++k) again.push_back({keys[k], ""});
  int reran = 0;
  auto r = guard.run_batch(again, [&](const idem::BatchItem&) { return ++reran; });
  CHECK(reran == 0);
  for (std::size_t k = 0; k < again.size(); ++k) {
    CHECK(r.outcomes[k].status == idem::Status::duplicate);
    CHECK(*r.outcomes[k].value == ran[k]);
  }
  INFO("killed after " << wait_for << " handlers of " << items);
  CHECK(completed == wait_for - 1);
}
