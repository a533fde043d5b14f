#pragma once
/// @file kafka/offset_tracker.hpp OffsetTracker: which Kafka offset is safe to commit when outcomes come out of order.
// Guide and guarantees: docs/consuming.md.

#include <fmt/core.h>

#include <algorithm>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/core/error.hpp"

namespace idem::kafka {

/// One assignment of (or seek back in) a partition: outcomes carrying an epoch that is over are ignored.
using Epoch = std::uint64_t;

/// A partition and the offset to commit for it, as committables() and revoke_all() list them.
struct PartitionOffset {
  std::string topic;           ///< The topic's name.
  std::int32_t partition = 0;  ///< The partition number.
  std::int64_t offset = 0;     ///< The offset to commit: the next one to read (Kafka's convention).
  /// Field-wise comparison, so that lists of them compare in tests and logs.
  friend bool operator==(const PartitionOffset&, const PartitionOffset&) = default;
};

/// Counters since construction, for metrics and tests.
struct OffsetTrackerStats {
  std::uint64_t tracked = 0;  ///< track() calls accepted.
  std::uint64_t settled = 0;  ///< settle() calls that settled a message.
  std::uint64_t retried = 0;  ///< retry() calls accepted.
  std::uint64_t ignored = 0;  ///< settle() / retry() calls ignored because their epoch was over.
  std::uint64_t dropped = 0;  ///< Tracked, not yet committable messages forgotten by revoke, rewind or assign.
};

/**
 * Per (topic, partition), which offset is safe to commit when messages finish out of order (a
 * batch, run_async, a thread pool): the one after the longest prefix of tracked messages that are
 * all settled, never past a message whose outcome is not final. Kafka commits one offset per
 * partition, "everything before this is done", so committing a later message's offset while an
 * earlier one is still running would lose the earlier one if the consumer died. The idea is the
 * one of modern-cpp-kafka's UnorderedOffsetCommitQueue: out-of-order acks in, the next contiguous
 * committable offset out; this one adds epochs so that rebalances and seeks cannot mix up two
 * deliveries of one offset.
 *
 * The consumer loop calls:
 * - assign() in the rebalance callback, for each partition assigned; revoke() (its result is the
 *   offset to commit before letting go) for each partition revoked or lost;
 * - track() for each message as it is polled (offsets ascending per partition; gaps are normal:
 *   compacted topics, transaction markers), and keeps the epoch it returns with the message;
 * - settle() once the message's outcome is final (executed, duplicate, stale, dead-lettered...);
 *   retry() when it will be processed again in this process (it stays unsettled); rewind() when
 *   the consumer seeks the partition back to redeliver from an offset (pause/seek-back retry);
 * - committable() / committables() when it commits, and pending() for backpressure.
 *
 * Epochs: every assign() and rewind() hands out a new epoch, larger than any handed out before by
 * this tracker. track() returns the partition's current one; settle() and retry() say which epoch
 * their message was tracked in. A message whose partition was revoked (or re-assigned, or rewound
 * past it) since then is redelivered to whoever owns the partition now, so its late outcome must
 * not count: the call is ignored and returns false. Bad calls (an offset never tracked, tracked
 * twice or out of order, a message of the current epoch settled twice, an epoch never handed out)
 * are caller bugs and throw usage_error, leaving the tracker unchanged.
 *
 * Thread-safe: every member takes one mutex, so any thread may settle while the consumer thread
 * tracks and commits. Memory per partition is bounded by the messages tracked and not yet
 * committable (see held()).
 */
class OffsetTracker {
 public:
  /// Starts owning a partition (rebalance: assigned) and returns its new epoch.
  Epoch assign(std::string_view topic, std::int32_t partition) {
    check_partition(topic, partition);
    // A partition still owned starts over too: the broker redelivers from the committed offset.
    std::lock_guard lock(mu_);
    auto it = parts_.find(KeyView{topic, partition});
    if (it == parts_.end()) it = parts_.emplace(Key{std::string(topic), partition}, Partition{}).first;
    Partition& p = it->second;
    forget(p);
    p.owned = true;
    p.epoch = ++last_epoch_;
    return p.epoch;
  }

