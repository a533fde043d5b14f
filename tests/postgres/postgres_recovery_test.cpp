// PostgresStore (lease mode) when a reply is lost after the server ran the request (issue 11
// point 2): a proxy between the store and the server drops the answer and closes the connection;
// the store asks once more as the same holder on a fresh session and gets the answer the lost
// reply carried: no false in_flight or lease_lost, no second write, no re-run of the handler.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "idem/idem.hpp"
#include "idem/postgres.hpp"
#include "pg_support.hpp"
#include "support/tcp_proxy.hpp"

using namespace std::chrono_literals;
using idem::AcquireStatus;
using idem::State;
using idem::WriteStatus;
using pgtest::ap;
using pgtest::key;

namespace {

// A lease-mode store whose one session goes through a proxy, already set up (migrated, its
// statements prepared), so the next request on it is the one a test means to cut.
struct Proxied {
  explicit Proxied(idem::PostgresMode mode = idem::PostgresMode::lease, idem::millis settle_wait = 2s)
      : store(make(mode, settle_wait)) {}
  idem::test::TcpProxy proxy{pgtest::port()};
  idem::PostgresStore store;

  idem::PostgresStore make(idem::PostgresMode mode, idem::millis settle_wait) {
    auto o = pgtest::options(mode);
    o.client.conninfo = "host=127.0.0.1 port=" + std::to_string(proxy.port()) + " user=postgres dbname=postgres";
    o.client.pool.size = 1;
    o.client.pool.wait = 5s;
    o.client.settle_wait = settle_wait;
    idem::PostgresStore s(o.client, o.store);
    REQUIRE_FALSE(s.inspect(key("warm-up")).has_value());
    return s;
  }
};

}  // namespace

TEST_CASE("postgres recovery: an acquire whose reply is lost answers acquired with the same fence",
          "[postgres][fault]") {
  Proxied p;
  const auto k = key("acquire");
  p.proxy.cut_next_reply();
  auto a = p.store.acquire(k, ap(7));
  CHECK(p.proxy.cuts() == 1);
  REQUIRE(a.status == AcquireStatus::acquired);  // not in_flight: the live lease is this holder's
  CHECK(a.holder == idem::Holder{1, 7});
  CHECK(a.attempts == 1);
  // A takeover's lost reply too: the retry finds the holder's own row, fence 2, nothing written twice.
  const auto k2 = key("takeover");
  REQUIRE(p.store.acquire(k2, ap(1, 50ms)).status == AcquireStatus::acquired);
  std::this_thread::sleep_for(120ms);
  p.proxy.cut_next_reply();
  auto t = p.store.acquire(k2, ap(2));
  CHECK(p.proxy.cuts() == 2);
  REQUIRE(t.status == AcquireStatus::acquired);
  CHECK(t.holder == idem::Holder{2, 2});
  auto rec = p.store.inspect(k2);
  REQUIRE(rec);
  CHECK(rec->attempts == 2);
  // Another holder's live lease is still in flight for everybody else.
  CHECK(p.store.acquire(k2, ap(3)).status == AcquireStatus::in_flight);
}

TEST_CASE("postgres recovery: complete, complete_unavailable and fail whose reply is lost answer ok",
          "[postgres][fault]") {
  Proxied p;
  const auto k = key("complete");
  auto a = p.store.acquire(k, ap(11));
  REQUIRE(a.status == AcquireStatus::acquired);
  p.proxy.cut_next_reply();
  CHECK(p.store.complete(k, a.holder, "done", 60s) == WriteStatus::ok);  // not lease_lost
  CHECK(p.proxy.cuts() == 1);
  auto rec = p.store.inspect(k);
  REQUIRE(rec);
  CHECK(rec->state == State::completed);
  CHECK(rec->result == "done");
  // The recognition is for the lost reply only: a second complete of the same holder is still refused.
  CHECK(p.store.complete(k, a.holder, "again", 60s) == WriteStatus::lease_lost);

  const auto ku = key("unavailable");
  auto u = p.store.acquire(ku, ap(12));
  p.proxy.cut_next_reply();
  CHECK(p.store.complete_unavailable(ku, u.holder, "too large", 60s) == WriteStatus::ok);
  auto d = p.store.acquire(ku, ap(13));
  CHECK(d.status == AcquireStatus::duplicate);
  CHECK(d.result_unavailable);
  CHECK(d.payload == "too large");

  for (bool permanent : {false, true}) {
    const auto kf = key(permanent ? "fail-permanent" : "fail-backoff");
    auto f = p.store.acquire(kf, ap(14));
    idem::FailParams fp;
    fp.error = "boom";
    fp.permanent = permanent;
    fp.backoff = 30s;
    p.proxy.cut_next_reply();
    CHECK(p.store.fail(kf, f.holder, fp) == WriteStatus::ok);
    auto fr = p.store.inspect(kf);
    REQUIRE(fr);
    CHECK(fr->state == State::failed);
    CHECK(fr->permanent == permanent);
    CHECK(fr->error == "boom");
  }
  CHECK(p.proxy.cuts() == 4);
}

TEST_CASE("postgres recovery: the guard runs the handler once when the acquire's and the complete's replies are lost",
          "[postgres][fault]") {
  Proxied p;
  idem::IdempotencyGuard g(p.store);
  const auto k = key("guard");
  int ran = 0;
  p.proxy.cut_next_reply();  // the acquire's reply
  auto out = g.run(k, [&](const idem::Context&) {
    ++ran;
    p.proxy.cut_next_reply();  // the complete's reply
    return std::string("paid");
  });
  CHECK(p.proxy.cuts() == 2);
  CHECK(out.status == idem::Status::executed);
  auto again = g.run(k, [&](const idem::Context&) {
    ++ran;
    return std::string("paid twice");
  });
  CHECK(again.status == idem::Status::duplicate);
  CHECK(again.value == "paid");
  CHECK(ran == 1);
}

