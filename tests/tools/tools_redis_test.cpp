// The `idem` tool on real redis-servers: each command's output and exit status, a release refused
// for a wrong fence, doctor on a misconfigured and a well-configured server, ACL errors, and a
// listing of IDEM_TOOLS_RECORDS records that pages through SCAN without holding them.

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdlib>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "idem/redis.hpp"
#include "tool_run.hpp"

using namespace std::chrono_literals;
using idem::test::contains;
using idem::test::RedisServer;
using idem::test::run_tool;

namespace {

std::string url(const RedisServer& s) { return "redis://127.0.0.1:" + std::to_string(s.port()); }

idem::AcquireParams params(std::uint64_t token, idem::millis lease = 30s) {
  idem::AcquireParams p;
  p.lease = lease;
  p.retention = 1h;
  p.token = token;
  p.owner = "worker-7:4242";
  return p;
}

// A durable, non-evicting server: what doctor should pass.
std::vector<std::string> good_config() { return {"appendonly yes", "appendfsync always", "maxmemory-policy noeviction"}; }

}  // namespace

TEST_CASE("inspect, list, stats and purge show the records") {
  RedisServer server(good_config());
  idem::RedisStore store{server.options()};
  auto done = store.acquire("order-1", params(1));
  REQUIRE(store.complete("order-1", done.holder, "receipt-42", 1h) == idem::WriteStatus::ok);
  REQUIRE(store.acquire("stuck-1", params(2, 50ms)).status == idem::AcquireStatus::acquired);
  auto f = store.acquire("failed-1", params(3));
  idem::FailParams fp;
  fp.error = "card declined";
  fp.permanent = true;
  REQUIRE(store.fail("failed-1", f.holder, fp) == idem::WriteStatus::ok);
  std::this_thread::sleep_for(100ms);

  auto r = run_tool({"inspect", "order-1", "stuck-1", "--url", url(server)});
  CHECK(r.status == 0);
  CHECK(contains(r.out, "key          order-1\nstate        completed\nfence        1\n"));
  CHECK(contains(r.out, "result       10 bytes"));
  CHECK(contains(r.out, "state        in_progress"));
  CHECK(contains(r.out, "owner        worker-7:4242"));
  CHECK(contains(r.out, "lease        lapsed "));
  CHECK(contains(r.out, "expires in   59m"));

  r = run_tool({"inspect", "no-such-key", "--url", url(server)});
  CHECK(r.status == 1);
  CHECK(contains(r.out, "key 'no-such-key' not found"));

  r = run_tool({"inspect", "order-1", "--json", "--url", url(server)});
  CHECK(r.status == 0);
  CHECK(contains(r.out, "{\"key\":\"order-1\",\"state\":\"completed\",\"fence\":1,"));
  CHECK(contains(r.out, "\"result_bytes\":10"));

  // Stuck keys first: in_progress, then failed, then completed.
  r = run_tool({"list", "--url", url(server)});
  CHECK(r.status == 0);
  const auto stuck = r.out.find("stuck-1"), failed = r.out.find("failed-1"), completed = r.out.find("order-1");
  CHECK(stuck < failed);
  CHECK(failed < completed);
  CHECK(completed != std::string::npos);

  r = run_tool({"list", "--state", "in_progress", "--older-than", "10ms", "--json", "--url", url(server)});
  CHECK(r.status == 0);
  CHECK(r.lines == 1);
  CHECK(contains(r.out, "\"key\":\"stuck-1\""));
  r = run_tool({"list", "--state", "in_progress", "--older-than", "5m", "--url", url(server)});
  CHECK(r.status == 0);
  CHECK(r.lines == 1);  // the header only
  r = run_tool({"list", "--state", "completed", "--older-than", "5m", "--url", url(server)});
  CHECK(r.status == 2);
  CHECK(contains(r.out, "not completed"));
  r = run_tool({"list", "--state", "bogus", "--url", url(server)});
  CHECK(r.status == 2);
  r = run_tool({"list", "--limit", "2", "--json", "--url", url(server)});
  CHECK(r.lines == 2);

  r = run_tool({"stats", "--url", url(server)});
  CHECK(r.status == 0);
  CHECK(contains(r.out, "records      3\nin_progress  1 (1 with a lapsed lease)\ncompleted    1\nfailed       1\n"));
  r = run_tool({"stats", "--json", "--url", url(server)});
  CHECK(contains(r.out, "{\"records\":3,\"in_progress\":1,\"completed\":1,\"failed\":1,\"lapsed\":1,"));

  r = run_tool({"purge", "--url", url(server)});
  CHECK(r.status == 0);
  CHECK(contains(r.out, "nothing to purge"));
}

