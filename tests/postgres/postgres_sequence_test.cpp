// PostgresSequenceStore on the fixture server: compare-and-set semantics (in order, older, equal,
// gaps, full uint64 range), an 8-thread race, SequenceGate in lease mode, run_sequenced in
// transactional mode (the advance commits with the business write, rolls back with a handler
// exception, a stale event answers Stale), bad input and binary-safe entity ids.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <limits>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "contract/sequence_race.hpp"
#include "idem/idem.hpp"
#include "idem/postgres.hpp"
#include "pg_support.hpp"
#if IDEM_TEST_ASYNC
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_future.hpp>

#include "idem/asio/sequence.hpp"
#endif

using namespace std::chrono_literals;
using idem::PostgresSequenceStore;
using idem::Status;

namespace {

idem::PostgresSequenceStoreOptions seq_options(std::string table = "seq_" + pgtest::random_hex(8)) {
  idem::PostgresSequenceStoreOptions o;
  o.schema = "idem_test";
  o.table = std::move(table);
  return o;
}

// A client of its own on the fixture server, for a sequence store without a PostgresStore.
std::shared_ptr<idem::PostgresClient> client(std::string conninfo = pgtest::conninfo()) {
  idem::PostgresOptions o = pgtest::options().client;
  o.conninfo = std::move(conninfo);
  return std::make_shared<idem::PostgresClient>(std::move(o));
}

std::string uid(std::string_view base) { return std::string(base) + "-" + pgtest::random_hex(8); }

}  // namespace

TEST_CASE("postgres sequence: compare-and-set in order, older, equal, gaps") {
  PostgresSequenceStore s{client(), seq_options()};
  const std::string e = uid("acct");
  CHECK_FALSE(s.last_applied(e).has_value());
  auto a = s.advance(e, 3);
  CHECK(a.advanced);
  CHECK_FALSE(a.previous.has_value());
  a = s.advance(e, 4);
  CHECK(a.advanced);
  CHECK(a.previous == 3u);
  a = s.advance(e, 2);
  CHECK_FALSE(a.advanced);
  CHECK(a.previous == 4u);
  a = s.advance(e, 4);
  CHECK_FALSE(a.advanced);
  CHECK(a.previous == 4u);
  a = s.advance(e, 10);
  CHECK(a.advanced);
  CHECK_FALSE(s.advance(e, 9).advanced);
  CHECK(s.last_applied(e) == 10u);
  const auto max = std::numeric_limits<std::uint64_t>::max();
  CHECK(s.advance(e, max - 1).advanced);
  CHECK(s.advance(e, max).advanced);
  CHECK_FALSE(s.advance(e, max).advanced);
  CHECK(s.last_applied(e) == max);
  const std::string f = uid("zero");
  CHECK(s.advance(f, 0).advanced);
  CHECK_FALSE(s.advance(f, 0).advanced);
  CHECK(s.erase(f));
  CHECK_FALSE(s.erase(f));
  CHECK_FALSE(s.last_applied(f).has_value());
}

TEST_CASE("postgres sequence: the table, its identifiers and its migration") {
  const std::string table = "seq_" + pgtest::random_hex(8);
  PostgresSequenceStore s{client(), seq_options(table)};
  CHECK(s.qualified_table() == "\"idem_test\".\"" + table + "\"");
  s.migrate();
  s.migrate();  // idempotent
  pgtest::Raw raw;
  CHECK(raw.scalar("SELECT data_type FROM information_schema.columns WHERE table_schema = 'idem_test' AND "
                   "table_name = '" + table + "' AND column_name = 'entity'") == "bytea");
  auto bad = seq_options();
  bad.table = "Robert'); DROP TABLE x;--";
  CHECK_THROWS_AS((PostgresSequenceStore{client(), bad}), idem::invalid_options_error);
  bad = seq_options();
  bad.schema = "pg_catalog";
  CHECK_THROWS_AS((PostgresSequenceStore{client(), bad}), idem::invalid_options_error);
  CHECK_THROWS_AS((PostgresSequenceStore{std::shared_ptr<idem::PostgresClient>(), seq_options()}),
                  idem::invalid_options_error);
  CHECK_THROWS_AS(idem::PostgresClient({.pool = {.size = 0}}), idem::invalid_options_error);

  auto off = seq_options();
  off.auto_migrate = false;
  PostgresSequenceStore unmigrated{client(), off};
  try {
    unmigrated.advance("a", 1);
    FAIL("no error");
  } catch (const idem::store_error& e) {
    CHECK(e.code() == "42P01");
    CHECK_FALSE(e.retryable());
  }
}

