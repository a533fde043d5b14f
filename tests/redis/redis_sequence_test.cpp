// RedisSequenceStore against a real redis-server started by the test: compare-and-set semantics
// (in order, older, equal, gaps, full uint64 range), key layout and hash slot, script reload after
// SCRIPT FLUSH, an 8-thread race, SequenceGate over RedisStore, bad input, binary-safe entities,
// corrupt values and a dead server (typed errors, fail closed).
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "contract/sequence_race.hpp"
#include "idem/idem.hpp"
#include "idem/redis.hpp"
#include "idem/redis/hash_slot.hpp"
#include "redis_factory.hpp"
#if IDEM_TEST_ASYNC
#include "asio_factory.hpp"
#include "idem/asio/sequence.hpp"
#include "idem/asio/sequence_store.hpp"
#endif

using namespace std::chrono_literals;
using idem::RedisSequenceStore;
using idem::Status;
using idem::test::RedisServer;

namespace {

RedisServer& server() {
  static RedisServer s;
  return s;
}

idem::RedisOptions opts() {
  idem::RedisOptions o = server().options();
  o.pool.size = 16;
  o.key_prefix = "seqtest-" + idem::test::random_hex() + ":";
  return o;
}

// A RedisStore, its guard and a RedisSequenceStore on the same server (and key prefix): the
// blocking face. The cases written over `TestType` run on both faces of the engine.
struct GateFixture {
  idem::RedisOptions o = opts();
  idem::RedisStore store{o};
  RedisSequenceStore seqs{store};
  idem::IdempotencyGuard<idem::RedisStore> guard{store, {.lease = 10s, .retention = 1h}};
};

#if IDEM_TEST_ASYNC
idem::test::IoThread& io_thread() {
  static idem::test::IoThread io;
  return io;
}
// The same on AsyncRedisStore's connections (AsyncRedisSequenceStore): the async face.
struct AsyncGateFixture {
  idem::RedisOptions o = opts();
  idem::AsyncRedisStore store{io_thread().io.get_executor(), o};
  idem::AsyncRedisSequenceStore seqs{store};
  idem::IdempotencyGuard<idem::AsyncRedisStore> guard{store, {.lease = 10s, .retention = 1h}};
};
#define IDEM_SEQ_FACES GateFixture, AsyncGateFixture
#else
#define IDEM_SEQ_FACES GateFixture
#endif

}  // namespace

TEMPLATE_TEST_CASE("redis sequence: compare-and-set in order, older, equal, gaps", "", IDEM_SEQ_FACES) {
  TestType f;
  auto& s = f.seqs;
  CHECK_FALSE(s.last_applied("acct-1").has_value());

  auto a = s.advance("acct-1", 3);
  CHECK(a.advanced);
  CHECK_FALSE(a.previous.has_value());
  CHECK(s.last_applied("acct-1") == 3u);

  a = s.advance("acct-1", 4);  // in order
  CHECK(a.advanced);
  CHECK(a.previous == 4u - 1);

  a = s.advance("acct-1", 2);  // older
  CHECK_FALSE(a.advanced);
  CHECK(a.previous == 4u);

  a = s.advance("acct-1", 4);  // equal never advances
  CHECK_FALSE(a.advanced);
  CHECK(a.previous == 4u);

  a = s.advance("acct-1", 10);  // gap allowed
  CHECK(a.advanced);
  CHECK(a.previous == 4u);
  a = s.advance("acct-1", 9);  // the skipped one is now stale
  CHECK_FALSE(a.advanced);
  CHECK(s.last_applied("acct-1") == 10u);

  CHECK_FALSE(s.last_applied("acct-2").has_value());  // entities are independent
  CHECK(s.advance("acct-2", 0).advanced);             // 0 is a valid first sequence
  CHECK_FALSE(s.advance("acct-2", 0).advanced);
}

TEMPLATE_TEST_CASE("redis sequence: exact over the whole uint64 range (decimal compare, not Lua doubles)", "", IDEM_SEQ_FACES) {
  TestType f;
  auto& s = f.seqs;
  const std::uint64_t two53 = std::uint64_t{1} << 53;  // 2^53 + 1 is 2^53 as a Lua double
  CHECK(s.advance("e", two53).advanced);
  CHECK(s.advance("e", two53 + 1).advanced);
  CHECK_FALSE(s.advance("e", two53).advanced);
  CHECK(s.last_applied("e") == two53 + 1);
  CHECK(s.advance("e", 99999999999999999).advanced);
  CHECK(s.advance("e", 100000000000000000).advanced);  // longer string is larger
  const auto max = std::numeric_limits<std::uint64_t>::max();
  CHECK(s.advance("e", max - 1).advanced);
  CHECK(s.advance("e", max).advanced);
  CHECK_FALSE(s.advance("e", max).advanced);
  CHECK(s.last_applied("e") == max);
}

