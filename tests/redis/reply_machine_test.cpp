// The reply machine (src/redis/reply_machine.hpp) step by step, without a socket: each reply or
// I/O event a transport can see, what the machine answers, and what it remembers of the request.
// Replies are read by hiredis's reader from the bytes a server sends, as both transports get them.
// Also, the same way, a new connection's handshake and a sentinel's answer (client.hpp).
#include <catch2/catch.hpp>

#include <hiredis/hiredis.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "client.hpp"
#include "idem/core/error.hpp"
#include "reply_machine.hpp"
#include "reply_of.hpp"

using namespace idem::detail::redis;
using idem_test::reply_of;
using std::chrono::milliseconds;

namespace {

auto error_reply(const std::string& text) { return reply_of("-" + text + "\r\n"); }

const Route cluster{.cluster = true, .sentinel = false, .max_redirects = 3};
const Route sentinel{.cluster = false, .sentinel = true, .max_redirects = 3};
const Route plain{};

// A copy of the exception a `fail` decision carries (the decision is often a temporary), its
// what() in `what`; empty when it carries another type.
template <class E>
std::optional<E> failure_as(const Decision& d, std::string& what) {
  REQUIRE(d.next == Next::fail);
  REQUIRE(d.error);
  try {
    std::rethrow_exception(d.error);
  } catch (const E& e) {
    what = e.what();
    return e;
  } catch (...) {
  }
  FAIL("the decision carries another exception type");
  return std::nullopt;
}

}  // namespace

TEST_CASE("reply machine: a reply that is not an error is delivered and changes nothing", "[redis][reply_machine]") {
  Attempt a;
  for (const char* resp : {"+OK\r\n", ":7\r\n", "$3\r\nabc\r\n", "*0\r\n", "$-1\r\n"}) {
    const auto r = reply_of(resp);
    CHECK(on_reply(a, r.get(), cluster, "acquire of key 'k'", 1).next == Next::deliver);
  }
  CHECK(a.redirects == 0);
  CHECK_FALSE(a.reloaded);
  CHECK_FALSE(a.resent);
}

TEST_CASE("reply machine: MOVED, ASK and TRYAGAIN on a cluster, each counted", "[redis][reply_machine]") {
  Attempt a;
  const auto moved = error_reply("MOVED 3999 127.0.0.1:7002");
  Decision d = on_reply(a, moved.get(), cluster, "acquire of key 'k'", 3999);
  CHECK(d.next == Next::moved);
  CHECK_FALSE(d.to.ask);
  CHECK(d.to.slot == 3999);
  CHECK(d.to.to.host == "127.0.0.1");
  CHECK(d.to.to.port == 7002);
  CHECK(a.redirects == 1);

  const auto ask = error_reply("ASK 3999 127.0.0.1:7003");
  d = on_reply(a, ask.get(), cluster, "acquire of key 'k'", 3999);
  CHECK(d.next == Next::ask);
  CHECK(d.to.ask);
  CHECK(d.to.to.port == 7003);
  CHECK(a.redirects == 2);

  const auto tryagain = error_reply("TRYAGAIN Multiple keys request during rehashing of slot");
  d = on_reply(a, tryagain.get(), cluster, "acquire of key 'k'", 3999);
  CHECK(d.next == Next::later);
  CHECK(d.delay == milliseconds(40));  // the third redirection's wait
  CHECK(a.redirects == 3);
}

TEST_CASE("reply machine: the redirection after max_redirects fails, retryable, saying what and where",
          "[redis][reply_machine]") {
  Attempt a;
  const auto moved = error_reply("MOVED 12 127.0.0.1:7001");
  for (int i = 1; i <= cluster.max_redirects; ++i) CHECK(on_reply(a, moved.get(), cluster, "the run", 12).next == Next::moved);
  std::string what;
  const auto e = failure_as<idem::store_error>(on_reply(a, moved.get(), cluster, "complete of key 'k'", 12), what);
  REQUIRE(e);
  CHECK(e->code() == "REDIRECTS");
  CHECK(e->retryable());
  CHECK_THAT(what, Catch::Contains("complete of key 'k'") && Catch::Contains("slot 12") &&
                       Catch::Contains("3 times") && Catch::Contains("MOVED 12 127.0.0.1:7001") &&
                       Catch::Contains("max_redirects"));
}

