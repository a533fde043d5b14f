// PostgresStore behind PgBouncer (pgbouncer.sh: Debian's pgbouncer, an ini of its own, in front of
// the fixture server, started once per ctest run as a fixture). Session pooling changes nothing: the store contract holds. Transaction
// pooling hands each transaction to any server session: with PostgresOptions::transaction_pooler
// the stores send unnamed statements and keep no session state, and the contract holds; without
// it the first statement that meets another server session is refused with an error that names
// the option. Built twice (one contract suite per binary): IDEM_PGBOUNCER_MODE is "session" or
// "transaction".
#include <spawn.h>
#include <sys/wait.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <chrono>
#include <fstream>
#include <memory>
#include <string_view>
#include <string>
#include <thread>
#include <vector>

#include "contract/contract_suite.hpp"
#ifdef IDEM_PGBOUNCER_RELAY
#include <mutex>
#include <span>

#include "idem/outbox/relay.hpp"
#endif
#include "idem/postgres/sequence_store.hpp"
#include "pg_support.hpp"

extern char** environ;

using namespace std::chrono_literals;

namespace {

// A pgbouncer of this process's own, in IDEM_PGBOUNCER_MODE, in front of the fixture server;
// stopped by PID at exit. One that cannot start fails the test.
class Bouncer {
 public:
  Bouncer() : state_(std::string(IDEM_PG_BOUNCER_STATE) + "-" + IDEM_PGBOUNCER_MODE + "-" + pgtest::random_hex(6)) {
    if (run({"start", state_, std::to_string(pgtest::port()), IDEM_PGBOUNCER_MODE}) != 0)
      throw std::runtime_error("pgbouncer.sh start failed: a pooler that cannot start is a failure");
    std::ifstream in(state_ + "/conninfo");
    std::getline(in, conninfo_);
  }
  ~Bouncer() { run({"stop", state_}); }
  Bouncer(const Bouncer&) = delete;
  Bouncer& operator=(const Bouncer&) = delete;
  [[nodiscard]] const std::string& conninfo() const { return conninfo_; }

 private:
  static int run(std::vector<std::string> args) {
    args.insert(args.begin(), {"/bin/sh", IDEM_PG_BOUNCER_SCRIPT});
    std::vector<char*> argv;
    for (auto& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);
    pid_t pid = -1;
    if (::posix_spawn(&pid, "/bin/sh", nullptr, nullptr, argv.data(), environ) != 0) return -1;
    int st = 0;
    ::waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }
  std::string state_, conninfo_;
};

const std::string& bouncer_conninfo() {
  static Bouncer b;
  return b.conninfo();
}

constexpr bool transaction_pooling = std::string_view(IDEM_PGBOUNCER_MODE) == "transaction";

pgtest::Config behind(idem::PostgresMode m = idem::PostgresMode::lease) {
  auto o = pgtest::options(m);
  o.client.conninfo = bouncer_conninfo();
  o.client.transaction_pooler = transaction_pooling;
  o.client.pool.size = 8;
  return o;
}

struct BouncerFactory : pgtest::ServerFactoryBase {
  using store_type = idem::PostgresStore;
  BouncerFactory() : ServerFactoryBase("b" + pgtest::random_hex() + ":"), store_(pgtest::store(behind())) {}
  store_type& store() { return store_; }

 private:
  store_type store_;
};

}  // namespace

// Session pooling is a plain session to the client: the basic case below shows it; the contract
// runs where it can break, behind transaction pooling.
#ifdef IDEM_PGBOUNCER_CONTRACT
IDEM_CONTRACT_SUITE(BouncerFactory, "[postgres][pgbouncer]")
#endif

TEST_CASE("pgbouncer: acquire, complete, duplicate, and a transactional commit with its write", "[postgres][pgbouncer]") {
  idem::PostgresStore lease = pgtest::store(behind());
  const auto k = pgtest::key("basic");
  auto a = lease.acquire(k, pgtest::ap(1));
  REQUIRE(a.status == idem::AcquireStatus::acquired);
  CHECK(lease.complete(k, a.holder, "r", std::chrono::seconds(60)) == idem::WriteStatus::ok);
  auto d = lease.acquire(k, pgtest::ap(2));
  CHECK(d.status == idem::AcquireStatus::duplicate);
  CHECK(d.payload == "r");
  auto o = behind(idem::PostgresMode::transactional);
  idem::PostgresStore tx(o.client, o.store);
  const auto kt = pgtest::key("basic-tx");
  auto t = tx.begin(kt, pgtest::ap(3));
  REQUIRE(t.decision().status == idem::AcquireStatus::acquired);
  CHECK(t.exec("SELECT 1").rows() == 1);
  CHECK(t.commit("tx", std::chrono::seconds(60)) == idem::WriteStatus::ok);
  CHECK(tx.acquire(kt, pgtest::ap(4)).status == idem::AcquireStatus::duplicate);
}