  /// Stops owning a partition (rebalance: revoked, lost): returns the offset to commit first, then forgets the rest.
  std::optional<std::int64_t> revoke(std::string_view topic, std::int32_t partition) {
    check_partition(topic, partition);
    // Not owned: nothing, no error, since eager rebalances and shutdown paths revoke what may be
    // revoked already.
    std::lock_guard lock(mu_);
    auto it = parts_.find(KeyView{topic, partition});
    if (it == parts_.end() || !it->second.owned) return std::nullopt;
    return release(it->second);
  }

  /// revoke() of every owned partition (eager protocol, shutdown): the offsets to commit first.
  std::vector<PartitionOffset> revoke_all() {
    std::lock_guard lock(mu_);
    std::vector<PartitionOffset> out;
    for (auto& [key, p] : parts_) {
      if (!p.owned) continue;
      if (auto offset = release(p)) out.push_back({key.topic, key.partition, *offset});
    }
    return out;
  }

  /// Records a polled message (offsets ascending per partition); returns the epoch to pass to settle() / retry().
  Epoch track(std::string_view topic, std::int32_t partition, std::int64_t offset) {
    check_offset(topic, partition, offset);
    std::lock_guard lock(mu_);
    Partition& p = owned(topic, partition, "track");
    if (offset < p.next_track)
      throw usage_error(
          fmt::format("OffsetTracker::track: {}/{} offset {} is not above the last one tracked ({}): "
                      "offsets must ascend per partition; call rewind() when seeking back",
                      topic, partition, offset, p.next_track - 1));
    p.window.push_back({offset, p.epoch, false});
    p.next_track = offset + 1;
    ++p.unsettled;
    ++unsettled_;
    ++held_;
    ++stats_.tracked;
    return p.epoch;
  }

  /// Marks a message's outcome final (executed, duplicate, dead-lettered...); false: its epoch is over, ignored.
  bool settle(std::string_view topic, std::int32_t partition, std::int64_t offset, Epoch epoch) {
    check_offset(topic, partition, offset);
    std::lock_guard lock(mu_);
    Partition* p = nullptr;
    Entry* e = find(topic, partition, offset, epoch, "settle", p);
    if (!e) return false;
    e->settled = true;
    --p->unsettled;
    --unsettled_;
    ++stats_.settled;
    // The settled prefix becomes committable and leaves the window, so the window only holds
    // what is not committable yet.
    while (!p->window.empty() && p->window.front().settled) {
      p->commit = p->window.front().offset + 1;
      p->window.pop_front();
      --held_;
    }
    return true;
  }

  /// Notes that a message runs again here (it stays unsettled); false: its epoch is over, stop retrying it.
  bool retry(std::string_view topic, std::int32_t partition, std::int64_t offset, Epoch epoch) {
    check_offset(topic, partition, offset);
    std::lock_guard lock(mu_);
    Partition* p = nullptr;
    if (!find(topic, partition, offset, epoch, "retry", p)) return false;
    ++stats_.retried;
    return true;
  }

  /// The consumer seeks back to `offset` (pause/seek-back retry): forgets what was tracked from it; a new epoch.
  Epoch rewind(std::string_view topic, std::int32_t partition, std::int64_t offset) {
    check_offset(topic, partition, offset);
    std::lock_guard lock(mu_);
    Partition& p = owned(topic, partition, "rewind");
    // Not below committable(): those messages are settled and their offset may be committed
    // already, and committable() never goes back within an assignment.
    if (p.commit && offset < *p.commit)
      throw usage_error(
          fmt::format("OffsetTracker::rewind: {}/{} offset {} is below the committable offset {}: "
                      "those messages are settled",
                      topic, partition, offset, *p.commit));
    const auto from = std::lower_bound(p.window.begin(), p.window.end(), offset,
                                       [](const Entry& e, std::int64_t o) { return e.offset < o; });
    for (auto it = from; it != p.window.end(); ++it) {
      if (!it->settled) {
        --p.unsettled;
        --unsettled_;
      }
      --held_;
      ++stats_.dropped;
    }
    p.window.erase(from, p.window.end());
    p.next_track = offset;
    p.epoch = ++last_epoch_;
    return p.epoch;
  }

