#pragma once
// Lost replies, one suite for every Redis store (RedisStore, AsyncRedisStore): a reply lost after
// the server ran the request (tcp_proxy.hpp) is settled by the same holder asking again on a fresh
// connection, never guessed; when that cannot be done the outcome is unknown; reads are not resent.
//
// A Fixture has `proxy` (a TcpProxy in front of the server), `store` (through the proxy, one
// connection, command_timeout 1 s, that connection already up so the proxy's next reply is the
// call under test) and `key` (fresh per case). IDEM_LOST_REPLY_SUITE(Fixture, "redis", "[redis]")
// names one CTest case per function below.

#include <catch2/catch.hpp>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "redis/redis_factory.hpp"
#include "support/tcp_proxy.hpp"

namespace idem::test::lost_reply {

using namespace std::chrono_literals;
inline constexpr auto params = &idem::test::acquire_params;

template <class T>
void resent_counted(T& t) {
  if constexpr (requires { t.store.stats().resent; }) CHECK(t.store.stats().resent >= 1);
}

template <class T>
void lost_acquire(T& t) {
  t.proxy.arm(TcpProxy::Action::cut);
  auto r = t.store.acquire(t.key, params(77));
  CHECK(t.proxy.fired());
  CHECK(r.status == AcquireStatus::acquired);
  CHECK(r.holder == Holder{1, 77});
  CHECK(r.attempts == 1);
  CHECK_FALSE(r.takeover);
  auto rec = t.store.inspect(t.key);
  REQUIRE(rec);
  CHECK(rec->holder == Holder{1, 77});
  // A rival is still in flight behind it, and the holder completes as usual.
  CHECK(t.store.acquire(t.key, params(78)).status == AcquireStatus::in_flight);
  CHECK(t.store.complete(t.key, r.holder, "done", 60s) == WriteStatus::ok);
  resent_counted(t);

  // A takeover whose reply was lost: the retry finds the record already its own, so it answers
  // acquired with the fence the takeover gave, as a plain acquisition (the record does not keep
  // how it was acquired; docs/redis.md).
  const std::string k2 = t.key + "-takeover";
  auto lapsing = params(1);
  lapsing.lease = 100ms;
  REQUIRE(t.store.acquire(k2, lapsing).status == AcquireStatus::acquired);
  std::this_thread::sleep_for(200ms);
  t.proxy.arm(TcpProxy::Action::cut);
  auto taken = t.store.acquire(k2, params(2));
  CHECK(t.proxy.fired());
  CHECK(taken.status == AcquireStatus::acquired);
  CHECK(taken.holder == Holder{2, 2});
  CHECK_FALSE(taken.takeover);
}

template <class T>
void lost_complete(T& t) {
  auto r = t.store.acquire(t.key, params(5));
  REQUIRE(r.status == AcquireStatus::acquired);
  t.proxy.arm(TcpProxy::Action::cut);
  CHECK(t.store.complete(t.key, r.holder, "the result", 60s) == WriteStatus::ok);
  CHECK(t.proxy.fired());
  auto d = t.store.acquire(t.key, params(6));
  CHECK(d.status == AcquireStatus::duplicate);
  CHECK(d.payload == "the result");
  // Another completion by the same holder is still refused: a completed record is never overwritten.
  CHECK(t.store.complete(t.key, r.holder, "other", 60s) == WriteStatus::lease_lost);
}

template <class T>
void lost_fail(T& t) {
  for (const bool release : {false, true}) {
    const std::string k = t.key + (release ? "-release" : "-record");
    auto r = t.store.acquire(k, params(9));
    REQUIRE(r.status == AcquireStatus::acquired);
    FailParams fp;
    fp.error = "boom";
    fp.release = release;
    fp.backoff = 30s;
    fp.retention = 60s;
    t.proxy.arm(TcpProxy::Action::cut);
    CHECK(t.store.fail(k, r.holder, fp) == WriteStatus::ok);
    CHECK(t.proxy.fired());
    auto rec = t.store.inspect(k);
    REQUIRE(rec);
    CHECK(rec->state == State::failed);
    CHECK(rec->error == "boom");
    CHECK(rec->holder == r.holder);
    const auto next = t.store.acquire(k, params(10)).status;
    CHECK(next == (release ? AcquireStatus::acquired : AcquireStatus::in_flight));
  }
}

template <class T>
void lost_complete_unavailable(T& t) {
  auto r = t.store.acquire(t.key, params(5));
  t.proxy.arm(TcpProxy::Action::cut);
  CHECK(t.store.complete_unavailable(t.key, r.holder, "too large", 60s) == WriteStatus::ok);
  CHECK(t.proxy.fired());
  auto d = t.store.acquire(t.key, params(6));
  CHECK(d.status == AcquireStatus::duplicate);
  CHECK(d.result_unavailable);
  CHECK(d.payload == "too large");
}

template <class T>
void held_past_timeout(T& t) {
  auto r = t.store.acquire(t.key, params(3));
  t.proxy.arm(TcpProxy::Action::hold);
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(t.store.complete(t.key, r.holder, "v", 60s) == WriteStatus::ok);
  CHECK(t.proxy.fired());
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  CHECK(t.store.acquire(t.key, params(4)).payload == "v");
}

template <class T>
void no_retry_possible(T& t) {
  auto r = t.store.acquire(t.key, params(5));
  t.proxy.arm(TcpProxy::Action::cut, 0, {}, /*refuse_after=*/true);
  try {
    (void)t.store.complete(t.key, r.holder, "v", 60s);
    FAIL("a lost reply with no retry possible was reported as settled");
  } catch (const outcome_unknown_error& e) {
    CHECK_FALSE(e.retryable());
    CHECK(std::string(e.what()).find("unknown") != std::string::npos);
  }
  t.proxy.refuse(false);
  // The write had run: the holder's own retry now settles it, and nothing ran twice.
  CHECK(t.store.complete(t.key, r.holder, "v", 60s) == WriteStatus::ok);
  auto rec = t.store.inspect(t.key);
  REQUIRE(rec);
  CHECK(rec->state == State::completed);

  t.proxy.arm(TcpProxy::Action::cut, 0, {}, true);
  CHECK_THROWS_AS(t.store.acquire(t.key + "-acquire", params(6)), outcome_unknown_error);
  t.proxy.refuse(false);
  // The acquisition had been made: its holder gets it back, a rival is in flight behind it.
  CHECK(t.store.acquire(t.key + "-acquire", params(7)).status == AcquireStatus::in_flight);
  CHECK(t.store.acquire(t.key + "-acquire", params(6)).holder == Holder{1, 6});
}

template <class T>
void error_reply_to_retry(T& t) {
  auto r = t.store.acquire(t.key, params(5));
  // The retry goes on a new connection (no handshake as the default user: no AUTH, no SELECT).
  t.proxy.plan({{TcpProxy::Action::cut, {}}, {TcpProxy::Action::replace, "-LOADING injected by the test\r\n"}});
  try {
    (void)t.store.complete(t.key, r.holder, "v", 60s);
    FAIL("an error reply to the retry was reported as settled");
  } catch (const outcome_unknown_error& e) {
    CHECK(e.code() == "LOADING");
    CHECK_FALSE(e.retryable());
    CHECK(std::string(e.what()).find(t.key) != std::string::npos);
  }
  CHECK(t.proxy.fired());
  CHECK(t.store.acquire(t.key, params(6)).payload == "v");  // the first had run
}

// A batch (one many.lua call) whose reply was lost, and whose retry answers one key with an error:
// that key's first sending may have run, so the batch is in doubt, as a single call would be.
template <class T>
void error_element_in_retried_batch(T& t) {
  const std::string a = t.key + "-a", b = t.key + "-b";
  auto ra = t.store.acquire(a, params(5));
  auto rb = t.store.acquire(b, params(5));
  const std::vector<CompleteItem> items{{a, ra.holder, "va"}, {b, rb.holder, "vb"}};
  t.proxy.plan({{TcpProxy::Action::cut, {}}, {TcpProxy::Action::replace, "*2\r\n:1\r\n-LOADING injected by the test\r\n"}});
  try {
    (void)t.store.complete_batch(items, 60s);
    FAIL("an error element in the retried batch's reply was reported as settled");
  } catch (const outcome_unknown_error& e) {
    CHECK(e.code() == "LOADING");
    CHECK_FALSE(e.retryable());
  }
  CHECK(t.proxy.fired());
  CHECK(t.store.acquire(b, params(6)).payload == "vb");  // the first sending had run
}

template <class T>
void reads_not_resent(T& t) {
  t.proxy.arm(TcpProxy::Action::cut);
  CHECK_THROWS_AS(t.store.inspect(t.key), connection_error);
  CHECK_NOTHROW(t.store.inspect(t.key));
}

}  // namespace idem::test::lost_reply

