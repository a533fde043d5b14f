// http_payments: `POST /charges` made safe to retry with the Idempotency-Key header (docs/http.md).
//
//   idem_http_payments [--port 8080] [--store URL] [--lease-ms 30000] [--retention-ms 86400000]
//                      [--processing-ms 0]
//
// --store picks where the keys live: redis://host:port (lease mode), postgresql://user@host/db
// (transactional mode: the charge row and the stored response commit together, as Stripe does),
// or memory (one process only). Try it:
//
//   curl -i -X POST localhost:8080/charges -H 'Idempotency-Key: "order-1"' -d '{"amount":500}'
//
// again with the same key: the same charge id, with `Idempotent-Replayed: true`. The simulated card
// "source":"tok_declined" answers 402 (stored and replayed), "tok_processor_down" 503 (not stored:
// a retry runs again). Every run of the handler is logged on stdout.

#include <libpq-fe.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>

#include "idem/http/httplib.hpp"
#include "idem/postgres.hpp"
#include "idem/redis.hpp"

namespace {

struct Args {
  int port = 8080;
  std::string store = "memory";
  idem::millis lease{30'000}, retention{86'400'000}, processing{0};
};

[[noreturn]] void usage(int status) {
  std::fprintf(status ? stderr : stdout,
               "usage: idem_http_payments [--port N] [--store redis://...|postgresql://...|memory] [--lease-ms N]\n"
               "                          [--retention-ms N] [--processing-ms N]\n");
  std::exit(status);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") usage(0);
    if (i + 1 >= argc) usage(2);
    const char* v = argv[++i];
    if (k == "--port")
      a.port = std::atoi(v);
    else if (k == "--store")
      a.store = v;
    else if (k == "--lease-ms")
      a.lease = idem::millis{std::atoll(v)};
    else if (k == "--retention-ms")
      a.retention = idem::millis{std::atoll(v)};
    else if (k == "--processing-ms")
      a.processing = idem::millis{std::atoll(v)};
    else
      usage(2);
  }
  return a;
}

// A toy JSON reader for the two fields of the example; use your JSON library.
std::string field(const std::string& body, const std::string& name) {
  const auto at = body.find("\"" + name + "\"");
  if (at == std::string::npos) return {};
  auto v = body.find_first_not_of(" :", at + name.size() + 2);
  if (v == std::string::npos) return {};
  if (body[v] == '"') return body.substr(v + 1, body.find('"', v + 1) - v - 1);
  return body.substr(v, body.find_first_not_of("0123456789", v) - v);
}

std::string new_charge_id() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  char id[32];
  std::snprintf(id, sizeof id, "ch_%016llx", static_cast<unsigned long long>(rng()));
  return id;
}

void json(httplib::Response& res, int status, const std::string& body) {
  res.status = status;
  res.set_content(body, "application/json");
}

template <class Store>
int serve(Store& store, const Args& a) {
  // release: an answer that is not stored (a 5xx, an exception) frees the key for the retry.
  idem::IdempotencyGuard<Store> guard{store, {.lease = a.lease, .retention = a.retention}};
  idem::http::Endpoint<Store> endpoint{guard};  // 400 / 409 / 422 / replay; options in docs/http.md
  std::mutex mu;
  std::map<std::string, long> charges;  // lease-mode stores: stands in for your database

  // YOUR LOGIC: runs at most once per Idempotency-Key; what it answers is what retries get.
  auto create_charge = [&](const httplib::Request& req, httplib::Response& res, const auto& ctx) {
    const long amount = std::atol(field(req.body, "amount").c_str());
    const std::string source = field(req.body, "source");
    std::this_thread::sleep_for(a.processing);  // the card network
    if (amount <= 0) {
      json(res, 400, R"({"error":"amount must be a positive number of cents"})");
    } else if (source == "tok_declined") {
      json(res, 402, R"({"error":"card_declined"})");
    } else if (source == "tok_processor_down") {
      json(res, 503, R"({"error":"processor unavailable, retry"})");
    } else {
      const std::string id = new_charge_id();
      if constexpr (requires { ctx.tx->exec(""); }) {
        // Transactional mode: this row commits with the stored response, or neither does.
        ctx.tx->exec("INSERT INTO http_payments.charges (id, amount) VALUES ($1, $2)", id, amount);
      } else {
        std::lock_guard lock(mu);
        charges[id] = amount;
      }
      res.set_header("Location", "/charges/" + id);
      json(res, 201, R"({"id":")" + id + R"(","amount":)" + std::to_string(amount) + "}");
    }
    std::printf("handled key=%s status=%d\n", req.get_header_value("Idempotency-Key").c_str(), res.status);
    std::fflush(stdout);
  };
  httplib::Server server;
  server.set_payload_max_length(8 << 20);  // above the endpoint's own limit, which answers problem+json
  server.Post("/charges", idem::http::idempotent(endpoint, create_charge));

  const int port =
      a.port == 0 ? server.bind_to_any_port("127.0.0.1") : (server.bind_to_port("127.0.0.1", a.port) ? a.port : -1);
  if (port < 0) {
    std::fprintf(stderr, "idem_http_payments: cannot listen on 127.0.0.1:%d\n", a.port);
    return 1;
  }
  const std::string scheme = a.store.substr(0, a.store.find(':'));  // never the URL: it may hold a password
  std::printf("listening on 127.0.0.1:%d (store %s, keys kept %lld s)\n", port, scheme.c_str(),
              static_cast<long long>(a.retention.count() / 1000));
  std::fflush(stdout);
  return server.listen_after_bind() ? 0 : 1;
}

// The business table of the PostgreSQL mode (a real service has it already).
void create_tables(const std::string& conninfo) {
  PGconn* c = PQconnectdb(conninfo.c_str());
  PQsetNoticeProcessor(
      c, [](void*, const char*) {}, nullptr);
  PGresult* r = PQexec(c,
                       "SELECT pg_advisory_lock(7340); CREATE SCHEMA IF NOT EXISTS http_payments; "
                       "CREATE TABLE IF NOT EXISTS http_payments.charges (id text PRIMARY KEY, amount bigint NOT NULL, "
                       "created_at timestamptz NOT NULL DEFAULT now()); SELECT pg_advisory_unlock(7340)");
  const bool ok = PQresultStatus(r) == PGRES_TUPLES_OK;
  PQclear(r);
  const std::string error = PQerrorMessage(c);
  PQfinish(c);
  if (!ok) throw std::runtime_error("cannot create http_payments.charges: " + error);
}

}  // namespace

int main(int argc, char** argv) try {
  const Args a = parse(argc, argv);
  const std::string& url = a.store;
  if (url.rfind("redis", 0) == 0 || url.rfind("unix://", 0) == 0) {
    idem::RedisStore store{idem::parse_redis_url(url)};
    return serve(store, a);
  }
  if (url.rfind("postgres", 0) == 0) {
    create_tables(url);
    idem::PostgresStore store{{.conninfo = url, .pool = {.size = 32, .wait = idem::millis{10'000}}},
                              {.schema = "http_payments", .mode = idem::PostgresMode::transactional}};
    return serve(store, a);
  }
  if (url == "memory") {
    idem::MemoryStore store;
    return serve(store, a);
  }
  std::fprintf(stderr, "idem_http_payments: --store must be redis://..., postgresql://... or memory\n");
  return 2;
} catch (const std::exception& e) {
  std::fprintf(stderr, "idem_http_payments: %s\n", e.what());
  return 1;
}
