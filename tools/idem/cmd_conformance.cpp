// idem conformance: the store contract suite (tests/contract/contract_suite.hpp) run against the
// user's own server, one table row per case, with the reason and a hint for each failure.
//
// Design (docs/operations.md): the case functions are compiled into the tool as they are into
// the tests, with the assertions of conformance_check.hpp instead of Catch2's, and the case list
// comes from the suite's own IDEM_CONTRACT_SUITE macro, so a case added to the contract appears
// here with no edit. Nothing of the user's is touched: Redis cases run under a key prefix of
// their own (`<--prefix>conformance-<random>:`, inside the application's prefix so an ACL key
// pattern such as ~idem:* covers it), deleted at the end through RedisAdmin (SCAN + DEL on every
// master, over any URL the store takes); PostgreSQL cases run on a table of their own
// (`<--schema>.idem_conformance_<random>`), created by migrate() and dropped at the end, with the
// schema too when this run created it. Waits are real sleeps on short leases.

#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <libpq-fe.h>

#include "common.hpp"
#include "conformance_check.hpp"
#include "idem/detail/random.hpp"
#include "idem/postgres.hpp"
#include "idem/redis.hpp"
#include "idem/redis/admin.hpp"

#include "contract_suite.hpp"

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::string random_hex(int n) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s;
  while (static_cast<int>(s.size()) < n) {
    std::uint64_t t = idem::detail::random_token();
    for (int i = 0; i < 16 && static_cast<int>(s.size()) < n; ++i, t >>= 4) s += digits[t & 0xf];
  }
  return s;
}

// The contract suite's Factory over a store built once for the run; every case gets a key
// namespace of its own, so a case that fails half-way cannot disturb the next.
template <class Store>
struct Factory {
  using store_type = Store;
  Store* s;
  std::string ns;
  idem::millis lease;
  Store& store() { return *s; }
  std::string key(std::string_view name) { return ns + std::string(name); }
  void advance(idem::millis d) { std::this_thread::sleep_for(d); }
  [[nodiscard]] idem::millis short_lease() const { return lease; }
  // A conformance run, not a load test: enough contention to show one winner per key.
  [[nodiscard]] int race_threads() const { return 4; }
  [[nodiscard]] int race_keys() const { return 40; }
  [[nodiscard]] int race_rounds() const { return 2; }
};

template <class F>
struct Case {
  const char* name;
  void (*run)(F&);
};

// The suite's case list, taken from its own macro.
#undef IDEM_CONTRACT_CASE_
#define IDEM_CONTRACT_CASE_(Factory, tag, name, fn) Case<Factory>{name, &::idem::contract::fn<Factory>},
template <class F>
std::vector<Case<F>> contract_cases() {
  return {IDEM_CONTRACT_SUITE(F, "")};
}
#undef IDEM_CONTRACT_CASE_

struct Row {
  std::string name;
  bool pass = false;
  bool run = true;
  long ms = 0;
  std::string reason;
  std::string hint;
};

bool has(std::string_view s, std::string_view part) { return s.find(part) != std::string_view::npos; }

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  return out;
}

