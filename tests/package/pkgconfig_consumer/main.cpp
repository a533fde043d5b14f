// A downstream project built with make + pkg-config only (Makefile): the core, and one call into
// each compiled component it was given (-DHAS_idem_redis, ...), so each library's link line from
// its .pc file is exercised, not only its headers.
#include <idem/idem.hpp>
#ifdef HAS_idem_redis
#include <idem/redis.hpp>
#endif
#ifdef HAS_idem_postgres
#include <idem/outbox/writer.hpp>
#include <idem/postgres.hpp>
#endif
#ifdef HAS_idem_sqlite
#include <idem/sqlite.hpp>
#endif

#include <fmt/format.h>

#include <string>

int main() {
  idem::MemoryStore store;
  idem::IdempotencyGuard guard(store);
  int effects = 0;
  auto a = guard.run("order-1", [&] { return ++effects; });
  auto b = guard.run("order-1", [&] { return ++effects; });
  bool ok = a.status == idem::Status::executed && b.status == idem::Status::duplicate && effects == 1;
  // The version accessor and the string agree, and the macros are what CMake put in the .pc file.
  const idem::Version v = idem::version();
  ok = ok && fmt::format("{}.{}.{}", v.major, v.minor, v.patch) == idem::version_string &&
       v == idem::Version{IDEM_VERSION_MAJOR, IDEM_VERSION_MINOR, IDEM_VERSION_PATCH} && v >= idem::Version{0, 1, 0};
  std::string parts;
#ifdef HAS_idem_redis
  // parse_redis_url lives in libidem_redis.
  const idem::RedisOptions r = idem::parse_redis_url("redis://cache.example:6380/2");
  ok = ok && r.host == "cache.example" && r.port == 6380 && r.db == 2;
  parts += " redis";
#endif
#ifdef HAS_idem_postgres
  // outbox_message_id lives in libidem_postgres.
  const std::string id = idem::outbox_message_id("idem.idem_records", "order-1", 0);
  ok = ok && id.size() == 34 && id.substr(32) == "-0";
  parts += " postgres";
#endif
#ifdef HAS_idem_sqlite
  // The options check lives in libidem_sqlite; an empty path is refused before SQLite opens anything.
  try {
    idem::SqliteStore sq{idem::SqliteOptions{}};
    ok = false;
  } catch (const idem::invalid_options_error&) {
  }
  parts += " sqlite";
#endif
  fmt::print("pkg-config consumer, idem {}:{} {}\n", idem::version_string, parts, ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
