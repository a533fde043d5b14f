// PostgresJoined: transactional mode inside the application's own transaction, on a raw libpq
// connection (LibpqConnection) and, where libpqxx is found, a libpqxx transaction
// (idem::pqxx::Connection): the commit, the application's rollback, a handler that throws, a busy
// key in another transaction, the session killed between the business write and COMMIT, and many
// threads on one key, each in a transaction of its own.

#include "pg_support.hpp"

#include <atomic>
#include <memory>
#include <optional>
#include <stdexcept>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <libpq-fe.h>

#include "idem/postgres/joined.hpp"
#ifdef IDEM_TEST_PQXX
#include "idem/pqxx.hpp"
#endif

using namespace std::chrono_literals;
using pgtest::key;

namespace {

// The application on raw libpq: its own connection, its own BEGIN / COMMIT, its own writes.
class LibpqApp {
 public:
  LibpqApp() : raw_(std::make_unique<pgtest::Raw>()) {}
  void begin() {
    raw_->exec("BEGIN");
    conn_.emplace(raw_->get());
  }
  idem::JoinedConnection& conn() { return *conn_; }
  void write(const std::string& table, const std::string& id) {
    const char* v = id.c_str();
    PGresult* r = PQexecParams(raw_->get(), ("INSERT INTO " + table + " (id) VALUES ($1)").c_str(), 1, nullptr, &v,
                               nullptr, nullptr, 0);
    const bool ok = PQresultStatus(r) == PGRES_COMMAND_OK;
    const std::string why = PQresultErrorMessage(r);
    PQclear(r);
    if (!ok) throw std::runtime_error("application write failed: " + why);
  }
  // False when COMMIT did not commit (the session was gone).
  bool commit() {
    PGresult* r = PQexec(raw_->get(), "COMMIT");
    const bool ok = PQresultStatus(r) == PGRES_COMMAND_OK && std::string(PQcmdStatus(r)) == "COMMIT";
    PQclear(r);
    conn_.reset();
    return ok;
  }
  void rollback() {
    PQclear(PQexec(raw_->get(), "ROLLBACK"));
    conn_.reset();
  }
  int backend_pid() { return PQbackendPID(raw_->get()); }
  void reconnect() { raw_ = std::make_unique<pgtest::Raw>(); }

 private:
  std::unique_ptr<pgtest::Raw> raw_;
  std::optional<idem::LibpqConnection> conn_;
};

#ifdef IDEM_TEST_PQXX
// The application on libpqxx: a pqxx::work per transaction.
class PqxxApp {
 public:
  PqxxApp() : c_(std::make_unique<pqxx::connection>(pgtest::conninfo())) {}
  void begin() {
    w_.emplace(*c_);
    conn_.emplace(*w_);
  }
  idem::JoinedConnection& conn() { return *conn_; }
  void write(const std::string& table, const std::string& id) {
    w_->exec_params("INSERT INTO " + table + " (id) VALUES ($1)", id);
  }
  bool commit() {
    conn_.reset();
    try {
      w_->commit();
    } catch (const std::exception&) {
      w_.reset();
      return false;
    }
    w_.reset();
    return true;
  }
  void rollback() {
    conn_.reset();
    w_->abort();
    w_.reset();
  }
  int backend_pid() { return c_->backendpid(); }
  void reconnect() {
    conn_.reset();
    w_.reset();
    c_ = std::make_unique<pqxx::connection>(pgtest::conninfo());
  }

 private:
  std::unique_ptr<pqxx::connection> c_;
  std::optional<pqxx::work> w_;
  std::optional<idem::pqxx::Connection> conn_;
};
#define IDEM_JOINED_APPS LibpqApp, PqxxApp
#else
#define IDEM_JOINED_APPS LibpqApp
#endif

// A business table of the test's own, dropped at the end.
struct Table {
  pgtest::Raw raw;
  std::string name = "biz_" + pgtest::random_hex(8);
  Table() { raw.exec("CREATE TABLE " + name + " (id text NOT NULL)"); }
  ~Table() {
    try {
      raw.exec("DROP TABLE " + name);
    } catch (...) {
    }
  }
  int rows(const std::string& id) { return std::stoi(raw.scalar("SELECT count(*) FROM " + name + " WHERE id = '" + id + "'")); }
};

idem::PostgresStore tx_store() { return pgtest::store(idem::PostgresMode::transactional); }

}  // namespace