TEST_CASE("redis sequence: key layout, hash tag shared with tagged idempotency keys") {
  auto o = opts();
  RedisSequenceStore s{o};
  idem::RedisStore store{o};
  CHECK(s.sequence_key("acct-42") == o.key_prefix + "seq:{acct-42}");
  s.advance("acct-42", 7);
  CHECK(server().command({"GET", o.key_prefix + "seq:{acct-42}"}) == "7");
  CHECK(server().command({"PTTL", o.key_prefix + "seq:{acct-42}"}) == "-1");  // never expires
  CHECK(idem::redis_hash_slot(s.sequence_key("acct-42")) ==
        idem::redis_hash_slot(store.redis_key("{acct-42}:evt-9")));
  // The client loaded the compare-and-set script under the SHA1 of its generated file.
  CHECK(server().command({"SCRIPT", "EXISTS", idem::test::generated_script_sha(server(), "seq/sequence_advance")}) ==
        "1");
  CHECK(s.erase("acct-42"));
  CHECK_FALSE(s.erase("acct-42"));
  CHECK_FALSE(s.last_applied("acct-42").has_value());
}

TEMPLATE_TEST_CASE("redis sequence: the script reloads itself after SCRIPT FLUSH", "", IDEM_SEQ_FACES) {
  TestType f;
  auto& s = f.seqs;
  CHECK(s.advance("x", 1).advanced);
  server().command({"SCRIPT", "FLUSH"});
  CHECK(s.advance("x", 2).advanced);
  CHECK(s.last_applied("x") == 2u);
}

TEMPLATE_TEST_CASE("redis sequence: binary-safe entity ids", "", IDEM_SEQ_FACES) {
  TestType f;
  auto& s = f.seqs;
  const std::string a("acct\0one", 8), b("acct\0two", 8), braces = "{x}y}\r\n\xff";
  CHECK(s.advance(a, 5).advanced);
  CHECK(s.advance(b, 1).advanced);
  CHECK(s.advance(braces, 9).advanced);
  CHECK(s.last_applied(a) == 5u);
  CHECK(s.last_applied(b) == 1u);
  CHECK(s.last_applied(braces) == 9u);
  CHECK_FALSE(s.last_applied(std::string("acct", 4)).has_value());
}

TEMPLATE_TEST_CASE("redis sequence: bad input and damaged values are typed errors", "", IDEM_SEQ_FACES) {
  TestType f;
  auto& s = f.seqs;
  CHECK_THROWS_AS(s.advance("", 1), idem::invalid_entity_error);
  CHECK_THROWS_AS(s.last_applied(""), idem::invalid_entity_error);
  CHECK_THROWS_AS(s.advance(std::string(2000, 'x'), 1), idem::invalid_entity_error);

  server().command({"SET", s.sequence_key("junk"), "12abc"});
  CHECK_THROWS_AS(s.advance("junk", 1), idem::corrupt_record_error);  // the script refuses it
  CHECK_THROWS_AS(s.last_applied("junk"), idem::corrupt_record_error);
  CHECK(server().command({"GET", s.sequence_key("junk")}) == "12abc");  // nothing overwritten

  server().command({"LPUSH", s.sequence_key("list"), "1"});
  try {
    s.advance("list", 1);
    FAIL("no error");
  } catch (const idem::store_error& e) {
    CHECK(e.code() == "WRONGTYPE");
    CHECK_FALSE(e.retryable());
  }
}

TEST_CASE("redis sequence: a moved-from store refuses calls") {
  RedisSequenceStore s{opts()};
  RedisSequenceStore moved = std::move(s);
  CHECK_THROWS_AS(s.advance("a", 1), idem::usage_error);  // NOLINT(bugprone-use-after-move)
  CHECK(moved.advance("a", 1).advanced);
}

TEST_CASE("redis sequence: an unreachable server is a connection_error") {
  idem::RedisOptions o;
  o.host = "127.0.0.1";
  o.port = idem::test::free_port();
  o.connect_timeout = 500ms;
  CHECK_THROWS_AS(RedisSequenceStore{o}, idem::connection_error);
  o.pool.size = 0;
  CHECK_THROWS_AS(RedisSequenceStore{o}, idem::invalid_options_error);
}

TEMPLATE_TEST_CASE("redis sequence: 8 threads on shared entities end at the max, each advance once", "", IDEM_SEQ_FACES) {
  TestType f;
  auto& s = f.seqs;
  idem::contract::advance_race(s, "ent-", 8, 4, 60);
}