TEST_CASE("postgres sequence: binary-safe entity ids and bad input") {
  PostgresSequenceStore s{client(), seq_options()};
  const std::string a("acct\0one", 8), b("acct\0two", 8), odd = "\xff\xfe'\"\\x00;--";
  CHECK(s.advance(a, 5).advanced);
  CHECK(s.advance(b, 1).advanced);
  CHECK(s.advance(odd, 7).advanced);
  CHECK(s.last_applied(a) == 5u);
  CHECK(s.last_applied(b) == 1u);
  CHECK(s.last_applied(odd) == 7u);
  CHECK_FALSE(s.last_applied(std::string("acct", 4)).has_value());

  CHECK_THROWS_AS(s.advance("", 1), idem::invalid_entity_error);
  CHECK_THROWS_AS(s.last_applied(""), idem::invalid_entity_error);
  CHECK_THROWS_AS(s.advance(std::string(2000, 'x'), 1), idem::invalid_entity_error);
}

TEST_CASE("postgres sequence: an unreachable server is a connection_error") {
  PostgresSequenceStore s{client("host=127.0.0.1 port=1 connect_timeout=2"), seq_options()};
  CHECK_THROWS_AS(s.advance("a", 1), idem::connection_error);
}

TEST_CASE("postgres sequence: 8 threads on shared entities end at the max, each advance once") {
  PostgresSequenceStore s{client(), seq_options()};
  idem::contract::advance_race(s, uid("race"), 8, 3, 25);
}

namespace {

// Lease mode: a gate over a PostgresStore and its sequence store, and what the handler ran.
struct LeaseGate {
  idem::PostgresStore store = pgtest::store();
  PostgresSequenceStore seqs{store, seq_options()};
  idem::IdempotencyGuard<idem::PostgresStore> guard{store, {.lease = 10s, .retention = 1h}};
  idem::SequenceGate<PostgresSequenceStore> gate{seqs};
  const std::string ent = uid("acct");
  std::vector<std::uint64_t> ran;

  idem::SequencedEvent event(std::uint64_t seq) {
    keys.push_back(ent + "/evt-" + std::to_string(seq));
    return {.key = keys.back(), .entity = ent, .seq = seq};
  }
  auto handler(std::uint64_t seq) {
    return [this, seq] {
      ran.push_back(seq);
      return static_cast<long>(seq);
    };
  }
  std::deque<std::string> keys;  // the events' keys outlive each call
};

}  // namespace

TEST_CASE("postgres sequence: SequenceGate over PostgresStore (lease mode) answers stale") {
  LeaseGate f;
  auto deliver = [&](std::uint64_t seq) { return f.gate.run(f.guard, f.event(seq), f.handler(seq)); };
  CHECK(deliver(1).status == Status::executed);
  CHECK(deliver(3).status == Status::executed);
  auto o2 = deliver(2);
  CHECK(o2.status == Status::stale);
  CHECK(o2.last_applied == 3u);
  CHECK(deliver(3).status == Status::stale);
  CHECK(f.ran == std::vector<std::uint64_t>{1, 3});
  CHECK(f.seqs.last_applied(f.ent) == 3u);
}