TEST_CASE("keys in --json: UTF-8 as text, other bytes as key_hex, each given back to release") {
  RedisServer server(good_config());
  idem::RedisStore store{server.options()};
  const std::string text = "caf\xc3\xa9-\xd0\xba\xd0\xbb\xd1\x8e\xd1\x87-\xf0\x9f\x99\x82";  // "café-ключ-🙂"
  // Not UTF-8: bytes that are never valid, and a sequence cut short.
  const std::string bytes = std::string("bin-\xff\xfe-\xe2\x82", 9);
  REQUIRE(store.acquire(text, params(1, 50ms)).status == idem::AcquireStatus::acquired);
  REQUIRE(store.acquire(bytes, params(2, 50ms)).status == idem::AcquireStatus::acquired);
  std::this_thread::sleep_for(100ms);

  auto r = run_tool({"list", "--state", "in_progress", "--json", "--url", url(server)});
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(contains(r.out, "\"key\":\"" + text + "\""));  // the UTF-8 bytes themselves, not \u escapes
  std::string from_list, hex_from_list;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("key")) {
      CHECK_FALSE(j.contains("key_hex"));
      from_list = j.at("key").get<std::string>();
    } else {
      hex_from_list = j.at("key_hex").get<std::string>();
    }
  }
  CHECK(from_list == text);
  CHECK(hex_from_list == "62696e2dfffe2de282");

  r = run_tool({"release", from_list, "--fence", "1", "--yes", "--json", "--url", url(server)});
  REQUIRE(r.status == 0);
  auto j = nlohmann::json::parse(r.out);
  CHECK(j.at("released") == true);
  CHECK(j.at("key") == text);
  CHECK(j.at("fence") == 1);
  CHECK(j.at("was") == "in_progress");
  CHECK(j.at("next_fence") == 2);
  CHECK(store.inspect(text)->state == idem::State::failed);

  r = run_tool({"release", "--key-hex", hex_from_list, "--fence", "1", "--yes", "--json", "--url", url(server)});
  REQUIRE(r.status == 0);
  j = nlohmann::json::parse(r.out);
  CHECK(j.at("released") == true);
  CHECK(j.at("key_hex") == hex_from_list);
  CHECK_FALSE(j.contains("key"));
  CHECK(store.inspect(bytes)->state == idem::State::failed);
  r = run_tool({"inspect", "--key-hex", hex_from_list, "--json", "--url", url(server)});
  CHECK(r.status == 0);
  CHECK(nlohmann::json::parse(r.out).at("state") == "failed");

  // A refusal keeps the tool's one error convention: a message on stderr and exit 1, with --json too.
  r = run_tool({"release", text, "--fence", "2", "--yes", "--json", "--url", url(server)});
  CHECK(r.status == 1);
  CHECK(contains(r.out, "idem: refused: '"));
  CHECK_FALSE(contains(r.out, "{"));
  r = run_tool({"release", "--key-hex", "6g", "--fence", "1", "--yes", "--url", url(server)});
  CHECK(r.status == 2);
  CHECK(contains(r.out, "not a key in hex"));
  r = run_tool({"release", "x", "--key-hex", "78", "--fence", "1", "--yes", "--url", url(server)});
  CHECK(r.status == 2);
  CHECK(contains(r.out, "one key at a time"));

  r = run_tool({"purge", "--json", "--url", url(server)});
  REQUIRE(r.status == 0);
  j = nlohmann::json::parse(r.out);
  CHECK(j.at("purged") == 0);
  CHECK(j.at("store_expires") == true);
  r = run_tool({"stats", "--json", "--url", url(server)});
  CHECK(nlohmann::json::parse(r.out).at("records") == 2);
}