  /// The offset to commit: after the settled prefix; nothing if not owned or nothing settled since assign().
  [[nodiscard]] std::optional<std::int64_t> committable(std::string_view topic, std::int32_t partition) const {
    std::lock_guard lock(mu_);
    const Partition* p = lookup(topic, partition);
    return p && p->owned ? p->commit : std::nullopt;
  }

  /// committable() of every owned partition that has one: the list a commit call takes.
  [[nodiscard]] std::vector<PartitionOffset> committables() const {
    std::lock_guard lock(mu_);
    std::vector<PartitionOffset> out;
    for (const auto& [key, p] : parts_)
      if (p.owned && p.commit) out.push_back({key.topic, key.partition, *p.commit});
    return out;
  }

  /// Tracked messages not settled yet, all partitions together: stop polling above a bound.
  [[nodiscard]] std::size_t pending() const {
    std::lock_guard lock(mu_);
    return unsettled_;
  }

  /// Tracked messages of one partition not settled yet (0 when it is not owned).
  [[nodiscard]] std::size_t pending(std::string_view topic, std::int32_t partition) const {
    std::lock_guard lock(mu_);
    const Partition* p = lookup(topic, partition);
    return p ? p->unsettled : 0;
  }

  /// Tracked messages not committable yet, settled or not: what a restart redelivers, what memory holds.
  [[nodiscard]] std::size_t held() const {
    std::lock_guard lock(mu_);
    return held_;
  }

  /// Tracked messages of one partition not committable yet, settled or not (0 when not owned).
  [[nodiscard]] std::size_t held(std::string_view topic, std::int32_t partition) const {
    std::lock_guard lock(mu_);
    const Partition* p = lookup(topic, partition);
    return p ? p->window.size() : 0;
  }

  /// The partition's current epoch, or nothing when it is not owned.
  [[nodiscard]] std::optional<Epoch> epoch(std::string_view topic, std::int32_t partition) const {
    std::lock_guard lock(mu_);
    const Partition* p = lookup(topic, partition);
    return p && p->owned ? std::optional<Epoch>(p->epoch) : std::nullopt;
  }

  /// Counters since construction.
  [[nodiscard]] OffsetTrackerStats stats() const {
    std::lock_guard lock(mu_);
    return stats_;
  }

 private:
  struct Entry {
    std::int64_t offset;
    Epoch epoch;  // the epoch it was tracked in: below a rewind point it stays the older one
    bool settled;
  };
  struct Partition {
    bool owned = false;
    Epoch epoch = 0;                     // the latest handed out for this partition
    std::deque<Entry> window;            // tracked, not committable yet; offsets ascending
    std::int64_t next_track = 0;         // the lowest offset track() accepts
    std::optional<std::int64_t> commit;  // after the settled prefix; nothing before a first settle
    std::size_t unsettled = 0;
  };
  struct Key {
    std::string topic;
    std::int32_t partition;
  };
  struct KeyView {
    std::string_view topic;
    std::int32_t partition;
  };
  // Looks a partition up by string_view: no std::string is built per call.
  struct KeyLess {
    using is_transparent = void;
    static KeyView view(const Key& k) noexcept { return {k.topic, k.partition}; }
    static KeyView view(const KeyView& k) noexcept { return k; }
    template <class A, class B>
    bool operator()(const A& a, const B& b) const noexcept {
      const KeyView x = view(a), y = view(b);
      if (const auto c = x.topic <=> y.topic; c != 0) return c < 0;
      return x.partition < y.partition;
    }
  };