#if IDEM_TEST_ASYNC
TEST_CASE("postgres sequence: SequenceGate::run_async over PostgresStore (lease mode) answers stale, advances") {
  LeaseGate f;
  auto deliver = [&](std::uint64_t seq) {
    boost::asio::io_context io;
    auto fut = boost::asio::co_spawn(io, f.gate.run_async(f.guard, f.event(seq), f.handler(seq)), boost::asio::use_future);
    io.run();
    return fut.get();
  };
  auto first = deliver(3);
  CHECK(first.status == Status::executed);
  CHECK(first.advanced);
  CHECK(first.last_applied == 3u);
  auto older = deliver(2);
  CHECK(older.status == Status::stale);
  CHECK(older.last_applied == 3u);
  CHECK(deliver(3).status == Status::stale);
  CHECK(deliver(4).value == 4L);
  CHECK(f.ran == std::vector<std::uint64_t>{3, 4});
  CHECK(f.seqs.last_applied(f.ent) == 4u);
  // A transactional-mode store is refused, at the call.
  idem::PostgresStore txs = pgtest::store(idem::PostgresMode::transactional);
  idem::IdempotencyGuard txg{txs, {.lease = 10s, .retention = 1h}};
  CHECK_THROWS_AS(f.gate.run_async(txg, {.key = "k", .entity = f.ent, .seq = 9}, [] { return 0L; }), idem::usage_error);
}
#endif

namespace {

// Transactional mode: a balance table written through ctx.tx, and the sequence in the same tx.
struct TxFixture {
  std::string accounts = "acct_" + pgtest::random_hex(8);
  idem::PostgresStore store = pgtest::store(idem::PostgresMode::transactional);
  PostgresSequenceStore seqs{store, seq_options()};
  std::shared_ptr<idem::CountingObserver> counts = std::make_shared<idem::CountingObserver>();
  idem::IdempotencyGuard<idem::PostgresStore> guard{
      store, {.lease = 10s, .retention = 1h, .failure = {.mode = idem::FailureMode::release}, .observer = counts}};
  pgtest::Raw raw;

  TxFixture() {
    store.migrate();  // creates schema idem_test when this test runs first (ctest -R, -j)
    raw.exec("CREATE TABLE idem_test." + accounts + " (id text PRIMARY KEY, balance bigint NOT NULL)");
  }
  ~TxFixture() {
    try {
      raw.exec("DROP TABLE IF EXISTS idem_test." + accounts);
    } catch (...) {
    }
  }
  std::string balance(const std::string& id) {
    return raw.scalar("SELECT balance FROM idem_test." + accounts + " WHERE id = '" + id + "'");
  }
  // Sets the balance to `value` (a state-replacing event), as the handler's business write.
  auto set_balance(const std::string& key, const std::string& id, std::uint64_t seq, long value, bool fail = false) {
    return idem::run_sequenced(guard, seqs, {.key = key, .entity = id, .seq = seq},
                               [&, value, fail](const auto& ctx) -> long {
                                 ctx.tx->exec("INSERT INTO idem_test." + accounts +
                                                  " (id, balance) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE "
                                                  "SET balance = EXCLUDED.balance",
                                              id, value);
                                 if (fail) throw std::runtime_error("handler failed after its write");
                                 return value;
                               });
  }
};

}  // namespace

TEST_CASE("postgres sequence: transactional advance commits with the business write") {
  TxFixture f;
  const std::string id = uid("a");
  auto o1 = f.set_balance(id + "/1", id, 1, 100);
  CHECK(o1.status == Status::executed);
  CHECK(o1.advanced);
  CHECK(o1.last_applied == 1u);
  CHECK(o1.value == 100L);
  CHECK(f.balance(id) == "100");
  CHECK(f.seqs.last_applied(id) == 1u);

  auto o3 = f.set_balance(id + "/3", id, 3, 300);
  CHECK(o3.status == Status::executed);
  CHECK(f.balance(id) == "300");

  auto o2 = f.set_balance(id + "/2", id, 2, 200);  // reordered: stale before any transaction
  CHECK(o2.status == Status::stale);
  CHECK(o2.action() == idem::BrokerAction::ack);
  CHECK(o2.last_applied == 3u);
  CHECK(f.balance(id) == "300");

  auto dup = f.set_balance(id + "/3", id, 3, 300);  // redelivery: stale by sequence
  CHECK(dup.status == Status::stale);
  CHECK(f.seqs.last_applied(id) == 3u);
}

