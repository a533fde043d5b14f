#pragma once
/// @file guard/lease_keeper.hpp The lease keeper: one thread per guard that extends the lease of
/// every live holder of that guard while its handler runs (GuardOptions::heartbeat).

#include <chrono>
#include <condition_variable>
#include <exception>
#include <list>
#include <memory>
#include <mutex>
#include <stop_token>
#include <string_view>
#include <thread>
#include <utility>

#include "idem/core/observer.hpp"
#include "idem/core/record.hpp"
#include "idem/core/store.hpp"

namespace idem::detail {

/**
 * Thread model: one keeper thread per guard, started by the first run that registers a holder and
 * joined when the guard is destroyed; a guard without heartbeat never creates a keeper. The thread
 * extends each registered holder every lease/3, one store call at a time, in due order. When the
 * store answers lease_lost, or no extension succeeded for a whole lease (the store is unreachable,
 * so another holder may already have taken over), it fires the holder's stop token and reports
 * on_lease_lost; it never extends that holder again. Unregistering waits for an extension of that
 * holder in progress, so no extension is ever sent after the run's complete or fail.
 */
template <StateStore Store>
class LeaseKeeper {
  using clock = std::chrono::steady_clock;

  struct Entry {
    std::string_view key;
    Holder holder;
    std::stop_source* stop;
    clock::time_point due, last_ok;
    bool busy = false;  // an extension of this holder is in flight, on the keeper thread
    bool lost = false;  // stop fired; never extended again
  };

public:
  /// Keeps leases of `lease` on `store`, reporting to `observer` (may be null).
  LeaseKeeper(Store& store, millis lease, std::shared_ptr<Observer> observer)
      : store_(&store), lease_(lease), period_(lease / 3), observer_(std::move(observer)) {}
  LeaseKeeper(const LeaseKeeper&) = delete;
  LeaseKeeper& operator=(const LeaseKeeper&) = delete;
  ~LeaseKeeper() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  /// Keeps `holder`'s lease on `key` alive until destroyed (or end()); a null keeper keeps
  /// nothing (heartbeat off). `key` and `stop` must outlive it.
  class Registration {
  public:
    Registration(LeaseKeeper* k, std::string_view key, const Holder& holder, std::stop_source& stop)
        : keeper_(k) {
      if (keeper_) it_ = keeper_->add(Entry{key, holder, &stop, {}, {}});
    }
    Registration(const Registration&) = delete;
    Registration& operator=(const Registration&) = delete;
    ~Registration() { end(); }
    /// Stops keeping the lease; returns once no extension of this holder is in flight.
    void end() noexcept {
      if (keeper_) std::exchange(keeper_, nullptr)->remove(it_);
    }

  private:
    LeaseKeeper* keeper_;
    typename std::list<Entry>::iterator it_;
  };

private:
  typename std::list<Entry>::iterator add(Entry e) {
    e.last_ok = clock::now();
    e.due = e.last_ok + period_;
    std::unique_lock lock(mu_);
    // Started before the entry goes in: a thread that cannot start leaves nothing registered.
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    auto it = entries_.insert(entries_.end(), e);
    lock.unlock();
    wake_.notify_all();
    return it;
  }

  void remove(typename std::list<Entry>::iterator it) noexcept {
    std::unique_lock lock(mu_);
    idle_.wait(lock, [&] { return !it->busy; });
    entries_.erase(it);
  }

  void loop() {
    std::unique_lock lock(mu_);
    while (!stopping_) {
      auto next = entries_.end();
      for (auto it = entries_.begin(); it != entries_.end(); ++it)
        if (!it->lost && (next == entries_.end() || it->due < next->due)) next = it;
      if (next == entries_.end()) {
        wake_.wait(lock);
        continue;
      }
      if (const auto due = next->due; due > clock::now()) {
        // A copy: the entry may be removed while this waits, and wait_until reads the time again.
        wake_.wait_until(lock, due);
        continue;
      }
      next->busy = true;  // remove() waits: the entry, its key and its stop source stay valid
      const Entry e = *next;
      lock.unlock();
      const Verdict v = extend(e);
      const auto now = clock::now();
      const bool lost = v == Verdict::lost || (v == Verdict::failed && now - e.last_ok >= lease_);
      if (v == Verdict::ok && observer_) observer_->on_lease_extended(e.key, e.holder.fence);
      if (lost) {
        // The stop callbacks are the handler's code: never run them under the keeper's lock.
        if (observer_) observer_->on_lease_lost(e.key, e.holder.fence);
        e.stop->request_stop();
      }
      lock.lock();
      next->busy = false;
      next->lost = lost;
      if (v == Verdict::ok) next->last_ok = now;
      next->due = now + period_;
      idle_.notify_all();
    }
  }

  enum class Verdict { ok, lost, failed };

  Verdict extend(const Entry& e) {
    try {
      return store_->extend(e.key, e.holder, lease_) == WriteStatus::ok ? Verdict::ok : Verdict::lost;
    } catch (const std::exception& ex) {
      if (observer_) observer_->on_store_error(e.key, ex);
      return Verdict::failed;
    }
  }

  Store* store_;
  millis lease_, period_;
  std::shared_ptr<Observer> observer_;
  std::mutex mu_;
  std::condition_variable wake_, idle_;
  std::list<Entry> entries_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace idem::detail
