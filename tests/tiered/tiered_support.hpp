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
struct TieredFactory : pgtest::ServerFactoryBase {
  using store_type = idem::TieredStore;
  TieredFactory()
      : pgtest::ServerFactoryBase("t" + pgtest::random_hex() + ":"), pg_(pgtest::store(pg_options())),
        tiered_(redis_options(), pg_) {}
  store_type& store() { return tiered_; }

private:
  idem::PostgresStore pg_;
  idem::TieredStore tiered_;
};

}  // namespace tieredtest