// The usual causes behind a store's error text; "" when none applies.
std::string hint_for(std::string_view message, bool redis) {
  const std::string m = lower(message);
  if (redis) {
    if (has(m, "noperm")) {
      if (has(m, "'evalsha'")) return "the ACL user may not run EVALSHA, which every store call uses: grant +evalsha";
      if (has(m, "'time'"))
        return "the ACL user may not run TIME, which the scripts call for the store clock: grant +time";
      if (has(m, "'script")) return "the ACL user may not load the scripts: grant +script|load";
      if (has(m, "key") || has(m, "channel"))
        return "the ACL user's key patterns do not cover the store's prefix: grant ~<prefix>* (e.g. ~idem:*)";
      return "the ACL user lacks a command idem needs: see the least-privilege ACL in docs/redis.md";
    }
    if (has(m, "can't run this command"))
      return "a script was refused a command it calls (TIME, GET, SET, PTTL, PEXPIRE): grant them to the ACL user";
    if (has(m, "evalsha") && (has(m, "unknown command") || has(m, "not supported") || has(m, "unsupported")))
      return "the server or proxy does not support EVALSHA (e.g. twemproxy): idem needs Lua scripts on the server";
    if (has(m, "noscript"))
      return "EVALSHA keeps answering NOSCRIPT: a proxy sends SCRIPT LOAD and EVALSHA to different servers";
    if (has(m, "unknown command") || has(m, "not supported"))
      return "the server or proxy does not support a command idem needs (EVALSHA, SCRIPT LOAD, TIME)";
    if (has(m, "readonly")) return "the URL points at a replica: use the master (or redis-sentinel://)";
    if (has(m, "moved") || has(m, "crossslot")) return "the server is a Redis Cluster: use redis-cluster://";
    if (has(m, "oom ")) return "the server is out of memory (maxmemory with noeviction): free memory or raise maxmemory";
    if (has(m, "wrongpass") || has(m, "noauth")) return "wrong or missing user/password in the URL";
  } else {
    if (has(m, "42501") || has(m, "permission denied"))
      return "the role lacks a privilege: it needs USAGE and CREATE on the schema (this run creates and drops a table)";
    if (has(m, "password authentication failed")) return "wrong user or password in the URL";
    if (has(m, "read-only transaction") || has(m, "25006")) return "the URL points at a standby: use the primary";
    if (has(m, "does not exist") && has(m, "function")) return "the server lacks a function idem's schema uses: check the version (>= 12)";
  }
  if (has(m, "timed out") || has(m, "timeout"))
    return "the server answered too slowly: a loaded server, a slow network or a proxy buffering replies";
  if (has(m, "connection refused") || has(m, "could not connect")) return "nothing listens at the URL's address";
  return "";
}

// The run's own session as the URL's user, for what the store API has no call for: deleting the
// run's keys, and asking which command a script was refused. RedisAdmin connects through the
// stores' one connection factory, so every URL the store took (TLS, Sentinel, Cluster) reaches it.
std::unique_ptr<idem::RedisAdmin> open_admin(const idem::RedisOptions& o, std::string& error) {
  try {
    return std::make_unique<idem::RedisAdmin>(o);
  } catch (const std::exception& e) {
    error = e.what();
    return nullptr;
  }
}

// Redis 7 names no command when a script is refused one: the user's own session asks which.
std::string refused_script_command(idem::RedisAdmin* admin) {
  if (admin == nullptr) return "";
  try {
    return admin->refused_script_command();
  } catch (const std::exception&) {
    return "";
  }
}

// Deletes every Redis key under the run's prefix, on every master.
std::string redis_cleanup(idem::RedisAdmin* admin, const std::string& admin_error, const std::string& prefix) {
  const std::string left = fmt::format(" (keys under '{}' expire by themselves within 10 minutes)", prefix);
  if (admin == nullptr) return fmt::format("not done: {}{}", admin_error, left);
  try {
    return fmt::format("{} keys deleted under '{}'", admin->remove_all(), prefix);
  } catch (const std::exception& e) {
    return fmt::format("not done: {}{}", e.what(), left);
  }
}

// A libpq session for the run's own DDL (the store's sessions are its own business).
struct Pg {
  PGconn* c;
  explicit Pg(const std::string& conninfo) : c(PQconnectdb(conninfo.c_str())) {}
  Pg(const Pg&) = delete;
  Pg& operator=(const Pg&) = delete;
  ~Pg() { PQfinish(c); }
  [[nodiscard]] bool ok() const { return PQstatus(c) == CONNECTION_OK; }
  // "" on success, else the server's message.
  std::string exec(const std::string& sql, int* rows = nullptr) {
    std::unique_ptr<PGresult, void (*)(PGresult*)> r(PQexec(c, sql.c_str()), PQclear);
    const auto st = PQresultStatus(r.get());
    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) {
      std::string m = PQresultErrorMessage(r.get());
      while (!m.empty() && (m.back() == '\n' || m.back() == ' ')) m.pop_back();
      return m.empty() ? "query failed" : m;
    }
    if (rows) *rows = PQntuples(r.get());
    return "";
  }
};

