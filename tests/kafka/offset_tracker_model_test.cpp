// idem::kafka::OffsetTracker: a seeded, randomized model check (offset_tracker_test's second
// source file; the fixed and multi-threaded cases are in offset_tracker_test.cpp).
#include "idem/kafka/offset_tracker.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "idem/core/error.hpp"
#include "kafka/splitmix.hpp"

using idem::kafka::Epoch;
using idem::kafka::OffsetTracker;
using idem::kafka::PartitionOffset;
using Offset = std::optional<std::int64_t>;

// ---- Randomized model check ---------------------------------------------------------------------
//
// Each case simulates a consumer on 1 to 4 partitions (two topics) whose logs have gaps: it polls
// (track), completes messages in random order (settle, or retry first for a few rounds), commits,
// is revoked and re-assigned (redelivery from the committed offset), seeks back to a message to
// retry it (rewind), and makes bad calls. A plain model (every message tracked since the
// assignment, in a std::map) is checked against the tracker after every step; then everything
// is polled and settled, and the committed position must be the end of every log.
namespace {

std::uint64_t env_u64(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoull(v, nullptr, 0) : fallback;
}

class Sim {
 public:
  explicit Sim(std::uint64_t seed) : seed_(seed), rng_{seed} {
    const std::size_t n = 1 + rng_.below(4);
    for (std::size_t i = 0; i < n; ++i) {
      Part p;
      p.topic = i % 2 ? "b" : "a";
      p.partition = static_cast<std::int32_t>(i / 2);
      std::int64_t o = static_cast<std::int64_t>(rng_.below(1000));  // retention deleted what was before
      const std::size_t len = rng_.below(8) == 0 ? 0 : 1 + rng_.below(40);
      for (std::size_t k = 0; k < len; ++k) {
        p.log.push_back(o);
        o += rng_.chance(20) ? 2 + static_cast<std::int64_t>(rng_.below(5)) : 1;  // a gap
      }
      parts_.push_back(std::move(p));
    }
  }

  void run() {
    try {
      steps();
    } catch (const idem::error& x) {  // a call the model deems right was refused: report it with the seed
      expect(false, std::string("unexpected ") + x.what());
    }
  }

  idem::kafka::OffsetTrackerStats stats() const { return tracker_.stats(); }

 private:
  void steps() {
    doing("initial assign");
    for (std::size_t i = 0; i < parts_.size(); ++i)
      if (rng_.chance(80)) assign(i);
    check();
    const std::size_t count = 50 + rng_.below(150);
    for (step_ = 1; step_ <= count; ++step_) {
      const std::size_t roll = rng_.below(100);
      if (roll < 30)
        poll(1 + rng_.below(4));
      else if (roll < 70)
        complete();
      else if (roll < 78)
        commit();
      else if (roll < 83)
        revoke();
      else if (roll < 89)
        assign_some();
      else if (roll < 95)
        rewind();
      else
        bad_call();
      check();
    }
    // The end: every partition owned again, every message polled and every outcome final.
    doing("final assign");
    for (std::size_t i = 0; i < parts_.size(); ++i)
      if (!parts_[i].owned) assign(i);
    check();
    for (;; ++step_) {
      const bool more = std::any_of(parts_.begin(), parts_.end(), [](const Part& p) { return p.next < p.log.size(); });
      if (!more && handles_.empty()) break;
      if (more && (handles_.empty() || rng_.chance(40)))
        poll(1 + rng_.below(8));
      else
        complete();
      check();
    }
    doing("final check");
    for (const Part& p : parts_) {
      if (p.log.empty()) continue;
      const Offset c = tracker_.committable(p.topic, p.partition);
      const Offset end = c ? c : p.committed;
      expect(end == Offset(p.log.back() + 1), [&] {
        return fmt::format("{}/{}: all settled, committable {} (committed {}), the log ends at {}", p.topic,
                           p.partition, str(c), str(p.committed), p.log.back());
      });
    }
  }

  struct Tracked {
    Epoch epoch;
    bool settled;
  };
  struct Part {
    std::string topic;
    std::int32_t partition = 0;
    std::vector<std::int64_t> log;  // the offsets the broker holds
    bool owned = false;
    Epoch epoch = 0;
    std::map<std::int64_t, Tracked> tracked;  // since the assignment, minus what a rewind dropped
    std::size_t next = 0;                     // index in log of the next message a poll returns
    std::int64_t next_track = 0;              // the lowest offset track() accepts
    Offset committed;                         // what the group committed last
    Offset seen;                              // the committable offset last seen in this assignment
  };
  struct Handle {  // a message somewhere in the consumer's workers: its outcome comes later
    std::size_t part;
    std::int64_t offset;
    Epoch epoch;
    int retries;  // retry rounds before its outcome is final
  };

