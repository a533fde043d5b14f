// PostgresStore's batch path (BatchStore, lease mode): acquire_many decides each key exactly as
// acquire does in one statement per chunk, a batch costs a bounded number of round trips and
// statements, answers lost mid-batch are settled as the same holder, and transactional mode runs
// batches item by item. The contract suite's batch cases run in postgres_contract_test.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "idem/postgres.hpp"
#include "pg_support.hpp"
#include "support/tcp_proxy.hpp"

using namespace std::chrono_literals;
using idem::AcquireRequest;
using idem::AcquireStatus;
using idem::BatchItem;
using idem::State;
using idem::Status;
using idem::WriteStatus;
using pgtest::ap;
using pgtest::key;

namespace {

// A loopback TCP proxy that delays every chunk by `one_way` in each direction without
// serialising them (each is due at its arrival + one_way): a network with that latency, so the
// time a call takes counts its round trips.
class DelayProxy {
public:
  DelayProxy(int upstream, std::chrono::milliseconds one_way) : upstream_(upstream), delay_(one_way) {
    listen_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a = loopback(0);
    socklen_t len = sizeof a;
    REQUIRE(listen_ >= 0);
    REQUIRE(::bind(listen_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::listen(listen_, 16) == 0);
    REQUIRE(::getsockname(listen_, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { loop(); });
  }
  ~DelayProxy() {
    stop_ = true;
    thread_.join();
    for (Pair& p : pairs_) {
      ::close(p.fd[0]);
      ::close(p.fd[1]);
    }
    ::close(listen_);
  }
  DelayProxy(const DelayProxy&) = delete;
  DelayProxy& operator=(const DelayProxy&) = delete;
  [[nodiscard]] int port() const { return port_; }

private:
  using clock = std::chrono::steady_clock;
  struct Chunk {
    clock::time_point due;
    std::string bytes;
  };
  struct Pair {
    int fd[2];                 // client, server
    std::deque<Chunk> out[2];  // bytes due to be written to fd[i]
    bool open = true;
  };
  static sockaddr_in loopback(int port) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    return a;
  }
  static bool send_all(int fd, const std::string& s) {
    std::size_t at = 0;
    while (at < s.size()) {
      const ssize_t w = ::send(fd, s.data() + at, s.size() - at, MSG_NOSIGNAL);
      if (w <= 0) return false;
      at += static_cast<std::size_t>(w);
    }
    return true;
  }
  void loop() {
    std::vector<char> buf(65536);
    while (!stop_) {
      const auto now = clock::now();
      auto wait = 20ms;
      for (Pair& p : pairs_)
        for (auto& q : p.out)
          if (!q.empty())
            wait = std::min(wait, std::max(0ms, std::chrono::duration_cast<std::chrono::milliseconds>(q.front().due - now)));
      std::vector<pollfd> fds{{listen_, POLLIN, 0}};
      for (const Pair& p : pairs_) {
        fds.push_back({p.fd[0], POLLIN, 0});
        fds.push_back({p.fd[1], POLLIN, 0});
      }
      ::poll(fds.data(), fds.size(), static_cast<int>(wait.count()) + 1);
      for (std::size_t i = 0; i < pairs_.size(); ++i) {
        Pair& p = pairs_[i];
        for (int side = 0; side < 2; ++side) {
          if (!p.open || fds[1 + 2 * i + static_cast<std::size_t>(side)].revents == 0) continue;
          const ssize_t n = ::recv(p.fd[side], buf.data(), buf.size(), 0);
          if (n <= 0) {
            p.open = false;
            continue;
          }
          p.out[1 - side].push_back({clock::now() + delay_, std::string(buf.data(), static_cast<std::size_t>(n))});
        }
        const auto t = clock::now();
        for (int side = 0; side < 2 && p.open; ++side)
          while (!p.out[side].empty() && p.out[side].front().due <= t) {
            if (!send_all(p.fd[side], p.out[side].front().bytes)) p.open = false;
            p.out[side].pop_front();
          }
      }
      std::erase_if(pairs_, [](Pair& p) {
        if (p.open) return false;
        ::close(p.fd[0]);
        ::close(p.fd[1]);
        return true;
      });
      if (fds[0].revents != 0) {
        const int c = ::accept4(listen_, nullptr, nullptr, SOCK_CLOEXEC);
        if (c < 0) continue;
        const int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        sockaddr_in a = loopback(upstream_);
        if (s < 0 || ::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
          ::close(c);
          if (s >= 0) ::close(s);
          continue;
        }
        const int one = 1;  // forward each chunk when it is due (no Nagle delay on top)
        ::setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        ::setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        pairs_.push_back(Pair{{c, s}, {}, true});
      }
    }
  }

  int upstream_;
  std::chrono::milliseconds delay_;
  int listen_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::vector<Pair> pairs_;  // the proxy thread's alone (and the destructor's, after join)
  std::thread thread_;
};

std::string conninfo_at(int port) {
  return "host=127.0.0.1 port=" + std::to_string(port) + " user=postgres dbname=postgres";
}

// A lease-mode store whose sessions go through a TcpProxy, already set up (migrated, statements
// prepared), so the next request is the one a test means to cut. One session: a batch's writer
// holds it, and a resend needs the dead one dropped first.
// With a larger pool, a batch's completions spread over up to batch_sessions of its sessions.
struct Proxied {
  explicit Proxied(std::size_t pool = 1) : store(make(pool)) {}
  idem::test::TcpProxy proxy{pgtest::port()};
  idem::PostgresStore store;

