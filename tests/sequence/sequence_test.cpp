// SequenceGate and MemorySequenceStore: in-order, out-of-order, duplicate, equal, gaps, contiguous
// mode, the concurrent "became stale while running" case, an 8-thread race, and bad input; and the
// same decisions through every driver of the gate (run, run_batch, run_async).
#include "idem/sequence/gate.hpp"

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <future>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#if IDEM_TEST_ASYNC
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_future.hpp>

#include "idem/asio/sequence.hpp"
#endif

using namespace std::chrono_literals;
using idem::Status;

namespace {

struct Fixture {
  idem::MemoryStore store{idem::MemoryStoreOptions{.shards = 8, .max_records = 0}};
  idem::MemorySequenceStore seqs{idem::MemorySequenceStoreOptions{.shards = 8}};
  std::shared_ptr<idem::CountingObserver> stats = std::make_shared<idem::CountingObserver>();
  idem::IdempotencyGuard<idem::MemoryStore> guard{store, {.lease = 10s, .retention = 1h, .observer = stats}};
  idem::SequenceGate<idem::MemorySequenceStore> gate{seqs};
  std::vector<std::uint64_t> applied;  // sequences whose handler ran, in order

  auto deliver(std::uint64_t seq, std::string_view entity = "acct-1") {
    const std::string key = std::string(entity) + "/evt-" + std::to_string(seq);
    return gate.run(guard, {.key = key, .entity = entity, .seq = seq}, [&] {
      applied.push_back(seq);
      return static_cast<long>(seq) * 10;
    });
  }
};

}  // namespace

TEST_CASE("memory sequence store: compare-and-set advance", "[sequence][memory]") {
  idem::MemorySequenceStore s;
  CHECK_FALSE(s.last_applied("e").has_value());
  auto a = s.advance("e", 5);
  CHECK(a.advanced);
  CHECK_FALSE(a.previous.has_value());
  a = s.advance("e", 5);  // equal: never advances
  CHECK_FALSE(a.advanced);
  CHECK(a.previous == 5u);
  a = s.advance("e", 3);
  CHECK_FALSE(a.advanced);
  CHECK(a.previous == 5u);
  a = s.advance("e", 9);
  CHECK(a.advanced);
  CHECK(a.previous == 5u);
  CHECK(s.last_applied("e") == 9u);
  a = s.advance("other", 0);  // 0 is a valid first sequence
  CHECK(a.advanced);
  CHECK(s.size() == 2);
  CHECK(s.erase("e"));
  CHECK_FALSE(s.erase("e"));
  CHECK_FALSE(s.last_applied("e").has_value());
}

TEST_CASE("memory sequence store: bound on entities fails closed", "[sequence][memory]") {
  idem::MemorySequenceStore s{{.shards = 1, .max_entities = 2}};
  s.advance("a", 1);
  s.advance("b", 1);
  CHECK(s.advance("a", 2).advanced);  // existing entities still advance
  CHECK_THROWS_AS(s.advance("c", 1), idem::capacity_error);
  CHECK_THROWS_AS(idem::MemorySequenceStore({.shards = 0}), idem::invalid_options_error);
}

TEST_CASE("gate: in-order events all apply", "[sequence]") {
  Fixture f;
  for (std::uint64_t s = 1; s <= 5; ++s) {
    auto out = f.deliver(s);
    REQUIRE(out.status == Status::executed);
    CHECK(out.advanced);
    CHECK(out.last_applied == s);
    CHECK(out.value == static_cast<long>(s) * 10);
    CHECK(out.action() == idem::BrokerAction::ack);
  }
  CHECK(f.applied == std::vector<std::uint64_t>{1, 2, 3, 4, 5});
  CHECK(f.gate.last_applied("acct-1") == 5u);
}

TEST_CASE("gate: out-of-order older events are stale, handler not run, acked", "[sequence]") {
  Fixture f;
  REQUIRE(f.deliver(3).status == Status::executed);
  auto old = f.deliver(2);
  CHECK(old.status == Status::stale);
  CHECK(old.action() == idem::BrokerAction::ack);
  CHECK_FALSE(old.handler_ran());
  CHECK_FALSE(old.advanced);
  CHECK(old.last_applied == 3u);
  CHECK_FALSE(old.value.has_value());
  CHECK(f.deliver(1).status == Status::stale);
  CHECK(f.applied == std::vector<std::uint64_t>{3});
  // stale keys leave no idempotency record behind
  CHECK_FALSE(f.store.inspect("acct-1/evt-2").has_value());
  CHECK(f.stats->count(Status::stale) == 2);
  CHECK(f.stats->count(Status::executed) == 1);
}