TEMPLATE_TEST_CASE("joined: the claim, the application's write and the completion commit together",
                   "[postgres][joined]", IDEM_JOINED_APPS) {
  Table t;
  idem::PostgresStore store = tx_store();
  TestType app;
  const auto k = key("joined-commit");
  app.begin();
  {
    idem::PostgresJoined joined{store, app.conn()};
    idem::IdempotencyGuard guard{joined};
    auto out = guard.run(k, [&](const idem::context_t<idem::PostgresJoined>& ctx) {
      REQUIRE(ctx.tx != nullptr);
      CHECK(ctx.tx->key() == k);
      app.write(t.name, k);
      return std::string("charged");
    });
    CHECK(out.status == idem::Status::executed);
    // Nothing is visible outside the application's transaction before it commits.
    CHECK(t.rows(k) == 0);
    CHECK_FALSE(store.inspect(k));
  }
  REQUIRE(app.commit());
  CHECK(t.rows(k) == 1);
  auto rec = store.inspect(k);
  REQUIRE(rec);
  CHECK(rec->state == idem::State::completed);
  CHECK(rec->result == "charged");

  // The redelivery, in a transaction of its own: the stored result, the handler not run.
  app.begin();
  idem::PostgresJoined joined{store, app.conn()};
  idem::IdempotencyGuard guard{joined};
  int calls = 0;
  auto again = guard.run(k, [&]() -> std::string {
    ++calls;
    return "again";
  });
  CHECK(again.status == idem::Status::duplicate);
  CHECK(*again.value == "charged");
  CHECK(calls == 0);
  REQUIRE(app.commit());
  CHECK(t.rows(k) == 1);
}

TEMPLATE_TEST_CASE("joined: the application rolls back: neither the write nor the record, the next delivery runs",
                   "[postgres][joined]", IDEM_JOINED_APPS) {
  Table t;
  idem::PostgresStore store = tx_store();
  TestType app;
  const auto k = key("joined-rollback");
  for (int round = 0; round < 2; ++round) {
    app.begin();
    idem::PostgresJoined joined{store, app.conn()};
    idem::IdempotencyGuard guard{joined};
    auto out = guard.run(k, [&] {
      app.write(t.name, k);
      return round;
    });
    CHECK(out.status == idem::Status::executed);
    if (round == 0) {
      app.rollback();  // the application changed its mind: the claim goes with its writes
      CHECK(t.rows(k) == 0);
      CHECK_FALSE(store.inspect(k));
    } else {
      REQUIRE(app.commit());
    }
  }
  CHECK(t.rows(k) == 1);
  REQUIRE(store.inspect(k));
  CHECK(store.inspect(k)->result == idem::codec<int>::encode(1));
}

TEMPLATE_TEST_CASE("joined: a handler that throws undoes its writes since the claim, the application's stay",
                   "[postgres][joined]", IDEM_JOINED_APPS) {
  Table t;
  idem::PostgresStore store = tx_store();
  TestType app;
  const auto k = key("joined-throw");
  app.begin();
  app.write(t.name, k + "-before");
  {
    idem::PostgresJoined joined{store, app.conn()};
    idem::IdempotencyGuard guard{joined, {.failure = {.mode = idem::FailureMode::record}}};
    CHECK_THROWS_WITH(guard.run(k,
                                [&]() -> int {
                                  app.write(t.name, k);
                                  throw std::runtime_error("card declined");
                                }),
                      Catch::Contains("card declined"));
  }
  app.write(t.name, k + "-after");  // the transaction is still usable
  REQUIRE(app.commit());
  CHECK(t.rows(k + "-before") == 1);
  CHECK(t.rows(k) == 0);
  CHECK(t.rows(k + "-after") == 1);
  // Under the record policy the failure was written on the store's own session: a retryable
  // failure, not a completion (under release, the default, nothing is left).
  auto rec = store.inspect(k);
  REQUIRE(rec);
  CHECK(rec->state == idem::State::failed);
}

