// The `idem` tool on sqlite:///path URLs: a SqliteStore file in a temporary directory (no server),
// each command's output and exit status — inspect, list, stats, a fenced release, purge, doctor on
// a good file and on a misconfigured one, migrate --status / --apply / --print-sql — and the URL
// errors. A few seconds.

#include <catch2/catch.hpp>

#include <chrono>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "sqlite_support.hpp"
#include "tool_run.hpp"

using namespace std::chrono_literals;
using idem::test::contains;
using idem::test::run_tool;
using sqlitetest::ap;

namespace {

std::string url_of(const std::string& path) { return "sqlite://" + path; }

// Lines of --json output as objects.
std::vector<nlohmann::json> json_lines(const std::string& out) {
  std::vector<nlohmann::json> v;
  std::size_t at = 0;
  while (at < out.size()) {
    const auto nl = out.find('\n', at);
    const std::string line = out.substr(at, nl == std::string::npos ? std::string::npos : nl - at);
    if (!line.empty() && line.front() == '{') v.push_back(nlohmann::json::parse(line));
    if (nl == std::string::npos) break;
    at = nl + 1;
  }
  return v;
}

}  // namespace

TEST_CASE("inspect, list, stats, release and purge on a SQLite file") {
  const std::string path = sqlitetest::fresh_path("tools");
  const std::string url = url_of(path);
  idem::SqliteStore store({.path = path});
  auto done = store.acquire("order-1", ap(1));
  REQUIRE(store.complete("order-1", done.holder, "receipt-42", 1h) == idem::WriteStatus::ok);
  auto held = store.acquire("stuck-1", ap(2, 50ms));
  REQUIRE(held.status == idem::AcquireStatus::acquired);
  auto f = store.acquire("failed-1", ap(3));
  idem::FailParams fp;
  fp.error = "card declined";
  fp.permanent = true;
  REQUIRE(store.fail("failed-1", f.holder, fp) == idem::WriteStatus::ok);
  auto old = store.acquire("old-1", ap(4));
  REQUIRE(store.complete("old-1", old.holder, "r", 1ms) == idem::WriteStatus::ok);
  std::this_thread::sleep_for(80ms);  // stuck-1's lease lapses, old-1 expires

  auto r = run_tool({"inspect", url, "order-1"});
  CHECK(r.status == 0);
  CHECK(contains(r.out, "completed"));
  CHECK(contains(r.out, "10 bytes"));
  r = run_tool({"inspect", url, "old-1"});
  CHECK(r.status == 1);
  CHECK(contains(r.out, "not found on sqlite " + path));

  r = run_tool({"list", "--url", url, "--json"});
  REQUIRE(r.status == 0);
  auto rows = json_lines(r.out);
  REQUIRE(rows.size() == 3);
  CHECK(rows[0]["key"] == "stuck-1");  // stuck keys first
  CHECK(rows[0]["overdue_ms"].get<long>() >= 0);
  CHECK(rows[1]["key"] == "failed-1");
  CHECK(rows[2]["key"] == "order-1");
  r = run_tool({"list", url, "--state", "in_progress", "--older-than", "10ms", "--page", "1"});
  CHECK(r.status == 0);
  CHECK(contains(r.out, "stuck-1"));
  CHECK_FALSE(contains(r.out, "order-1"));

  r = run_tool({"stats", url, "--json"});
  REQUIRE(r.status == 0);
  auto s = nlohmann::json::parse(r.out);
  CHECK(s["records"] == 3);
  CHECK(s["in_progress"] == 1);
  CHECK(s["completed"] == 1);
  CHECK(s["failed"] == 1);
  CHECK(s["lapsed"] == 1);
  CHECK(s["expired_rows"] == 1);

  // A fenced release: the wrong fence and a completed key are refused; the right fence frees it and
  // the next acquire takes it with fence + 1; the old holder's completion is refused.
  r = run_tool({"release", url, "stuck-1", "--fence", "7", "--yes"});
  CHECK(r.status == 1);
  CHECK(contains(r.out, "has fence 1, not 7"));
  r = run_tool({"release", url, "order-1", "--fence", "1", "--yes"});
  CHECK(r.status == 1);
  CHECK(contains(r.out, "is completed"));
  r = run_tool({"release", url, "stuck-1", "--fence", "1", "--yes", "--json"});
  REQUIRE(r.status == 0);
  CHECK(nlohmann::json::parse(r.out)["next_fence"] == 2);
  CHECK(store.complete("stuck-1", held.holder, "late", 1h) == idem::WriteStatus::lease_lost);
  auto again = store.acquire("stuck-1", ap(5));
  CHECK(again.status == idem::AcquireStatus::acquired);
  CHECK(again.holder.fence == 2);
  // A live lease is refused without --force.
  r = run_tool({"release", url, "stuck-1", "--fence", "2", "--yes"});
  CHECK(r.status == 1);
  CHECK(contains(r.out, "live lease"));
  r = run_tool({"release", url, "stuck-1", "--fence", "2", "--yes", "--force"});
  CHECK(r.status == 0);

  r = run_tool({"purge", url, "--json"});
  REQUIRE(r.status == 0);
  CHECK(nlohmann::json::parse(r.out)["purged"] == 1);
  r = run_tool({"purge", url});
  CHECK(r.status == 0);
  CHECK(contains(r.out, "purged 0 expired rows"));
}