TEST_CASE("gate: equal sequence is stale, even under a new key", "[sequence]") {
  Fixture f;
  REQUIRE(f.deliver(4).status == Status::executed);
  auto same =
      f.gate.run(f.guard, {.key = "another-id", .entity = "acct-1", .seq = 4}, [&] { f.applied.push_back(99); });
  CHECK(same.status == Status::stale);
  CHECK(same.last_applied == 4u);
  CHECK(f.applied == std::vector<std::uint64_t>{4});
}

TEST_CASE("gate: a redelivered event is stale once applied, duplicate replay repairs a missed advance", "[sequence]") {
  Fixture f;
  REQUIRE(f.deliver(1).status == Status::executed);
  CHECK(f.deliver(1).status == Status::stale);  // redelivery of the applied event
  CHECK(f.applied.size() == 1);

  // Completed in the guard but the advance never happened (a crash between the two steps on
  // stores where they are separate): the redelivery is a duplicate and advances the sequence.
  auto direct = f.guard.run("acct-1/evt-2", [] { return 20L; });
  REQUIRE(direct.status == Status::executed);
  CHECK(f.gate.last_applied("acct-1") == 1u);
  auto redelivered = f.deliver(2);
  CHECK(redelivered.status == Status::duplicate);
  CHECK(redelivered.value == 20L);
  CHECK(redelivered.advanced);
  CHECK(f.gate.last_applied("acct-1") == 2u);
  CHECK(f.applied.size() == 1);
}

TEST_CASE("gate: gaps are allowed by default", "[sequence]") {
  Fixture f;
  CHECK(f.deliver(10).status == Status::executed);
  CHECK(f.deliver(25).status == Status::executed);
  CHECK(f.deliver(11).status == Status::stale);  // filled in too late: older than 25
  CHECK(f.deliver(1000).status == Status::executed);
  CHECK(f.applied == std::vector<std::uint64_t>{10, 25, 1000});
}

TEST_CASE("gate: entities are independent", "[sequence]") {
  Fixture f;
  CHECK(f.deliver(5, "acct-a").status == Status::executed);
  CHECK(f.deliver(1, "acct-b").status == Status::executed);
  CHECK(f.deliver(4, "acct-a").status == Status::stale);
  CHECK(f.deliver(2, "acct-b").status == Status::executed);
}

TEST_CASE("gate: contiguous mode requeues an event whose predecessor is missing", "[sequence]") {
  Fixture f;
  idem::SequenceGate strict{f.seqs, {.contiguous = true, .first = 1, .gap_retry_after = 250ms}};
  std::vector<std::uint64_t> ran;
  auto deliver = [&](std::uint64_t seq) {
    return strict.run(f.guard, "acct-1/evt-" + std::to_string(seq), "acct-1", seq, [&] { ran.push_back(seq); });
  };
  auto early = deliver(2);
  CHECK(early.status == Status::in_flight);
  CHECK(early.gap);
  CHECK(early.retry_after == 250ms);
  CHECK(early.action() == idem::BrokerAction::requeue);
  CHECK_FALSE(f.store.inspect("acct-1/evt-2").has_value());  // no record: the redelivery is fresh
  CHECK(deliver(1).status == Status::executed);
  CHECK(deliver(3).gap);
  CHECK(deliver(2).status == Status::executed);
  CHECK(deliver(3).status == Status::executed);
  CHECK(deliver(2).status == Status::stale);
  CHECK(ran == std::vector<std::uint64_t>{1, 2, 3});
  // below `first` with nothing applied can never run
  CHECK(strict.run(f.guard, "x/evt-0", "x", 0, [&] { ran.push_back(0); }).status == Status::stale);
  CHECK_THROWS_AS(idem::SequenceGate(f.seqs, {.gap_retry_after = -1ms}), idem::invalid_options_error);
}