TEST_CASE("reply machine: with no router a redirection is the caller's error reply", "[redis][reply_machine]") {
  Attempt a;
  const auto moved = error_reply("MOVED 12 127.0.0.1:7001");
  CHECK(on_reply(a, moved.get(), plain, "acquire", -1).next == Next::deliver);
  CHECK(a.redirects == 0);
  CHECK(on_reply(a, error_reply("ERR wrong number of arguments").get(), cluster, "acquire", 1).next == Next::deliver);
  CHECK(on_reply(a, reply_of("+OK\r\n").get(), cluster, "acquire", 1).next == Next::deliver);
}

TEST_CASE("reply machine: TRYAGAIN waits longer each time, at most 100 ms", "[redis][reply_machine]") {
  CHECK(tryagain_delay(1) == milliseconds(10));
  CHECK(tryagain_delay(2) == milliseconds(20));
  CHECK(tryagain_delay(3) == milliseconds(40));
  CHECK(tryagain_delay(4) == milliseconds(80));
  CHECK(tryagain_delay(5) == milliseconds(100));
  CHECK(tryagain_delay(50) == milliseconds(100));
  CHECK(tryagain_delay(0) == milliseconds(10));
}

TEST_CASE("reply machine: NOSCRIPT reloads once, a second one is the caller's error", "[redis][reply_machine]") {
  Attempt a;
  const auto noscript = error_reply("NOSCRIPT No matching script. Please use EVAL.");
  CHECK(on_reply(a, noscript.get(), plain, "acquire", -1).next == Next::reload);
  CHECK(a.reloaded);
  CHECK(on_reply(a, noscript.get(), plain, "acquire", -1).next == Next::deliver);
}

TEST_CASE("reply machine: a plain command's NOSCRIPT is its answer, nothing reloaded", "[redis][reply_machine]") {
  Attempt a;
  a.idem_script = false;
  const auto noscript = error_reply("NOSCRIPT No matching script. Please use EVAL.");
  CHECK(on_reply(a, noscript.get(), plain, "EVALSHA", -1).next == Next::deliver);
  CHECK_FALSE(a.reloaded);
}

TEST_CASE("reply machine: a demoted master is left under Sentinel only", "[redis][reply_machine]") {
  for (const char* text : {"READONLY You can't write against a read only replica.", "LOADING Redis is loading",
                           "MASTERDOWN Link with MASTER is down"}) {
    Attempt a;
    const auto r = error_reply(text);
    const Decision d = on_reply(a, r.get(), sentinel, "acquire", -1);
    CHECK(d.next == Next::leave_master);
    CHECK_THAT(d.why, Catch::Contains("not the master now"));
    CHECK(on_reply(a, r.get(), plain, "acquire", -1).next == Next::deliver);
  }
}

TEST_CASE("reply machine: a lost reply is resent once as the same holder, a second loss is in doubt",
          "[redis][reply_machine]") {
  SECTION("a holder's step") {
    Attempt a;
    const IoFailure first{"Redis at 127.0.0.1:6379 did not answer within command_timeout (200 ms)", true};
    CHECK(on_lost(a, first, Resend::same_holder, "complete of key 'k'").next == Next::resend);
    CHECK(a.resent);
    CHECK(a.first.text == first.text);
    std::string what;
    const auto e = failure_as<idem::outcome_unknown_error>(
        on_lost(a, {"connection to Redis at 127.0.0.1:6379 broke", false}, Resend::same_holder, "complete of key 'k'"),
        what);
    REQUIRE(e);
    CHECK_THAT(what, Catch::Contains("complete of key 'k'") && Catch::Contains("did not answer") &&
                         Catch::Contains("broke"));
  }
  SECTION("a request that is not a holder's: a retryable I/O error, may have run") {
    Attempt a;
    std::string what;
    CHECK(failure_as<idem::timeout_error>(on_lost(a, {"no answer", true}, Resend::never, "inspect"), what)->retryable());
    CHECK_THAT(what, Catch::Contains("may or may not have run"));
    CHECK(failure_as<idem::connection_error>(on_lost(a, {"broke", false}, Resend::never, "inspect"), what)->retryable());
    CHECK_FALSE(a.resent);
  }
}