  idem::PostgresStore make(std::size_t pool) {
    auto o = pgtest::options();
    o.client.conninfo = conninfo_at(proxy.port());
    o.client.pool.size = pool;
    o.client.pool.wait = 5s;
    idem::PostgresStore s(o.client, o.store);
    REQUIRE_FALSE(s.inspect(key("warm-up")).has_value());
    return s;
  }
};

std::vector<AcquireRequest> requests(const std::vector<std::string>& keys, std::uint64_t first_token,
                                     idem::millis lease = 30s) {
  std::vector<AcquireRequest> r;
  for (std::size_t i = 0; i < keys.size(); ++i) r.push_back({keys[i], ap(first_token + i, lease)});
  return r;
}

std::vector<std::string> fresh_keys(const std::string& name, int n) {
  const std::string prefix = key(name) + ":";
  std::vector<std::string> keys;
  for (int i = 0; i < n; ++i) keys.push_back(prefix + std::to_string(i));
  return keys;
}

// The key's claim lock id (docs/postgres.md, "How a claim locks"), computed by the server.
std::string claim_lock_sql(const idem::PostgresStore& s, const std::string& k) {
  return "('x' || substr(encode(sha256(convert_to('" + s.qualified_table() + "', 'UTF8') || '\\x00'::bytea || "
         "convert_to('" + k + "', 'UTF8')), 'hex'), 1, 16))::bit(64)::bigint";
}

}  // namespace

TEST_CASE("postgres batch: acquire_many decides every kind of key as acquire does, in request order",
          "[postgres][batch]") {
  idem::PostgresStore s = pgtest::store();
  const auto fresh = key("fresh"), held = key("held"), done = key("done"), failed = key("failed"),
             mm = key("mm"), lapsed = key("lapsed"), retry = key("retry");
  REQUIRE(s.acquire(held, ap(1)).status == AcquireStatus::acquired);
  auto d = s.acquire(done, ap(2));
  REQUIRE(s.complete(done, d.holder, "result", 60s) == WriteStatus::ok);
  auto f = s.acquire(failed, ap(3));
  REQUIRE(s.fail(failed, f.holder, {.error = "bad", .permanent = true, .retention = 60s}) == WriteStatus::ok);
  auto fp = ap(4);
  fp.fingerprint = "aaaa";
  REQUIRE(s.acquire(mm, fp).status == AcquireStatus::acquired);
  REQUIRE(s.acquire(lapsed, ap(5, 50ms)).status == AcquireStatus::acquired);
  auto r = s.acquire(retry, ap(6));
  REQUIRE(s.fail(retry, r.holder, {.error = "again", .release = true, .retention = 60s}) == WriteStatus::ok);
  std::this_thread::sleep_for(120ms);

  std::vector<AcquireRequest> reqs{{fresh, ap(10)},  {held, ap(11)},   {done, ap(12)}, {failed, ap(13)},
                                   {mm, ap(14)},     {lapsed, ap(15)}, {retry, ap(16)}, {fresh, ap(17)}};
  reqs[4].params.fingerprint = "bbbb";
  auto out = s.acquire_many(reqs);
  REQUIRE(out.size() == reqs.size());
  CHECK(out[0].status == AcquireStatus::acquired);
  CHECK(out[0].holder == idem::Holder{1, 10});
  CHECK(out[0].attempts == 1);
  CHECK(out[1].status == AcquireStatus::in_flight);
  CHECK(out[1].retry_after > 25s);
  CHECK(out[2].status == AcquireStatus::duplicate);
  CHECK(out[2].payload == "result");
  CHECK(out[3].status == AcquireStatus::previously_failed);
  CHECK(out[3].payload == "bad");
  CHECK(out[4].status == AcquireStatus::mismatch);
  CHECK(out[5].status == AcquireStatus::acquired);
  CHECK(out[5].takeover);
  CHECK(out[5].holder == idem::Holder{2, 15});
  CHECK(out[6].status == AcquireStatus::acquired);
  CHECK_FALSE(out[6].takeover);
  CHECK(out[6].holder == idem::Holder{2, 16});
  CHECK(out[6].attempts == 2);
  // The same key twice: decided as two acquires in a row (the second finds the first's lease).
  CHECK(out[7].status == AcquireStatus::in_flight);
  auto rec = s.inspect(fresh);
  REQUIRE(rec);
  CHECK(rec->holder == idem::Holder{1, 10});
  CHECK(s.acquire_many({}).empty());
}

TEST_CASE("postgres batch: acquire_many of 300 keys (three statements in one pipeline) answers in order",
          "[postgres][batch]") {
  idem::PostgresStore s = pgtest::store();
  const auto keys = fresh_keys("many", 300);
  auto out = s.acquire_many(requests(keys, 1000));
  REQUIRE(out.size() == keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    CHECK(out[i].status == AcquireStatus::acquired);
    CHECK(out[i].holder == idem::Holder{1, 1000 + i});
  }
  for (std::size_t i = 0; i < keys.size(); i += 37) CHECK(s.inspect(keys[i])->holder.token == 1000 + i);
  auto again = s.acquire_many(requests(keys, 5000));
  for (const auto& a : again) CHECK(a.status == AcquireStatus::in_flight);
}

TEST_CASE("postgres batch: a row another transaction locks, and a claim lock another holds, answer in_flight",
          "[postgres][batch]") {
  for (auto wait : {idem::PostgresClaimWait::none, idem::PostgresClaimWait::bounded}) {
    INFO("claim_wait " << (wait == idem::PostgresClaimWait::none ? "none" : "bounded"));
    auto o = pgtest::options();
    o.store.claim_wait = wait;
    idem::PostgresStore s = pgtest::store(o);
    const auto locked = key("locked"), busy = key("busy"), dup = key("dup");
    auto keys = fresh_keys("around", 4);
    // A lapsed lease (the batch would take it over) whose row another transaction locks.
    REQUIRE(s.acquire(locked, ap(1, 50ms)).status == AcquireStatus::acquired);
    auto d = s.acquire(dup, ap(2));
    REQUIRE(s.complete(dup, d.holder, "r", 60s) == WriteStatus::ok);
    std::this_thread::sleep_for(100ms);
    pgtest::Raw raw;
    raw.exec("BEGIN");
    raw.exec("SELECT 1 FROM " + s.qualified_table() + " WHERE key = convert_to('" + locked + "', 'UTF8') FOR UPDATE");
    if (wait == idem::PostgresClaimWait::none) raw.exec("SELECT pg_advisory_xact_lock(" + claim_lock_sql(s, busy) + ")");
    std::vector<AcquireRequest> reqs{{keys[0], ap(10)}, {locked, ap(11)}, {keys[1], ap(12)}, {busy, ap(13)},
                                     {dup, ap(14)},     {keys[2], ap(15)}};
    const auto t0 = std::chrono::steady_clock::now();
    auto out = s.acquire_many(reqs);
    const auto took = std::chrono::steady_clock::now() - t0;
    raw.exec("ROLLBACK");
    CHECK(out[0].status == AcquireStatus::acquired);
    CHECK(out[1].status == AcquireStatus::in_flight);  // as acquire answers a 55P03
    CHECK(out[1].retry_after == 30s);
    CHECK(out[2].status == AcquireStatus::acquired);
    if (wait == idem::PostgresClaimWait::none) {
      CHECK(out[3].status == AcquireStatus::in_flight);  // its claim lock is held: nothing inserted
      CHECK(out[3].retry_after == 30s);
      CHECK_FALSE(s.inspect(busy).has_value());
      CHECK(took < 5s);  // nothing waited
    } else {
      CHECK(out[3].status == AcquireStatus::acquired);  // no claim lock in bounded mode
    }
    CHECK(out[4].status == AcquireStatus::duplicate);
    CHECK(out[4].payload == "r");
    CHECK(out[5].status == AcquireStatus::acquired);
    // The locked key is free again: the next batch takes it over.
    auto next = s.acquire_many(std::vector<AcquireRequest>{{locked, ap(20)}});
    CHECK(next[0].status == AcquireStatus::acquired);
    CHECK(next[0].takeover);
  }
}

TEST_CASE("postgres batch: a batch of 100 new keys costs one acquire statement and about two round trips",
          "[postgres][batch]") {
  // 20 ms each way: one round trip is 40 ms, the 200 of an item-by-item batch would be 8 s.
  constexpr auto one_way = 20ms;
  DelayProxy proxy(pgtest::port(), one_way);
  auto o = pgtest::options();
  o.client.conninfo = conninfo_at(proxy.port());
  o.client.pool.size = 2;
  o.store.table = "batch_cost_" + pgtest::random_hex(8);  // statements of its own in pg_stat_statements
  idem::PostgresStore s(o.client, o.store);
  idem::IdempotencyGuard g(s, {.lease = 30s, .retention = 600s});
  // Prepared sessions: a batch opens its extra completion sessions (batch_sessions, here as many
  // as the pool of 2 has) the first time, each several round trips through this proxy; the pool
  // keeps them for the batches after.
  const auto warm = fresh_keys("warm-up", 2);
  REQUIRE(g.run_batch(std::vector<BatchItem>{{warm[0], ""}, {warm[1], ""}}, [](const BatchItem&) { return 0; }).executed() == 2);

  pgtest::Raw raw;
  const bool counted = raw.scalar("SELECT count(*) FROM pg_available_extensions WHERE name = 'pg_stat_statements'") == "1" &&
                       raw.scalar("SELECT current_setting('shared_preload_libraries')").find("pg_stat_statements") !=
                           std::string::npos;
  const std::string table = o.store.table;
  auto calls = [&](const std::string& like, const std::string& unlike = "") {
    std::string q = "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements WHERE query LIKE '%" + table + "%' AND query LIKE '" + like + "'";
    if (!unlike.empty()) q += " AND query NOT LIKE '" + unlike + "'";
    return std::stol(raw.scalar(q));
  };
  long many0 = 0, single0 = 0, complete0 = 0, all0 = 0;
  if (counted) {
    raw.exec("CREATE EXTENSION IF NOT EXISTS pg_stat_statements");
    many0 = calls("%unnest(%");
    single0 = calls("%INSERT INTO%", "%unnest(%");
    complete0 = calls("UPDATE%result = $4%");
    all0 = calls("%");
  } else {
    WARN("pg_stat_statements is not loaded: statements not counted");
  }

  const auto keys = fresh_keys("cost", 100);
  std::vector<BatchItem> items;
  for (const auto& k : keys) items.push_back({k, ""});
  int ran = 0;
  const auto t0 = std::chrono::steady_clock::now();
  auto r = g.run_batch(items, [&](const BatchItem&) { return ++ran; });
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
  CHECK(r.executed() == 100);
  const double rtts = static_cast<double>(took.count()) / static_cast<double>((2 * one_way).count());
  WARN("run_batch of 100 new keys through a 40 ms round trip: " << took.count() << " ms = " << rtts << " round trips");
  // The acquisitions take one round trip, the completions' answers one more after the last
  // handler; a generous bound for a loaded machine, far below the 200 of one call per item.
  CHECK(rtts < 10);
  if (counted) {
    CHECK(calls("%unnest(%") - many0 == 1);                  // every acquisition in one statement
    CHECK(calls("%INSERT INTO%", "%unnest(%") - single0 == 0);  // no single acquire
    CHECK(calls("UPDATE%result = $4%") - complete0 == 100);    // one completion each, each its own commit
    CHECK(calls("%") - all0 == 101);
  }
  for (std::size_t i = 0; i < keys.size(); i += 9) CHECK(s.inspect(keys[i])->state == State::completed);
}

TEST_CASE("postgres batch: an acquire_many whose reply is lost answers acquired with the same holders",
          "[postgres][batch][fault]") {
  Proxied p;
  const auto other = key("other");
  REQUIRE(p.store.acquire(other, ap(1)).status == AcquireStatus::acquired);
  auto keys = fresh_keys("lost-acquire", 5);
  keys.push_back(other);
  p.proxy.cut_next_reply();
  auto out = p.store.acquire_many(requests(keys, 100));
  CHECK(p.proxy.cuts() == 1);
  for (std::size_t i = 0; i + 1 < keys.size(); ++i) {
    CHECK(out[i].status == AcquireStatus::acquired);  // not in_flight: the live lease is this holder's
    CHECK(out[i].holder == idem::Holder{1, 100 + i});
  }
  CHECK(out.back().status == AcquireStatus::in_flight);  // another holder's is still in flight
}

TEST_CASE("postgres batch: a completion whose answer is lost mid-batch is settled as the same holder",
          "[postgres][batch][fault]") {
  const std::size_t pool = GENERATE(1, 4);  // completions on one session, or over four
  INFO("pool " << pool);
  Proxied p(pool);
  idem::IdempotencyGuard g(p.store, {.lease = 30s, .retention = 600s});
  const auto keys = fresh_keys("lost-complete", 10);
  std::vector<BatchItem> items;
  for (const auto& k : keys) items.push_back({k, ""});
  std::map<std::string, int> runs;
  auto handler = [&](const BatchItem& it) {
    const int n = ++runs[std::string(it.key)];
    if (it.key == keys[4]) {
      std::this_thread::sleep_for(50ms);  // the earlier answers are through
      p.proxy.cut_next_reply();           // this item's completion runs; its answer is lost
    }
    return std::string(it.key) + "#" + std::to_string(n);
  };
  auto r = g.run_batch(items, handler);
  CHECK(p.proxy.cuts() == 1);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    INFO("item " << i);
    CHECK_FALSE(r.errors[i]);
    CHECK(r.outcomes[i].status == Status::executed);  // not lease_lost
    auto rec = p.store.inspect(keys[i]);
    REQUIRE(rec);
    CHECK(rec->state == State::completed);
    CHECK(rec->result == idem::codec<std::string>::encode(keys[i] + "#1"));
  }
  // Redelivered: every item is a duplicate, no handler runs twice.
  auto again = g.run_batch(items, handler);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    CHECK(again.outcomes[i].status == Status::duplicate);
    CHECK(again.outcomes[i].value == keys[i] + "#1");
  }
  for (const auto& [k, n] : runs) CHECK(n == 1);
}