TEMPLATE_TEST_CASE("redis sequence: SequenceGate over RedisStore answers stale and advances", "", IDEM_SEQ_FACES) {
  TestType f;
  auto& [o, store, seqs, guard] = f;
  idem::SequenceGate gate{seqs};
  std::vector<std::uint64_t> ran;
  auto deliver = [&](std::uint64_t seq, std::string_view entity = "acct-1") {
    const std::string key = "{" + std::string(entity) + "}:evt-" + std::to_string(seq);
    return gate.run(guard, {.key = key, .entity = entity, .seq = seq}, [&] {
      ran.push_back(seq);
      return static_cast<long>(seq);
    });
  };
  auto o1 = deliver(1);
  CHECK(o1.status == Status::executed);
  CHECK(o1.advanced);
  auto o3 = deliver(3);
  CHECK(o3.status == Status::executed);
  auto o2 = deliver(2);  // reordered: older than 3
  CHECK(o2.status == Status::stale);
  CHECK(o2.action() == idem::BrokerAction::ack);
  CHECK(o2.last_applied == 3u);
  auto o3b = deliver(3);  // duplicate delivery of 3: stale by sequence
  CHECK(o3b.status == Status::stale);
  CHECK(ran == std::vector<std::uint64_t>{1, 3});
  CHECK(seqs.last_applied("acct-1") == 3u);
  CHECK(gate.last_applied("acct-1") == 3u);

  // Crash between completion and advance: the redelivery is a duplicate that repairs the advance.
  auto first = guard.run("{acct-1}:evt-5", [&] { return 5L; });
  CHECK(first.status == Status::executed);
  auto o5 = deliver(5);
  CHECK(o5.status == Status::duplicate);
  CHECK(o5.advanced);
  CHECK(seqs.last_applied("acct-1") == 5u);

  // A throwing handler does not advance.
  CHECK_THROWS_AS(gate.run(guard, {.key = "{acct-1}:evt-6", .entity = "acct-1", .seq = 6},
                           [&]() -> long { throw std::runtime_error("boom"); }),
                  std::runtime_error);
  CHECK(seqs.last_applied("acct-1") == 5u);
}

namespace {
long evalsha_calls() {
  const std::string info = server().command({"INFO", "commandstats"});
  const auto at = info.find("cmdstat_evalsha:calls=");
  return at == std::string::npos ? 0 : std::stol(info.substr(at + 22));
}
}  // namespace

TEMPLATE_TEST_CASE("redis sequence: SequenceGate completes and advances in one script", "", IDEM_SEQ_FACES) {
  TestType f;
  auto& [o, store, seqs, guard] = f;
  idem::SequenceGate gate{seqs};
  int ran = 0;
  auto handler = [&] { return ++ran; };

  const long before = evalsha_calls();
  auto out = gate.run(guard, {.key = "{acct-9}:evt-1", .entity = "acct-9", .seq = 1}, handler);
  CHECK(out.status == Status::executed);
  CHECK(out.advanced);
  CHECK(out.last_applied == 1u);
  CHECK(evalsha_calls() - before == 2);  // acquire, then complete_advance: no separate advance
  CHECK(seqs.last_applied("acct-9") == 1u);
  auto rec = store.inspect("{acct-9}:evt-1");
  REQUIRE(rec);
  CHECK(rec->state == idem::State::completed);

  const long before_stale = evalsha_calls();
  CHECK(gate.run(guard, {.key = "{acct-9}:evt-1", .entity = "acct-9", .seq = 1}, handler).status == Status::stale);
  CHECK(evalsha_calls() == before_stale);  // one GET answers a stale redelivery
  CHECK(ran == 1);

  // A completion that lost its lease writes nothing and advances nothing.
  idem::AcquireParams p{.lease = 10s, .retention = 1h, .token = 77};
  auto a = store.acquire("{acct-9}:evt-2", p);
  REQUIRE(a.status == idem::AcquireStatus::acquired);
  idem::Holder stale_holder = a.holder;
  stale_holder.token = 78;
  auto lost = seqs.complete_advance(store, "{acct-9}:evt-2", stale_holder, "r", 1h, "acct-9", 2);
  CHECK(lost.status == idem::WriteStatus::lease_lost);
  CHECK_FALSE(lost.advance.advanced);
  CHECK(seqs.last_applied("acct-9") == 1u);
  CHECK(store.inspect("{acct-9}:evt-2")->state == idem::State::in_progress);
  auto won = seqs.complete_advance(store, "{acct-9}:evt-2", a.holder, "r", 1h, "acct-9", 2);
  CHECK(won.status == idem::WriteStatus::ok);
  CHECK(won.advance.advanced);
  CHECK(won.advance.previous == 1u);
  // An older event completing later (it passed the check before 2 advanced) records, never goes back.
  auto b = store.acquire("{acct-9}:evt-0", p);
  auto older = seqs.complete_advance(store, "{acct-9}:evt-0", b.holder, "", 1h, "acct-9", 0);
  CHECK(older.status == idem::WriteStatus::ok);
  CHECK_FALSE(older.advance.advanced);
  CHECK(older.advance.previous == 2u);
  CHECK(seqs.last_applied("acct-9") == 2u);
}