TEST_CASE("postgres recovery: a session that dies as a call starts on it is replaced and the call sent again",
          "[postgres][fault]") {
  Proxied p;
  const auto k = key("dead-session");
  p.proxy.cut_next_request();
  auto a = p.store.acquire(k, ap(31));
  REQUIRE(a.status == AcquireStatus::acquired);
  p.proxy.cut_next_request();
  CHECK(p.store.extend(k, a.holder, 30s) == WriteStatus::ok);
  p.proxy.cut_next_request();
  CHECK(p.store.complete(k, a.holder, "once", 60s) == WriteStatus::ok);
  p.proxy.cut_next_request();
  auto rec = p.store.inspect(k);
  CHECK(p.proxy.cuts() == 4);
  REQUIRE(rec);
  CHECK(rec->result == "once");
  CHECK(rec->attempts == 1);
}

TEST_CASE("postgres recovery: a transactional claim whose session dies as it starts is sent again",
          "[postgres][fault][tx]") {
  Proxied p(idem::PostgresMode::transactional);
  const auto k = key("tx-dead-session");
  p.proxy.cut_next_request();
  auto tx = p.store.begin(k, ap(41));
  CHECK(p.proxy.cuts() == 1);
  REQUIRE(tx.decision().status == AcquireStatus::acquired);
  CHECK(tx.decision().holder == idem::Holder{1, 41});
  CHECK(tx.commit("tx", 60s) == WriteStatus::ok);
  CHECK(p.store.acquire(k, ap(42)).payload == "tx");
}

TEST_CASE("postgres recovery: a lost reply that cannot be asked again is outcome_unknown_error",
          "[postgres][fault]") {
  Proxied p(idem::PostgresMode::lease, 300ms);
  const auto k = key("unknown");
  auto a = p.store.acquire(k, ap(21));
  p.proxy.refuse(true);  // the second session cannot be opened
  p.proxy.cut_next_reply();
  auto e = pgtest::capture<idem::outcome_unknown_error>([&] { (void)p.store.complete(k, a.holder, "r", 60s); });
  CHECK_FALSE(e.retryable());
  CHECK(std::string(e.what()).find("outcome is unknown") != std::string::npos);
  p.proxy.refuse(false);
  // The server did run it: inspect tells, and a redelivery is a duplicate.
  auto rec = p.store.inspect(k);
  REQUIRE(rec);
  CHECK(rec->state == State::completed);
  CHECK(p.store.acquire(k, ap(22)).status == AcquireStatus::duplicate);
  // A read has no outcome to doubt: it fails as a plain, retryable connection error.
  p.proxy.refuse(true);
  p.proxy.cut_next_reply();
  bool unknown = false, retryable = false;
  try {
    (void)p.store.inspect(k);
  } catch (const idem::outcome_unknown_error&) {
    unknown = true;
  } catch (const idem::connection_error& ce) {
    retryable = ce.retryable();
  }
  CHECK_FALSE(unknown);
  CHECK(retryable);
}

TEST_CASE("postgres recovery: a lost reply is asked again until a server answers, within settle_wait",
          "[postgres][fault]") {
  Proxied p;
  const auto k = key("settle-later");
  auto a = p.store.acquire(k, ap(51));
  p.proxy.refuse(true);  // no session for a while, as during a failover
  p.proxy.cut_next_reply();
  std::thread opener([&] {
    std::this_thread::sleep_for(400ms);
    p.proxy.refuse(false);
  });
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(p.store.complete(k, a.holder, "late", 60s) == WriteStatus::ok);
  const auto waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  opener.join();
  std::printf("lease-mode complete settled after %.3f s\n", waited);
  CHECK(waited >= 0.35);
  CHECK(p.store.inspect(k)->result == "late");
}

TEST_CASE("postgres recovery: a COMMIT whose answer is lost is settled by reading its transaction",
          "[postgres][fault][tx]") {
  Proxied p(idem::PostgresMode::transactional);
  const auto k = key("tx-settle");
  auto tx = p.store.begin(k, ap(61));
  REQUIRE(tx.decision().status == AcquireStatus::acquired);
  p.proxy.cut_next_reply();  // the answer of tx_complete + COMMIT: the server committed
  CHECK(tx.commit("settled", 60s) == WriteStatus::ok);
  CHECK(p.proxy.cuts() == 1);
  CHECK(p.store.inspect(k)->result == "settled");

  // The same, with no session for a while after the cut (a primary being promoted).
  const auto k2 = key("tx-settle-later");
  auto tx2 = p.store.begin(k2, ap(62));
  p.proxy.plan({{idem::test::TcpProxy::Action::cut, {}}}, true);
  std::thread opener([&] {
    std::this_thread::sleep_for(300ms);
    p.proxy.refuse(false);
  });
  CHECK(tx2.commit("later", 60s) == WriteStatus::ok);
  opener.join();
  CHECK(p.store.inspect(k2)->result == "later");

  // A commit that never reaches a server it can be read on: outcome_unknown_error after settle_wait.
  Proxied q(idem::PostgresMode::transactional, 300ms);
  const auto k3 = key("tx-unknown");
  auto tx3 = q.store.begin(k3, ap(63));
  q.proxy.plan({{idem::test::TcpProxy::Action::cut, {}}}, true);
  auto e = pgtest::capture<idem::outcome_unknown_error>([&] { (void)tx3.commit("r", 60s); });
  CHECK_FALSE(e.retryable());
  CHECK(std::string(e.what()).find("settle_wait") != std::string::npos);
  q.proxy.refuse(false);
  CHECK(q.store.inspect(k3)->result == "r");  // it had committed: inspect tells
}
