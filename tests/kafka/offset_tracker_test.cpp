// idem::kafka::OffsetTracker: the committable offset per partition under out-of-order outcomes,
// rebalances (revoke / re-assign with epochs), seek-back retries and bad calls, and a
// multi-threaded case (run under TSan by the tsan preset). The seeded, randomized model check is
// in offset_tracker_model_test.cpp, linked into the same binary.
#include "idem/kafka/offset_tracker.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "idem/core/error.hpp"
#include "kafka/splitmix.hpp"

using idem::kafka::Epoch;
using idem::kafka::OffsetTracker;
using idem::kafka::PartitionOffset;

namespace {

constexpr const char* T = "payments";

using Offset = std::optional<std::int64_t>;

}  // namespace

TEST_CASE("offset tracker: the committable offset is the settled prefix + 1, whatever the settle order") {
  OffsetTracker t;
  const Epoch e = t.assign(T, 0);
  CHECK(t.epoch(T, 0) == e);
  CHECK_FALSE(t.committable(T, 0));  // nothing settled yet: nothing to commit, the committed offset stands
  for (std::int64_t o = 0; o < 5; ++o) REQUIRE(t.track(T, 0, o) == e);
  CHECK(t.pending() == 5);
  CHECK(t.held(T, 0) == 5);

  REQUIRE(t.settle(T, 0, 2, e));
  CHECK_FALSE(t.committable(T, 0));  // 0 and 1 still run: committing 3 would lose them on a crash
  REQUIRE(t.settle(T, 0, 0, e));
  CHECK(t.committable(T, 0) == Offset(1));
  REQUIRE(t.settle(T, 0, 1, e));
  CHECK(t.committable(T, 0) == Offset(3));  // 1 closes the gap up to the settled 2
  REQUIRE(t.settle(T, 0, 4, e));
  CHECK(t.committable(T, 0) == Offset(3));
  CHECK(t.pending(T, 0) == 1);
  CHECK(t.held(T, 0) == 2);  // 3 (running) and 4 (settled, behind it)
  REQUIRE(t.settle(T, 0, 3, e));
  CHECK(t.committable(T, 0) == Offset(5));
  CHECK(t.pending() == 0);
  CHECK(t.held() == 0);
  CHECK(t.committables() == std::vector<PartitionOffset>{{T, 0, 5}});
  const auto s = t.stats();
  CHECK(s.tracked == 5);
  CHECK(s.settled == 5);
  CHECK(s.ignored == 0);
}

TEST_CASE("offset tracker: gaps in the offsets (compaction, transaction markers) do not hold the commit back") {
  OffsetTracker t;
  const Epoch e = t.assign(T, 3);
  t.track(T, 3, 5);
  t.track(T, 3, 8);  // 6 and 7 were compacted away or are transaction markers: never delivered
  t.track(T, 3, 13);
  REQUIRE(t.settle(T, 3, 8, e));
  CHECK_FALSE(t.committable(T, 3));
  REQUIRE(t.settle(T, 3, 5, e));
  CHECK(t.committable(T, 3) == Offset(9));
  t.track(T, 3, 14);
  REQUIRE(t.settle(T, 3, 14, e));
  CHECK(t.committable(T, 3) == Offset(9));  // 13 runs
  REQUIRE(t.settle(T, 3, 13, e));
  CHECK(t.committable(T, 3) == Offset(15));
  t.track(T, 3, 100);
  REQUIRE(t.settle(T, 3, 100, e));
  CHECK(t.committable(T, 3) == Offset(101));
}

TEST_CASE("offset tracker: partitions and topics are independent, committables lists the owned ones") {
  OffsetTracker t;
  const Epoch a0 = t.assign("a", 0);
  const Epoch a1 = t.assign("a", 1);
  const Epoch b0 = t.assign("b", 0);
  CHECK(a0 != a1);
  t.track("a", 0, 10);
  t.track("a", 1, 10);
  t.track("b", 0, 3);
  t.track("b", 0, 4);
  REQUIRE(t.settle("a", 1, 10, a1));
  REQUIRE(t.settle("b", 0, 4, b0));
  CHECK(t.committables() == std::vector<PartitionOffset>{{"a", 1, 11}});
  REQUIRE(t.settle("b", 0, 3, b0));
  CHECK(t.committables() == std::vector<PartitionOffset>{{"a", 1, 11}, {"b", 0, 5}});
  CHECK(t.pending() == 1);
  CHECK(t.pending("a", 0) == 1);
  CHECK(t.pending("zzz", 9) == 0);  // never seen: nothing pending, no error
  // Eager rebalance / shutdown: everything goes, with what to commit first.
  CHECK(t.revoke_all() == std::vector<PartitionOffset>{{"a", 1, 11}, {"b", 0, 5}});
  CHECK(t.pending() == 0);
  CHECK(t.committables().empty());
  CHECK_FALSE(t.settle("a", 0, 10, a0));  // its partition went meanwhile: ignored
}