TEST_CASE("postgres sequence: SequenceGate::run_batch advances inside each item's transaction") {
  TxFixture f;
  idem::SequenceGate gate{f.seqs};
  const std::string a = uid("a"), b = uid("b");
  REQUIRE(f.set_balance(a + "/2", a, 2, 200).status == Status::executed);
  // a: 1 stale, 3 runs; b: 1 runs, then 3 throws (its write and advance roll back together).
  // SequencedEvent holds views: the keys live here for the whole batch.
  const std::vector<std::string> keys{a + "/1", a + "/3", b + "/1", b + "/3"};
  const std::vector<idem::SequencedEvent> events{{.key = keys[0], .entity = a, .seq = 1},
                                                 {.key = keys[1], .entity = a, .seq = 3},
                                                 {.key = keys[2], .entity = b, .seq = 1},
                                                 {.key = keys[3], .entity = b, .seq = 3}};
  auto r = gate.run_batch(f.guard, events, [&](const idem::SequencedEvent& ev, const auto& ctx) -> long {
    const long value = static_cast<long>(ev.seq) * 100;
    ctx.tx->exec("INSERT INTO idem_test." + f.accounts +
                     " (id, balance) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET balance = EXCLUDED.balance",
                 std::string(ev.entity), value);
    if (ev.entity == b && ev.seq == 3) throw std::runtime_error("handler failed after its write");
    return value;
  });
  CHECK(r.outcomes[0].status == Status::stale);
  CHECK(r.outcomes[1].status == Status::executed);
  CHECK(r.sequence[1].advanced);
  CHECK(r.outcomes[2].status == Status::executed);
  CHECK(r.errors[3] != nullptr);
  CHECK_FALSE(r.sequence[3].advanced);
  CHECK(f.balance(a) == "300");
  CHECK(f.balance(b) == "100");  // b/3's write rolled back with its advance
  CHECK(f.seqs.last_applied(a) == 3u);
  CHECK(f.seqs.last_applied(b) == 1u);
}

TEST_CASE("postgres sequence: a handler exception rolls back the advance with the write") {
  TxFixture f;
  const std::string id = uid("b");
  CHECK(f.set_balance(id + "/1", id, 1, 10).status == Status::executed);
  CHECK_THROWS_AS(f.set_balance(id + "/2", id, 2, 20, /*fail=*/true), std::runtime_error);
  CHECK(f.balance(id) == "10");               // the write rolled back
  CHECK(f.seqs.last_applied(id) == 1u);       // and so did the advance
  auto retry = f.set_balance(id + "/2", id, 2, 20);  // the redelivery applies (failure released the key)
  CHECK(retry.status == Status::executed);
  CHECK(f.balance(id) == "20");
  CHECK(f.seqs.last_applied(id) == 2u);
}

