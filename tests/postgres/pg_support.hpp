#pragma once
// Test support for PostgresStore: the fixture server's conninfo, raw SQL, unique names, and the
// factory the contract suite instantiates.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <memory>
#include <optional>

#include <catch2/catch.hpp>
#include <libpq-fe.h>

#include "idem/guard/guard.hpp"
#include "idem/postgres.hpp"

namespace pgtest {

// The CTest fixture (pg_cluster.sh start) writes the conninfo of the shared server to a file whose
// path is compiled in (IDEM_PG_CONNINFO_FILE overrides it). No server is a failure, never a skip.
inline std::string conninfo() {
  const char* file = std::getenv("IDEM_PG_CONNINFO_FILE");
  if (!file || !*file) file = IDEM_PG_CONNINFO_FILE_DEFAULT;
  std::ifstream in(file);
  std::string line;
  if (!in || !std::getline(in, line) || line.empty())
    throw std::runtime_error(std::string("no conninfo in ") + file + ": the PostgreSQL fixture did not start");
  return line;
}

// The fixture server's port ("host=127.0.0.1 port=N user=postgres dbname=postgres").
inline int port(const std::string& ci = conninfo()) {
  const auto at = ci.find("port=");
  if (at == std::string::npos) throw std::runtime_error("no port in conninfo " + ci);
  return std::stoi(ci.substr(at + 5));
}

inline std::string random_hex(int n = 12) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  static constexpr char digits[] = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < n; ++i) s += digits[rng() % 16];
  return s;
}

inline std::string key(std::string_view name) { return "s" + random_hex() + ":" + std::string(name); }

inline idem::AcquireParams ap(std::uint64_t token, idem::millis lease = std::chrono::seconds(30)) {
  idem::AcquireParams p;
  p.lease = lease;
  p.retention = std::max<idem::millis>(lease * 4, std::chrono::seconds(60));
  p.token = token;
  p.owner = "pg-test";
  return p;
}

// The exception of type E that f throws (a test failure when it throws none).
template <class E, class F>
E capture(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e;
  }
  FAIL("expected exception was not thrown");
  throw std::logic_error("unreachable");
}

// A libpq result of the tests' own (PostgresResult wraps only the store's).
class RawResult {
public:
  explicit RawResult(PGresult* r) noexcept : r_(r, &PQclear) {}
  int rows() const { return PQntuples(r_.get()); }
  std::string_view get(int row, int col) const {
    return {PQgetvalue(r_.get(), row, col), static_cast<std::size_t>(PQgetlength(r_.get(), row, col))};
  }
  PGresult* native() const { return r_.get(); }

private:
  std::unique_ptr<PGresult, void (*)(PGresult*)> r_;
};

// A plain libpq connection for setup and for poking at rows behind the store's back.
class Raw {
public:
  explicit Raw(const std::string& ci = conninfo()) : c_(PQconnectdb(ci.c_str())) {
    if (PQstatus(c_) != CONNECTION_OK) {
      std::string m = PQerrorMessage(c_);
      PQfinish(c_);
      throw std::runtime_error("raw connect failed: " + m);
    }
  }
  Raw(const Raw&) = delete;
  Raw& operator=(const Raw&) = delete;
  ~Raw() { PQfinish(c_); }
  RawResult exec(const std::string& sql) {
    RawResult r(PQexec(c_, sql.c_str()));
    auto st = PQresultStatus(r.native());
    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK)
      throw std::runtime_error("raw sql failed: " + sql + ": " + PQresultErrorMessage(r.native()));
    return r;
  }
  std::string scalar(const std::string& sql) {
    auto r = exec(sql);
    return r.rows() ? std::string(r.get(0, 0)) : std::string();
  }
  PGconn* get() const { return c_; }

private:
  PGconn* c_;
};

// A table whose inserts make COMMIT itself take `seconds` (a deferred constraint trigger sleeps in
// it), so a test can act while a transaction is inside COMMIT, before its commit record. Returns
// the table's name; drop_slow_commit_table removes it with its function.
inline std::string slow_commit_table(Raw& raw, int seconds) {
  const std::string t = "slow_" + random_hex(8);
  raw.exec("CREATE TABLE " + t + " (id int); CREATE FUNCTION " + t +
           "_fn() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(" + std::to_string(seconds) +
           "); RETURN NULL; END $$; CREATE CONSTRAINT TRIGGER " + t + "_trg AFTER INSERT ON " + t +
           " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION " + t + "_fn()");
  return t;
}

inline void drop_slow_commit_table(Raw& raw, const std::string& t) {
  raw.exec("DROP TABLE " + t + "; DROP FUNCTION " + t + "_fn()");
}

// Whether backend `pid` shows wait event `event` (PgSleep, SyncRep, ...) within `limit`, polled
// every 20 ms.
inline bool backend_waits(Raw& raw, int pid, const char* event,
                          std::chrono::milliseconds limit = std::chrono::seconds(5)) {
  const std::string sql = "SELECT count(*) FROM pg_stat_activity WHERE pid = " + std::to_string(pid) +
                          " AND wait_event = '" + event + "'";
  for (auto waited = std::chrono::milliseconds(0); waited < limit; waited += std::chrono::milliseconds(20)) {
    if (raw.scalar(sql) == "1") return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// The options of a test store: its connection and the store itself.
struct Config {
  idem::PostgresOptions client;
  idem::PostgresStoreOptions store;
};

inline Config options(idem::PostgresMode mode = idem::PostgresMode::lease) {
  Config o;
  o.client.conninfo = conninfo();
  o.client.pool.size = 16;
  o.store.schema = "idem_test";
  o.store.table = "records";
  o.store.mode = mode;
  return o;
}

// A store on a client of its own, as configured.
inline idem::PostgresStore store(const Config& o) { return idem::PostgresStore(o.client, o.store); }
inline idem::PostgresStore store(idem::PostgresMode mode = idem::PostgresMode::lease) { return store(options(mode)); }

// Handlers written for any store (`const idem::Context&`) must work on PostgresStore too.
static_assert(std::is_convertible_v<const idem::IdempotencyGuard<idem::PostgresStore>::context_type&,
                                    const idem::Context&>);

// What the contract suite asks of a factory on a real server's clock: keys under a prefix of the
// case's own, time that passes by sleeping, races sized for a server round trip.
struct ServerFactoryBase {
  explicit ServerFactoryBase(std::string prefix) : prefix_(std::move(prefix)) {}
  std::string key(std::string_view name) { return prefix_ + std::string(name); }
  void advance(idem::millis d) { std::this_thread::sleep_for(d); }
  idem::millis short_lease() const { return idem::millis{200}; }
  int race_threads() const { return 8; }
  int race_keys() const { return 20; }
  int race_rounds() const { return 3; }

private:
  std::string prefix_;
};

// Factory of the contract suite (lease mode) on the shared fixture server.
struct PgFactory : ServerFactoryBase {
  using store_type = idem::PostgresStore;
  PgFactory() : ServerFactoryBase("c" + random_hex() + ":"), store_(pgtest::store()) {}
  store_type& store() { return store_; }

private:
  store_type store_;
};

}  // namespace pgtest