TEST_CASE("gate: guard outcomes pass through, handler errors do not advance", "[sequence]") {
  Fixture f;
  // mismatch: same key, another payload
  auto a = f.gate.run(f.guard, {.key = "k1", .entity = "e", .seq = 1, .payload = "amount=5"}, [] {});
  REQUIRE(a.status == Status::executed);
  auto b = f.gate.run(f.guard, {.key = "k1", .entity = "e", .seq = 2, .payload = "amount=6"}, [] {});
  CHECK(b.status == Status::mismatch);
  CHECK(b.action() == idem::BrokerAction::dead_letter);
  CHECK(f.gate.last_applied("e") == 1u);

  // a throwing handler: rethrown, sequence unchanged, a redelivery runs again (release policy)
  int calls = 0;
  auto boom = [&] {
    if (++calls == 1) throw std::runtime_error("downstream unavailable");
    return 7;
  };
  CHECK_THROWS_AS(f.gate.run(f.guard, "k3", "e", 3, boom), std::runtime_error);
  CHECK(f.gate.last_applied("e") == 1u);
  auto again = f.gate.run(f.guard, "k3", "e", 3, boom);
  CHECK(again.status == Status::executed);
  CHECK(again.value == 7);
  CHECK(f.gate.last_applied("e") == 3u);

  // in flight: another holder is running the same key
  auto r = f.store.acquire("k4", {.lease = 10s, .retention = 1h, .token = 42});
  REQUIRE(r.status == idem::AcquireStatus::acquired);
  auto busy = f.gate.run(f.guard, "k4", "e", 4, [] {});
  CHECK(busy.status == Status::in_flight);
  CHECK_FALSE(busy.gap);
  CHECK(busy.action() == idem::BrokerAction::requeue);
  CHECK(f.gate.last_applied("e") == 3u);
}

TEST_CASE("gate: an event that became stale while its handler ran is recorded, sequence kept", "[sequence]") {
  Fixture f;
  std::promise<void> started, release;
  auto release_f = release.get_future().share();
  auto slow = std::async(std::launch::async, [&] {
    return f.gate.run(f.guard, "evt-5", "acct", 5, [&] {
      started.set_value();
      release_f.wait();
      return 5;
    });
  });
  started.get_future().wait();
  auto fast = f.gate.run(f.guard, "evt-7", "acct", 7, [] { return 7; });
  REQUIRE(fast.status == Status::executed);
  CHECK(fast.advanced);
  release.set_value();
  auto late = slow.get();
  CHECK(late.status == Status::executed);  // it ran, and its result is recorded under its key
  CHECK(late.handler_ran());
  CHECK_FALSE(late.advanced);  // the compare-and-set lost: never goes backwards
  CHECK(late.last_applied == 7u);
  CHECK(f.gate.last_applied("acct") == 7u);
  auto rec = f.store.inspect("evt-5");
  REQUIRE(rec.has_value());
  CHECK(rec->state == idem::State::completed);
  CHECK(f.gate.run(f.guard, "evt-5", "acct", 5, [] { return -1; }).status == Status::stale);
}

TEST_CASE("gate: bad input is a typed error and changes nothing", "[sequence][validation]") {
  Fixture f;
  bool ran = false;
  CHECK_THROWS_AS(f.gate.run(f.guard, "k", "", 1, [&] { ran = true; }), idem::invalid_entity_error);
  CHECK_THROWS_AS(f.gate.run(f.guard, "k", std::string(2000, 'e'), 1, [&] { ran = true; }), idem::invalid_entity_error);
  CHECK_THROWS_AS(f.gate.run(f.guard, "", "acct", 1, [&] { ran = true; }), idem::invalid_key_error);
  CHECK_THROWS_AS(f.seqs.advance("", 1), idem::invalid_entity_error);
  CHECK_THROWS_AS(f.seqs.last_applied(""), idem::invalid_entity_error);
  CHECK_THROWS_AS(f.gate.last_applied(""), idem::invalid_entity_error);
  CHECK_THROWS_AS(idem::SequenceGate(f.seqs, {.max_entity_bytes = 0}), idem::invalid_options_error);
  try {
    f.gate.run(f.guard, "k", "", 1, [] {});
  } catch (const idem::usage_error& e) {
    CHECK_FALSE(e.retryable());
    CHECK(std::string(e.what()).find("entity") != std::string::npos);
  }
  CHECK_FALSE(ran);
  CHECK(f.seqs.size() == 0);
  CHECK(f.store.size() == 0);
}