TEST_CASE("postgres sequence: an event that became stale inside the transaction answers stale") {
  TxFixture f;
  const std::string id = uid("c");
  CHECK(f.set_balance(id + "/1", id, 1, 100).status == Status::executed);
  // Another transaction holds the entity's row and moves it to 7. Event 5 passes the unlocked
  // pre-check (it sees 1), then its in-transaction advance waits for the row; once 7 commits the
  // compare-and-set fails, so the handler must not run and the outcome is stale.
  pgtest::Raw other;
  other.exec("BEGIN");
  other.exec("UPDATE " + f.seqs.qualified_table() + " SET last_seq = 7 WHERE entity = convert_to('" + id +
             "', 'UTF8')");
  std::atomic<bool> ran{false};
  idem::SequencedOutcome<long> out;
  std::thread t([&] {
    out = idem::run_sequenced(f.guard, f.seqs, {.key = id + "/5", .entity = id, .seq = 5}, [&](const auto&) {
      ran = true;
      return 500L;
    });
  });
  bool waiting = false;
  for (int i = 0; i < 200 && !waiting; ++i) {  // up to 10 s for the advance to block on the row
    waiting = f.raw.scalar("SELECT count(*) FROM pg_stat_activity WHERE " +
                           std::to_string(PQbackendPID(other.get())) + " = ANY(pg_blocking_pids(pid))") != "0";
    if (!waiting) std::this_thread::sleep_for(50ms);
  }
  other.exec("COMMIT");
  t.join();
  CHECK(waiting);
  CHECK(out.status == Status::stale);
  CHECK(out.last_applied == 7u);
  CHECK_FALSE(out.advanced);
  CHECK_FALSE(ran);
  CHECK(f.balance(id) == "100");
  CHECK(f.seqs.last_applied(id) == 7u);
  CHECK(f.counts->count(Status::executed) == 1);  // event 1 only: the stale run is reported once, as stale
  CHECK(f.counts->count(Status::stale) == 1);
  CHECK(f.counts->handler_errors() == 0);
  // The transaction rolled back: no record, no failure counted; the redelivery is stale at the check.
  CHECK_FALSE(f.store.inspect(id + "/5").has_value());
  CHECK(idem::run_sequenced(f.guard, f.seqs, {.key = id + "/5", .entity = id, .seq = 5}, [] { return 1L; }).status ==
        Status::stale);
}

TEST_CASE("postgres sequence: run_sequenced stores the handler's result as guard.run does") {
  TxFixture f;
  const std::string id = uid("o");
  CHECK(f.set_balance(id + "/2", id, 2, 42).status == Status::executed);
  auto direct = f.guard.run(id + "/2", [] { return 0L; });  // the same key through the guard directly
  CHECK(direct.status == Status::duplicate);
  CHECK(direct.value == 42L);
}

TEST_CASE("postgres sequence: concurrent events of one entity serialise on the row lock") {
  TxFixture f;
  const std::string id = uid("d");
  // 8 threads deliver shuffled, duplicated events 1..40 (value = seq * 10). The final balance must
  // be that of the highest sequence and the sequence must end there; no stale event may commit.
  constexpr int threads = 8, events = 40;
  std::atomic<int> executed{0}, stale{0}, other{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 11u);
      std::vector<std::uint64_t> seqs;
      for (std::uint64_t q = 1; q <= events; ++q) seqs.push_back(q);
      std::shuffle(seqs.begin(), seqs.end(), rng);
      for (auto q : seqs) {
        for (int attempt = 0; attempt < 200; ++attempt) {
          auto o = f.set_balance(id + "/" + std::to_string(q), id, q, static_cast<long>(q) * 10);
          if (o.status == Status::in_flight) {
            std::this_thread::sleep_for(5ms);
            continue;
          }
          if (o.status == Status::executed) ++executed;
          else if (o.status == Status::stale || o.status == Status::duplicate) ++stale;
          else ++other;
          break;
        }
      }
    });
  }
  for (auto& th : pool) th.join();
  CHECK(other == 0);
  CHECK(executed >= 1);
  CHECK(executed + stale == threads * events);
  CHECK(f.seqs.last_applied(id) == std::uint64_t{events});
  CHECK(f.balance(id) == std::to_string(events * 10));
}

TEST_CASE("postgres sequence: run_sequenced refuses a lease-mode store") {
  idem::PostgresStore store = pgtest::store();
  PostgresSequenceStore seqs{store, seq_options()};
  idem::IdempotencyGuard guard{store};
  CHECK_THROWS_AS(idem::run_sequenced(guard, seqs, "k", "e", 1, [] {}), idem::usage_error);
  CHECK_THROWS_AS(idem::run_sequenced(guard, seqs, "k", "", 1, [] {}), idem::invalid_entity_error);
}

