#pragma once
/// @file memory_store.hpp MemoryStore: the in-process, thread-safe, sharded StateStore.

#include <algorithm>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <fmt/core.h>

#include "idem/core/clock.hpp"
#include "idem/detail/sharded_map.hpp"
#include "idem/core/validate.hpp"
#include "idem/core/error.hpp"
#include "idem/core/record.hpp"
#include "idem/core/batch_store.hpp"
#include "idem/core/store.hpp"

namespace idem {

/// Options of MemoryStore.
struct MemoryStoreOptions {
  /// Number of independently locked shards; more shards, less contention. Must be > 0.
  std::size_t shards = 64;
  /// Upper bound on stored records (0 = unbounded). At the bound, expired records of the shard are
  /// purged; if the shard is still full, acquire of a new key throws capacity_error (fail closed:
  /// live and completed records are never evicted, since that would allow a second execution).
  std::size_t max_records = 1'000'000;
  /// Clock used for leases and expiry; null = SteadyClock. Share a ManualClock to test leases.
  std::shared_ptr<const Clock> clock;
};

/**
 * In-process StateStore: thread-safe, sharded (one mutex per shard, no global lock), with lazy
 * retention expiry and a record bound. The default for tests, demos and single-process consumers.
 * Records live only as long as the process: it protects against redelivery within one process.
 *
 * @code
 * idem::MemoryStore store;                 // 64 shards, 1M records, steady clock
 * idem::IdempotencyGuard guard{store};
 * @endcode
 */
class MemoryStore {
public:
  /// Creates an empty store; throws invalid_options_error on zero shards.
  explicit MemoryStore(MemoryStoreOptions options = {}) : options_(std::move(options)) {
    if (options_.shards == 0) throw invalid_options_error("idem: MemoryStoreOptions::shards must be > 0");
    if (!options_.clock) options_.clock = std::make_shared<SteadyClock>();
    per_shard_cap_ = options_.max_records == 0
                         ? 0
                         : std::max<std::size_t>(1, (options_.max_records + options_.shards - 1) / options_.shards);
  }
  MemoryStore(MemoryStore&&) noexcept = default;             ///< Movable; not copyable.
  MemoryStore& operator=(MemoryStore&&) noexcept = default;  ///< Movable; not copyable.

  /// Atomic acquire of docs/design.md §1; see AcquireStatus for the outcomes.
  AcquireResult acquire(std::string_view key, const AcquireParams& p) {
    detail::check_acquire(key, p);
    Shard& sh = shard(key);
    std::lock_guard lock(sh.mu);
    return acquire_locked(sh, key, p, now_ms());
  }

  /// Records the result if `h` still holds the key; else lease_lost and nothing changes.
  WriteStatus complete(std::string_view key, const Holder& h, std::string_view result, millis retention) {
    return write_completed(key, h, retention, false, result);
  }

  /// Completes the key without its result (see CompletesUnavailable) if `h` still holds it.
  WriteStatus complete_unavailable(std::string_view key, const Holder& h, std::string_view reason, millis retention) {
    return write_completed(key, h, retention, true, reason);
  }


  /// Releases or records a failure if `h` still holds the key; else lease_lost.
  WriteStatus fail(std::string_view key, const Holder& h, const FailParams& f) {
    detail::check_holder(key, h);
    detail::check_lease(f.retention, "retention");
    return with_holder(key, h, [&](Entry& e, std::int64_t now) {
      e.rec.state = State::failed;
      e.rec.error = f.error;
      e.rec.lease_until_ms = 0;
      e.rec.permanent = !f.release && f.permanent;
      e.rec.retry_at_ms = f.release ? now : now + std::max<std::int64_t>(0, f.backoff.count());
      e.expires_at_ms = now + f.retention.count();
    });
  }

  /// Pushes the lease of a live holder to now + lease; lease_lost if taken over or gone.
  WriteStatus extend(std::string_view key, const Holder& h, millis lease) {
    detail::check_holder(key, h);
    detail::check_lease(lease);
    return with_holder(key, h, [&](Entry& e, std::int64_t now) {
      e.rec.lease_until_ms = now + lease.count();
      e.expires_at_ms = std::max(e.expires_at_ms, e.rec.lease_until_ms);
    });
  }