std::string quote_ident(const std::string& s) { return "\"" + s + "\""; }  // names are [a-z0-9_]

// Runs every case on `store` and returns the rows; `setup_error` set = nothing could run.
template <class Store>
std::vector<Row> run_cases(Store* store, const std::string& setup_error, idem::millis lease, bool redis) {
  std::vector<Row> rows;
  int index = 0;
  for (const auto& c : contract_cases<Factory<Store>>()) {
    Row row;
    row.name = c.name;
    ++index;
    if (!store) {
      row.run = false;
      row.reason = fmt::format("not run: {}", setup_error);
      rows.push_back(std::move(row));
      continue;
    }
    Factory<Store> f{store, "c" + std::to_string(index) + ":", lease};
    // A store call that throws on a case's own threads would end the process (std::terminate),
    // so those cases run only after the same calls succeeded here, single-threaded.
    if (c.run == &idem::contract::concurrent_acquire_has_one_winner<Factory<Store>> ||
        c.run == &idem::contract::guard_race_exactly_once<Factory<Store>>) {
      try {
        const auto k = f.key("probe");
        auto r = store->acquire(k, idem::contract::params(1));
        static_cast<void>(store->complete(k, r.holder, "probe", 60s));
      } catch (const std::exception& e) {
        row.run = false;
        row.reason = fmt::format("not run on threads: a single acquire already fails: {}", e.what());
        row.hint = hint_for(row.reason, redis);
        rows.push_back(std::move(row));
        continue;
      }
    }
    auto& rec = idem::conformance::recorder();
    rec.reset();
    std::string thrown;
    const auto t0 = Clock::now();
    try {
      c.run(f);
    } catch (const idem::conformance::Abort&) {
    } catch (const std::exception& e) {
      thrown = e.what();
    } catch (...) {
      thrown = "a non-std exception";
    }
    row.ms = static_cast<long>(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count());
    const auto first = rec.first();
    row.pass = !first && thrown.empty();
    // The first thing that went wrong is the reason; an exception after a failed expectation is
    // usually its consequence, but its text is what names the cause (NOPERM, unknown command).
    if (first) row.reason = *first;
    if (!thrown.empty()) row.reason = row.reason.empty() ? thrown : fmt::format("{}; then: {}", row.reason, thrown);
    if (!row.pass) row.hint = hint_for(row.reason, redis);
    rows.push_back(std::move(row));
  }
  return rows;
}

int report(const std::vector<Row>& rows, const std::string& where, const std::string& setup, const std::string& cleanup,
           long total_ms, bool json) {
  int failed = 0;
  std::size_t width = 4;
  for (const auto& r : rows) {
    failed += !r.pass;
    width = std::max(width, r.name.size());
  }
  if (json) {
    for (const auto& r : rows) {
      idem::tool::Json j = idem::tool::Json::object();
      idem::tool::put_bytes(j, "case", r.name);
      j["result"] = r.pass ? "pass" : r.run ? "fail" : "not_run";
      j["ms"] = r.ms;
      idem::tool::put_bytes(j, "reason", r.reason);
      idem::tool::put_bytes(j, "hint", r.hint);
      idem::tool::print_json(j);
    }
    idem::tool::Json summary = idem::tool::Json::object();
    idem::tool::put_bytes(summary, "store", where);
    summary["passed"] = rows.size() - static_cast<std::size_t>(failed);
    summary["failed"] = failed;
    summary["ms"] = total_ms;
    idem::tool::put_bytes(summary, "cleanup", cleanup);
    idem::tool::print_json(summary);
    return failed ? idem::tool::exit_refused : idem::tool::exit_ok;
  }
  std::cout << "idem conformance: " << where << "\n" << setup << "\n\n";
  std::cout << "RESULT  " << "CASE" << std::string(width - 4, ' ') << "  TIME\n";
  for (const auto& r : rows) {
    const char* tag = r.pass ? "PASS    " : r.run ? "FAIL    " : "NOT RUN ";
    std::cout << tag << r.name << std::string(width - r.name.size(), ' ') << "  "
              << (r.run ? idem::tool::format_duration(r.ms) : "-") << "\n";
    if (!r.pass) {
      std::cout << "        reason: " << idem::tool::printable(r.reason.substr(0, 400)) << "\n";
      if (!r.hint.empty()) std::cout << "        hint:   " << r.hint << "\n";
    }
  }
  std::cout << "\n" << rows.size() - static_cast<std::size_t>(failed) << " passed, " << failed << " failed in "
            << idem::tool::format_duration(total_ms) << "; cleanup: " << cleanup << "\n";
  if (failed) std::cout << "idem does not hold its contract on this server as configured\n";
  return failed ? idem::tool::exit_refused : idem::tool::exit_ok;
}