TEMPLATE_TEST_CASE("joined: a key another transaction holds answers in_flight, and this transaction stays usable",
                   "[postgres][joined]", IDEM_JOINED_APPS) {
  Table t;
  idem::PostgresStore store = tx_store();
  TestType a, b;
  const auto k = key("joined-busy");
  a.begin();
  idem::PostgresJoined ja{store, a.conn()};
  auto held = ja.begin(k, pgtest::ap(1));
  REQUIRE(held.decision().status == idem::AcquireStatus::acquired);
  a.write(t.name, k);

  b.begin();
  idem::PostgresJoined jb{store, b.conn()};
  const auto t0 = std::chrono::steady_clock::now();
  auto other = jb.begin(k, pgtest::ap(2));
  CHECK(other.decision().status == idem::AcquireStatus::in_flight);
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
  b.write(t.name, k + "-b");  // b's transaction was not aborted by the busy claim
  REQUIRE(b.commit());

  REQUIRE(held.commit("first", 60s) == idem::WriteStatus::ok);
  REQUIRE(a.commit());
  CHECK(t.rows(k) == 1);
  CHECK(t.rows(k + "-b") == 1);
  b.begin();
  idem::PostgresJoined jb2{store, b.conn()};
  auto dup = jb2.begin(k, pgtest::ap(3));
  CHECK(dup.decision().status == idem::AcquireStatus::duplicate);
  CHECK(dup.decision().payload == "first");
  REQUIRE(b.commit());
}

TEMPLATE_TEST_CASE("joined: the session killed between the business write and COMMIT leaves no trace, the "
                   "redelivery runs once",
                   "[postgres][joined]", IDEM_JOINED_APPS) {
  Table t;
  idem::PostgresStore store = tx_store();
  TestType app;
  pgtest::Raw admin;
  const auto k = key("joined-crash");
  app.begin();
  {
    idem::PostgresJoined joined{store, app.conn()};
    idem::IdempotencyGuard guard{joined};
    auto out = guard.run(k, [&] { app.write(t.name, k); });
    CHECK(out.status == idem::Status::executed);
  }
  // The consumer dies before its COMMIT: the server sees the session go and rolls it all back.
  admin.exec("SELECT pg_terminate_backend(" + std::to_string(app.backend_pid()) + ")");
  CHECK_FALSE(app.commit());
  CHECK(t.rows(k) == 0);
  CHECK_FALSE(store.inspect(k));
  // The redelivery, on the restarted consumer's new connection.
  app.reconnect();
  app.begin();
  idem::PostgresJoined joined{store, app.conn()};
  idem::IdempotencyGuard guard{joined};
  int calls = 0;
  auto out = guard.run(k, [&] {
    ++calls;
    app.write(t.name, k);
  });
  CHECK(out.status == idem::Status::executed);
  REQUIRE(app.commit());
  CHECK(calls == 1);
  CHECK(t.rows(k) == 1);
}

TEMPLATE_TEST_CASE("joined: eight threads on one key, each in a transaction of its own: one effect",
                   "[postgres][joined]", IDEM_JOINED_APPS) {
  Table t;
  idem::PostgresStore store = tx_store();
  const auto k = key("joined-race");
  std::atomic<int> executed{0}, duplicates{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i)
    threads.emplace_back([&] {
      TestType app;
      for (;;) {
        app.begin();
        idem::PostgresJoined joined{store, app.conn()};
        idem::IdempotencyGuard guard{joined, {.lease = 5s}};
        auto out = guard.run(k, [&] {
          app.write(t.name, k);
          std::this_thread::sleep_for(20ms);  // holds the claim while the others arrive
          return 7;
        });
        if (out.status == idem::Status::executed) {
          if (app.commit()) ++executed;
          return;
        }
        app.rollback();
        if (out.status == idem::Status::duplicate) {
          ++duplicates;
          return;
        }
        std::this_thread::sleep_for(10ms);  // in_flight: the broker would redeliver later
      }
    });
  for (auto& th : threads) th.join();
  CHECK(executed == 1);
  CHECK(duplicates == 7);
  CHECK(t.rows(k) == 1);
}

TEST_CASE("joined: refused without an open transaction, or on a lease-mode store", "[postgres][joined]") {
  idem::PostgresStore tx = tx_store();
  pgtest::Raw raw;
  idem::LibpqConnection conn{raw.get()};
  idem::PostgresJoined joined{tx, conn};
  auto e = pgtest::capture<idem::usage_error>([&] { (void)joined.begin(key("joined-no-begin"), pgtest::ap(1)); });
  CHECK_THAT(e.what(), Catch::Contains("BEGIN"));
  CHECK_THROWS_AS(idem::LibpqConnection(nullptr), idem::usage_error);
  idem::PostgresStore lease = pgtest::store(idem::PostgresMode::lease);
  CHECK_THROWS_AS((idem::PostgresJoined{lease, conn}), idem::invalid_options_error);
}