TEST_CASE("offset tracker: revoke mid-flight returns what to commit, then late outcomes are ignored") {
  OffsetTracker t;
  const Epoch e1 = t.assign(T, 0);
  for (std::int64_t o = 0; o < 10; ++o) t.track(T, 0, o);
  for (std::int64_t o : {0, 1, 2, 3, 5, 7}) REQUIRE(t.settle(T, 0, o, e1));
  CHECK(t.committable(T, 0) == Offset(4));

  CHECK(t.revoke(T, 0) == Offset(4));  // commit 4 in the revoke callback, then let go
  CHECK(t.pending() == 0);
  CHECK(t.held() == 0);
  CHECK_FALSE(t.committable(T, 0));
  CHECK_FALSE(t.epoch(T, 0));
  CHECK(t.stats().dropped == 6);  // 4..9: the next owner gets them from offset 4

  // The handlers of 4, 6, 8, 9 finish after the revoke: their outcomes must not count.
  CHECK_FALSE(t.settle(T, 0, 4, e1));
  CHECK_FALSE(t.retry(T, 0, 6, e1));
  CHECK(t.stats().ignored == 2);
  CHECK_FALSE(t.revoke(T, 0));  // revoked already: nothing, no error (eager protocols repeat it)
  CHECK_THROWS_AS(t.track(T, 0, 10), idem::usage_error);

  // Assigned back: the broker redelivers from the committed offset 4, in a new epoch.
  const Epoch e2 = t.assign(T, 0);
  CHECK(e2 > e1);
  CHECK(t.track(T, 0, 4) == e2);  // below the 9 tracked before: a new assignment starts over
  t.track(T, 0, 5);
  // The old delivery of offset 4 finishing now must not settle the new one, still running.
  CHECK_FALSE(t.settle(T, 0, 4, e1));
  CHECK_FALSE(t.committable(T, 0));
  CHECK(t.pending(T, 0) == 2);
  REQUIRE(t.settle(T, 0, 4, e2));
  CHECK(t.committable(T, 0) == Offset(5));
}

TEST_CASE("offset tracker: assign of a partition already owned starts it over in a new epoch") {
  OffsetTracker t;
  const Epoch e1 = t.assign(T, 0);
  t.track(T, 0, 7);
  REQUIRE(t.settle(T, 0, 7, e1));
  t.track(T, 0, 8);
  const Epoch e2 = t.assign(T, 0);
  CHECK(e2 > e1);
  CHECK(t.pending() == 0);
  CHECK_FALSE(t.committable(T, 0));
  CHECK_FALSE(t.settle(T, 0, 8, e1));
  t.track(T, 0, 8);
  REQUIRE(t.settle(T, 0, 8, e2));
  CHECK(t.committable(T, 0) == Offset(9));
}

TEST_CASE("offset tracker: a seek-back retry (rewind) drops what follows and ignores its old outcomes") {
  OffsetTracker t;
  const Epoch e1 = t.assign(T, 0);
  for (std::int64_t o = 0; o < 6; ++o) t.track(T, 0, o);
  REQUIRE(t.settle(T, 0, 0, e1));
  REQUIRE(t.settle(T, 0, 1, e1));
  REQUIRE(t.retry(T, 0, 2, e1));  // 2 answered in_flight: it stays unsettled
  REQUIRE(t.settle(T, 0, 3, e1));
  CHECK(t.committable(T, 0) == Offset(2));
  CHECK(t.stats().retried == 1);

  CHECK_THROWS_AS(t.rewind(T, 0, 1), idem::usage_error);  // 1 is settled and may be committed
  const Epoch e2 = t.rewind(T, 0, 2);                     // the consumer seeks back to 2: 2..5 come again
  CHECK(e2 > e1);
  CHECK(t.epoch(T, 0) == e2);
  CHECK(t.committable(T, 0) == Offset(2));
  CHECK(t.pending() == 0);
  CHECK(t.held() == 0);
  CHECK_FALSE(t.settle(T, 0, 4, e1));  // the first delivery of 4, finishing late
  CHECK_FALSE(t.retry(T, 0, 2, e1));   // the retry loop of the first delivery of 2: stop
  CHECK_THROWS_AS(t.track(T, 0, 1), idem::usage_error);
  for (std::int64_t o = 2; o < 6; ++o) CHECK(t.track(T, 0, o) == e2);
  for (std::int64_t o : {5, 4, 3}) REQUIRE(t.settle(T, 0, o, e2));
  CHECK(t.committable(T, 0) == Offset(2));
  REQUIRE(t.settle(T, 0, 2, e2));
  CHECK(t.committable(T, 0) == Offset(6));
}