TEST_CASE("gate: 8 threads race on shared entities with shuffled, duplicated sequences", "[sequence][race]") {
  constexpr int kEntities = 12, kSeqs = 60, kThreads = 8;
  idem::MemoryStore store{idem::MemoryStoreOptions{.shards = 16, .max_records = 0}};
  idem::MemorySequenceStore seqs{idem::MemorySequenceStoreOptions{.shards = 4}};
  idem::IdempotencyGuard guard{store, {.lease = 30s, .retention = 1h}};
  idem::SequenceGate gate{seqs};

  struct Delivery {
    int entity;
    int seq;
  };
  std::vector<Delivery> deliveries;
  std::mt19937 rng(20261122);
  for (int e = 0; e < kEntities; ++e)
    for (int s = 1; s <= kSeqs; ++s) {
      const int copies = 1 + static_cast<int>(rng() % 3);
      for (int c = 0; c < copies; ++c) deliveries.push_back({e, s});
    }
  std::shuffle(deliveries.begin(), deliveries.end(), rng);

  std::vector<std::atomic<int>> ran(kEntities * (kSeqs + 1));
  std::vector<std::atomic<int>> executed(kEntities * (kSeqs + 1));
  std::mutex qmu;
  std::vector<Delivery> queue(deliveries.rbegin(), deliveries.rend());
  std::vector<std::atomic<int>> stale_of(kEntities * (kSeqs + 1));
  std::atomic<long> stale{0}, requeued{0}, unexpected{0};
  const auto deadline = std::chrono::steady_clock::now() + 30s;

  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (;;) {
        Delivery d{};
        {
          std::lock_guard lock(qmu);
          if (queue.empty() || std::chrono::steady_clock::now() > deadline) return;
          d = queue.back();
          queue.pop_back();
        }
        const std::string entity = "acct-" + std::to_string(d.entity);
        const std::string key = entity + "/evt-" + std::to_string(d.seq);
        const std::size_t slot = static_cast<std::size_t>(d.entity * (kSeqs + 1) + d.seq);
        auto out = gate.run(guard, key, entity, static_cast<std::uint64_t>(d.seq), [&] {
          ran[slot].fetch_add(1);
          std::this_thread::yield();
          return d.seq;
        });
        if (out.status == Status::executed) executed[slot].fetch_add(1);
        if (out.status == Status::stale) stale.fetch_add(1);
        if (out.status == Status::in_flight) {  // another copy is running: requeue at the front
          requeued.fetch_add(1);
          std::lock_guard lock(qmu);
          queue.insert(queue.begin(), d);
        }
        if (out.status == Status::stale) stale_of[slot].fetch_add(1);
        if (out.status == Status::lease_lost || out.status == Status::mismatch ||
            out.status == Status::previously_failed)
          unexpected.fetch_add(1);  // Catch2 assertions are not thread-safe: count, check after join
      }
    });
  }
  for (auto& t : threads) t.join();
  REQUIRE(queue.empty());
  CHECK(unexpected.load() == 0);

  long applied = 0;
  for (int e = 0; e < kEntities; ++e) {
    CHECK(gate.last_applied("acct-" + std::to_string(e)) == static_cast<std::uint64_t>(kSeqs));
    for (int s = 1; s <= kSeqs; ++s) {
      const std::size_t slot = static_cast<std::size_t>(e * (kSeqs + 1) + s);
      INFO("entity " << e << " seq " << s);
      REQUIRE(ran[slot].load() <= 1);                                  // never twice
      REQUIRE(ran[slot].load() == executed[slot].load());              // ran <=> reported executed, once
      if (ran[slot].load() == 0) REQUIRE(stale_of[slot].load() >= 1);  // skipped as stale, not lost
      applied += ran[slot].load();
    }
    // the highest sequence is never stale, so it always applies
    CHECK(ran[static_cast<std::size_t>(e * (kSeqs + 1) + kSeqs)].load() == 1);
  }
  UNSCOPED_INFO("applied " << applied << ", stale " << stale.load() << ", requeued " << requeued.load());
}

// ---- the same decisions through every driver: run, run_batch (one event), run_async ----