TEST_CASE("doctor on a SQLite file: a store's file passes, a file in rollback-journal mode without the table fails") {
  const std::string path = sqlitetest::fresh_path("doctor");
  {
    idem::SqliteStore store({.path = path});
    store.migrate();
  }
  auto r = run_tool({"doctor", url_of(path)});
  INFO(r.out);
  CHECK(r.status == 0);
  CHECK(contains(r.out, "journal_mode: wal"));
  CHECK(contains(r.out, "synchronous:"));
  CHECK(contains(r.out, "file system:"));
  CHECK(contains(r.out, "schema: schema version 2"));
  CHECK(contains(r.out, "busy_timeout:"));
  CHECK(contains(r.out, "file size: file "));
  r = run_tool({"doctor", url_of(path), "--json"});
  CHECK(r.status == 0);
  CHECK(json_lines(r.out).size() >= 7);

  const std::string plain = sqlitetest::fresh_path("plain");
  {
    sqlitetest::Raw raw(plain);
    raw.exec("PRAGMA journal_mode=DELETE; CREATE TABLE other (x)");
  }
  r = run_tool({"doctor", url_of(plain)});
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK(contains(r.out, "[error]   journal_mode: 'delete', not wal"));
  CHECK(contains(r.out, "no table idem_records"));
}

TEST_CASE("migrate on a SQLite file: status, apply, print-sql") {
  const std::string path = sqlitetest::fresh_path("migrate");
  auto r = run_tool({"migrate", url_of(path), "--status"});
  CHECK(r.status == 3);  // the tool never creates a file but with --apply
  CHECK(contains(r.out, "no such file"));
  r = run_tool({"migrate", url_of(path), "--apply"});
  CHECK(r.status == 0);
  CHECK(contains(r.out, "from schema version 0 to 2"));
  r = run_tool({"migrate", url_of(path), "--status", "--json"});
  CHECK(r.status == 0);
  CHECK(nlohmann::json::parse(r.out)["version"] == 2);
  r = run_tool({"migrate", url_of(path), "--apply"});
  CHECK(contains(r.out, "already at schema version 2"));

  // The printed SQL makes a table a store without auto_migrate accepts.
  r = run_tool({"migrate", url_of(path), "--print-sql", "--table", "printed"});
  REQUIRE(r.status == 0);
  CHECK(contains(r.out, "CREATE TABLE \"printed\""));
  const std::string other = sqlitetest::fresh_path("printed");
  {
    sqlitetest::Raw raw(other);
    raw.exec(r.out);
  }
  idem::SqliteStore store({.path = other, .table = "printed", .auto_migrate = false});
  CHECK(store.acquire("k", ap(1)).status == idem::AcquireStatus::acquired);
}

TEST_CASE("sqlite URLs the tool refuses") {
  auto r = run_tool({"stats", "sqlite:///nonexistent/dir/idem.db"});
  CHECK(r.status == 3);
  CHECK(contains(r.out, "no such file"));
  r = run_tool({"stats", "sqlite:///tmp/x.db?mode=ro"});
  CHECK(r.status == 2);
  CHECK(contains(r.out, "without ?options"));
  r = run_tool({"stats", "--url", "mysql://h/db"});
  CHECK(r.status == 2);
  CHECK(contains(r.out, "sqlite:///path"));
  r = run_tool({"conformance", "sqlite:///tmp/x.db"});
  CHECK(r.status == 2);
  CHECK(contains(r.out, "sqlite:///"));
}