TEST_CASE("offset tracker: messages below the rewind point keep their epoch and still settle") {
  OffsetTracker t;
  const Epoch e1 = t.assign(T, 0);
  for (std::int64_t o = 0; o < 4; ++o) t.track(T, 0, o);
  const Epoch e2 = t.rewind(T, 0, 2);  // 0 and 1 still run on a thread pool
  CHECK(t.pending(T, 0) == 2);
  REQUIRE(t.settle(T, 0, 0, e1));
  CHECK(t.committable(T, 0) == Offset(1));
  CHECK_THROWS_AS(t.settle(T, 0, 1, e2), idem::usage_error);  // 1 was tracked in e1, not e2
  REQUIRE(t.settle(T, 0, 1, e1));
  CHECK(t.committable(T, 0) == Offset(2));
  t.track(T, 0, 2);
  REQUIRE(t.settle(T, 0, 2, e2));
  CHECK(t.committable(T, 0) == Offset(3));
}

TEST_CASE("offset tracker: bad calls throw usage_error and change nothing") {
  OffsetTracker t;
  // Malformed coordinates.
  CHECK_THROWS_AS(t.assign("", 0), idem::usage_error);
  CHECK_THROWS_AS(t.assign(T, -1), idem::usage_error);
  CHECK_THROWS_AS(t.revoke(T, -1), idem::usage_error);
  // Not assigned: track() and rewind() need the partition; settle() an epoch it handed out.
  CHECK_THROWS_AS(t.track(T, 0, 0), idem::usage_error);
  CHECK_THROWS_AS(t.rewind(T, 0, 0), idem::usage_error);
  CHECK_THROWS_AS(t.settle(T, 0, 0, 1), idem::usage_error);

  const Epoch e = t.assign(T, 0);
  CHECK_THROWS_AS(t.track(T, 0, -1), idem::usage_error);
  CHECK_THROWS_AS(t.track(T, 0, std::numeric_limits<std::int64_t>::max()), idem::usage_error);
  t.track(T, 0, 0);
  t.track(T, 0, 2);
  CHECK_THROWS_AS(t.track(T, 0, 2), idem::usage_error);          // twice
  CHECK_THROWS_AS(t.track(T, 0, 1), idem::usage_error);          // below the last one
  CHECK_THROWS_AS(t.settle(T, 0, 1, e), idem::usage_error);      // never tracked (a gap)
  CHECK_THROWS_AS(t.settle(T, 0, 3, e), idem::usage_error);      // never tracked (not polled yet)
  CHECK_THROWS_AS(t.settle(T, 0, 2, 0), idem::usage_error);      // epoch 0 is never handed out
  CHECK_THROWS_AS(t.settle(T, 0, 2, e + 1), idem::usage_error);  // an epoch from the future
  CHECK_THROWS_AS(t.settle(T, 1, 2, e), idem::usage_error);      // a partition never assigned
  CHECK_THROWS_AS(t.settle(T, 0, -2, e), idem::usage_error);
  REQUIRE(t.settle(T, 0, 2, e));
  CHECK_THROWS_AS(t.settle(T, 0, 2, e), idem::usage_error);  // twice (still held behind 0)
  CHECK_THROWS_AS(t.retry(T, 0, 2, e), idem::usage_error);   // final is final
  REQUIRE(t.settle(T, 0, 0, e));
  CHECK_THROWS_AS(t.settle(T, 0, 0, e), idem::usage_error);  // twice (committable already)
  // What the refused calls left: exactly the state of the accepted ones.
  CHECK(t.committable(T, 0) == Offset(3));
  CHECK(t.pending() == 0);
  CHECK(t.held() == 0);
  const auto s = t.stats();
  CHECK(s.tracked == 2);
  CHECK(s.settled == 2);
  CHECK(s.ignored == 0);

  try {
    t.track(T, 0, 1);
    FAIL("no exception");
  } catch (const idem::usage_error& x) {
    CHECK_FALSE(x.retryable());  // a caller bug: retrying the same call cannot help
    CHECK(std::string(x.what()).find("payments/0 offset 1") != std::string::npos);
  }
}