  static void check_partition(std::string_view topic, std::int32_t partition) {
    if (topic.empty()) throw usage_error("OffsetTracker: empty topic name");
    if (partition < 0) throw usage_error(fmt::format("OffsetTracker: {} partition {} is negative", topic, partition));
  }
  static void check_offset(std::string_view topic, std::int32_t partition, std::int64_t offset) {
    check_partition(topic, partition);
    // The upper bound keeps offset + 1 (the committed form) representable.
    if (offset < 0 || offset == std::numeric_limits<std::int64_t>::max())
      throw usage_error(
          fmt::format("OffsetTracker: {}/{} offset {} is not a message offset", topic, partition, offset));
  }

  const Partition* lookup(std::string_view topic, std::int32_t partition) const {
    auto it = parts_.find(KeyView{topic, partition});
    return it == parts_.end() ? nullptr : &it->second;
  }

  Partition& owned(std::string_view topic, std::int32_t partition, const char* what) {
    auto it = parts_.find(KeyView{topic, partition});
    if (it == parts_.end() || !it->second.owned)
      throw usage_error(
          fmt::format("OffsetTracker::{}: {}/{} is not assigned: call assign() from the rebalance "
                      "callback first",
                      what, topic, partition));
    return it->second;
  }

  // The tracked, unsettled entry of (offset, epoch); nullptr when the epoch is over (the call is
  // then ignored); usage_error when the call cannot be right whatever happened meanwhile.
  Entry* find(std::string_view topic, std::int32_t partition, std::int64_t offset, Epoch epoch, const char* what,
              Partition*& out) {
    auto it = parts_.find(KeyView{topic, partition});
    // An epoch comes from track(), which needs the partition assigned: an unknown partition or an
    // epoch not handed out yet for it is a mix-up, not a late outcome.
    if (it == parts_.end() || epoch == 0 || epoch > it->second.epoch)
      throw usage_error(
          fmt::format("OffsetTracker::{}: {}/{} offset {}: epoch {} was never handed out for this "
                      "partition (pass the one track() returned)",
                      what, topic, partition, offset, epoch));
    Partition& p = it->second;
    out = &p;
    if (p.owned) {
      const auto e = std::lower_bound(p.window.begin(), p.window.end(), offset,
                                      [](const Entry& x, std::int64_t o) { return x.offset < o; });
      if (e != p.window.end() && e->offset == offset && e->epoch == epoch) {
        if (e->settled)
          throw usage_error(
              fmt::format("OffsetTracker::{}: {}/{} offset {} is settled already", what, topic, partition, offset));
        return &*e;
      }
    }
    // Not in the window. With an epoch that is over (a revoke, a re-assign or a rewind since),
    // the message was dropped: ignore its outcome. With the current one it was never tracked in
    // it, or was settled and is committable already.
    if (!p.owned || epoch != p.epoch) {
      ++stats_.ignored;
      return nullptr;
    }
    if (p.commit && offset < *p.commit)
      throw usage_error(
          fmt::format("OffsetTracker::{}: {}/{} offset {} is below the committable offset {}: "
                      "settled already",
                      what, topic, partition, offset, *p.commit));
    throw usage_error(fmt::format("OffsetTracker::{}: {}/{} offset {} was not tracked in epoch {}", what, topic,
                                  partition, offset, epoch));
  }

  // Forgets what a partition tracked; the epoch stays, so older ones keep being recognised.
  void forget(Partition& p) {
    unsettled_ -= p.unsettled;
    held_ -= p.window.size();
    stats_.dropped += p.window.size();
    p.window.clear();
    p.unsettled = 0;
    p.next_track = 0;
    p.commit.reset();
  }

  std::optional<std::int64_t> release(Partition& p) {
    const auto offset = p.commit;
    forget(p);
    p.owned = false;
    return offset;
  }

  mutable std::mutex mu_;
  std::map<Key, Partition, KeyLess> parts_;  // revoked partitions stay, so their old epochs are known
  Epoch last_epoch_ = 0;
  std::size_t unsettled_ = 0;  // over owned partitions: forget() takes a partition's out
  std::size_t held_ = 0;
  OffsetTrackerStats stats_;
};

}  // namespace idem::kafka
