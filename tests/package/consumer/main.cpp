// A downstream project: it only knows find_package(idem) and the public headers (the umbrellas).
#include <idem/idem.hpp>
#ifdef CONSUMER_HAS_REDIS
#include <idem/redis.hpp>
#endif
#ifdef CONSUMER_HAS_POSTGRES
#include <idem/postgres.hpp>
#endif
#ifdef CONSUMER_HAS_HTTP
#include <idem/http/endpoint.hpp>
#endif

#include <cstdio>
#include <string>

int main() {
  idem::MemoryStore store;
  idem::IdempotencyGuard guard(store);
  int effects = 0;
  auto a = guard.run("order-1", [&] { return ++effects; });
  auto b = guard.run("order-1", [&] { return ++effects; });
  std::printf("idem %s: %s then %s, effects=%d\n", idem::version_string, idem::to_string(a.status).data(),
              idem::to_string(b.status).data(), effects);
  bool ok = a.status == idem::Status::executed && b.status == idem::Status::duplicate && effects == 1;
#ifdef CONSUMER_HAS_HTTP
  idem::http::Endpoint<idem::MemoryStore> endpoint(guard);
  idem::http::Request req;
  req.method = "POST";
  req.target = "/charges";
  req.headers.emplace_back("Idempotency-Key", "\"k-1\"");
  auto charge = [&](const idem::http::Request&) { return idem::http::Response{201, {}, "charged"}; };
  const auto first = endpoint.handle(req, charge);
  const auto again = endpoint.handle(req, charge);
  std::printf("http: %d then %d (replayed: %s)\n", first.status, again.status,
              std::string(again.header("Idempotent-Replayed")).c_str());
  ok = ok && first.status == 201 && again.header("Idempotent-Replayed") == "true";
#endif
  return ok ? 0 : 1;
}