  /// Decides each request as acquire() does, in request order (BatchStore).
  std::vector<AcquireResult> acquire_many(std::span<const AcquireRequest> requests) {
    // A bad request refuses the batch before any key is taken, as the other stores do.
    for (const AcquireRequest& r : requests) detail::check_acquire(r.key, r.params);
    // One lock per shard touched: the requests grouped by shard, in request order within one
    // (so a key asked twice is decided in order: acquired, then in_flight).
    std::vector<std::pair<std::size_t, std::size_t>> order(requests.size());  // (shard, request)
    for (std::size_t i = 0; i < requests.size(); ++i) order[i] = {shards_.index_of(requests[i].key), i};
    std::sort(order.begin(), order.end());
    std::vector<AcquireResult> out(requests.size());
    for (std::size_t b = 0; b < order.size();) {
      Shard& sh = shards_.at(order[b].first);
      std::lock_guard lock(sh.mu);
      const std::int64_t now = now_ms();
      std::size_t e = b;
      for (; e < order.size() && order[e].first == order[b].first; ++e) {
        const AcquireRequest& r = requests[order[e].second];
        out[order[e].second] = acquire_locked(sh, r.key, r.params, now);
      }
      b = e;
    }
    return out;
  }

  /// The writes of one batch (BatchWriter): in memory each is done when it is made.
  class BatchWriter {
  public:
    /// A writer on `s` (MemoryStore::batch_writer() makes it).
    explicit BatchWriter(MemoryStore& s) : s_(&s) {}
    /// Completes now; the status is kept for finish().
    void complete(std::string_view key, const Holder& h, std::string_view result, millis retention) {
      statuses_.push_back(s_->complete(key, h, result, retention));
    }
    /// Fails now; the status is kept for finish().
    void fail(std::string_view key, const Holder& h, const FailParams& f) { statuses_.push_back(s_->fail(key, h, f)); }
    /// The statuses, in the order the writes were made.
    std::vector<WriteStatus> finish() { return std::move(statuses_); }

  private:
    MemoryStore* s_;
    std::vector<WriteStatus> statuses_;
  };
  /// A writer for one batch (BatchStore).
  BatchWriter batch_writer() { return BatchWriter(*this); }

  /// A snapshot of the live record, or nullopt if absent or expired.
  std::optional<Record> inspect(std::string_view key) {
    detail::check_key(key, static_cast<std::size_t>(-1));
    Shard& sh = shard(key);
    std::lock_guard lock(sh.mu);
    auto it = sh.map.find(key);
    if (it == sh.map.end() || it->second.expires_at_ms <= now_ms()) return std::nullopt;
    return it->second.rec;
  }

  /// Removes expired records from every shard; returns how many were removed.
  std::size_t purge_expired() {
    std::size_t n = 0;
    for (std::size_t i = 0; i < shards_.shard_count(); ++i) {
      Shard& sh = shards_.at(i);
      std::lock_guard lock(sh.mu);
      n += purge_locked(sh, now_ms());
    }
    return n;
  }

  /// Number of stored records, expired ones not yet purged included.
  [[nodiscard]] std::size_t size() const { return shards_.size(); }

private:
  struct Entry {
    Record rec;
    std::int64_t expires_at_ms = 0;
  };
  using Shard = detail::ShardedMap<Entry>::Shard;

  std::int64_t now_ms() const noexcept { return options_.clock->now_ms(); }

  Shard& shard(std::string_view key) const noexcept { return shards_.shard(key); }