TEST_CASE("release frees a stuck key only with its fence, never a completed one") {
  RedisServer server(good_config());
  idem::RedisStore store{server.options()};
  auto held = store.acquire("stuck", params(7, 50ms));
  REQUIRE(held.holder.fence == 1);
  std::this_thread::sleep_for(100ms);

  // Without a terminal, release wants --yes.
  auto r = run_tool({"release", "stuck", "--fence", "1", "--url", url(server)});
  CHECK(r.status == 2);
  CHECK(contains(r.out, "pass --yes"));

  r = run_tool({"release", "stuck", "--fence", "2", "--yes", "--url", url(server)});
  CHECK(r.status == 1);
  CHECK(contains(r.out, "refused: 'stuck' has fence 1, not 2"));
  CHECK(store.inspect("stuck")->state == idem::State::in_progress);  // untouched

  r = run_tool({"release", "stuck", "--fence", "1", "--yes", "--url", url(server)});
  CHECK(r.status == 0);
  CHECK(contains(r.out, "released 'stuck' (fence 1, was in_progress): the next delivery acquires it with fence 2"));
  // The old holder is locked out; the next delivery takes it with the next fence.
  CHECK(store.complete("stuck", held.holder, "late", 1h) == idem::WriteStatus::lease_lost);
  auto next = store.acquire("stuck", params(8));
  CHECK(next.status == idem::AcquireStatus::acquired);
  CHECK(next.holder.fence == 2);
  CHECK_FALSE(next.takeover);

  // That new holder's lease is live: refused unless --force.
  r = run_tool({"release", "stuck", "--fence", "2", "--yes", "--url", url(server)});
  CHECK(r.status == 1);
  CHECK(contains(r.out, "live lease"));
  r = run_tool({"release", "stuck", "--fence", "2", "--yes", "--force", "--url", url(server)});
  CHECK(r.status == 0);

  auto c = store.acquire("done", params(9));
  REQUIRE(store.complete("done", c.holder, "x", 1h) == idem::WriteStatus::ok);
  r = run_tool({"release", "done", "--fence", "1", "--yes", "--url", url(server)});
  CHECK(r.status == 1);
  CHECK(contains(r.out, "completed keys are never released"));
  CHECK(store.inspect("done")->state == idem::State::completed);

  r = run_tool({"release", "ghost", "--fence", "1", "--yes", "--url", url(server)});
  CHECK(r.status == 1);
  CHECK(contains(r.out, "not found"));
}

TEST_CASE("doctor flags allkeys-lru and appendonly no, and passes a durable noeviction server") {
  {
    RedisServer bad({"maxmemory-policy allkeys-lru", "appendonly no"});
    auto r = run_tool({"doctor", "--url", url(bad)});
    INFO(r.out);
    CHECK(r.status == 1);
    CHECK(contains(r.out, "[warning] maxmemory-policy: maxmemory-policy is allkeys-lru"));
    CHECK(contains(r.out, "[error]   appendonly: appendonly is no"));
    CHECK(contains(r.out, "fix: CONFIG SET appendonly yes"));
    CHECK(contains(r.out, "1 error(s), 1 warning(s)"));
  }
  {
    RedisServer evicting({"maxmemory-policy allkeys-lru", "maxmemory 100mb", "appendonly yes"});
    auto r = run_tool({"doctor", "--json", "--url", url(evicting)});
    CHECK(r.status == 1);
    CHECK(contains(r.out, "{\"severity\":\"error\",\"check\":\"maxmemory-policy\""));
  }
  {
    RedisServer good(good_config());
    auto r = run_tool({"doctor", "--url", url(good)});
    INFO(r.out);
    CHECK(r.status == 0);
    CHECK(contains(r.out, "[ok]      maxmemory-policy: noeviction"));
    CHECK(contains(r.out, "[ok]      appendfsync: always"));
    CHECK(contains(r.out, "[ok]      acl: user default may run every command"));
    CHECK(contains(r.out, "0 error(s)"));
  }
}