#ifdef IDEM_PGBOUNCER_CONTRACT  // the transaction-mode binary only
TEST_CASE("pgbouncer transaction mode: transactional mode, the sequence store and concurrent claims work",
          "[postgres][pgbouncer]") {
  auto o = behind(idem::PostgresMode::transactional);
  idem::PostgresStore tx(o.client, o.store);
  pgtest::Raw raw;
  const std::string t = "bounced_" + pgtest::random_hex(8);
  raw.exec("CREATE TABLE " + t + " (k text PRIMARY KEY)");
  idem::IdempotencyGuard g(tx);
  std::atomic<int> ran{0};
  std::vector<std::thread> threads;
  const auto k = pgtest::key("tx");
  for (int i = 0; i < 6; ++i)
    threads.emplace_back([&] {
      for (int j = 0; j < 5; ++j) {
        const std::string kj = k + std::to_string(j);
        // A copy of a key held by another thread answers in_flight: it is delivered again.
        for (int tries = 0; tries < 200; ++tries) {
          auto out = g.run(kj, [&](const auto& ctx) {
            ++ran;
            ctx.tx->exec("INSERT INTO " + t + " VALUES ($1)", kj);
            return std::string("ok");
          });
          if (out.status != idem::Status::in_flight) break;
          std::this_thread::sleep_for(5ms);
        }
      }
    });
  for (auto& th : threads) th.join();
  // Each of the 5 keys ran once (a second insert of its row would fail), whatever the concurrency.
  CHECK(raw.scalar("SELECT count(*) FROM " + t) == "5");
  CHECK(ran.load() == 5);
  raw.exec("DROP TABLE " + t);

  idem::PostgresSequenceStore seqs(tx, {.table = "bounced_sequences"});
  const auto e = pgtest::key("entity");
  CHECK(seqs.advance(e, 5).advanced);
  CHECK_FALSE(seqs.advance(e, 4).advanced);
  CHECK(seqs.last_applied(e) == 5u);
}

TEST_CASE("pgbouncer transaction mode without transaction_pooler is refused with an error that names it",
          "[postgres][pgbouncer]") {
  auto o = behind();
  o.client.transaction_pooler = false;
  o.store.table = "plain_" + pgtest::random_hex(6);
  bool refused = false;
  std::string why;
  // Two clients one after the other: the second meets the server session the first prepared on.
  for (int i = 0; i < 4 && !refused; ++i) {
    idem::PostgresStore s(o.client, o.store);
    try {
      for (int j = 0; j < 5; ++j) (void)s.acquire(pgtest::key("p"), pgtest::ap(1));
    } catch (const idem::invalid_options_error& e) {
      refused = true;
      why = e.what();
    }
  }
  INFO(why);
  CHECK(refused);
  CHECK_THAT(why, Catch::Contains("transaction_pooler"));
}

// Two services' stores on one database, on tables of their own, each with a client of its own,
// behind one transaction-mode pooler whose 3 server sessions the 8 client sessions share: each
// store's statements meet server sessions where the other's are prepared. A statement's name is
// derived from its text, so no call is ever answered from the other store's table. Without
// transaction_pooler a call may be refused with invalid_options_error, never decided wrongly;
// with it every call is decided right.
TEST_CASE("pgbouncer transaction mode: two stores on different tables never answer from each other's table",
          "[postgres][pgbouncer]") {
  const bool pooler = GENERATE(false, true);
  INFO("transaction_pooler = " << pooler);
  const std::string suffix = pgtest::random_hex(6);
  auto config = [&](const char* svc) {
    auto o = behind();
    o.client.transaction_pooler = pooler;
    o.client.pool.size = 4;
    o.store.table = std::string(svc) + "_" + suffix;
    return o;
  };
  const auto oa = config("svc_a"), ob = config("svc_b");
  for (const auto* o : {&oa, &ob}) {  // the tables, made through a client that cannot be refused
    auto m = *o;
    m.client.transaction_pooler = true;
    idem::PostgresStore(m.client, m.store).migrate();
  }
  idem::PostgresStore a(oa.client, oa.store), b(ob.client, ob.store);
  const std::string prefix = "two:" + suffix + ":";
  constexpr int keys = 40;
  std::atomic<int> refused{0}, right{0};
  std::mutex mu;
  std::vector<std::string> wrong;
  auto note_wrong = [&](std::string w) {
    std::lock_guard lk(mu);
    wrong.push_back(std::move(w));
  };
  auto params = [](const char* owner, std::uint64_t token) {
    auto p = pgtest::ap(token);
    p.owner = owner;
    return p;
  };
  // Runs f, counting a refusal; any other error is a failure of the test.
  auto attempt = [&](const std::string& what, auto&& f) {
    try {
      f();
    } catch (const idem::invalid_options_error& e) {
      if (pooler) note_wrong(what + ": refused with transaction_pooler set: " + e.what());
      ++refused;
    } catch (const std::exception& e) {
      note_wrong(what + ": " + e.what());
    }
  };
  // Service A completes its keys first.
  for (int i = 0; i < keys; ++i) {
    const std::string k = prefix + std::to_string(i);
    attempt("a first " + k, [&] {
      auto d = a.acquire(k, params("svc-a", 1));
      if (d.status != idem::AcquireStatus::acquired) return note_wrong("a first " + k + ": not acquired");
      if (a.complete(k, d.holder, "A:" + k, 60s) != idem::WriteStatus::ok) note_wrong("a complete " + k);
      ++right;
    });
  }
  // Then both at once: A asks its keys again (duplicates, its own results), B runs the same key
  // names, which its own table has never seen.
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      for (int i = t; i < keys; i += 2) {
        const std::string k = prefix + std::to_string(i);
        attempt("a again " + k, [&] {
          auto d = a.acquire(k, params("svc-a", 2));
          if (d.status != idem::AcquireStatus::duplicate || d.payload != "A:" + k)
            return note_wrong("a again " + k + ": " + std::string(idem::to_string(d.status)) + " '" + d.payload + "'");
          ++right;
        });
      }
    });
    threads.emplace_back([&, t] {
      for (int i = t; i < keys; i += 2) {
        const std::string k = prefix + std::to_string(i);
        attempt("b " + k, [&] {
          auto d = b.acquire(k, params("svc-b", 3));
          if (d.status != idem::AcquireStatus::acquired)
            return note_wrong("b " + k + ": " + std::string(idem::to_string(d.status)) + " '" + d.payload + "'");
          if (b.complete(k, d.holder, "B:" + k, 60s) != idem::WriteStatus::ok) return note_wrong("b complete " + k);
          ++right;
        });
      }
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& w : wrong) FAIL_CHECK(w);
  // Each table holds its own service's rows only (a claim whose completion was refused stays
  // in progress until its lease ends).
  pgtest::Raw raw;
  const std::string qa = "idem_test." + oa.store.table, qb = "idem_test." + ob.store.table;
  const auto foreign = [&](const std::string& table, const char* owner, const char* result_prefix) {
    return raw.scalar("SELECT count(*) FROM " + table + " WHERE owner <> '" + owner +
                      "' OR (state = 2 AND convert_from(result, 'UTF8') NOT LIKE '" + result_prefix + "%')");
  };
  CHECK(foreign(qa, "svc-a", "A:") == "0");
  CHECK(foreign(qb, "svc-b", "B:") == "0");
  std::printf("two stores behind transaction pooling (transaction_pooler %s): %d calls right, %d refused, %zu wrong\n",
              pooler ? "on" : "off", right.load(), refused.load(), wrong.size());
  if (pooler) CHECK(right.load() == 3 * keys);
  raw.exec("DROP TABLE " + qa + ", " + qb);
}

