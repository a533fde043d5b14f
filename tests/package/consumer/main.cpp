// A downstream project: it only knows find_package(idem) and the public headers (the umbrellas).
#include <idem/idem.hpp>
#ifdef CONSUMER_HAS_REDIS
#include <idem/redis.hpp>
#endif
#ifdef CONSUMER_HAS_POSTGRES
#include <idem/postgres.hpp>
#endif

#include <cstdio>

int main() {
  idem::MemoryStore store;
  idem::IdempotencyGuard guard(store);
  int effects = 0;
  auto a = guard.run("order-1", [&] { return ++effects; });
  auto b = guard.run("order-1", [&] { return ++effects; });
  std::printf("idem %s: %s then %s, effects=%d\n", idem::version_string, idem::to_string(a.status).data(),
              idem::to_string(b.status).data(), effects);
  return a.status == idem::Status::executed && b.status == idem::Status::duplicate && effects == 1 ? 0 : 1;
}