TEST_CASE("postgres batch: completions that cannot be settled are reported, never acked",
          "[postgres][batch][fault]") {
  Proxied p;
  idem::IdempotencyGuard g(p.store, {.lease = 30s, .retention = 600s});
  const auto keys = fresh_keys("unsettled", 4);
  std::vector<BatchItem> items;
  for (const auto& k : keys) items.push_back({k, ""});
  auto r = g.run_batch(items, [&](const BatchItem& it) {
    if (it.key == keys[3]) {
      std::this_thread::sleep_for(50ms);
      p.proxy.arm(idem::test::TcpProxy::Action::cut, 0, {}, true);  // and no new session after
    }
    return 1;
  });
  p.proxy.refuse(false);
  // finish() could not settle the last write: every completion of the batch is reported (the
  // consumer redelivers; the records that were written answer duplicate then).
  for (std::size_t i = 0; i < keys.size(); ++i) {
    REQUIRE(r.errors[i]);
    CHECK(r.action(i) == idem::BrokerAction::requeue);
  }
  CHECK_THROWS_AS(std::rethrow_exception(r.errors[3]), idem::outcome_unknown_error);
  auto rec = p.store.inspect(keys[3]);
  REQUIRE(rec);
  CHECK(rec->state == State::completed);  // the server ran it: inspect tells
  int ran = 0;
  auto again = g.run_batch(items, [&](const BatchItem&) { return ++ran; });
  CHECK(ran == 0);
  for (const auto& o : again.outcomes) CHECK(o.status == Status::duplicate);
}