#endif

#ifdef IDEM_PGBOUNCER_RELAY
// The outbox relay behind transaction pooling: no session settings, and no LISTEN (a pooled
// server session would never hear the NOTIFY) — it polls, says so once, and publishes every row.
namespace {
class Collect final : public idem::OutboxPublisher {
 public:
  void publish(std::span<const idem::OutboxMessage> batch) override {
    std::lock_guard lk(mu_);
    for (const auto& m : batch) ids_.push_back(m.id);
  }
  [[nodiscard]] std::string name() const override { return "collect"; }
  std::size_t size() {
    std::lock_guard lk(mu_);
    return ids_.size();
  }

 private:
  std::mutex mu_;
  std::vector<std::string> ids_;
};
}  // namespace

TEST_CASE("pgbouncer transaction mode: the outbox relay polls instead of LISTEN, warns once, publishes every row",
          "[postgres][pgbouncer][outbox]") {
  auto o = behind(idem::PostgresMode::transactional);
  o.store.table = "relayed_" + pgtest::random_hex(6);
  o.store.outbox = true;
  idem::PostgresStore tx(o.client, o.store);
  tx.migrate();
  idem::IdempotencyGuard g(tx);
  for (int i = 0; i < 20; ++i)
    CHECK(g.run(pgtest::key("m") + std::to_string(i), [&](const auto& ctx) {
             ctx.outbox().send("dest", "k" + std::to_string(i % 3), "p");
             return 1;
           }).status == idem::Status::executed);
  auto* sink = new Collect;
  idem::OutboxRelayOptions ro;
  ro.postgres.conninfo = o.client.conninfo;
  ro.postgres.transaction_pooler = true;
  ro.schema = o.store.schema;
  ro.table = o.store.table;
  ro.poll_interval = idem::millis{100};
  ro.migrate = false;
  idem::OutboxRelay relay{std::unique_ptr<idem::OutboxPublisher>(sink), ro};
  std::mutex mu;
  std::vector<std::string> warnings, errors;
  relay.set_observer([&](const idem::OutboxRelayEvent& e) {
    std::lock_guard lk(mu);
    if (e.kind == idem::OutboxRelayEvent::Kind::warning) warnings.push_back(e.error);
    if (e.kind == idem::OutboxRelayEvent::Kind::error) errors.push_back(e.error);
  });
  relay.start();
  for (int i = 0; i < 100 && sink->size() < 20; ++i) std::this_thread::sleep_for(50ms);
  relay.stop();
  CHECK(sink->size() == 20);
  std::lock_guard lk(mu);
  INFO((errors.empty() ? std::string() : errors.front()));
  CHECK(errors.empty());
  REQUIRE(warnings.size() == 1);
  CHECK_THAT(warnings.front(), Catch::Contains("LISTEN"));
}
#endif
