// The `idem` tool on real PostgreSQL servers: the shared fixture (started fast: fsync and
// synchronous_commit off, so doctor must flag it) and a durable server of this test's own, which
// doctor must pass. Each command's output and exit status, a fenced release, purge, and a listing
// of IDEM_TOOLS_RECORDS rows read page by page.

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "pg_support.hpp"
#include "tool_run.hpp"

using namespace std::chrono_literals;
using idem::test::contains;
using idem::test::run_tool;

namespace {

// "host=H port=P user=U dbname=D" as the URL an operator would type.
std::string url_of(const std::string& conninfo) {
  auto field = [&](const std::string& name) {
    const auto at = conninfo.find(name + "=");
    const auto end = conninfo.find(' ', at);
    return conninfo.substr(at + name.size() + 1, end == std::string::npos ? std::string::npos : end - at - name.size() - 1);
  };
  return "postgresql://" + field("user") + "@" + field("host") + ":" + field("port") + "/" + field("dbname");
}

struct Table {
  std::string name = "t_" + pgtest::random_hex(10);
  std::string conninfo;
  idem::PostgresStore store;
  explicit Table(std::string ci = pgtest::conninfo())
      : conninfo(ci), store(idem::PostgresOptions{.conninfo = ci}, idem::PostgresStoreOptions{.schema = "idem_tools", .table = name}) {
    store.migrate();
  }
  std::vector<std::string> args(std::vector<std::string> a) const {
    for (const std::string& x : {std::string("--url"), url_of(conninfo), std::string("--schema"), std::string("idem_tools"),
                                 std::string("--table"), name})
      a.push_back(x);
    return a;
  }
};

// A durable PostgreSQL (fsync and synchronous_commit on) for this test alone; stopped at the end.
struct DurableServer {
  std::string state = IDEM_TOOLS_STATE_DIR;
  std::string conninfo;
  DurableServer() {
    const std::string cmd = std::string("sh ") + IDEM_PG_CLUSTER_SCRIPT + " start " + state + " durable >/dev/null";
    if (std::system(cmd.c_str()) != 0) throw std::runtime_error("test: the durable PostgreSQL did not start");
    std::ifstream in(state + "/conninfo");
    std::getline(in, conninfo);
    if (conninfo.empty()) throw std::runtime_error("test: no conninfo from the durable PostgreSQL");
  }
  ~DurableServer() {
    const std::string cmd = std::string("sh ") + IDEM_PG_CLUSTER_SCRIPT + " stop " + state;
    [[maybe_unused]] int rc = std::system(cmd.c_str());
  }
};

}  // namespace

TEST_CASE("inspect, list, stats, release and purge on a PostgreSQL table") {
  Table t;
  auto done = t.store.acquire("order-1", pgtest::ap(1));
  REQUIRE(t.store.complete("order-1", done.holder, "receipt-42", 1h) == idem::WriteStatus::ok);
  auto held = t.store.acquire("stuck-1", pgtest::ap(2, 50ms));
  auto f = t.store.acquire("failed-1", pgtest::ap(3));
  idem::FailParams fp;
  fp.error = "card declined";
  fp.permanent = true;
  REQUIRE(t.store.fail("failed-1", f.holder, fp) == idem::WriteStatus::ok);
  std::this_thread::sleep_for(100ms);

  auto r = run_tool(t.args({"inspect", "order-1", "stuck-1"}));
  CHECK(r.status == 0);
  CHECK(contains(r.out, "key          order-1\nstate        completed\nfence        1\nattempts     1\n"));
  CHECK(contains(r.out, "result       10 bytes"));
  CHECK(contains(r.out, "owner        pg-test"));
  CHECK(contains(r.out, "lease        lapsed "));
  r = run_tool(t.args({"inspect", "nope"}));
  CHECK(r.status == 1);
  CHECK(contains(r.out, "not found"));

  r = run_tool(t.args({"list"}));
  CHECK(r.status == 0);
  CHECK(r.out.find("stuck-1") < r.out.find("failed-1"));
  CHECK(r.out.find("failed-1") < r.out.find("order-1"));
  r = run_tool(t.args({"list", "--state", "in_progress", "--older-than", "10ms", "--json"}));
  CHECK(r.lines == 1);
  CHECK(contains(r.out, "\"key\":\"stuck-1\",\"state\":\"in_progress\",\"fence\":1"));

  r = run_tool(t.args({"stats"}));
  CHECK(r.status == 0);
  CHECK(contains(r.out, "records      3\nin_progress  1 (1 with a lapsed lease)\ncompleted    1\nfailed       1\n"));

  r = run_tool(t.args({"release", "stuck-1", "--fence", "5", "--yes"}));
  CHECK(r.status == 1);
  CHECK(contains(r.out, "refused: 'stuck-1' has fence 1, not 5"));
  r = run_tool(t.args({"release", "stuck-1", "--fence", "1", "--yes"}));
  CHECK(r.status == 0);
  CHECK(contains(r.out, "released 'stuck-1' (fence 1, was in_progress)"));
  CHECK(t.store.complete("stuck-1", held.holder, "late", 1h) == idem::WriteStatus::lease_lost);
  auto next = t.store.acquire("stuck-1", pgtest::ap(4));
  CHECK(next.status == idem::AcquireStatus::acquired);
  CHECK(next.holder.fence == 2);
  r = run_tool(t.args({"release", "stuck-1", "--fence", "2", "--yes"}));
  CHECK(r.status == 1);
  CHECK(contains(r.out, "live lease"));
  r = run_tool(t.args({"release", "order-1", "--fence", "1", "--yes"}));
  CHECK(r.status == 1);
  CHECK(contains(r.out, "never released"));
  r = run_tool(t.args({"release", "failed-1", "--fence", "1", "--yes"}));
  CHECK(r.status == 0);
  CHECK(t.store.acquire("failed-1", pgtest::ap(5)).status == idem::AcquireStatus::acquired);

  // Expired rows: retention 1 s (purge_after rounds up to the next second).
  for (int i = 0; i < 5; ++i) {
    idem::AcquireParams p = pgtest::ap(100 + static_cast<std::uint64_t>(i), 100ms);
    p.retention = 200ms;
    t.store.acquire("short-" + std::to_string(i), p);
  }
  std::this_thread::sleep_for(1500ms);
  r = run_tool(t.args({"purge", "--batch", "2"}));
  CHECK(r.status == 0);
  CHECK(contains(r.out, "purged 5 expired rows"));
  CHECK_FALSE(t.store.inspect("order-1") == std::nullopt);
}

