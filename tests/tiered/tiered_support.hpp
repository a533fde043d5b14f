#pragma once
// Test support for TieredStore: one redis-server per test process (no persistence, started on
// first use), the PostgreSQL fixture server, and the factory the contract suite instantiates.

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "idem/tiered.hpp"
#include "pg_support.hpp"
#include "redis_server.hpp"

namespace tieredtest {

using namespace std::chrono_literals;

// The redis-server every case of this process shares (a case that restarts one starts its own).
inline idem::test::RedisServer& server() {
  static idem::test::RedisServer s;
  return s;
}

inline idem::RedisOptions redis_options(const idem::test::RedisServer& s = server()) {
  idem::RedisOptions o = s.options();
  o.pool.size = 16;
  o.connect_timeout = 500ms;
  o.command_timeout = 2000ms;
  return o;
}

// A transactional-mode PostgresStore on the fixture server, in the tiered tests' own table.
inline pgtest::Config pg_options(idem::PostgresMode mode = idem::PostgresMode::transactional) {
  pgtest::Config o = pgtest::options(mode);
  o.store.table = "tiered_records";
  return o;
}

// Observer that keeps the warnings (Redis outages) and counts store errors.
class Warnings : public idem::Observer {
public:
  void on_warning(std::string_view m) noexcept override {
    std::lock_guard lock(mu_);
    messages_.emplace_back(m);
  }
  std::vector<std::string> messages() const {
    std::lock_guard lock(mu_);
    return messages_;
  }

private:
  mutable std::mutex mu_;
  std::vector<std::string> messages_;
};

// Factory of the contract suite: a TieredStore over the process's Redis and the fixture's
// PostgreSQL in transactional mode (so the guard cases run through begin()).
struct TieredFactory {
  using store_type = idem::TieredStore;
  TieredFactory() : pg_(pgtest::store(pg_options())), tiered_(redis_options(), pg_), prefix_("t" + pgtest::random_hex() + ":") {}
  store_type& store() { return tiered_; }
  std::string key(std::string_view name) { return prefix_ + std::string(name); }
  void advance(idem::millis d) { std::this_thread::sleep_for(d); }
  idem::millis short_lease() const { return idem::millis{200}; }
  int race_threads() const { return 8; }
  int race_keys() const { return 20; }
  int race_rounds() const { return 3; }

private:
  idem::PostgresStore pg_;
  idem::TieredStore tiered_;
  std::string prefix_;
};

}  // namespace tieredtest