  // acquire() on a locked shard at `now` (a batch decides every key of a shard under one lock).
  AcquireResult acquire_locked(Shard& sh, std::string_view key, const AcquireParams& p, std::int64_t now) {
    auto it = sh.map.find(key);
    if (it != sh.map.end() && it->second.expires_at_ms <= now) {
      sh.map.erase(it);
      it = sh.map.end();
    }
    AcquireResult r;
    if (it == sh.map.end()) {
      if (per_shard_cap_ != 0 && sh.map.size() >= per_shard_cap_) {
        purge_locked(sh, now);
        if (sh.map.size() >= per_shard_cap_)
          throw capacity_error(
              fmt::format("idem: MemoryStore is full (max_records={}); lower retention or raise max_records",
                          options_.max_records),
              "FULL");
      }
      Entry e;
      e.rec.state = State::in_progress;
      e.rec.holder = {1, p.token};
      e.rec.owner = p.owner;
      e.rec.lease_until_ms = now + p.lease.count();
      e.rec.attempts = 1;
      e.rec.fingerprint = p.fingerprint;
      e.expires_at_ms = now + p.retention.count();
      sh.map.emplace(std::string(key), std::move(e));
      r.status = AcquireStatus::acquired;
      r.holder = {1, p.token};
      r.attempts = 1;
      return r;
    }
    Entry& e = it->second;
    Record& rec = e.rec;
    r.attempts = rec.attempts;
    if (!p.fingerprint.empty() && !rec.fingerprint.empty() && rec.fingerprint != p.fingerprint) {
      r.status = AcquireStatus::mismatch;
      return r;
    }
    switch (rec.state) {
      case State::completed:
        r.status = AcquireStatus::duplicate;
        r.result_unavailable = rec.permanent;
        r.payload = rec.permanent ? rec.error : rec.result;
        return r;
      case State::in_progress:
        if (rec.lease_until_ms > now) {
          r.status = AcquireStatus::in_flight;
          r.retry_after = millis{rec.lease_until_ms - now};
          return r;
        }
        r.takeover = true;
        break;
      case State::failed:
        if (rec.permanent) {
          r.status = AcquireStatus::previously_failed;
          r.payload = rec.error;
          return r;
        }
        if (rec.retry_at_ms > now) {
          r.status = AcquireStatus::in_flight;
          r.retry_after = millis{rec.retry_at_ms - now};
          return r;
        }
        break;
    }
    rec.state = State::in_progress;
    rec.holder = {rec.holder.fence + 1, p.token};
    rec.owner = p.owner;
    rec.lease_until_ms = now + p.lease.count();
    rec.retry_at_ms = 0;
    rec.attempts += 1;
    rec.error.clear();
    e.expires_at_ms = std::max(e.expires_at_ms, now + p.retention.count());
    r.status = AcquireStatus::acquired;
    r.holder = rec.holder;
    r.attempts = rec.attempts;
    return r;
  }

  // `unavailable`: `text` is why the result is missing, else the result itself.
  WriteStatus write_completed(std::string_view key, const Holder& h, millis retention, bool unavailable,
                              std::string_view text) {
    detail::check_holder(key, h);
    detail::check_lease(retention, "retention");
    return with_holder(key, h, [&](Entry& e, std::int64_t now) {
      e.rec.state = State::completed;
      e.rec.permanent = unavailable;
      (unavailable ? e.rec.error : e.rec.result) = text;
      e.rec.lease_until_ms = 0;
      e.expires_at_ms = now + retention.count();
    });
  }

  template <class F>
  WriteStatus with_holder(std::string_view key, const Holder& h, F&& write) {
    Shard& sh = shard(key);
    std::lock_guard lock(sh.mu);
    const std::int64_t now = now_ms();
    auto it = sh.map.find(key);
    if (it == sh.map.end() || it->second.expires_at_ms <= now || it->second.rec.state != State::in_progress ||
        it->second.rec.holder != h)
      return WriteStatus::lease_lost;
    write(it->second, now);
    return WriteStatus::ok;
  }

  static std::size_t purge_locked(Shard& sh, std::int64_t now) {
    return std::erase_if(sh.map, [now](const auto& kv) { return kv.second.expires_at_ms <= now; });
  }

  MemoryStoreOptions options_;
  std::size_t per_shard_cap_ = 0;
  detail::ShardedMap<Entry> shards_{options_.shards};
};

static_assert(StateStore<MemoryStore>);
static_assert(CompletesUnavailable<MemoryStore>);

}  // namespace idem