TEST_CASE("a UTF-8 key from list --json released as given, release and purge --json on PostgreSQL") {
  Table t;
  const std::string text = "caf\xc3\xa9-\xd0\xba\xd0\xbb\xd1\x8e\xd1\x87-\xf0\x9f\x99\x82";  // "café-ключ-🙂"
  REQUIRE(t.store.acquire(text, pgtest::ap(1, 50ms)).status == idem::AcquireStatus::acquired);
  const std::string bytes = std::string("bin-\xff\x00", 6);
  REQUIRE(t.store.acquire(bytes, pgtest::ap(2, 50ms)).status == idem::AcquireStatus::acquired);
  std::this_thread::sleep_for(100ms);
  auto r = run_tool(t.args({"list", "--json"}));
  INFO(r.out);
  REQUIRE(r.status == 0);
  REQUIRE(r.lines == 2);
  const auto first = nlohmann::json::parse(r.out.substr(0, r.out.find('\n')));
  const auto second = nlohmann::json::parse(r.out.substr(r.out.find('\n') + 1));
  const auto& utf8 = first.contains("key") ? first : second;
  const auto& other = first.contains("key") ? second : first;
  CHECK(other.at("key_hex") == "62696e2dff00");
  r = run_tool(t.args({"release", utf8.at("key").get<std::string>(), "--fence", "1", "--yes", "--json"}));
  REQUIRE(r.status == 0);
  auto j = nlohmann::json::parse(r.out);
  CHECK(j.at("released") == true);
  CHECK(j.at("key") == text);
  CHECK(j.at("next_fence") == 2);
  CHECK(t.store.inspect(text)->state == idem::State::failed);
  r = run_tool(t.args({"release", "--key-hex", other.at("key_hex").get<std::string>(), "--fence", "1", "--yes", "--json"}));
  REQUIRE(r.status == 0);
  CHECK(t.store.inspect(bytes)->state == idem::State::failed);

  for (int i = 0; i < 3; ++i) {
    idem::AcquireParams p = pgtest::ap(100 + static_cast<std::uint64_t>(i), 100ms);
    p.retention = 200ms;
    t.store.acquire("short-" + std::to_string(i), p);
  }
  std::this_thread::sleep_for(1500ms);
  r = run_tool(t.args({"purge", "--json"}));
  REQUIRE(r.status == 0);
  j = nlohmann::json::parse(r.out);
  CHECK(j.at("purged") == 3);
  CHECK(j.at("store_expires") == false);
  CHECK(j.at("store") == "postgresql " + std::string("\"idem_tools\".\"") + t.name + "\"");
}