  static std::string str(const Offset& o) { return o ? std::to_string(*o) : "none"; }

  // The message is built on failure only (a lambda, or a plain string): the checks run after
  // every step of thousands of cases, and formatting each time would dominate a debug build.
  template <class What>
  void expect(bool ok, What&& what) const {
    if (ok) return;
    std::string text;
    if constexpr (std::is_invocable_v<What>)
      text = what();
    else
      text = std::string(what);
    throw std::runtime_error(
        fmt::format("seed {} step {} ({}): {}  [replay: IDEM_TRACKER_SEED={} IDEM_TRACKER_CASES=1]", seed_, step_,
                    action(), text, seed_));
  }
  // What the step does, recorded cheaply and formatted on failure only.
  void doing(const char* what) { act_ = {what, nullptr, -1, -1, 0}; }
  void doing(const char* what, const Part& p, std::int64_t offset = -1, Epoch epoch = 0) {
    act_ = {what, &p, p.partition, offset, epoch};
  }
  std::string action() const {
    std::string a = act_.what;
    if (act_.part) a += fmt::format(" {}/{}", act_.part->topic, act_.partition);
    if (act_.offset >= 0) a += fmt::format(" @{}", act_.offset);
    if (act_.epoch) a += fmt::format(" epoch {}", act_.epoch);
    return a;
  }

  template <class F>
  void expect_usage_error(F&& f, const std::string& what) {
    try {
      f();
    } catch (const idem::usage_error&) {
      return;
    }
    expect(false, "no usage_error: " + what);
  }

  // The model's committable offset, and how many tracked messages the settled prefix holds.
  static Offset model_committable(const Part& p, std::size_t& prefix) {
    prefix = 0;
    Offset c;
    if (!p.owned) return c;
    for (const auto& [o, m] : p.tracked) {
      if (!m.settled) break;
      c = o + 1;
      ++prefix;
    }
    return c;
  }

  bool live(const Handle& h) const {
    const Part& p = parts_[h.part];
    if (!p.owned) return false;
    const auto it = p.tracked.find(h.offset);
    return it != p.tracked.end() && it->second.epoch == h.epoch && !it->second.settled;
  }

  std::vector<std::size_t> owned_parts(bool with_more = false) const {
    std::vector<std::size_t> out;
    for (std::size_t i = 0; i < parts_.size(); ++i)
      if (parts_[i].owned && (!with_more || parts_[i].next < parts_[i].log.size())) out.push_back(i);
    return out;
  }

  void assign(std::size_t i) {
    Part& p = parts_[i];
    const Epoch e = tracker_.assign(p.topic, p.partition);
    expect(e > last_epoch_, [&] { return fmt::format("assign returned epoch {}, not above {}", e, last_epoch_); });
    last_epoch_ = e;
    p.owned = true;
    p.epoch = e;
    p.tracked.clear();
    p.seen.reset();
    p.next_track = 0;
    // The broker redelivers from the committed offset (auto.offset.reset=earliest without one).
    p.next = p.committed
                 ? static_cast<std::size_t>(std::lower_bound(p.log.begin(), p.log.end(), *p.committed) - p.log.begin())
                 : 0;
  }

  void poll(std::size_t n) {
    doing("poll");
    const auto candidates = owned_parts(true);
    if (candidates.empty()) return;
    Part& p = parts_[candidates[rng_.below(candidates.size())]];
    const std::size_t i = static_cast<std::size_t>(&p - parts_.data());
    for (; n > 0 && p.next < p.log.size(); --n) {
      const std::int64_t o = p.log[p.next++];
      const Epoch e = tracker_.track(p.topic, p.partition, o);
      expect(e == p.epoch, [&] {
        return fmt::format("track {}/{}@{} gave epoch {}, the partition's is {}", p.topic, p.partition, o, e, p.epoch);
      });
      p.tracked[o] = {e, false};
      p.next_track = o + 1;
      handles_.push_back({i, o, e, rng_.chance(25) ? 1 + static_cast<int>(rng_.below(3)) : 0});
    }
  }