namespace {

struct Got {
  Status status = Status::in_flight;
  bool advanced = false;
  std::optional<std::uint64_t> last_applied;
  bool gap = false;
  idem::millis retry_after{0};
  long value = 0;
};

struct ByRun {
  template <class Gate, class H>
  static Got deliver(Fixture& f, Gate& gate, const idem::SequencedEvent& ev, H h) {
    auto o = gate.run(f.guard, ev, h);
    return {o.status, o.advanced, o.last_applied, o.gap, o.retry_after, o.value.value_or(0)};
  }
};

struct ByBatch {
  template <class Gate, class H>
  static Got deliver(Fixture& f, Gate& gate, const idem::SequencedEvent& ev, H h) {
    auto r = gate.run_batch(f.guard, std::span<const idem::SequencedEvent>(&ev, 1),
                            [&](const idem::SequencedEvent&) { return h(); });
    REQUIRE(r.outcomes.size() == 1);
    if (r.errors[0]) std::rethrow_exception(r.errors[0]);
    const auto& o = r.outcomes[0];
    return {o.status, r.sequence[0].advanced, r.sequence[0].last_applied, r.sequence[0].gap, o.retry_after,
            o.value.value_or(0)};
  }
};

#if IDEM_TEST_ASYNC
struct ByAsync {
  template <class Gate, class H>
  static Got deliver(Fixture& f, Gate& gate, const idem::SequencedEvent& ev, H h) {
    boost::asio::io_context io;
    auto fut = boost::asio::co_spawn(io, gate.run_async(f.guard, ev, h), boost::asio::use_future);
    io.run();
    auto o = fut.get();
    return {o.status, o.advanced, o.last_applied, o.gap, o.retry_after, o.value.value_or(0)};
  }
};
#define IDEM_GATE_DRIVERS ByRun, ByBatch, ByAsync
#else
#define IDEM_GATE_DRIVERS ByRun, ByBatch
#endif

}  // namespace

TEMPLATE_TEST_CASE("gate drivers: stale, equal, newer, gaps and the advance", "[sequence][drivers]", IDEM_GATE_DRIVERS) {
  Fixture f;
  auto deliver = [&](std::uint64_t seq, std::string_view entity = "acct-1") {
    const std::string key = std::string(entity) + "/evt-" + std::to_string(seq);
    return TestType::deliver(f, f.gate, {.key = key, .entity = entity, .seq = seq}, [&f, seq] {
      f.applied.push_back(seq);
      return static_cast<long>(seq) * 10;
    });
  };
  auto first = deliver(2);
  CHECK(first.status == Status::executed);
  CHECK(first.advanced);
  CHECK(first.last_applied == 2u);
  CHECK(first.value == 20);
  auto older = deliver(1);
  CHECK(older.status == Status::stale);
  CHECK(older.last_applied == 2u);
  CHECK_FALSE(f.store.inspect("acct-1/evt-1").has_value());  // no claim, no record
  CHECK(deliver(2).status == Status::stale);                  // a redelivery once applied
  auto jump = deliver(7);                                     // gaps are allowed by default
  CHECK(jump.status == Status::executed);
  CHECK(jump.last_applied == 7u);
  CHECK(deliver(1, "acct-2").status == Status::executed);  // entities are independent
  CHECK(f.applied == std::vector<std::uint64_t>{2, 7, 1});
  CHECK(f.gate.last_applied("acct-1") == 7u);
  CHECK(f.stats->count(Status::stale) == 2);  // the gate's own decisions reach the guard's observer

  // A missed advance (a crash between the completion and the advance) is repaired by the
  // duplicate: the record answers, the sequence catches up, the handler does not run again.
  REQUIRE(f.guard.run("acct-3/evt-4", [] { return 40L; }).status == Status::executed);
  auto repaired = deliver(4, "acct-3");
  CHECK(repaired.status == Status::duplicate);
  CHECK(repaired.value == 40);
  CHECK(repaired.advanced);
  CHECK(f.gate.last_applied("acct-3") == 4u);
}