int run_redis(const std::string& url, const idem::tool::Globals& g, idem::millis lease, bool json) {
  idem::RedisOptions o = idem::parse_redis_url(url);
  const std::string prefix = g.prefix + "conformance-" + random_hex(16) + ":";
  o.key_prefix = prefix;
  o.connect_timeout = 3000ms;
  o.command_timeout = 10000ms;
  o.pool.size = 8;
  const auto t0 = Clock::now();
  std::unique_ptr<idem::RedisStore> store;
  std::string setup_error;
  std::string where =
      o.unix_socket.empty() ? fmt::format("redis {}:{}", o.host, o.port) : fmt::format("redis {}", o.unix_socket);
  if (!o.cluster_nodes.empty()) where = "redis cluster";
  if (!o.sentinels.empty()) where = fmt::format("redis sentinel master {}", o.sentinel_master);
  try {
    store = std::make_unique<idem::RedisStore>(o);
  } catch (const idem::connection_error&) {
    throw;  // nothing to test: the usual "store unreachable" exit
  } catch (const std::exception& e) {
    setup_error = e.what();
  }
  auto rows = run_cases(store.get(), setup_error, lease, true);
  store.reset();
  std::string admin_error;
  const auto admin = open_admin(o, admin_error);
  std::optional<std::string> refused;
  for (auto& r : rows) {
    if (!has(r.reason, "can't run this command")) continue;
    if (!refused) refused = refused_script_command(admin.get());
    if (!refused->empty()) r.hint = fmt::format("{} (as the URL's user: {})", hint_for(*refused, true), *refused);
  }
  const std::string cleanup = redis_cleanup(admin.get(), admin_error, prefix);
  if (!setup_error.empty()) {
    Row r{"connect and load the scripts", false, true, 0, setup_error, hint_for(setup_error, true)};
    rows.insert(rows.begin(), std::move(r));
  }
  const long ms = static_cast<long>(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count());
  return report(rows, where, fmt::format("keys under {} (deleted at the end)", prefix), cleanup, ms, json);
}