// ---- Threads ------------------------------------------------------------------------------------

TEST_CASE("offset tracker: 4 threads settle while the consumer thread tracks, commits and rebalances") {
  OffsetTracker t;
  constexpr std::int64_t per_partition = 3000;
  constexpr int workers = 4;
  struct Item {
    std::int32_t partition;
    std::int64_t offset;
    Epoch epoch;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Item> queue;
  bool done = false;
  std::atomic<long> settled{0}, ignored{0};

  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w) {
    pool.emplace_back([&, w] {
      Rng rng{static_cast<std::uint64_t>(w) + 1};
      std::vector<Item> mine;
      for (;;) {
        {
          std::unique_lock lock(mu);
          cv.wait(lock, [&] { return done || !queue.empty(); });
          if (queue.empty()) return;
          const std::size_t n = std::min<std::size_t>(queue.size(), 1 + rng.below(16));
          mine.assign(queue.begin(), queue.begin() + static_cast<std::ptrdiff_t>(n));
          queue.erase(queue.begin(), queue.begin() + static_cast<std::ptrdiff_t>(n));
        }
        // Finish them in an order of this worker's own, some after a retry round.
        for (std::size_t i = mine.size(); i > 1; --i) std::swap(mine[i - 1], mine[rng.below(i)]);
        for (const Item& m : mine) {
          if (rng.chance(10)) t.retry(T, m.partition, m.offset, m.epoch);
          (t.settle(T, m.partition, m.offset, m.epoch) ? settled : ignored).fetch_add(1);
        }
      }
    });
  }

  // The consumer thread: partitions 0 and 1 stay owned; partition 2 is revoked and assigned back
  // now and then, so workers settle messages of epochs that are over meanwhile.
  const Epoch e0 = t.assign(T, 0);
  const Epoch e1 = t.assign(T, 1);
  Epoch e2 = t.assign(T, 2);
  std::int64_t next2 = 0;
  Offset seen0, seen1;
  bool monotonic = true;
  std::vector<Item> chunk;
  Rng rng{99};
  for (std::int64_t i = 0; i < per_partition; ++i) {
    chunk.push_back({0, i, t.track(T, 0, i)});
    chunk.push_back({1, 3 * i, t.track(T, 1, 3 * i)});  // gaps
    chunk.push_back({2, next2, t.track(T, 2, next2)});
    ++next2;
    if (chunk.size() >= 48) {
      {
        std::lock_guard lock(mu);
        queue.insert(queue.end(), chunk.begin(), chunk.end());
      }
      cv.notify_all();
      chunk.clear();
      // Commit: the committable offsets only move forward, and never past what was tracked.
      // (Recorded, checked after the join: a failing REQUIRE here would leave the workers unjoined.)
      const Offset c0 = t.committable(T, 0), c1 = t.committable(T, 1);
      monotonic = monotonic && (!c0 || (*c0 <= i + 1 && (!seen0 || *c0 >= *seen0)));
      monotonic = monotonic && (!c1 || (*c1 <= 3 * i + 1 && (!seen1 || *c1 >= *seen1)));
      if (c0) seen0 = c0;
      if (c1) seen1 = c1;
      if (rng.chance(20)) {
        if (const Offset c2 = t.revoke(T, 2)) next2 = *c2;  // the next owner starts from the commit
        e2 = t.assign(T, 2);
      }
    }
  }
  {
    std::lock_guard lock(mu);
    queue.insert(queue.end(), chunk.begin(), chunk.end());
    done = true;
  }
  cv.notify_all();
  for (auto& th : pool) th.join();

  CHECK(monotonic);
  CHECK(e0 != e1);
  CHECK(t.committable(T, 0) == Offset(per_partition));
  CHECK(t.committable(T, 1) == Offset(3 * (per_partition - 1) + 1));
  CHECK(t.pending() == 0);
  CHECK(t.held() == 0);
  CHECK(t.epoch(T, 2) == e2);
  const auto s = t.stats();
  CHECK(s.settled == static_cast<std::uint64_t>(settled.load()));
  CHECK(s.ignored >= static_cast<std::uint64_t>(ignored.load()));
  CHECK(settled.load() + ignored.load() == 3 * per_partition);
}