TEST_CASE("missing ACL permissions, bad URLs and unreachable servers are clear errors") {
  RedisServer server({"appendonly yes",
                      // May look and check, but not run the scripts.
                      "user looker on >pw ~idem:* +get +info +ping +config|get +acl|whoami +acl|dryrun +scan"});
  const std::string looker = "redis://looker:pw@127.0.0.1:" + std::to_string(server.port());
  auto r = run_tool({"doctor", "--url", looker});
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK(contains(r.out, "[error]   acl: user looker may not run EVALSHA, SCRIPT LOAD, SET, PTTL, PEXPIRE, TIME"));
  r = run_tool({"inspect", "k", "--url", looker});
  CHECK(r.status == 3);
  CHECK(contains(r.out, "refused by ACL"));

  r = run_tool({"inspect", "k", "--url", "redis://wrong:pw@127.0.0.1:" + std::to_string(server.port())});
  CHECK(r.status == 3);
  CHECK(contains(r.out, "authentication"));
  // rediss:// is a store URL the tool opens (TLS): nothing listening is "cannot connect", not a bad URL.
  r = run_tool({"stats", "--url", "rediss://127.0.0.1:" + std::to_string(idem::test::free_port())});
  CHECK(r.status == 3);
  CHECK(contains(r.out, "cannot connect"));
  r = run_tool({"stats", "--url", "redis://127.0.0.1:notaport"});
  CHECK(r.status == 2);
  r = run_tool({"stats", "--url", "mysql://x"});
  CHECK(r.status == 2);
  CHECK(contains(r.out, "unsupported store URL"));
  r = run_tool({"stats"});
  CHECK(r.status == 2);
  CHECK(contains(r.out, "no store given"));
  r = run_tool({"stats", "--url", "redis://127.0.0.1:" + std::to_string(idem::test::free_port())});
  CHECK(r.status == 3);
  CHECK(contains(r.out, "cannot connect"));
  r = run_tool({"--help"});
  CHECK(r.status == 0);
  for (const char* cmd : {"inspect", "list", "release", "purge", "stats", "doctor", "migrate", "conformance"}) {
    CHECK(contains(r.out, cmd));
    auto h = run_tool({cmd, "--help"});
    CHECK(h.status == 0);
    CHECK(contains(h.out, "--url"));
    CHECK(contains(h.out, "The store: a URL argument, --url/-u or the IDEM_URL environment variable"));
  }
}

TEST_CASE("every command takes the store as an argument, with --url or from IDEM_URL") {
  RedisServer server(good_config());
  idem::RedisStore store{server.options()};
  auto done = store.acquire("order-1", params(1));
  REQUIRE(store.complete("order-1", done.holder, "receipt-42", 1h) == idem::WriteStatus::ok);
  REQUIRE(store.acquire("stuck", params(2, 50ms)).status == idem::AcquireStatus::acquired);
  std::this_thread::sleep_for(100ms);
  const std::string u = url(server);
  const std::string elsewhere = "redis://127.0.0.1:" + std::to_string(idem::test::free_port());
  ::unsetenv("IDEM_URL");

  // The URL as the first argument, for every command.
  auto r = run_tool({"inspect", u, "order-1"});
  INFO(r.out);
  CHECK(r.status == 0);
  CHECK(contains(r.out, "key          order-1\nstate        completed\n"));
  r = run_tool({"list", u, "--json"});
  CHECK(r.status == 0);
  CHECK(r.lines == 2);
  r = run_tool({"stats", u});
  CHECK(r.status == 0);
  CHECK(contains(r.out, "records      2\n"));
  r = run_tool({"doctor", u});
  CHECK(r.status == 0);
  CHECK(contains(r.out, "[ok]      maxmemory-policy: noeviction"));
  r = run_tool({"purge", u});
  CHECK(r.status == 0);
  CHECK(contains(r.out, "nothing to purge"));
  r = run_tool({"release", u, "stuck", "--fence", "1", "--yes"});
  CHECK(r.status == 0);
  CHECK(contains(r.out, "released 'stuck' (fence 1, was in_progress)"));
  // The argument and --url may both be given when they agree.
  r = run_tool({"stats", u, "--url", u});
  CHECK(r.status == 0);
  r = run_tool({"inspect", "-u", u, u, "order-1"});
  CHECK(r.status == 0);

  // Two different stores: a usage error naming both, whatever the command; nothing is opened.
  for (std::vector<std::string> args : std::vector<std::vector<std::string>>{
           {"stats", u, "--url", elsewhere},
           {"doctor", elsewhere, "-u", u},
           {"list", u, "--url", elsewhere},
           {"purge", u, "--url", elsewhere},
           {"inspect", u, "order-1", "--url", elsewhere},
           {"release", u, "stuck", "--fence", "2", "--yes", "--url", elsewhere},
           {"conformance", u, "--url", elsewhere}}) {
    r = run_tool(args);
    INFO(args.front() << ": " << r.out);
    CHECK(r.status == 2);
    CHECK(contains(r.out, "two different stores given: '"));
    CHECK(contains(r.out, "' (argument) and '"));
    CHECK(contains(r.out, "' (--url); give one"));
  }

  // Keys: the URL argument is taken only in front; a key that looks like a URL follows it.
  r = run_tool({"inspect", u});
  CHECK(r.status == 2);
  CHECK(contains(r.out, "no key given"));
  r = run_tool({"inspect", u, "redis://not-a-store"});
  CHECK(r.status == 1);
  CHECK(contains(r.out, "key 'redis://not-a-store' not found"));
  r = run_tool({"release", u, "--fence", "1", "--yes"});
  CHECK(r.status == 2);
  CHECK(contains(r.out, "no key given"));
  r = run_tool({"release", u, "a", "b", "--fence", "1", "--yes"});
  CHECK(r.status == 2);
  r = run_tool({"stats", u, "extra"});
  CHECK(r.status == 2);

  // IDEM_URL when neither is given; an argument or --url overrides it.
  ::setenv("IDEM_URL", u.c_str(), 1);
  r = run_tool({"stats"});
  CHECK(r.status == 0);
  CHECK(contains(r.out, "records      2\n"));
  r = run_tool({"inspect", "order-1"});
  CHECK(r.status == 0);
  ::setenv("IDEM_URL", elsewhere.c_str(), 1);
  r = run_tool({"stats", u});
  CHECK(r.status == 0);
  r = run_tool({"inspect", "order-1", "--url", u});
  CHECK(r.status == 0);
  r = run_tool({"stats"});
  CHECK(r.status == 3);
  CHECK(contains(r.out, "cannot connect"));
  ::unsetenv("IDEM_URL");
}