  // One message's turn, in random order: a retry round, or its final outcome.
  void complete() {
    doing("complete");
    if (handles_.empty()) return;
    const std::size_t k = rng_.below(handles_.size());
    Handle& h = handles_[k];
    const Part& p = parts_[h.part];
    const bool alive = live(h);
    if (h.retries > 0) {
      doing("retry", p, h.offset, h.epoch);
      const bool r = tracker_.retry(p.topic, p.partition, h.offset, h.epoch);
      expect(r == alive, [&] { return fmt::format("retry answered {}, the model says {}", r, alive); });
      if (r) {
        --h.retries;
        return;
      }
    } else {
      doing("settle", p, h.offset, h.epoch);
      const bool r = tracker_.settle(p.topic, p.partition, h.offset, h.epoch);
      expect(r == alive, [&] { return fmt::format("settle answered {}, the model says {}", r, alive); });
      if (r) parts_[h.part].tracked[h.offset].settled = true;
    }
    handles_[k] = handles_.back();
    handles_.pop_back();
  }

  void commit() {
    doing("commit");
    std::vector<PartitionOffset> want;
    for (Part& p : parts_) {
      std::size_t prefix = 0;
      if (const Offset c = model_committable(p, prefix)) {
        want.push_back({p.topic, p.partition, *c});
        p.committed = c;
      }
    }
    std::sort(want.begin(), want.end(), [](const PartitionOffset& a, const PartitionOffset& b) {
      return a.topic != b.topic ? a.topic < b.topic : a.partition < b.partition;
    });
    expect(tracker_.committables() == want, "committables() differs from the model");
  }

  void revoke() {
    const auto candidates = owned_parts();
    if (candidates.empty()) return;
    Part& p = parts_[candidates[rng_.below(candidates.size())]];
    doing("revoke", p);
    std::size_t prefix = 0;
    const Offset want = model_committable(p, prefix);
    const Offset got = tracker_.revoke(p.topic, p.partition);
    expect(got == want, [&] { return fmt::format("revoke returned {}, the model says {}", str(got), str(want)); });
    if (got) p.committed = got;  // committed in the revoke callback
    p.owned = false;
    p.tracked.clear();
    p.seen.reset();
  }

  void assign_some() {
    std::vector<std::size_t> candidates;
    for (std::size_t i = 0; i < parts_.size(); ++i)
      if (!parts_[i].owned || rng_.chance(15)) candidates.push_back(i);  // sometimes one still owned
    if (candidates.empty()) return;
    const std::size_t i = candidates[rng_.below(candidates.size())];
    doing("assign", parts_[i]);
    assign(i);
  }

  // The seek-back retry: the first unsettled message of a partition comes again, and all after it.
  void rewind() {
    std::vector<std::size_t> candidates;
    for (std::size_t i : owned_parts())
      for (const auto& [o, m] : parts_[i].tracked)
        if (!m.settled) {
          candidates.push_back(i);
          break;
        }
    if (candidates.empty()) return;
    Part& p = parts_[candidates[rng_.below(candidates.size())]];
    std::int64_t target = 0;
    for (const auto& [o, m] : p.tracked)
      if (!m.settled) {
        target = o;
        break;
      }
    doing("rewind to", p, target);
    std::size_t prefix = 0;
    if (const Offset c = model_committable(p, prefix); c && *c > 0 && rng_.chance(30))
      expect_usage_error([&] { tracker_.rewind(p.topic, p.partition, *c - 1); }, "rewind below the committable offset");
    const Epoch e = tracker_.rewind(p.topic, p.partition, target);
    expect(e > last_epoch_, [&] { return fmt::format("rewind returned epoch {}, not above {}", e, last_epoch_); });
    last_epoch_ = e;
    p.epoch = e;
    p.tracked.erase(p.tracked.lower_bound(target), p.tracked.end());
    p.next_track = target;
    p.next = static_cast<std::size_t>(std::lower_bound(p.log.begin(), p.log.end(), target) - p.log.begin());
  }

  void bad_call() {
    const std::size_t i = rng_.below(parts_.size());
    Part& p = parts_[i];
    switch (rng_.below(4)) {
      case 0:  // an offset that does not ascend
        if (!p.owned || p.next_track == 0) return;
        doing("bad: track not ascending");
        expect_usage_error([&] { tracker_.track(p.topic, p.partition, p.next_track - 1); }, "a bad call");
        return;
      case 1:  // an epoch never handed out
        if (last_epoch_ == 0 || p.epoch == 0) return;
        doing("bad: settle with a future epoch");
        expect_usage_error([&] { tracker_.settle(p.topic, p.partition, 0, last_epoch_ + 1); }, "a bad call");
        return;
      case 2:  // settled twice, in its epoch
        for (const auto& [o, m] : p.tracked)
          if (p.owned && m.settled && m.epoch == p.epoch) {
            doing("bad: settle twice", p, o, p.epoch);
            const std::int64_t offset = o;
            expect_usage_error([&] { tracker_.settle(p.topic, p.partition, offset, p.epoch); }, "settled twice");
            return;
          }
        return;
      default:  // a partition not owned
        if (p.owned) return;
        doing("bad: track on a partition not owned");
        expect_usage_error([&] { tracker_.track(p.topic, p.partition, 0); }, "a bad call");
        return;
    }
  }

