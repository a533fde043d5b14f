#pragma once
// Contract-suite factories for RedisStore: one redis-server per test process (started on first
// use, stopped at exit), a fresh store per case, keys under a random per-case namespace.

#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include "idem/detail/random.hpp"
#include "idem/redis.hpp"
#include "redis_server.hpp"

namespace idem::test {

inline std::string random_hex() {
  static constexpr char hex[] = "0123456789abcdef";
  std::uint64_t t = detail::random_token();
  std::string s;
  for (int i = 0; i < 16; ++i, t >>= 4) s += hex[t & 0xf];
  return s;
}

// Acquire parameters of the fault and recovery tests: a lease no test outlives, a minute's retention.
inline AcquireParams acquire_params(std::uint64_t token) {
  AcquireParams p;
  p.lease = millis{30'000};
  p.retention = millis{60'000};
  p.token = token;
  return p;
}

// The ACL user of the least-privilege setup documented in docs/redis.md.
inline const std::vector<std::string>& acl_config() {
  static const std::vector<std::string> lines{
      "user default off",
      "user idem-app on \">app secret!\" ~idem:* -@all +evalsha +script|load +get +mget +set +pttl +pexpire +time",
  };
  return lines;
}

struct RedisFactoryBase {
  std::string ns = "contract-" + random_hex() + ":";
  std::string key(std::string_view name) { return ns + std::string(name); }
  void advance(millis d) { std::this_thread::sleep_for(d); }
  [[nodiscard]] millis short_lease() const { return millis{200}; }
  // 8 threads x 200 keys x 3 rounds: thousands of real round trips, seconds even under TSan.
  [[nodiscard]] int race_threads() const { return 8; }
  [[nodiscard]] int race_keys() const { return 200; }
  [[nodiscard]] int race_rounds() const { return 3; }
};

struct RedisFactory : RedisFactoryBase {
  using store_type = RedisStore;
  static RedisServer& server() {
    static RedisServer s;
    return s;
  }
  RedisStore s{[] {
    RedisOptions o = server().options();
    o.pool.size = 16;
    return o;
  }()};
  store_type& store() { return s; }
};

struct RedisAclFactory : RedisFactoryBase {
  using store_type = RedisStore;
  static RedisServer& server() {
    static RedisServer s{acl_config()};
    return s;
  }
  RedisStore s{[] {
    RedisOptions o;
    o.url = "redis://idem-app:app%20secret%21@127.0.0.1:" + std::to_string(server().port()) + "/0";
    o.pool.size = 16;
    o.command_timeout = millis{5000};
    return o;
  }()};
  store_type& store() { return s; }
};

}  // namespace idem::test