TEMPLATE_TEST_CASE("redis sequence: a damaged sequence key fails closed after the result is recorded", "",
                   IDEM_SEQ_FACES) {
  TestType f;
  auto& [o, store, seqs, guard] = f;
  int ran = 0;
  auto handler = [&] { return ++ran; };
  idem::AcquireParams p{.lease = 10s, .retention = 1h, .token = 5};

  // Damaged between the gate's check and the completion: the record completes (the effect is
  // recorded, so no redelivery runs it again), the key is not overwritten, the caller gets the error.
  auto a = store.acquire("{junk}:evt-1", p);
  server().command({"SET", seqs.sequence_key("junk"), "12abc"});
  CHECK_THROWS_AS(seqs.complete_advance(store, "{junk}:evt-1", a.holder, "", 1h, "junk", 1),
                  idem::corrupt_record_error);
  CHECK(store.inspect("{junk}:evt-1")->state == idem::State::completed);
  CHECK(server().command({"GET", seqs.sequence_key("junk")}) == "12abc");
  idem::SequenceGate gate{seqs};
  CHECK_THROWS_AS(gate.run(guard, {.key = "{junk}:evt-1", .entity = "junk", .seq = 1}, handler),
                  idem::corrupt_record_error);  // the redelivery stops at the same key
  CHECK(ran == 0);

  auto l = store.acquire("{list}:evt-1", p);
  server().command({"LPUSH", seqs.sequence_key("list"), "1"});
  try {
    seqs.complete_advance(store, "{list}:evt-1", l.holder, "", 1h, "list", 1);
    FAIL("no error");
  } catch (const idem::store_error& e) {
    CHECK(e.code() == "WRONGTYPE");
  }
  CHECK(store.inspect("{list}:evt-1")->state == idem::State::completed);
  auto c = store.acquire("{acct}:evt-1", p);
  CHECK_THROWS_AS(seqs.complete_advance(store, "{acct}:evt-1", c.holder, "", 1h, "", 1), idem::invalid_entity_error);
  CHECK(store.inspect("{acct}:evt-1")->state == idem::State::in_progress);
}

TEST_CASE("redis sequence: complete_advance is refused for a store on another client") {
  GateFixture f;
  auto& [o, store, seqs, guard] = f;
  idem::AcquireParams p{.lease = 10s, .retention = 1h, .token = 5};
  // One script writes both keys: a sequence store on another database cannot complete for this store.
  auto other = o;
  other.db = 1;
  RedisSequenceStore elsewhere{other};
  auto c = store.acquire("{acct}:evt-1", p);
  CHECK_THROWS_AS(elsewhere.complete_advance(store, "{acct}:evt-1", c.holder, "", 1h, "acct", 1), idem::usage_error);
  // Nor can one with the same options on a client of its own: the check is "the same client".
  RedisSequenceStore twin{o};
  CHECK_THROWS_AS(twin.complete_advance(store, "{acct}:evt-1", c.holder, "", 1h, "acct", 1), idem::usage_error);
  CHECK(store.inspect("{acct}:evt-1")->state == idem::State::in_progress);
}

