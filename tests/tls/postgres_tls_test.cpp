// PostgresStore over TLS on the fixture's TLS-only server: libpq checks the CA and the host name
// (sslmode=verify-full), and each check that fails, fails closed with its message; a plain-text
// connection is refused by the server; mutual TLS with `cert` authentication; no secret (the
// password) in a message.
#include <catch2/catch.hpp>

#include <string>

#include "idem/idem.hpp"
#include "idem/postgres.hpp"
#include "postgres/pg_support.hpp"

namespace {

std::string certs() {
  const char* s = std::getenv("IDEM_TLS_STATE");
  return std::string(s && *s ? s : IDEM_TLS_STATE_DEFAULT) + "/certs/";
}

// The fixture's conninfo without its sslmode/sslrootcert, for cases that set their own.
std::string base() {
  const std::string ci = pgtest::conninfo();
  return ci.substr(0, ci.find(" sslmode="));
}

struct Caught {
  std::string text;
  bool connection = false;  // a connection_error
  bool retryable = true;
  [[nodiscard]] const char* what() const { return text.c_str(); }
};

// The error a store built on `conninfo` throws (a test failure when none).
Caught refusal(const std::string& conninfo) {
  try {
    idem::PostgresStore s(idem::PostgresOptions{.conninfo = conninfo},
                          idem::PostgresStoreOptions{.schema = "idem_test"});
    (void)s.inspect("tls-probe");  // the first use connects, if construction did not
  } catch (const idem::store_error& e) {
    return {e.what(), dynamic_cast<const idem::connection_error*>(&e) != nullptr, e.retryable()};
  }
  FAIL("no store_error was thrown");
  return {};
}

}  // namespace

TEST_CASE("postgres tls: verify-full connects over TLS 1.2+", "[postgres][tls]") {
  pgtest::Raw raw;
  CHECK(raw.scalar("SELECT ssl::text FROM pg_stat_ssl WHERE pid = pg_backend_pid()") == "true");
  auto store = pgtest::store();
  const std::string k = pgtest::key("tls");
  CHECK(store.acquire(k, pgtest::ap(1)).status == idem::AcquireStatus::acquired);
}

TEST_CASE("postgres tls: each failed check fails closed with libpq's message", "[postgres][tls][fail]") {
  SECTION("unknown CA") {
    const auto e = refusal(base() + " sslmode=verify-full sslrootcert=" + certs() + "other-ca.crt");
    INFO(e.what());
    CHECK(e.connection);
    CHECK_FALSE(e.retryable);  // as on Redis: a wrong CA stops the consumer instead of retrying forever
    CHECK_THAT(e.what(), Catch::Contains("certificate verify failed"));
  }
  SECTION("wrong host name") {
    std::string ci = base();
    ci.replace(ci.find("host=localhost"), 14, "host=wrong.example");
    const auto e = refusal(ci + " sslmode=verify-full sslrootcert=" + certs() + "ca.crt");
    INFO(e.what());
    CHECK_THAT(e.what(), Catch::Contains("does not match host name \"wrong.example\""));
    CHECK_FALSE(e.retryable);
  }
  SECTION("no TLS: the server takes TLS connections only") {
    const auto e = refusal(base() + " sslmode=disable");
    INFO(e.what());
    CHECK_THAT(e.what(), Catch::Contains("no encryption"));
  }
  SECTION("mutual TLS without a client certificate") {
    std::string ci = base();
    ci.replace(ci.find("user=postgres"), 13, "user=idem-app");
    const auto e = refusal(ci + " sslmode=verify-full sslrootcert=" + certs() + "ca.crt");
    INFO(e.what());
    CHECK_THAT(e.what(), Catch::Contains("certificate"));
  }
}

TEST_CASE("postgres tls: mutual TLS authenticates the role by its certificate", "[postgres][tls]") {
  std::string ci = base();
  ci.replace(ci.find("user=postgres"), 13, "user=idem-app");
  ci += " sslmode=verify-full sslrootcert=" + certs() + "ca.crt sslcert=" + certs() + "client.crt sslkey=" + certs() +
        "client.key";
  pgtest::Raw raw(ci);
  CHECK(raw.scalar("SELECT current_user") == "idem-app");
  idem::PostgresStore s(idem::PostgresOptions{.conninfo = ci},
                        idem::PostgresStoreOptions{.schema = "idem_mtls_" + pgtest::random_hex(6)});
  CHECK(s.acquire(pgtest::key("mtls"), pgtest::ap(2)).status == idem::AcquireStatus::acquired);
}

TEST_CASE("postgres tls: the password is never in a message", "[postgres][tls][secrets]") {
  const std::string secret = "pg-secret-do-not-print";
  for (const std::string& ci :
       {base() + " password=" + secret + " sslmode=verify-full sslrootcert=" + certs() + "other-ca.crt",
        "postgresql://postgres:" + secret + "@127.0.0.1:1/postgres?sslmode=require",
        base() + " password=" + secret + " sslmode=bogus"}) {
    try {
      idem::PostgresStore s(idem::PostgresOptions{.conninfo = ci}, idem::PostgresStoreOptions{.schema = "idem_test"});
      (void)s.inspect("tls-probe");
      FAIL("connected");
    } catch (const idem::error& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(secret) == std::string::npos);
    }
  }
}

// The least privileges docs/security.md gives the application's role: the schema made by a
// migration role, then USAGE on the schema and row privileges on the table, nothing else.
TEST_CASE("postgres tls: a role with the documented least privileges runs the store", "[postgres][tls][acl]") {
  const std::string schema = "idem_lp_" + pgtest::random_hex(6);
  const std::string role = "idem_rt_" + pgtest::random_hex(6);
  {
    idem::PostgresStore owner(idem::PostgresOptions{.conninfo = pgtest::conninfo()},
                              idem::PostgresStoreOptions{.schema = schema, .table = "records"});
    owner.migrate();
  }
  pgtest::Raw raw;
  raw.exec("CREATE ROLE " + role + " LOGIN");
  raw.exec("GRANT USAGE ON SCHEMA " + schema + " TO " + role);
  raw.exec("GRANT SELECT, INSERT, UPDATE, DELETE ON " + schema + ".records TO " + role);
  std::string ci = pgtest::conninfo();
  ci.replace(ci.find("user=postgres"), 13, "user=" + role);
  idem::PostgresStore app(idem::PostgresOptions{.conninfo = ci},
                          idem::PostgresStoreOptions{.schema = schema, .table = "records", .auto_migrate = false});
  idem::IdempotencyGuard guard(app, {});
  const std::string k = pgtest::key("lp");
  CHECK(guard.run(k, "p", [] { return 7; }).status == idem::Status::executed);
  CHECK(guard.run(k, "p", [] { return 8; }).status == idem::Status::duplicate);
  CHECK(app.purge_expired(100) == 0);
}
