// The connection pool under the PostgreSQL client (src/common/pool.hpp), alone, with many threads:
// the tsan preset runs it (the PostgreSQL suites, which use the pool for real, are left out of
// tsan for its time budget). The connections are counters, so what is checked is the pool's own
// bookkeeping: never more than pool.size open, nothing leaked by a failed connect or an
// unhealthy return, a dead idle connection replaced, a full pool's wait bounded.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include "idem/core/error.hpp"
#include "pool.hpp"

namespace {

using namespace std::chrono_literals;

// What the pool's traits see, shared by the threads.
struct Server {
  std::atomic<int> opened{0};      // connect() calls that succeeded
  std::atomic<int> open_now{0};    // connections not yet destroyed
  std::atomic<int> in_use{0};      // checked out now (the callers count it)
  std::atomic<int> most_in_use{0};
  std::atomic<int> fail_connects{0};  // the next n connect() calls throw
  std::atomic<bool> kill_idle{false};  // alive() answers false
};

struct Conn {
  explicit Conn(Server& s) : server(s) { server.open_now.fetch_add(1); }
  ~Conn() { server.open_now.fetch_sub(1); }
  Conn(const Conn&) = delete;
  Conn& operator=(const Conn&) = delete;
  Server& server;
};

struct Traits {
  using connection = std::unique_ptr<Conn>;
  Server* server;
  connection connect() {
    if (server->fail_connects.load() > 0 && server->fail_connects.fetch_sub(1) > 0)
      throw idem::connection_error("test: refused", "", true);
    server->opened.fetch_add(1);
    return std::make_unique<Conn>(*server);
  }
  bool alive(connection&) noexcept { return !server->kill_idle.load(); }
  bool reusable(connection&) noexcept { return true; }
};

using Pool = idem::detail::Pool<Traits>;

idem::PoolOptions options(std::size_t size, std::chrono::milliseconds wait) {
  idem::PoolOptions o;
  o.size = size;
  o.wait = wait;
  return o;
}

void use(Server& s) {
  const int now = s.in_use.fetch_add(1) + 1;
  int most = s.most_in_use.load();
  while (now > most && !s.most_in_use.compare_exchange_weak(most, now)) {
  }
  std::this_thread::yield();
  s.in_use.fetch_sub(1);
}

struct CountingObserver final : idem::Observer {
  std::atomic<int> events{0};
  std::atomic<std::size_t> most_open{0};
  void on_pool(const idem::PoolEvent& e) noexcept override {
    events.fetch_add(1);
    std::size_t m = most_open.load();
    while (e.open > m && !most_open.compare_exchange_weak(m, e.open)) {
    }
  }
};

}  // namespace

TEST_CASE("pool: 8 threads share 3 connections, never more open, every one returned", "[pool]") {
  Server s;
  CountingObserver obs;
  Pool pool(options(3, 10s), Traits{&s}, "test server");
  pool.observe(&obs, "test");
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 500; ++i) {
        Pool::Lease lease(pool);
        use(s);
        lease.healthy();
      }
    });
  for (auto& t : threads) t.join();
  CHECK(s.most_in_use.load() <= 3);
  CHECK(s.opened.load() <= 3);
  CHECK(s.open_now.load() == s.opened.load());  // all idle in the pool, none closed
  CHECK(obs.events.load() == 8 * 500 * 2);      // a checkout and a return each
  CHECK(obs.most_open.load() <= 3);
}

TEST_CASE("pool: an unhealthy return closes the connection and frees its place", "[pool]") {
  Server s;
  Pool pool(options(2, 10s), Traits{&s}, "test server");
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 300; ++i) {
        Pool::Lease lease(pool);
        use(s);
        lease.healthy((i + t) % 3 != 0);  // every third returned broken
      }
    });
  for (auto& t : threads) t.join();
  CHECK(s.most_in_use.load() <= 2);
  CHECK(s.open_now.load() <= 2);
  CHECK(s.opened.load() > 2);  // broken ones were replaced
  // The places of the closed ones are free: two can be held at once again.
  Pool::Lease a(pool), b(pool);
  CHECK(s.open_now.load() == 2);
}

TEST_CASE("pool: a failed connect gives its place back, the next caller connects", "[pool]") {
  Server s;
  Pool pool(options(2, 10s), Traits{&s}, "test server");
  s.fail_connects = 40;
  std::atomic<int> refused{0}, served{0}, not_retryable{0};
  std::vector<std::thread> threads;
  // Counted here, checked on the main thread: Catch's assertions are not thread-safe.
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        try {
          Pool::Lease lease(pool);
          use(s);
          lease.healthy();
          served.fetch_add(1);
        } catch (const idem::connection_error& e) {
          if (!e.retryable()) not_retryable.fetch_add(1);
          refused.fetch_add(1);
        }
      }
    });
  for (auto& t : threads) t.join();
  CHECK(not_retryable.load() == 0);
  CHECK(refused.load() == 40);
  CHECK(served.load() == 4 * 200 - 40);
  CHECK(s.most_in_use.load() <= 2);
  Pool::Lease a(pool), b(pool);  // both places usable: no failed connect kept one
  CHECK(s.open_now.load() == 2);
}

TEST_CASE("pool: an idle connection found dead is replaced, never handed out", "[pool]") {
  Server s;
  Pool pool(options(2, 10s), Traits{&s}, "test server");
  {
    Pool::Lease a(pool), b(pool);
    a.healthy();
    b.healthy();
  }
  REQUIRE(s.opened.load() == 2);
  s.kill_idle = true;
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t)
    threads.emplace_back([&] {
      Pool::Lease lease(pool);
      lease.healthy();
    });
  for (auto& t : threads) t.join();
  CHECK(s.opened.load() == 4);  // both idle ones dropped, two new made
  CHECK(s.open_now.load() <= 2);
}

TEST_CASE("pool: a full pool makes a caller wait at most pool.wait, then POOL timeout, retryable", "[pool]") {
  Server s;
  Pool pool(options(1, 50ms), Traits{&s}, "test server");
  Pool::Lease held(pool);
  const auto started = std::chrono::steady_clock::now();
  try {
    Pool::Lease second(pool);
    FAIL("a second lease from a pool of one");
  } catch (const idem::timeout_error& e) {
    CHECK(e.code() == "POOL");
    CHECK(e.retryable());
    CHECK_THAT(e.what(), Catch::Contains("test server") && Catch::Contains("pool.size"));
  }
  CHECK(std::chrono::steady_clock::now() - started >= 50ms);
}

TEST_CASE("pool: a caller waiting on a full pool is served when the holder returns", "[pool]") {
  Server s;
  Pool pool2(options(1, 10s), Traits{&s}, "test server");
  auto first = std::make_unique<Pool::Lease>(pool2);
  first->healthy();
  std::atomic<bool> got{false};
  std::thread t([&] {
    Pool::Lease l(pool2);
    got = true;
  });
  std::this_thread::sleep_for(20ms);
  CHECK_FALSE(got.load());
  first.reset();
  t.join();
  CHECK(got.load());
}