#if IDEM_TEST_ASYNC
TEST_CASE("redis sequence: AsyncRedisSequenceStore completes only for its own store, and awaits") {
  AsyncGateFixture f;
  auto& [o, store, seqs, guard] = f;
  AsyncGateFixture other;
  idem::AcquireParams p{.lease = 10s, .retention = 1h, .token = 5};
  auto c = store.acquire("{acct}:evt-1", p);
  CHECK_THROWS_AS(other.seqs.complete_advance(store, "{acct}:evt-1", c.holder, "", 1h, "acct", 1), idem::usage_error);
  CHECK(store.inspect("{acct}:evt-1")->state == idem::State::in_progress);
  // The async members, awaited.
  auto& io = io_thread();
  const auto first = io.run([&]() -> boost::asio::awaitable<idem::AdvanceResult> {
    co_return co_await seqs.async_advance("acct", 4, boost::asio::use_awaitable);
  }());
  CHECK(first.advanced);
  const auto done = io.run([&]() -> boost::asio::awaitable<idem::CompleteAdvanceResult> {
    co_return co_await seqs.async_complete_advance(store, "{acct}:evt-1", c.holder, "r", 1h, "acct", 5,
                                                   boost::asio::use_awaitable);
  }());
  CHECK(done.status == idem::WriteStatus::ok);
  CHECK(done.advance.previous == 4u);
  const auto last = io.run([&]() -> boost::asio::awaitable<std::optional<std::uint64_t>> {
    co_return co_await seqs.async_last_applied("acct", boost::asio::use_awaitable);
  }());
  CHECK(last == 5u);
  // Bad input fails the awaited call, nothing sent.
  CHECK_THROWS_AS(io.run([&]() -> boost::asio::awaitable<idem::AdvanceResult> {
                    co_return co_await seqs.async_advance("", 1, boost::asio::use_awaitable);
                  }()),
                  idem::invalid_entity_error);
}
#endif

#if IDEM_TEST_ASYNC
TEMPLATE_TEST_CASE("redis sequence: SequenceGate::run_async answers stale and advances with the completion", "",
                   IDEM_SEQ_FACES) {
  TestType f;
  auto& [o, store, seqs, guard] = f;
  idem::SequenceGate gate{seqs};
  int ran = 0;
  auto deliver = [&](std::uint64_t seq) {
    const std::string key = "{acct-a}:evt-" + std::to_string(seq);
    return io_thread().run(gate.run_async(guard, {.key = key, .entity = "acct-a", .seq = seq}, [&] { return ++ran; }));
  };
  const long before = evalsha_calls();
  auto out = deliver(2);
  CHECK(out.status == Status::executed);
  CHECK(out.advanced);
  CHECK(out.last_applied == 2u);
  CHECK(evalsha_calls() - before == 2);  // acquire, then complete_advance: the advance rode the completion
  CHECK(seqs.last_applied("acct-a") == 2u);
  auto older = deliver(1);
  CHECK(older.status == Status::stale);
  CHECK(older.last_applied == 2u);
  CHECK(older.action() == idem::BrokerAction::ack);
  CHECK_FALSE(store.inspect("{acct-a}:evt-1"));  // no claim, no record
  CHECK(deliver(2).status == Status::stale);
  auto newer = deliver(5);
  CHECK(newer.status == Status::executed);
  CHECK(newer.last_applied == 5u);
  CHECK(ran == 2);
  // A handler that awaits, and one that throws: the throw advances nothing.
  auto awaited = io_thread().run(gate.run_async(guard, {.key = "{acct-a}:evt-6", .entity = "acct-a", .seq = 6},
                                                []() -> boost::asio::awaitable<int> { co_return 66; }));
  CHECK(awaited.value == 66);
  CHECK(awaited.advanced);
  CHECK_THROWS_AS(io_thread().run(gate.run_async(guard, {.key = "{acct-a}:evt-7", .entity = "acct-a", .seq = 7},
                                                 []() -> int { throw std::runtime_error("boom"); })),
                  std::runtime_error);
  CHECK(seqs.last_applied("acct-a") == 6u);
  // Bad input is refused at the call, before anything is sent.
  CHECK_THROWS_AS(gate.run_async(guard, {.key = "{acct-a}:evt-8", .entity = "", .seq = 8}, [] { return 0; }),
                  idem::invalid_entity_error);
}
#endif

TEST_CASE("redis sequence: stores over one shared RedisClient complete and advance in one script") {
  auto client = std::make_shared<idem::RedisClient>(opts());
  idem::RedisStore store{client};
  RedisSequenceStore seqs{client};
  CHECK(store.client() == seqs.client());
  CHECK(seqs.options().port == client->options().port);
  auto a = store.acquire("{shared}:evt-1", idem::AcquireParams{.lease = 10s, .retention = 1h, .token = 7});
  REQUIRE(a.status == idem::AcquireStatus::acquired);
  auto r = seqs.complete_advance(store, "{shared}:evt-1", a.holder, "done", 1h, "shared", 1);
  CHECK(r.status == idem::WriteStatus::ok);
  CHECK(r.advance.advanced);
  CHECK(store.inspect("{shared}:evt-1")->result == "done");
  CHECK(seqs.last_applied("shared") == 1u);
  CHECK_THROWS_AS(RedisSequenceStore{std::shared_ptr<idem::RedisClient>{}}, idem::usage_error);
}
