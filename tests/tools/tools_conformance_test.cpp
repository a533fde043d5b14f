// `idem conformance` on real servers: the whole contract passes on a redis-server and on the
// PostgreSQL fixture (exit 0, one PASS row per case, nothing left behind), and fails with the
// reason and a hint on a Redis whose ACL user may not run EVALSHA, or TIME inside the scripts.

#include <catch2/catch.hpp>

#include <hiredis/hiredis.h>

#include <string>
#include <vector>

#include "pg_support.hpp"
#include "tool_run.hpp"

using idem::test::contains;
using idem::test::RedisServer;
using idem::test::run_tool;

namespace {

// The contract's cases, as the table names them (tests/contract/contract_suite.hpp).
const std::vector<std::string> some_cases{"acquire of a new key", "lapsed lease is taken over with fence+1",
                                          "retention expiry forgets and the token fences",
                                          "guard race: each key runs exactly once",
                                          "batch: a lapsed lease is taken over, stop at the first error"};

long long dbsize(const RedisServer& s) {
  redisContext* c = redisConnectUnix(s.socket_path().c_str());
  REQUIRE((c && !c->err));
  auto r = idem::test::command_argv(c, {"DBSIZE"});
  const long long n = r ? r->integer : -1;
  redisFree(c);
  return n;
}

}  // namespace

TEST_CASE("conformance passes on a redis-server and leaves no key behind") {
  RedisServer server;
  auto r = run_tool({"conformance", "redis://127.0.0.1:" + std::to_string(server.port())});
  INFO(r.out);
  CHECK(r.status == 0);
  CHECK(contains(r.out, "RESULT  CASE"));
  for (const auto& name : some_cases) CHECK(contains(r.out, "PASS    " + name));
  CHECK_FALSE(contains(r.out, "FAIL"));
  CHECK(contains(r.out, "22 passed, 0 failed"));
  CHECK(contains(r.out, "keys deleted under 'idem:conformance-"));
  CHECK(dbsize(server) == 0);

  r = run_tool({"conformance", "--json", "--prefix", "app:", "--url", "unix://" + server.socket_path()});
  CHECK(r.status == 0);
  CHECK(contains(r.out, "{\"case\":\"acquire of a new key\",\"result\":\"pass\","));
  CHECK(contains(r.out, "\"passed\":22,\"failed\":0,"));
  CHECK(dbsize(server) == 0);

  r = run_tool({"conformance", "--help"});
  CHECK(r.status == 0);
  CHECK(contains(r.out, "contract suite"));
}

TEST_CASE("conformance names the ACL permission a restricted Redis user lacks") {
  RedisServer server({"user noeval on >pw ~* +@all -evalsha", "user notime on >pw ~* +@all -time"});
  const std::string at = "@127.0.0.1:" + std::to_string(server.port());

  auto r = run_tool({"conformance", "redis://noeval:pw" + at});
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK(contains(r.out, "FAIL    acquire of a new key"));
  CHECK(contains(r.out, "NOPERM this user has no permissions to run the 'evalsha' command"));
  CHECK(contains(r.out, "hint:   the ACL user may not run EVALSHA"));
  CHECK(contains(r.out, "idem does not hold its contract on this server"));

  r = run_tool({"conformance", "redis://notime:pw" + at});
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK(contains(r.out, "FAIL    acquire of a new key"));
  CHECK(contains(r.out, "hint:   the ACL user may not run TIME"));
  CHECK(dbsize(server) == 0);
}

TEST_CASE("conformance passes on PostgreSQL and drops its table") {
  const std::string ci = pgtest::conninfo();
  auto field = [&](const std::string& name) {
    const auto a = ci.find(name + "=");
    const auto e = ci.find(' ', a);
    return ci.substr(a + name.size() + 1, e == std::string::npos ? std::string::npos : e - a - name.size() - 1);
  };
  const std::string url = "postgresql://" + field("user") + "@" + field("host") + ":" + field("port") + "/" + field("dbname");
  pgtest::Raw raw(ci);
  raw.exec("CREATE SCHEMA IF NOT EXISTS idem_conf_kept");

  auto r = run_tool({"conformance", url, "--schema", "idem_conf_kept"});
  INFO(r.out);
  CHECK(r.status == 0);
  for (const auto& name : some_cases) CHECK(contains(r.out, "PASS    " + name));
  CHECK(contains(r.out, "22 passed, 0 failed"));
  CHECK(contains(r.out, "cleanup: dropped table idem_conf_kept.idem_conformance_"));
  // An existing schema stays, without the run's table, functions or version row.
  CHECK(raw.scalar("SELECT count(*) FROM pg_namespace WHERE nspname = 'idem_conf_kept'") == "1");
  CHECK(raw.scalar("SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                   "WHERE n.nspname = 'idem_conf_kept' AND c.relname LIKE 'idem_conformance_%'") == "0");
  CHECK(raw.scalar("SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
                   "WHERE n.nspname = 'idem_conf_kept'") == "0");
  CHECK(raw.scalar("SELECT count(*) FROM idem_conf_kept.idem_schema_version") == "0");
  raw.exec("DROP SCHEMA idem_conf_kept CASCADE");

  // A schema the run had to create is dropped whole.
  r = run_tool({"conformance", url, "--schema", "idem_conf_new", "--json"});
  CHECK(r.status == 0);
  CHECK(contains(r.out, "\"passed\":22,\"failed\":0,"));
  CHECK(raw.scalar("SELECT count(*) FROM pg_namespace WHERE nspname = 'idem_conf_new'") == "0");
}