  // After every step: the tracker agrees with the model, and the two invariants hold.
  void check() {
    std::size_t pending = 0, held = 0;
    for (Part& p : parts_) {
      std::size_t prefix = 0;
      const Offset want = model_committable(p, prefix);
      const Offset got = tracker_.committable(p.topic, p.partition);
      const auto where = [&p] { return fmt::format("{}/{}", p.topic, p.partition); };
      expect(got == want,
             [&] { return fmt::format("{}: committable {}, the model says {}", where(), str(got), str(want)); });
      std::size_t unsettled = 0;
      for (const auto& [o, m] : p.tracked) {
        if (m.settled) continue;
        ++unsettled;
        // Invariant 1: never past a message whose outcome is not final.
        expect(!got || *got <= o,
               [&] { return fmt::format("{}: committable {} passes the unsettled {}", where(), *got, o); });
      }
      // Invariant 2: within an assignment it never goes back (rewinds included).
      expect(!got || !p.seen || *got >= *p.seen,
             [&] { return fmt::format("{}: committable went back from {} to {}", where(), *p.seen, str(got)); });
      if (got) p.seen = got;
      const std::size_t p_held = p.owned ? p.tracked.size() - prefix : 0;
      expect(tracker_.pending(p.topic, p.partition) == unsettled, [&] { return where() + ": pending differs"; });
      expect(tracker_.held(p.topic, p.partition) == p_held, [&] { return where() + ": held differs"; });
      expect(tracker_.epoch(p.topic, p.partition) == (p.owned ? std::optional<Epoch>(p.epoch) : std::nullopt),
             [&] { return where() + ": epoch differs"; });
      pending += unsettled;
      held += p_held;
    }
    expect(tracker_.pending() == pending,
           [&] { return fmt::format("pending() {}, the model says {}", tracker_.pending(), pending); });
    expect(tracker_.held() == held, [&] { return fmt::format("held() {}, the model says {}", tracker_.held(), held); });
  }

  std::uint64_t seed_;
  Rng rng_;
  OffsetTracker tracker_;
  std::vector<Part> parts_;
  std::vector<Handle> handles_;
  Epoch last_epoch_ = 0;
  std::size_t step_ = 0;
  struct {
    const char* what = "";
    const Part* part = nullptr;
    std::int32_t partition = -1;
    std::int64_t offset = -1;
    Epoch epoch = 0;
  } act_;
};

}  // namespace

TEST_CASE("offset tracker: randomized model check (IDEM_TRACKER_SEED, IDEM_TRACKER_CASES)") {
  const std::uint64_t seed = env_u64("IDEM_TRACKER_SEED", 20240611);
  const std::uint64_t cases = env_u64("IDEM_TRACKER_CASES", 2000);
  // Case k runs with seed + k, so a failure's own seed replays it alone (it prints how).
  std::printf("offset tracker model check: IDEM_TRACKER_SEED=%llu IDEM_TRACKER_CASES=%llu\n",
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(cases));
  std::fflush(stdout);
  const auto start = std::chrono::steady_clock::now();
  idem::kafka::OffsetTrackerStats total;
  for (std::uint64_t k = 0; k < cases; ++k) {
    try {
      Sim sim(seed + k);
      sim.run();
      const auto st = sim.stats();
      total.tracked += st.tracked;
      total.settled += st.settled;
      total.retried += st.retried;
      total.ignored += st.ignored;
      total.dropped += st.dropped;
    } catch (const std::runtime_error& e) {
      FAIL(e.what());
    }
  }
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
  // What the cases went through, so that a change which stops exercising a path shows here.
  std::printf(
      "offset tracker model check: %llu cases in %lld ms: %llu tracked, %llu settled, %llu retry rounds, "
      "%llu late outcomes ignored, %llu dropped by revoke/rewind/assign\n",
      static_cast<unsigned long long>(cases), static_cast<long long>(ms),
      static_cast<unsigned long long>(total.tracked), static_cast<unsigned long long>(total.settled),
      static_cast<unsigned long long>(total.retried), static_cast<unsigned long long>(total.ignored),
      static_cast<unsigned long long>(total.dropped));
  CHECK(total.ignored > 0);
  CHECK(total.retried > 0);
  CHECK(total.dropped > 0);
}