#define IDEM_LOST_REPLY_CASE_(Fixture, prefix, tag, name, fn) \
  TEST_CASE(prefix " " name, tag "[recovery]") {              \
    Fixture t;                                                \
    ::idem::test::lost_reply::fn(t);                          \
  }

/// The lost-reply cases for Fixture; `prefix` starts each case's name ("redis", "async").
#define IDEM_LOST_REPLY_SUITE(Fixture, prefix, tag)                                                              \
  IDEM_LOST_REPLY_CASE_(Fixture, prefix, tag, "lost acquire reply: the same holder's retry is acquired with the " \
                        "same fence", lost_acquire)                                                              \
  IDEM_LOST_REPLY_CASE_(Fixture, prefix, tag, "lost complete reply: the same holder's retry answers ok, nothing "  \
                        "is overwritten", lost_complete)                                                         \
  IDEM_LOST_REPLY_CASE_(Fixture, prefix, tag, "lost fail reply: the same holder's retry answers ok", lost_fail)   \
  IDEM_LOST_REPLY_CASE_(Fixture, prefix, tag, "lost complete_unavailable reply: the retry answers ok",            \
                        lost_complete_unavailable)                                                               \
  IDEM_LOST_REPLY_CASE_(Fixture, prefix, tag, "reply held past command_timeout: the same holder's retry settles "  \
                        "it", held_past_timeout)                                                                 \
  IDEM_LOST_REPLY_CASE_(Fixture, prefix, tag, "lost reply and no retry possible: outcome_unknown_error, then the " \
                        "holder settles it", no_retry_possible)                                                  \
  IDEM_LOST_REPLY_CASE_(Fixture, prefix, tag, "lost reply, then an error reply to the retry: "                    \
                        "outcome_unknown_error with its code", error_reply_to_retry)                             \
  IDEM_LOST_REPLY_CASE_(Fixture, prefix, tag, "lost batch reply, then a key's error in the retry's reply: "       \
                        "outcome_unknown_error", error_element_in_retried_batch)                                 \
  IDEM_LOST_REPLY_CASE_(Fixture, prefix, tag, "reads are not resent: a lost inspect reply is a retryable "        \
                        "connection_error", reads_not_resent)
