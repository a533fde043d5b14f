// The `idem` tool over TLS, run as a child process: `idem conformance` over rediss:// (mutual TLS
// too) and over a Redis Cluster whose nodes speak TLS only passes and leaves no key behind (its
// cleanup and ACL probe go through RedisAdmin, so through the stores' connection factory), and
// rediss:// at a plain-text port is refused at once, saying why.

#include <catch2/catch.hpp>

#include <chrono>
#include <string>

#include "tls_support.hpp"
#include "tool_run.hpp"

using namespace std::chrono_literals;
using idem::test::contains;
using idem::test::run_tool;
using idem::tlstest::cert;
using idem::tlstest::TlsRedisServer;
using idem::tlstest::TlsServerConfig;

namespace {

long long dbsize(TlsRedisServer& s) { return std::stoll(s.command({"DBSIZE"})); }

void check_passed(const idem::test::ToolRun& r) {
  INFO(r.out);
  CHECK(r.status == 0);
  CHECK(contains(r.out, "PASS    acquire of a new key"));
  CHECK(contains(r.out, "22 passed, 0 failed"));
  CHECK(contains(r.out, "keys deleted under 'idem:conformance-"));
  CHECK_FALSE(contains(r.out, "not done"));
}

}  // namespace

TEST_CASE("conformance over rediss:// passes and leaves no key behind", "[tools][tls]") {
  SECTION("server-checked TLS; a command refused inside the scripts is named by the ACL probe") {
    TlsRedisServer server(TlsServerConfig{"server", "no", {"user notime on >pw ~* +@all -time"}});
    const std::string at = "127.0.0.1:" + std::to_string(server.port()) + "?tls_ca_file=" + cert("ca.crt");
    check_passed(run_tool({"conformance", "rediss://" + at}));
    CHECK(dbsize(server) == 0);

    auto r = run_tool({"conformance", "rediss://notime:pw@" + at});
    INFO(r.out);
    CHECK(r.status == 1);
    CHECK(contains(r.out, "hint:   the ACL user may not run TIME"));
    CHECK(contains(r.out, "(as the URL's user: NOPERM"));
    CHECK(contains(r.out, "keys deleted under 'idem:conformance-"));
    CHECK(dbsize(server) == 0);
  }
  SECTION("mutual TLS") {
    TlsRedisServer server(TlsServerConfig{"server", "yes", {}});
    check_passed(run_tool({"conformance", "rediss://127.0.0.1:" + std::to_string(server.port()) +
                                              "?tls_ca_file=" + cert("ca.crt") + "&tls_cert_file=" +
                                              cert("client.crt") + "&tls_key_file=" + cert("client.key")}));
    CHECK(dbsize(server) == 0);
  }
}

TEST_CASE("conformance over a TLS Redis Cluster deletes its keys on every master", "[tools][tls][cluster]") {
  idem::tlstest::TlsCluster cluster;
  check_passed(run_tool({"conformance", cluster.url() + "&tls_ca_file=" + cert("ca.crt")}));
  CHECK(cluster.keys() == 0);
}

TEST_CASE("conformance over rediss:// at a plain-text port says so at once", "[tools][tls][fail]") {
  idem::test::RedisServer plain;
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_tool({"conformance", "rediss://127.0.0.1:" + std::to_string(plain.port()) + "?tls_ca_file=" +
                                        cert("ca.crt")});
  INFO(r.out);
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);  // the tool's connect_timeout is 3 s
  CHECK(r.status == 3);
  CHECK(contains(r.out, "does not speak TLS"));
  CHECK(contains(r.out, "use redis://"));
}