TEST_CASE("postgres batch: completions spread over batch_sessions sessions, taken only when the pool has them",
          "[postgres][batch]") {
  // Sessions this store opened, by a name of its own in pg_stat_activity (the pool keeps them).
  auto sessions_after_batch = [](std::size_t pool, std::size_t batch_sessions) {
    const std::string app = "lanes_" + pgtest::random_hex(8);
    auto o = pgtest::options();
    o.client.conninfo = conninfo_at(pgtest::port()) + " application_name=" + app;
    o.client.pool.size = pool;
    o.store.batch_sessions = batch_sessions;
    idem::PostgresStore s(o.client, o.store);
    idem::IdempotencyGuard g(s, {.lease = 30s, .retention = 600s});
    const auto keys = fresh_keys("lanes", 20);
    std::vector<BatchItem> items;
    for (const auto& k : keys) items.push_back({k, ""});
    auto r = g.run_batch(items, [](const BatchItem&) { return 1; });
    CHECK(r.executed() == 20);
    for (const auto& k : keys) CHECK(s.inspect(k)->state == State::completed);
    pgtest::Raw raw;
    return std::stoul(raw.scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = '" + app + "'"));
  };
  // One session acquires, then carries the first completion; three more carry the rest.
  CHECK(sessions_after_batch(8, 4) == 4);
  CHECK(sessions_after_batch(8, 1) == 1);
  CHECK(sessions_after_batch(2, 4) == 2);  // the pool's limit, not waited for past it
  // Refused at construction, naming the option.
  for (std::size_t bad : {std::size_t{0}, std::size_t{65}}) {
    auto o = pgtest::options();
    o.store.batch_sessions = bad;
    auto e = pgtest::capture<idem::invalid_options_error>([&] { idem::PostgresStore(o.client, o.store); });
    CHECK(std::string(e.what()).find("batch_sessions") != std::string::npos);
  }
}

TEST_CASE("postgres batch: 4 consumers batch the same keys: each key runs once", "[postgres][batch]") {
  idem::PostgresStore s = pgtest::store();
  const auto keys = fresh_keys("race", 60);
  std::atomic<int> total{0}, bad{0};
  std::vector<std::thread> threads;
  std::mutex mu;
  std::map<std::string, int> runs;  // Catch2's assertions are for the main thread: checked after the join
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      idem::IdempotencyGuard g(s, {.lease = 30s, .retention = 600s, .wait_for_in_flight = 10s});
      std::vector<std::string> mine = keys;
      std::shuffle(mine.begin(), mine.end(), std::mt19937(static_cast<unsigned>(t)));
      for (std::size_t at = 0; at < mine.size(); at += 20) {
        std::vector<BatchItem> items;
        for (std::size_t i = at; i < at + 20; ++i) items.push_back({mine[i], ""});
        auto r = g.run_batch(items, [&](const BatchItem& it) {
          std::lock_guard lk(mu);
          ++runs[std::string(it.key)];
          return ++total;
        });
        for (std::size_t i = 0; i < items.size(); ++i)
          if (r.errors[i] || (r.outcomes[i].status != Status::executed && r.outcomes[i].status != Status::duplicate))
            ++bad;
      }
    });
  for (auto& th : threads) th.join();
  CHECK(bad == 0);
  CHECK(total == 60);
  CHECK(runs.size() == 60);
  for (const auto& [k, n] : runs) CHECK(n == 1);
}

