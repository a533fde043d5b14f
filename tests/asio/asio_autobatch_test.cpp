// Auto-batching on AsyncRedisStore's connection: different callers' one-key steps that queue
// behind a write in flight leave as one `many` script call, and each caller gets exactly the
// answer its own call would have had. The reference for "would have had" is the same steps sent
// one call each (auto_batch = 1) against an identically prepared namespace.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/post.hpp>

#include "asio_factory.hpp"
#include "redis_topology.hpp"
#include "support/tcp_proxy.hpp"
#include "support/warnings.hpp"

using namespace std::chrono_literals;
namespace asio = boost::asio;
using idem::test::IoThread;
using idem::test::random_hex;

namespace {

struct Step {
  enum Kind { acquire, complete, fail, extend } kind = acquire;
  std::string key;
  std::uint64_t token = 0;       // acquire
  std::string fingerprint;       // acquire
  idem::millis lease{30'000};    // acquire, extend
  idem::Holder holder{};         // complete, fail, extend
  std::string text;              // complete: the result; fail: the error
};

// What one caller saw, in a form two runs can be compared in.
struct Answer {
  std::string error;  // the exception's type and code, empty when none
  std::string what;   // its message
  idem::AcquireResult acquired;
  idem::WriteStatus written = idem::WriteStatus::ok;
  bool operator==(const Answer& o) const {
    return error == o.error && acquired.status == o.acquired.status && acquired.holder.fence == o.acquired.holder.fence &&
           acquired.holder.token == o.acquired.holder.token && acquired.takeover == o.acquired.takeover &&
           acquired.attempts == o.acquired.attempts && acquired.payload == o.acquired.payload && written == o.written;
  }
};

std::string describe(const Answer& a) {
  if (!a.error.empty()) return a.error + ": " + a.what;
  return "acquire status " + std::to_string(static_cast<int>(a.acquired.status)) + " fence " +
         std::to_string(a.acquired.holder.fence) + " attempts " + std::to_string(a.acquired.attempts) + " payload '" +
         a.acquired.payload + "' / write " + std::to_string(static_cast<int>(a.written));
}

Answer from_error(std::exception_ptr e) {
  Answer a;
  try {
    std::rethrow_exception(e);
  } catch (const idem::outcome_unknown_error& x) {
    a.error = "outcome_unknown";
    a.what = x.what();
  } catch (const idem::corrupt_record_error& x) {
    a.error = "corrupt";
    a.what = x.what();
  } catch (const idem::durability_error& x) {
    a.error = "durability";
    a.what = x.what();
  } catch (const idem::store_error& x) {
    a.error = "store_error " + x.code();
    a.what = x.what();
  } catch (const idem::error& x) {
    a.error = "error";
    a.what = x.what();
  } catch (const std::exception& x) {
    a.error = "std::exception";
    a.what = x.what();
  }
  return a;
}

// Starts every step from one handler on the io thread, so they all queue on the connection's
// strand before its write goes: with auto-batching on, they leave as one call.
std::vector<Answer> burst(IoThread& io, idem::AsyncRedisStore& store, const std::string& ns, const std::vector<Step>& steps) {
  std::vector<std::promise<Answer>> promises(steps.size());
  std::vector<std::future<Answer>> futures;
  for (auto& p : promises) futures.push_back(p.get_future());
  std::vector<std::string> keys;
  for (const Step& s : steps) keys.push_back(ns + s.key);
  asio::post(io.io, [&] {
    for (std::size_t i = 0; i < steps.size(); ++i) {
      const Step& s = steps[i];
      auto wrote = [&promises, i](std::exception_ptr e, idem::WriteStatus w) {
        Answer a = e ? from_error(e) : Answer{};
        a.written = w;
        promises[i].set_value(std::move(a));
      };
      switch (s.kind) {
        case Step::acquire: {
          idem::AcquireParams p = idem::test::acquire_params(s.token);
          p.fingerprint = s.fingerprint;
          p.lease = s.lease;
          store.async_acquire(keys[i], p, [&promises, i](std::exception_ptr e, idem::AcquireResult r) {
            Answer a = e ? from_error(e) : Answer{};
            if (!e) a.acquired = std::move(r);
            promises[i].set_value(std::move(a));
          });
          break;
        }
        case Step::complete: store.async_complete(keys[i], s.holder, s.text, 60s, wrote); break;
        case Step::fail: store.async_fail(keys[i], s.holder, {.error = s.text, .release = true, .retention = 60s}, wrote); break;
        case Step::extend: store.async_extend(keys[i], s.holder, s.lease, wrote); break;
      }
    }
  });
  std::vector<Answer> out;
  for (auto& f : futures) out.push_back(f.get());
  return out;
}

idem::RedisOptions with_batch(idem::RedisOptions o, std::size_t n) {
  o.auto_batch = n;
  return o;
}

// A namespace holding one key in each state a coalesced call must tell apart.
void prepare(idem::test::RedisServer& server, idem::AsyncRedisStore& store, const std::string& ns) {
  auto take = [&](const std::string& k, std::uint64_t token, idem::millis lease = 60s, std::string_view fp = {}) {
    idem::AcquireParams p = idem::test::acquire_params(token);
    p.lease = lease;
    p.fingerprint = fp;
    auto r = store.acquire(ns + k, p);
    REQUIRE(r.status == idem::AcquireStatus::acquired);
    return r.holder;
  };
  REQUIRE(store.complete(ns + "dup", take("dup", 101), "rd", 60s) == idem::WriteStatus::ok);
  (void)take("busy", 102);
  (void)take("old", 103, 1ms);
  REQUIRE(store.complete(ns + "mism", take("mism", 104, 60s, "A"), "rm", 60s) == idem::WriteStatus::ok);
  (void)take("mine", 105);
  (void)take("mine2", 106);
  (void)take("mine3", 107);
  server.command({"SET", "idem:" + ns + "corrupt", "not an idem record"});
}

// New, duplicate, in flight, expired (taken over), mismatched, a key twice, a damaged record, and
// the holder's writes (complete, fail, extend) next to a stranger's complete (lease lost).
std::vector<Step> mixed_steps() {
  const idem::Holder mine{1, 105}, mine2{1, 106}, mine3{1, 107}, stranger{1, 999};
  return {
      {.kind = Step::acquire, .key = "new1", .token = 201},
      {.kind = Step::acquire, .key = "dup", .token = 202},
      {.kind = Step::acquire, .key = "busy", .token = 203},
      {.kind = Step::acquire, .key = "old", .token = 204},
      {.kind = Step::acquire, .key = "mism", .token = 205, .fingerprint = "B"},
      {.kind = Step::acquire, .key = "twice", .token = 206},
      {.kind = Step::acquire, .key = "twice", .token = 207},
      {.kind = Step::acquire, .key = "corrupt", .token = 208},
      {.kind = Step::complete, .key = "mine", .holder = mine, .text = "done"},
      {.kind = Step::complete, .key = "dup", .holder = stranger, .text = "not mine"},
      {.kind = Step::fail, .key = "mine2", .holder = mine2, .text = "boom"},
      {.kind = Step::extend, .key = "mine3", .lease = 45s, .holder = mine3},
      {.kind = Step::acquire, .key = "mine", .token = 209},  // after its completion in the same call
      {.kind = Step::acquire, .key = "new2", .token = 210},
  };
}

}  // namespace

TEST_CASE("auto-batching: a coalesced call mixing every answer gives each caller its single call's answer", "[asio][batch]") {
  idem::test::RedisServer server;
  IoThread io;
  idem::AsyncRedisStore batched{io.io.get_executor(), server.options()};
  idem::AsyncRedisStore single{io.io.get_executor(), with_batch(server.options(), 1)};
  const std::string ns = "mix-" + random_hex() + ":";
  prepare(server, batched, ns + "b:");
  prepare(server, single, ns + "s:");
  std::this_thread::sleep_for(30ms);  // "old"'s 1 ms lease lapses in both namespaces
  const auto steps = mixed_steps();

  const auto before = batched.stats();
  const std::vector<Answer> got = burst(io, batched, ns + "b:", steps);
  const auto after = batched.stats();
  std::vector<Answer> want;
  for (const Step& s : steps) want.push_back(burst(io, single, ns + "s:", {s}).front());  // one call each

  for (std::size_t i = 0; i < steps.size(); ++i) {
    INFO("step " << i << " (" << steps[i].key << "): batched " << describe(got[i]) << " | single " << describe(want[i]));
    CHECK(got[i] == want[i]);
  }
  // What the answers are, so the comparison is not of two equal mistakes.
  CHECK(got[0].acquired.status == idem::AcquireStatus::acquired);
  CHECK(got[1].acquired.status == idem::AcquireStatus::duplicate);
  CHECK(got[1].acquired.payload == "rd");
  CHECK(got[2].acquired.status == idem::AcquireStatus::in_flight);
  CHECK(got[3].acquired.status == idem::AcquireStatus::acquired);
  CHECK(got[3].acquired.takeover);
  CHECK(got[4].acquired.status == idem::AcquireStatus::mismatch);
  CHECK(got[5].acquired.status == idem::AcquireStatus::acquired);
  CHECK(got[6].acquired.status == idem::AcquireStatus::in_flight);
  CHECK(got[7].error == "corrupt");
  CHECK(got[8].written == idem::WriteStatus::ok);
  CHECK(got[9].written == idem::WriteStatus::lease_lost);
  CHECK(got[10].written == idem::WriteStatus::ok);
  CHECK(got[11].written == idem::WriteStatus::ok);
  CHECK(got[12].acquired.status == idem::AcquireStatus::duplicate);
  CHECK(got[12].acquired.payload == "done");
  CHECK(got[13].acquired.status == idem::AcquireStatus::acquired);
  // One script call carried them all (the damaged record's error did not stop the keys after it).
  CHECK(after.coalesced - before.coalesced == steps.size());
  CHECK(after.requests - before.requests == 1);
}

TEST_CASE("auto-batching: many callers on the same and on different keys, each key run once", "[asio][batch]") {
  idem::test::AsyncRedisFactory f;
  idem::IdempotencyGuard guard{f.store(), {.lease = 10s, .retention = 60s}};
  const std::string ns = "crowd-" + random_hex() + ":";
  constexpr int callers = 400, keys = 150;
  std::map<std::string, int> runs;
  std::mutex mu;
  std::atomic<int> finished{0}, errors{0};
  std::promise<void> all;
  asio::post(f.io.io, [&] {
    for (int i = 0; i < callers; ++i)
      asio::co_spawn(
          f.io.io,
          [&, i]() -> asio::awaitable<void> {
            const std::string key = ns + std::to_string(i % keys);
            auto out = co_await guard.run_async(key, "", [&] {
              std::lock_guard lk(mu);
              ++runs[key];
              return 1;
            });
            (void)out;
          },
          [&](std::exception_ptr e) {
            if (e) ++errors;
            if (++finished == callers) all.set_value();
          });
  });
  all.get_future().get();
  CHECK(errors == 0);
  CHECK(runs.size() == static_cast<std::size_t>(keys));
  for (const auto& [k, n] : runs) CHECK(n == 1);
  const auto st = f.store().stats();
  INFO("requests " << st.requests << ", steps coalesced " << st.coalesced << ", writes " << st.writes);
  CHECK(st.coalesced > 0);
  CHECK(st.requests < st.coalesced);  // fewer script calls than steps
}

TEST_CASE("auto-batching: the connection lost with a coalesced call in flight", "[asio][batch]") {
  idem::test::RedisServer server;
  idem::test::TcpProxy proxy{server.port()};
  IoThread io;
  idem::RedisOptions o = server.options();
  o.port = proxy.port();
  o.command_timeout = 1s;
  idem::AsyncRedisStore store{io.io.get_executor(), o};
  (void)store.inspect("warm");  // the connection and its handshake first: the next reply is the call's

  SECTION("the call is asked again once, as the same holders: each caller gets its own answer") {
    const std::string ns = "lost-" + random_hex() + ":";
    REQUIRE(store.acquire(ns + "dup", idem::test::acquire_params(1)).status == idem::AcquireStatus::acquired);
    REQUIRE(store.complete(ns + "dup", {1, 1}, "r", 60s) == idem::WriteStatus::ok);
    proxy.cut_next_reply();
    const auto before = store.stats();
    const auto got = burst(io, store, ns,
                           {{.kind = Step::acquire, .key = "a", .token = 11},
                            {.kind = Step::acquire, .key = "b", .token = 12},
                            {.kind = Step::acquire, .key = "dup", .token = 13},
                            {.kind = Step::acquire, .key = "a", .token = 14}});
    for (const auto& a : got) INFO(describe(a));
    CHECK(got[0].acquired.status == idem::AcquireStatus::acquired);
    CHECK(got[0].acquired.holder.fence == 1);
    CHECK(got[1].acquired.status == idem::AcquireStatus::acquired);
    CHECK(got[2].acquired.status == idem::AcquireStatus::duplicate);
    CHECK(got[3].acquired.status == idem::AcquireStatus::in_flight);  // "a" is 11's, asked again as 11
    CHECK(store.stats().resent - before.resent == 1);
    CHECK(store.stats().coalesced - before.coalesced == 4);
  }
  SECTION("the second sending lost too: every caller's outcome is unknown, never guessed") {
    const std::string ns = "lost2-" + random_hex() + ":";
    proxy.arm(idem::test::TcpProxy::Action::cut, 0, {}, true);  // cut, then refuse the reconnect
    const auto got = burst(io, store, ns,
                           {{.kind = Step::acquire, .key = "a", .token = 21},
                            {.kind = Step::acquire, .key = "b", .token = 22},
                            {.kind = Step::complete, .key = "c", .holder = {1, 23}, .text = "r"}});
    for (const auto& a : got) {
      INFO(describe(a));
      CHECK(a.error == "outcome_unknown");
    }
    proxy.refuse(false);
  }
}

TEST_CASE("auto-batching: min_replica_acks is checked per caller in a coalesced call", "[asio][batch]") {
  idem::test::ProxiedPair pair;
  IoThread io;
  idem::RedisOptions o = pair.master().options();
  o.min_replica_acks = 1;
  o.replica_ack_timeout = 300ms;
  idem::AsyncRedisStore store{io.io.get_executor(), o};
  const std::string ns = "acks-" + random_hex() + ":";
  auto a = store.acquire(ns + "dup", idem::test::acquire_params(1));
  REQUIRE(a.status == idem::AcquireStatus::acquired);
  REQUIRE(store.complete(ns + "dup", a.holder, "r", 60s) == idem::WriteStatus::ok);
  pair.hold_replication();
  const auto got = burst(io, store, ns,
                         {{.kind = Step::acquire, .key = "new", .token = 2}, {.kind = Step::acquire, .key = "dup", .token = 3}});
  // The claim that wrote is not trusted without its replica; the duplicate changed nothing.
  CHECK(got[0].error == "durability");
  CHECK(got[0].what.find("min_replica_acks") != std::string::npos);
  CHECK(got[1].error.empty());
  CHECK(got[1].acquired.status == idem::AcquireStatus::duplicate);
}

TEST_CASE("auto-batching: auto_batch outside 1..1024 is refused at construction", "[asio][batch]") {
  IoThread io;
  idem::RedisOptions o;
  o.auto_batch = 0;
  CHECK_THROWS_AS(idem::AsyncRedisStore(io.io.get_executor(), o), idem::invalid_options_error);
  o.auto_batch = 1025;
  CHECK_THROWS_AS(idem::AsyncRedisStore(io.io.get_executor(), o), idem::invalid_options_error);
}

static_assert(idem::BatchStore<idem::AsyncRedisStore>, "run_batch takes AsyncRedisStore's batch path");

TEST_CASE("auto-batching: run_batch on AsyncRedisStore leaves its acquisitions and completions coalesced",
          "[asio][batch]") {
  idem::test::AsyncRedisFactory f;
  idem::IdempotencyGuard guard{f.store(), {.lease = 10s, .retention = 60s}};
  const std::string ns = "runbatch-" + random_hex() + ":";
  // A key done before, one twice in the batch (acquired, then in_flight behind itself), the rest new.
  REQUIRE(guard.run(ns + "done", "", [] { return 7; }).status == idem::Status::executed);
  std::vector<std::string> keys{ns + "done", ns + "twice", ns + "twice"};
  for (int i = 0; i < 97; ++i) keys.push_back(ns + std::to_string(i));
  std::vector<idem::BatchItem> items;
  for (const auto& k : keys) items.push_back({.key = k});
  std::map<std::string, int> runs;
  const auto before = f.store().stats();
  auto r = guard.run_batch(items, [&](const idem::BatchItem& it) { return ++runs[std::string(it.key)]; });
  const auto after = f.store().stats();
  INFO("requests " << after.requests - before.requests << ", coalesced " << after.coalesced - before.coalesced);
  REQUIRE(r.outcomes.size() == items.size());
  CHECK(r.outcomes[0].status == idem::Status::duplicate);
  CHECK(runs[ns + "twice"] == 1);
  CHECK(runs.size() == 98);  // "twice" and the 97 new keys
  for (const auto& [k, n] : runs) CHECK(n == 1);
  // "done" answered by one MGET, 99 acquisitions and 98 completions in fewer script calls than
  // steps. How many completions meet in one call depends on scheduling (under TSan on a loaded
  // machine 58 calls were seen), so only the bound that holds by construction is checked: at least
  // the batch's acquisitions coalesce.
  CHECK(after.coalesced - before.coalesced >= 99);
  CHECK(after.requests - before.requests < 198);
  // Again: every key answered from its record, no handler; one MGET reads the usual completed
  // records, one script call decides the rest (a record MGET does not read, as for RedisStore).
  auto again = guard.run_batch(items, [&](const idem::BatchItem& it) { return ++runs[std::string(it.key)]; });
  for (const auto& o : again.outcomes) CHECK(o.status == idem::Status::duplicate);
  CHECK(f.store().stats().requests - after.requests <= 2);
  CHECK(runs.size() == 98);
  for (const auto& [k, n] : runs) CHECK(n == 1);
}

// As RedisStore's batches: with an ACL that refuses MGET the store warns once and every key goes
// through the script, with the same answers.
TEST_CASE("auto-batching: acquire_many on AsyncRedisStore without +mget warns once, every key through the script",
          "[asio][batch]") {
  static idem::test::RedisServer srv{{"user idem-nomget on >pw ~* -@all +evalsha +script|load +get +set +pttl "
                                      "+pexpire +time +config|get +info +ping"}};
  idem::RedisOptions o;
  o.url = "redis://idem-nomget:pw@127.0.0.1:" + std::to_string(srv.port()) + "/0";
  auto w = std::make_shared<idem::test::Warnings>();
  o.observer = w;
  IoThread io;
  idem::AsyncRedisStore store(io.io.get_executor(), o);
  const std::string ns = "nomget-" + random_hex() + ":";
  const std::string done = ns + "done", fresh = ns + "new";
  auto a = store.acquire(done, {.lease = 10s, .retention = 60s, .token = 1});
  REQUIRE(store.complete(done, a.holder, "r", 60s) == idem::WriteStatus::ok);
  for (std::uint64_t round = 0; round < 2; ++round) {
    const std::vector<idem::AcquireRequest> req{{done, {.lease = 10s, .retention = 60s, .token = 2 + 2 * round}},
                                                {fresh, {.lease = 10s, .retention = 60s, .token = 3 + 2 * round}}};
    const auto out = store.acquire_many(req);
    REQUIRE(out.size() == 2);
    CHECK(out[0].status == idem::AcquireStatus::duplicate);
    CHECK(out[0].payload == "r");
    CHECK(out[1].status == (round == 0 ? idem::AcquireStatus::acquired : idem::AcquireStatus::in_flight));
  }
  CHECK(w->count("+mget") == 1);
}

// acquire_batch and complete_batch of AsyncRedisStore answer as RedisStore's do (redis_store_test's
// "redis batch claim and complete"): in key order, a key twice one holder, bad input refused before
// anything is sent.
TEST_CASE("auto-batching: acquire_batch and complete_batch on AsyncRedisStore", "[asio][batch]") {
  idem::test::AsyncRedisFactory f;
  auto& store = f.store();
  const std::string ns = "abatch-" + random_hex() + ":";
  const idem::AcquireParams held{.lease = 10s, .retention = 60s, .token = 9};
  auto done = store.acquire(ns + "3", held);
  REQUIRE(store.complete(ns + "3", done.holder, "old", 60s) == idem::WriteStatus::ok);
  REQUIRE(store.acquire(ns + "5", held).status == idem::AcquireStatus::acquired);
  std::vector<std::string> names;
  for (int i = 0; i < 300; ++i) names.push_back(ns + std::to_string(i));
  names.push_back(ns + "7");  // twice: the second is in_flight behind the first
  std::vector<std::string_view> views(names.begin(), names.end());
  const idem::AcquireParams p{.lease = 10s, .retention = 60s, .token = 10};
  auto claims = store.acquire_batch(views, p);
  REQUIRE(claims.size() == views.size());
  std::vector<idem::CompleteItem> items;
  for (std::size_t i = 0; i < claims.size(); ++i) {
    INFO("key " << views[i]);
    if (i == 3) {
      CHECK(claims[i].status == idem::AcquireStatus::duplicate);
      CHECK(claims[i].payload == "old");
    } else if (i == 5 || i == 300) {
      CHECK(claims[i].status == idem::AcquireStatus::in_flight);
    } else {
      REQUIRE(claims[i].status == idem::AcquireStatus::acquired);
      CHECK(claims[i].holder.fence == 1);
      items.push_back({views[i], claims[i].holder, "ok"});
    }
  }
  items.push_back({views[3], idem::Holder{1, 10}, "stale"});  // not a holder: lease_lost
  const auto before = store.stats();
  const auto st = store.complete_batch(items, 60s);
  CHECK(store.stats().requests - before.requests < items.size());  // coalesced
  REQUIRE(st.size() == items.size());
  for (std::size_t i = 0; i + 1 < st.size(); ++i) CHECK(st[i] == idem::WriteStatus::ok);
  CHECK(st.back() == idem::WriteStatus::lease_lost);
  const auto again = store.acquire_batch(views, {.lease = 10s, .retention = 60s, .token = 11});
  for (std::size_t i = 0; i < again.size(); ++i)
    if (i != 5) CHECK(again[i].status == idem::AcquireStatus::duplicate);
  CHECK(store.acquire_batch({}, p).empty());
  CHECK(store.complete_batch({}, 60s).empty());
  const auto sent = store.stats().requests;
  const std::vector<std::string_view> with_empty{views[0], ""};
  CHECK_THROWS_AS(store.acquire_batch(with_empty, p), idem::invalid_key_error);
  const std::vector<idem::CompleteItem> bad{{views[0], idem::Holder{1, 10}, "x"}, {views[1], idem::Holder{0, 10}, "x"}};
  CHECK_THROWS_AS(store.complete_batch(bad, 60s), idem::usage_error);
  CHECK(store.stats().requests == sent);
}