TEST_CASE("list streams many records page by page") {
  constexpr std::size_t n = IDEM_TOOLS_RECORDS;
  RedisServer server(good_config());
  idem::RedisStore store{server.options()};
  std::vector<std::string> keys;
  for (std::size_t i = 0; i < 1000; ++i) keys.push_back({});
  for (std::size_t base = 0; base < n; base += 1000) {
    std::vector<std::string_view> views;
    for (std::size_t i = 0; i < 1000; ++i) {
      keys[i] = "msg-" + std::to_string(base + i);
      views.push_back(keys[i]);
    }
    auto claims = store.acquire_batch(views, params(base + 1));
    std::vector<idem::CompleteItem> items;
    for (std::size_t i = 0; i < views.size(); ++i) items.push_back({views[i], claims[i].holder, "result-payload-of-some-size"});
    store.complete_batch(items, 1h);
  }
  REQUIRE(server.command({"DBSIZE"}) == std::to_string(n));

  const auto scans_before = server.command({"INFO", "commandstats"});
  auto small = run_tool({"list", "--limit", "1", "--json", "--url", url(server)}, false);
  REQUIRE(small.status == 0);
  const auto t0 = std::chrono::steady_clock::now();
  auto all = run_tool({"list", "--state", "completed", "--json", "--page", "500", "--url", url(server)}, false);
  const auto took = std::chrono::steady_clock::now() - t0;
  REQUIRE(all.status == 0);
  CHECK(all.lines == n);
  // Paged: SCAN was called about n / 500 times, not once for everything.
  server.command({"CONFIG", "RESETSTAT"});
  auto again = run_tool({"list", "--state", "completed", "--page", "500", "--url", url(server)}, false);
  CHECK(again.lines == n + 1);
  const auto stats = server.command({"INFO", "commandstats"});
  const auto at = stats.find("cmdstat_scan:calls=");
  REQUIRE(at != std::string::npos);
  const long scans = std::stol(stats.substr(at + 19));
  CHECK(scans >= static_cast<long>(n / 1000));
  // Bounded memory: listing every record costs the tool no more than a few MB over listing one,
  // while the records themselves (JSON out) are many times that.
  const long output_kib = static_cast<long>(n * 250 / 1024);
  INFO("rss one: " << small.max_rss_kib << " KiB, rss all: " << all.max_rss_kib << " KiB, output ~" << output_kib
                   << " KiB, scans " << scans << ", took "
                   << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms");
  if (IDEM_TOOLS_CHECK_RSS) {
    CHECK(all.max_rss_kib - small.max_rss_kib < 8 * 1024);
    CHECK(all.max_rss_kib - small.max_rss_kib < output_kib / 2);
  }
  (void)scans_before;
}