TEST_CASE("reply machine: after a resend an error reply is in doubt, a redirection is still followed",
          "[redis][reply_machine]") {
  Attempt a;
  REQUIRE(on_lost(a, {"broke", false}, Resend::same_holder, "acquire of key 'k'").next == Next::resend);
  const auto moved = error_reply("MOVED 5 127.0.0.1:7001");
  CHECK(on_reply(a, moved.get(), cluster, "acquire of key 'k'", 5).next == Next::moved);
  const auto noscript = error_reply("NOSCRIPT No matching script.");
  CHECK(on_reply(a, noscript.get(), cluster, "acquire of key 'k'", 5).next == Next::reload);
  const auto usage = error_reply("IDEMUSAGE the lease is held by another holder");
  std::string what;
  const auto e = failure_as<idem::outcome_unknown_error>(on_reply(a, usage.get(), cluster, "acquire of key 'k'", 5), what);
  REQUIRE(e);
  CHECK(e->code() == "IDEMUSAGE");
  CHECK_THAT(what, Catch::Contains("broke") && Catch::Contains("held by another holder"));
  CHECK(on_reply(a, reply_of(":1\r\n").get(), cluster, "acquire of key 'k'", 5).next == Next::deliver);
  CHECK(on_resent_reply(Attempt{}, usage.get(), "acquire").next == Next::deliver);  // a first sending's own error
}

TEST_CASE("reply machine: a request that cannot be sent fails with its error, a resend stays in doubt",
          "[redis][reply_machine]") {
  const auto refused = std::make_exception_ptr(idem::connection_error("idem: cannot connect", "", true));
  Attempt a;
  std::string what;
  CHECK(failure_as<idem::connection_error>(on_unsent(a, refused, "cannot connect", "acquire"), what).has_value());
  CHECK(what == "idem: cannot connect");
  REQUIRE(on_lost(a, {"broke", false}, Resend::same_holder, "acquire").next == Next::resend);
  CHECK(failure_as<idem::outcome_unknown_error>(on_unsent(a, refused, "cannot connect", "acquire"), what).has_value());
  CHECK_THAT(what, Catch::Contains("broke") && Catch::Contains("cannot connect"));
}

// A new connection's handshake (client.hpp's Hello) and a sentinel's answer, judged the same way:
// from the bytes, without a socket.
namespace {
ReplyPtr owned(const std::string& bytes) { return ReplyPtr(reply_of(bytes).release()); }
}  // namespace

TEST_CASE("connection hello: what a new connection sends first, per the options", "[redis][hello]") {
  idem::RedisOptions o;
  CHECK(hello_for(o, false, false).requests.size() == 0);  // nothing to send: no round trip
  const Hello tls = hello_for(o, false, true);
  REQUIRE(tls.requests.size() == 1);
  CHECK(tls.requests[0] == "*1\r\n$4\r\nPING\r\n");  // TLS: one answer proves the server took the session
  o.user = "app";
  o.password = "secret";
  o.db = 2;
  const Hello all = hello_for(o, true, true);
  REQUIRE(all.requests.size() == 3);
  CHECK(all.check_role);
  CHECK(all.requests[0] == "*3\r\n$4\r\nAUTH\r\n$3\r\napp\r\n$6\r\nsecret\r\n");
  CHECK(all.requests[1] == "*2\r\n$6\r\nSELECT\r\n$1\r\n2\r\n");
  CHECK(all.requests[2] == "*1\r\n$4\r\nROLE\r\n");
}