TEST_CASE("postgres sequence: run_sequenced contiguous mode requeues gaps (deltas)") {
  TxFixture f;
  const std::string id = uid("e");
  const idem::SequenceGateOptions contiguous{.contiguous = true, .first = 1, .gap_retry_after = idem::millis{7}};
  std::vector<std::uint64_t> ran;
  auto deliver = [&](std::uint64_t seq) {
    return idem::run_sequenced(f.guard, f.seqs, contiguous, {.key = id + "/" + std::to_string(seq), .entity = id, .seq = seq},
                               [&](const auto& ctx) {
                                 ctx.tx->exec("INSERT INTO idem_test." + f.accounts +
                                                  " (id, balance) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE "
                                                  "SET balance = idem_test." + f.accounts + ".balance + EXCLUDED.balance",
                                              id, static_cast<long>(seq));
                                 ran.push_back(seq);
                               });
  };
  auto early = deliver(2);  // 1 has not been applied: wait
  CHECK(early.status == Status::in_flight);
  CHECK(early.gap);
  CHECK(early.retry_after == idem::millis{7});
  CHECK(early.action() == idem::BrokerAction::requeue);
  CHECK(f.seqs.last_applied(id) == std::nullopt);
  CHECK(deliver(1).status == Status::executed);
  CHECK(deliver(3).gap);
  CHECK(deliver(2).status == Status::executed);
  CHECK(deliver(3).status == Status::executed);
  CHECK(deliver(2).status == Status::stale);  // a duplicate of an applied delta is acked
  CHECK(deliver(0).status == Status::stale);
  CHECK(ran == std::vector<std::uint64_t>{1, 2, 3});
  CHECK(f.balance(id) == "6");
}

TEST_CASE("postgres sequence: a pooled connection ended by the server is dropped, not used") {
  const std::string table = "seq_" + pgtest::random_hex(8);
  PostgresSequenceStore s{client(), seq_options(table)};
  const std::string e = uid("kill");
  CHECK(s.advance(e, 1).advanced);
  pgtest::Raw raw;
  const std::string mine = "FROM pg_stat_activity WHERE pid <> pg_backend_pid() AND query LIKE '%" + table + "%'";
  raw.exec("SELECT pg_terminate_backend(pid) " + mine);
  for (int i = 0; i < 100 && raw.scalar("SELECT count(*) " + mine) != "0"; ++i) std::this_thread::sleep_for(50ms);
  CHECK(s.advance(e, 2).advanced);
  CHECK(s.last_applied(e) == 2u);
}

TEST_CASE("postgres sequence: a store and a sequence store migrating a fresh schema together both succeed") {
  pgtest::Raw raw;
  for (int round = 0; round < 12; ++round) {
    const std::string schema = "race_" + pgtest::random_hex(8);
    auto so = pgtest::options();
    so.store.schema = schema;
    idem::PostgresStore store{so.client, so.store};
    auto qo = seq_options();
    qo.schema = schema;
    PostgresSequenceStore seqs{store, qo};
    std::atomic<int> ready{0};
    std::exception_ptr e1, e2;
    auto go = [&](auto&& f, std::exception_ptr& err) {
      return std::thread([&, f]() mutable {
        ready.fetch_add(1);
        while (ready.load() < 2) std::this_thread::yield();
        try {
          f();
        } catch (...) {
          err = std::current_exception();
        }
      });
    };
    std::thread a = go([&] { store.migrate(); }, e1);
    std::thread b = go([&] { seqs.migrate(); }, e2);
    a.join();
    b.join();
    raw.exec("DROP SCHEMA " + schema + " CASCADE");
    REQUIRE_NOTHROW(e1 ? std::rethrow_exception(e1) : void());
    REQUIRE_NOTHROW(e2 ? std::rethrow_exception(e2) : void());
  }
}