int run_postgres(const std::string& url, const idem::tool::Globals& g, idem::millis lease, bool json) {
  const std::string table = "idem_conformance_" + random_hex(12);
  idem::PostgresStoreOptions so;
  so.schema = g.schema;
  so.table = table;
  so.auto_migrate = false;
  idem::PostgresOptions po;
  po.conninfo = url;
  po.pool.size = 8;
  // The name goes into this run's own SQL before the store checks it.
  for (char ch : g.schema)
    if (!((ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '_') || g.schema.size() > 63)
      throw idem::invalid_options_error(fmt::format("idem: --schema '{}' is not [a-z_][a-z0-9_]*", g.schema));
  const auto t0 = Clock::now();
  Pg admin(url);
  if (!admin.ok()) throw idem::connection_error(fmt::format("idem: cannot connect: {}", PQerrorMessage(admin.c)));
  // The schema is dropped at the end only if it did not exist before this run.
  int existed = 0;
  if (auto e = admin.exec("SELECT 1 FROM pg_namespace WHERE nspname = '" + g.schema + "'", &existed); !e.empty())
    throw idem::store_error(fmt::format("idem: {}", e), "", false);
  std::unique_ptr<idem::PostgresStore> store;
  std::string setup_error;
  try {
    store = std::make_unique<idem::PostgresStore>(po, so);
    store->migrate();
  } catch (const idem::connection_error&) {
    throw;
  } catch (const std::exception& e) {
    setup_error = e.what();
    store.reset();
  }
  auto rows = run_cases(store.get(), setup_error, lease, false);
  store.reset();
  const std::string qs = quote_ident(g.schema), qt = qs + "." + quote_ident(table);
  std::string cleanup;
  if (existed == 0) {
    const std::string e = admin.exec("DROP SCHEMA IF EXISTS " + qs + " CASCADE");
    cleanup = e.empty() ? fmt::format("dropped schema {} (created by this run)", g.schema)
                        : fmt::format("DROP SCHEMA {} failed: {}", g.schema, e);
  } else {
    std::string e = admin.exec("DROP TABLE IF EXISTS " + qt + " CASCADE");
    for (const char* fn : {"_acquire", "_record_failure"})
      if (e.empty()) e = admin.exec("DROP FUNCTION IF EXISTS " + qs + "." + quote_ident(table + fn));
    // The version table only exists once migrate() got that far.
    int have = 0;
    if (e.empty())
      e = admin.exec("SELECT 1 FROM pg_tables WHERE schemaname = '" + g.schema + "' AND tablename = 'idem_schema_version'", &have);
    if (e.empty() && have) e = admin.exec("DELETE FROM " + qs + ".idem_schema_version WHERE table_name = '" + table + "'");
    cleanup = e.empty() ? fmt::format("dropped table {}.{}", g.schema, table)
                        : fmt::format("dropping {}.{} failed: {}", g.schema, table, e);
  }
  if (!setup_error.empty()) {
    Row r{"create the table (migrate)", false, true, 0, setup_error, hint_for(setup_error, false)};
    rows.insert(rows.begin(), std::move(r));
  }
  const long ms = static_cast<long>(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count());
  return report(rows, fmt::format("postgresql {} on {}:{}", PQdb(admin.c), PQhost(admin.c), PQport(admin.c)),
                fmt::format("table {}.{} (dropped at the end)", g.schema, table), cleanup, ms, json);
}

}  // namespace

void register_conformance(CLI::App& app, idem::tool::Globals& g) {
  auto json = std::make_shared<bool>(false);
  auto lease = std::make_shared<std::string>("300ms");
  CLI::App* sub = idem::tool::subcommand(
      app, g, "conformance",
      "Run idem's store contract suite against the server at URL, non-destructively (its own key prefix "
      "or table, removed at the end), and print one row per case: PASS, or FAIL with the first failed "
      "expectation and a hint (a proxy without EVALSHA, an ACL without TIME, ...). Exit 0 only if all pass.");
  sub->add_option("--lease", *lease, "the short lease of the expiry and takeover cases (each waits 1-2 of them); "
                                     "raise it for a server far away")
      ->capture_default_str();
  sub->add_flag("--json", *json, "one JSON object per case, then a summary object");
  sub->callback([&g, json, lease] {
    idem::tool::guarded(g, [&] {
      const idem::millis l = idem::tool::parse_duration(*lease);
      if (l < 50ms) throw CLI::ValidationError("--lease", "at least 50ms");
      const std::string url = idem::tool::store_url(g);
      if (idem::tool::is_postgres_url(url)) return run_postgres(url, g, l, *json);
      // SqliteStore is linked into the program that uses it, not reached over a network: its
      // contract suite is tests/sqlite's sqlite_contract_test, not a check of a server's settings.
      if (idem::tool::is_sqlite_url(url))
        throw idem::invalid_options_error("idem: conformance checks a server: sqlite:/// files have no server to "
                                          "check (the contract suite runs on SqliteStore in tests/sqlite); use "
                                          "idem doctor sqlite:///path for the file's settings");
      if (idem::tool::is_store_url(url)) return run_redis(url, g, l, *json);
      throw idem::invalid_options_error("idem: unsupported store URL: use redis://, redis-cluster://, redis-sentinel:// "
                                        "or postgresql:// (sqlite:/// has no server to check)");
    });
  });
}