TEST_CASE("postgres batch: transactional mode runs a batch item by item, each in its own transaction",
          "[postgres][batch][tx]") {
  pgtest::Raw raw;
  const std::string t = "batch_tx_" + pgtest::random_hex(8);
  raw.exec("CREATE TABLE " + t + " (id text PRIMARY KEY)");
  idem::PostgresStore s = pgtest::store(idem::PostgresMode::transactional);
  idem::IdempotencyGuard g(s, {.lease = 30s, .retention = 600s});
  const auto keys = fresh_keys("tx", 3);
  std::vector<BatchItem> items;
  for (const auto& k : keys) items.push_back({k, ""});
  std::vector<int> pids;
  auto r = g.run_batch(items, [&](const BatchItem& it, const auto& ctx) {
    REQUIRE(ctx.tx != nullptr);  // the claiming transaction: not the batch path
    pids.push_back(ctx.tx->backend_pid());
    ctx.tx->exec("INSERT INTO " + t + " (id) VALUES ($1)", std::string(it.key));
    if (it.key == keys[1]) throw std::runtime_error("rolled back");
    return 1;
  });
  CHECK(r.outcomes[0].status == Status::executed);
  CHECK(r.errors[1]);
  CHECK(r.outcomes[2].status == Status::executed);
  // Items 0 and 2 committed with their records; item 1's write was rolled back with its claim.
  CHECK(raw.scalar("SELECT count(*) FROM " + t) == "2");
  CHECK(raw.scalar("SELECT count(*) FROM " + t + " WHERE id = '" + keys[1] + "'") == "0");
  CHECK(s.inspect(keys[0])->state == State::completed);
  CHECK(s.inspect(keys[2])->state == State::completed);
  raw.exec("DROP TABLE " + t);
}
