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
#include "idem/detail/lease_watch.hpp"

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
    LeaseWatch watch;   // when it is due, and whether it is lost (stop fired; never extended again)
    bool busy = false;  // an extension of this holder is in flight, on the keeper thread
  };

public:
  /// Keeps leases of `lease` on `store`, reporting to `observer` (may be null).
  LeaseKeeper(Store& store, millis lease, std::shared_ptr<Observer> observer)
      : store_(&store), lease_(lease), observer_(std::move(observer)) {}
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
      if (keeper_) it_ = keeper_->add(key, holder, stop);
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
  typename std::list<Entry>::iterator add(std::string_view key, const Holder& holder, std::stop_source& stop) {
    Entry e{key, holder, &stop, LeaseWatch(lease_, clock::now())};
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
        if (!it->watch.lost() && (next == entries_.end() || it->watch.due() < next->watch.due())) next = it;
      if (next == entries_.end()) {
        wake_.wait(lock);
        continue;
      }
      if (const auto due = next->watch.due(); due > clock::now()) {
        // A copy: the entry may be removed while this waits, and wait_until reads the time again.
        wake_.wait_until(lock, due);
        continue;
      }
      next->busy = true;  // remove() waits: the entry, its key and its stop source stay valid
      Entry e = *next;
      lock.unlock();
      // Reported outside the keeper's lock: a lost lease runs the handler's stop callbacks.
      try {
        const WriteStatus w = store_->extend(e.key, e.holder, lease_);
        report(e.watch.answered(w, clock::now()), observer_.get(), e.key, e.holder.fence, nullptr, *e.stop);
      } catch (const std::exception& ex) {
        report(e.watch.failed(clock::now()), observer_.get(), e.key, e.holder.fence, &ex, *e.stop);
      }
      lock.lock();
      next->busy = false;
      next->watch = e.watch;
      idle_.notify_all();
    }
  }

  Store* store_;
  millis lease_;
  std::shared_ptr<Observer> observer_;
  std::mutex mu_;
  std::condition_variable wake_, idle_;
  std::list<Entry> entries_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace idem::detail