TEST_CASE("migrate --print-sql applied with psql lets a store run without DDL rights, --status reports it") {
  const std::string schema = "idem_mig_" + pgtest::random_hex(8);
  const std::string role = "idem_app_" + pgtest::random_hex(8);
  const std::string u = url_of(pgtest::conninfo());
  auto with = [&](std::vector<std::string> a) {
    for (const std::string& x : {std::string("--schema"), schema, std::string("--table"), std::string("recs")}) a.push_back(x);
    return a;
  };
  auto r = run_tool(with({"migrate", u, "--status"}));
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK(contains(r.out, "not installed"));
  r = run_tool(with({"migrate", "--print-sql"}));
  REQUIRE(r.status == 0);
  CHECK(contains(r.out, "CREATE TABLE IF NOT EXISTS \"" + schema + "\".\"recs\""));
  CHECK_FALSE(contains(r.out, "@S@"));
  {
    // As a DBA would: the printed SQL through psql, as the superuser of the fixture.
    FILE* psql = ::popen(("psql -X -q -v ON_ERROR_STOP=1 '" + pgtest::conninfo() + "' >/dev/null").c_str(), "w");
    REQUIRE(psql != nullptr);
    REQUIRE(std::fwrite(r.out.data(), 1, r.out.size(), psql) == r.out.size());
    REQUIRE(::pclose(psql) == 0);
  }
  r = run_tool(with({"migrate", u, "--status", "--json"}));
  REQUIRE(r.status == 0);
  const auto status = nlohmann::json::parse(r.out);
  CHECK(status.at("version") == idem::PostgresStore::schema_version);
  CHECK(status.at("pending") == false);
  r = run_tool(with({"migrate", u, "--status"}));
  CHECK(contains(r.out, "schema version 2 (current)"));

  pgtest::Raw raw;
  raw.exec("CREATE ROLE " + role + " LOGIN");
  raw.exec("GRANT USAGE ON SCHEMA " + schema + " TO " + role);
  raw.exec("GRANT SELECT, INSERT, UPDATE, DELETE ON " + schema + ".recs TO " + role);
  CHECK(raw.scalar("SELECT has_schema_privilege('" + role + "', '" + schema + "', 'CREATE')") == "f");
  CHECK(raw.scalar("SELECT has_database_privilege('" + role + "', current_database(), 'CREATE')") == "f");
  std::string app = pgtest::conninfo();
  app.replace(app.find("user=postgres"), 13, "user=" + role);
  {
    idem::PostgresStore store(idem::PostgresOptions{.conninfo = app},
                              idem::PostgresStoreOptions{.schema = schema, .table = "recs", .auto_migrate = false});
    auto a = store.acquire("order-1", pgtest::ap(1));
    REQUIRE(a.status == idem::AcquireStatus::acquired);
    CHECK(store.complete("order-1", a.holder, "receipt-42", 1h) == idem::WriteStatus::ok);
    const auto again = store.acquire("order-1", pgtest::ap(2));
    CHECK(again.status == idem::AcquireStatus::duplicate);
    CHECK(again.payload == "receipt-42");
  }
  // --apply on a table at the current version changes nothing.
  r = run_tool(with({"migrate", u, "--apply"}));
  CHECK(r.status == 0);
  CHECK(contains(r.out, "already at schema version 2"));
  raw.exec("SET client_min_messages = warning");
  raw.exec("DROP SCHEMA " + schema + " CASCADE");
  raw.exec("DROP OWNED BY " + role);
  raw.exec("DROP ROLE " + role);
}

TEST_CASE("a PostgreSQL URL as the command's argument, with --url or from IDEM_URL") {
  Table t;
  auto done = t.store.acquire("order-1", pgtest::ap(1));
  REQUIRE(t.store.complete("order-1", done.holder, "receipt-42", 1h) == idem::WriteStatus::ok);
  const std::string u = url_of(t.conninfo);
  const std::vector<std::string> where{"--schema", "idem_tools", "--table", t.name};
  auto with = [&](std::vector<std::string> a) {
    a.insert(a.end(), where.begin(), where.end());
    return a;
  };
  ::unsetenv("IDEM_URL");
  auto r = run_tool(with({"inspect", u, "order-1"}));
  INFO(r.out);
  CHECK(r.status == 0);
  CHECK(contains(r.out, "key          order-1\nstate        completed\n"));
  r = run_tool(with({"stats", u}));
  CHECK(r.status == 0);
  CHECK(contains(r.out, "records      1\n"));
  r = run_tool(with({"list", u, "--json"}));
  CHECK(r.status == 0);
  CHECK(r.lines == 1);
  r = run_tool(with({"purge", u}));
  CHECK(r.status == 0);
  r = run_tool(with({"doctor", u}));
  CHECK(contains(r.out, "[ok]      schema: schema version 2"));
  r = run_tool(with({"release", u, "order-1", "--fence", "1", "--yes"}));
  CHECK(r.status == 1);
  CHECK(contains(r.out, "never released"));
  r = run_tool(with({"stats", u, "--url", "postgres://someone@127.0.0.1:1/other"}));
  CHECK(r.status == 2);
  CHECK(contains(r.out, "two different stores given"));
  ::setenv("IDEM_URL", u.c_str(), 1);
  r = run_tool(with({"stats"}));
  CHECK(r.status == 0);
  CHECK(contains(r.out, "records      1\n"));
  ::unsetenv("IDEM_URL");
}