TEMPLATE_TEST_CASE("gate drivers: contiguous gaps, and a failing handler that does not advance", "[sequence][drivers]",
                   IDEM_GATE_DRIVERS) {
  Fixture f;
  idem::SequenceGate strict{f.seqs, {.contiguous = true, .first = 1, .gap_retry_after = 250ms}};
  int calls = 0;
  auto deliver = [&](std::uint64_t seq, bool fail = false) {
    return TestType::deliver(f, strict, {.key = "acct-1/evt-" + std::to_string(seq), .entity = "acct-1", .seq = seq},
                             [&, seq, fail] {
                               ++calls;
                               if (fail) throw std::runtime_error("downstream unavailable");
                               f.applied.push_back(seq);
                               return static_cast<long>(seq);
                             });
  };
  auto early = deliver(2);
  CHECK(early.status == Status::in_flight);
  CHECK(early.gap);
  CHECK(early.retry_after == 250ms);
  CHECK(calls == 0);
  CHECK(deliver(1).status == Status::executed);
  CHECK_THROWS_AS(deliver(2, true), std::runtime_error);
  CHECK(strict.last_applied("acct-1") == 1u);  // the failure did not advance
  auto again = deliver(2);
  CHECK(again.status == Status::executed);
  CHECK(again.advanced);
  CHECK(f.applied == std::vector<std::uint64_t>{1, 2});
}

TEST_CASE("gate run_batch: events of one entity in one batch run in order, one behind an earlier waits",
          "[sequence][batch]") {
  Fixture f;
  REQUIRE(f.deliver(2).status == Status::executed);
  // Input order 3, 5, 4, 1 (and another entity): 3 and 5 run in order; 4 is behind 5 in this
  // batch, so it is redelivered and decided after it (stale then); 1 is stale at once.
  const std::vector<idem::SequencedEvent> events{{.key = "acct-1/evt-3", .entity = "acct-1", .seq = 3},
                                                 {.key = "acct-1/evt-5", .entity = "acct-1", .seq = 5},
                                                 {.key = "acct-1/evt-4", .entity = "acct-1", .seq = 4},
                                                 {.key = "acct-1/evt-1", .entity = "acct-1", .seq = 1},
                                                 {.key = "acct-9/evt-1", .entity = "acct-9", .seq = 1}};
  std::vector<std::string> ran;
  auto r = f.gate.run_batch(f.guard, events, [&](const idem::SequencedEvent& ev) {
    ran.emplace_back(ev.key);
    return static_cast<long>(ev.seq);
  });
  CHECK(ran == std::vector<std::string>{"acct-1/evt-3", "acct-1/evt-5", "acct-9/evt-1"});
  CHECK(r.outcomes[0].status == Status::executed);
  CHECK(r.outcomes[1].status == Status::executed);
  CHECK(r.outcomes[2].status == Status::in_flight);
  CHECK(r.outcomes[2].retry_after == 0ms);
  CHECK(r.action(2) == idem::BrokerAction::requeue);
  CHECK(r.outcomes[3].status == Status::stale);
  CHECK(r.outcomes[4].status == Status::executed);
  CHECK(r.sequence[1].advanced);
  CHECK(r.sequence[3].last_applied == 2u);
  CHECK(f.gate.last_applied("acct-1") == 5u);
  CHECK_FALSE(f.store.inspect("acct-1/evt-4").has_value());
  // The redelivered 4 is stale now.
  CHECK(f.gate.run_batch(f.guard, std::span(events).subspan(2, 1), [&](const idem::SequencedEvent&) { return 0L; })
            .outcomes[0]
            .status == Status::stale);

  // Contiguous: only the first event of an entity runs in a batch; the next waits for it.
  idem::SequenceGate strict{f.seqs, {.contiguous = true}};
  const std::vector<idem::SequencedEvent> chain{{.key = "c/evt-1", .entity = "c", .seq = 1},
                                                {.key = "c/evt-2", .entity = "c", .seq = 2}};
  auto c = strict.run_batch(f.guard, chain, [&](const idem::SequencedEvent&) { return 1L; });
  CHECK(c.outcomes[0].status == Status::executed);
  CHECK(c.outcomes[1].status == Status::in_flight);
  CHECK_FALSE(c.sequence[1].gap);
  CHECK(strict.run_batch(f.guard, std::span(chain).subspan(1, 1), [&](const idem::SequencedEvent&) { return 2L; })
            .outcomes[0]
            .status == Status::executed);
  CHECK(f.seqs.last_applied("c") == 2u);
}
