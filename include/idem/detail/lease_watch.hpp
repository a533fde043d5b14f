#pragma once
/// @file detail/lease_watch.hpp Internal: one holder's lease, watched without I/O — when to extend
/// it next and what an extension's answer means. The keeper thread (lease_keeper.hpp) and the
/// async heartbeat (asio/guard.hpp) both drive it, so "extend failed", "lease lost" and the stop
/// token follow one rule and are reported the same way. Not part of idem's API.

#include <chrono>
#include <exception>
#include <stop_token>
#include <string_view>

#include "idem/core/observer.hpp"
#include "idem/core/record.hpp"

namespace idem::detail {

class LeaseWatch {
 public:
  using clock = std::chrono::steady_clock;

  /// What an extension's answer means for the run.
  enum class Event {
    extended,  ///< the lease runs `lease` from now
    failed,    ///< the store did not answer; the lease may still hold (another try at due())
    lost,      ///< taken over, or not extended for a whole lease: the run must stop
  };

  /// A lease of `lease` acquired (or last extended) at `now`; extended every lease / 3.
  LeaseWatch(millis lease, clock::time_point now) noexcept
      : lease_(lease), period_(lease / 3), last_ok_(now), due_(now + period_) {}

  /// When the next extension is due.
  [[nodiscard]] clock::time_point due() const noexcept { return due_; }
  /// Whether the lease is lost (no extension is ever sent again).
  [[nodiscard]] bool lost() const noexcept { return lost_; }

  /// The store answered an extension made at `now`: ok, or lease_lost (another holder took over).
  Event answered(WriteStatus w, clock::time_point now) noexcept {
    if (w != WriteStatus::ok) return lose();
    last_ok_ = now;
    due_ = now + period_;
    return Event::extended;
  }

  /// The extension made at `now` threw (the store is unreachable, timed out, in doubt). After a
  /// whole lease without a success another holder may already have taken over: lost.
  Event failed(clock::time_point now) noexcept {
    if (now - last_ok_ >= lease_) return lose();
    due_ = now + period_;
    return Event::failed;
  }

 private:
  Event lose() noexcept {
    lost_ = true;
    return Event::lost;
  }

  millis lease_, period_;
  clock::time_point last_ok_, due_;
  bool lost_ = false;
};

/// Reports `e` for holder `fence` of `key` to `observer` (may be null) — on_lease_extended, the
/// extension's error to on_store_error (`error`, when it threw), on_lease_lost — and fires `stop`
/// when the lease is lost. Runs the handler's stop callbacks: call it under no lock.
inline void report(LeaseWatch::Event e, Observer* observer, std::string_view key, std::uint64_t fence,
                   const std::exception* error, std::stop_source& stop) {
  if (observer && error) observer->on_store_error(key, *error);
  switch (e) {
    case LeaseWatch::Event::extended:
      if (observer) observer->on_lease_extended(key, fence);
      break;
    case LeaseWatch::Event::failed:
      break;
    case LeaseWatch::Event::lost:
      if (observer) observer->on_lease_lost(key, fence);
      stop.request_stop();
      break;
  }
}

}  // namespace idem::detail