TEST_CASE("doctor flags the fast fixture, passes a durable server, and names a missing table") {
  {
    Table t;
    auto r = run_tool(t.args({"doctor"}));
    INFO(r.out);
    CHECK(r.status == 1);
    CHECK(contains(r.out, "[ok]      schema: schema version 2"));
    CHECK(contains(r.out, "[ok]      retention index"));
    CHECK(contains(r.out, "[error]   fsync: fsync is off"));
    CHECK(contains(r.out, "[error]   synchronous_commit: synchronous_commit is off"));
    r = run_tool({"doctor", "--url", url_of(pgtest::conninfo()), "--table", "no_such_table"});
    CHECK(r.status == 1);
    CHECK(contains(r.out, "[error]   schema: no table \"idem\".\"no_such_table\""));
    r = run_tool({"inspect", "k", "--url", url_of(pgtest::conninfo()), "--table", "no_such_table"});
    CHECK(r.status == 3);
    CHECK(contains(r.out, "no idem table"));
  }
  DurableServer durable;
  Table good(durable.conninfo);
  auto r = run_tool(good.args({"doctor"}));
  INFO(r.out);
  CHECK(r.status == 0);
  CHECK(contains(r.out, "[ok]      synchronous_commit: on"));
  CHECK(contains(r.out, "0 error(s)"));
}

TEST_CASE("bad PostgreSQL URLs and unreachable servers are clear errors") {
  auto r = run_tool({"stats", "--url", "postgresql://%zz@127.0.0.1/x"});
  CHECK(r.status == 2);
  CHECK(contains(r.out, "bad PostgreSQL URL"));
  r = run_tool({"stats", "--url", "postgresql://postgres@127.0.0.1:" + std::to_string(idem::test::free_port()) + "/postgres"});
  CHECK(r.status == 3);
  CHECK(contains(r.out, "cannot connect to PostgreSQL"));
  r = run_tool({"stats", "--url", url_of(pgtest::conninfo()), "--table", "Bad-Name"});
  CHECK(r.status == 2);
}

TEST_CASE("list reads many rows page by page") {
  constexpr std::size_t n = IDEM_TOOLS_RECORDS;
  Table t;
  pgtest::Raw raw;
  raw.exec("INSERT INTO idem_tools." + t.name +
           " (key, state, fence, token, attempts, lease_until, expires_at, purge_after, result) "
           "SELECT convert_to('msg-' || i, 'UTF8'), 2, 1, i, 1, 0, 9e15::bigint, 9e15::bigint, "
           "convert_to('result-payload-of-some-size', 'UTF8') FROM generate_series(1, " + std::to_string(n) + ") i");
  raw.exec("ANALYZE idem_tools." + t.name);
  // Paged: each page is one index scan of the primary key, counted in pg_stat_user_tables once the
  // tool's session has ended and flushed its statistics.
  const auto index_scans = [&] {
    raw.exec("SELECT pg_stat_clear_snapshot()");
    return std::stol(raw.scalar("SELECT coalesce(idx_scan, 0) FROM pg_stat_user_tables WHERE schemaname = 'idem_tools' "
                                "AND relname = '" + t.name + "'"));
  };
  const long scans_before = index_scans();
  auto small = run_tool(t.args({"list", "--limit", "1", "--json"}), false);
  REQUIRE(small.status == 0);
  auto all = run_tool(t.args({"list", "--state", "completed", "--json", "--page", "500"}), false);
  REQUIRE(all.status == 0);
  CHECK(all.lines == n);
  long scans = index_scans();
  for (int i = 0; i < 50 && scans - scans_before < static_cast<long>(n / 500); ++i) {
    std::this_thread::sleep_for(100ms);
    scans = index_scans();
  }
  CHECK(scans - scans_before >= static_cast<long>(n / 500));
  const long output_kib = static_cast<long>(n * 250 / 1024);
  INFO("rss one: " << small.max_rss_kib << " KiB, rss all: " << all.max_rss_kib << " KiB, output ~" << output_kib << " KiB, index scans " << scans - scans_before);
  if (IDEM_TOOLS_CHECK_RSS) {
    CHECK(all.max_rss_kib - small.max_rss_kib < 8 * 1024);
    CHECK(all.max_rss_kib - small.max_rss_kib < output_kib / 2);
  }
}