TEST_CASE("connection hello: a refused AUTH throws, ROLE must say master under Sentinel", "[redis][hello]") {
  idem::RedisOptions o;
  o.password = "wrong";
  const Hello auth = hello_for(o, false, false);
  std::vector<ReplyPtr> refused;
  refused.push_back(owned("-WRONGPASS invalid username-password pair or user is disabled.\r\n"));
  try {
    (void)hello_accepted(auth, refused);
    FAIL("a refused AUTH was accepted");
  } catch (const idem::store_error& e) {
    CHECK(e.code() == "WRONGPASS");
    CHECK_FALSE(e.retryable());
    CHECK_THAT(e.what(), Catch::Contains("authentication failed"));
  }
  std::vector<ReplyPtr> ok;
  ok.push_back(owned("+OK\r\n"));
  CHECK(hello_accepted(auth, ok));

  const Hello sentinel = hello_for(o, true, false);
  std::vector<ReplyPtr> master, replica;
  master.push_back(owned("+OK\r\n"));
  master.push_back(owned("*3\r\n$6\r\nmaster\r\n:10\r\n*0\r\n"));
  replica.push_back(owned("+OK\r\n"));
  replica.push_back(owned("*5\r\n$5\r\nslave\r\n$9\r\n127.0.0.1\r\n:6379\r\n$9\r\nconnected\r\n:10\r\n"));
  CHECK(hello_accepted(sentinel, master));
  CHECK_FALSE(hello_accepted(sentinel, replica));
}

TEST_CASE("sentinel answer: the master's address, or nothing for a name it does not know", "[redis][hello]") {
  const auto known = reply_of("*2\r\n$9\r\n127.0.0.1\r\n$4\r\n6380\r\n");
  const std::optional<Endpoint> m = parse_master_addr(known.get());
  REQUIRE(m);
  CHECK(m->host == "127.0.0.1");
  CHECK(m->port == 6380);
  CHECK_FALSE(parse_master_addr(reply_of("*-1\r\n").get()));  // unknown master name: a null array
  CHECK_FALSE(parse_master_addr(reply_of("*2\r\n$9\r\n127.0.0.1\r\n$5\r\n70000\r\n").get()));
  CHECK_FALSE(parse_master_addr(reply_of("*2\r\n$9\r\n127.0.0.1\r\n$4\r\n63x0\r\n").get()));
  idem::RedisOptions o;
  o.sentinel_master = "mymaster";
  o.sentinel_password = "s";
  const Hello h = sentinel_hello(o);
  REQUIRE(h.requests.size() == 2);
  CHECK_FALSE(h.check_role);
  CHECK(h.requests[0] == "*2\r\n$4\r\nAUTH\r\n$1\r\ns\r\n");
  CHECK(h.requests[1] == "*3\r\n$8\r\nSENTINEL\r\n$23\r\nget-master-addr-by-name\r\n$8\r\nmymaster\r\n");
  // A refused AUTH is collected into the lookup's message (the next sentinel is asked), not thrown.
  std::vector<ReplyPtr> refused;
  refused.push_back(owned("-WRONGPASS invalid username-password pair or user is disabled.\r\n"));
  refused.push_back(owned("-NOAUTH Authentication required.\r\n"));
  CHECK(hello_refusal(refused) == "WRONGPASS invalid username-password pair or user is disabled.");
  std::vector<ReplyPtr> answered;
  answered.push_back(owned("+OK\r\n"));
  answered.push_back(owned("*2\r\n$9\r\n127.0.0.1\r\n$4\r\n6380\r\n"));
  CHECK(hello_refusal(answered).empty());
}
