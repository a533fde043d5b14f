#pragma once
/// @file detail/warning_relay.hpp A store's advisories for every observer that asks for them. Not
/// part of idem's API.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/core/observer.hpp"

namespace idem::detail {

/**
 * Stands in for the observer a store was configured with: it passes every event on to that one,
 * and the store's advisories (on_warning) also to the observers attached later — each guard
 * attaches its own, so a guard's observer hears its store's eviction, replica and degradation
 * warnings without being set twice. A newcomer first gets the advisories raised before it came
 * (the settings checks run when the store is built; the last 16 are kept). Attached observers are
 * held weakly: a destroyed guard's drops out. Thread-safe.
 */
class WarningRelay final : public Observer {
public:
  explicit WarningRelay(std::shared_ptr<Observer> own) : own_(std::move(own)) {}

  /// `o` behind a relay, or `o` itself when it already is one (a store built from another's options).
  static std::shared_ptr<Observer> wrap(std::shared_ptr<Observer> o) {
    if (dynamic_cast<WarningRelay*>(o.get())) return o;
    return std::make_shared<WarningRelay>(std::move(o));
  }

  /// Hands the advisories to `o` too, those raised so far first; the store's own observer, a null
  /// one or one already attached changes nothing.
  void attach(const std::shared_ptr<Observer>& o) {
    if (!o || o == own_ || o.get() == this) return;
    std::vector<std::string> replay;
    {
      std::lock_guard lock(mu_);
      std::erase_if(attached_, [](const std::weak_ptr<Observer>& w) { return w.expired(); });
      for (const auto& w : attached_)
        if (w.lock() == o) return;
      attached_.push_back(o);
      attached_count_.store(attached_.size(), std::memory_order_release);
      replay = past_;
    }
    for (const auto& m : replay) o->on_warning(m);
  }

  void on_warning(std::string_view message) noexcept override {
    std::vector<std::shared_ptr<Observer>> to;
    try {
      std::lock_guard lock(mu_);
      past_.emplace_back(message);
      if (past_.size() > kept) past_.erase(past_.begin());
      for (const auto& w : attached_)
        if (auto s = w.lock()) to.push_back(std::move(s));
    } catch (...) {
      // Out of memory: the attached observers miss this one; the store's own still hears it.
    }
    if (own_) own_->on_warning(message);
    for (const auto& s : to) s->on_warning(message);
  }
  void on_outcome(const OutcomeEvent& e) noexcept override {
    if (own_) own_->on_outcome(e);
  }
  void on_store_error(std::string_view key, const std::exception& e) noexcept override {
    if (own_) own_->on_store_error(key, e);
  }
  void on_lease_lost(std::string_view key, std::uint64_t fence) noexcept override {
    if (own_) own_->on_lease_lost(key, fence);
  }
  void on_handler_error(std::string_view key, const std::exception_ptr& e) noexcept override {
    if (own_) own_->on_handler_error(key, e);
  }
  void on_lease_extended(std::string_view key, std::uint64_t fence) noexcept override {
    if (own_) own_->on_lease_extended(key, fence);
  }
  void on_batch(std::size_t size) noexcept override {
    if (own_) own_->on_batch(size);
  }
  void on_store_call(const StoreCallEvent& e) noexcept override {
    if (own_) own_->on_store_call(e);
  }
  void on_relay(const OutboxRelayEvent& e) noexcept override {
    if (own_) own_->on_relay(e);
  }
  void on_source(const SourceEvent& e) noexcept override {
    if (own_) own_->on_source(e);
  }
  // The store's pool reports here: to its own observer and every attached guard's. Two per store
  // call, so the attached list is looked at only when there is one.
  void on_pool(const PoolEvent& e) noexcept override {
    if (own_) own_->on_pool(e);
    if (attached_count_.load(std::memory_order_acquire) == 0) return;
    std::vector<std::shared_ptr<Observer>> to;
    try {
      std::lock_guard lock(mu_);
      for (const auto& w : attached_)
        if (auto s = w.lock()) to.push_back(std::move(s));
    } catch (...) {
      return;  // out of memory: the attached observers miss this one
    }
    for (const auto& s : to) s->on_pool(e);
  }

private:
  static constexpr std::size_t kept = 16;
  std::shared_ptr<Observer> own_;
  std::mutex mu_;
  std::vector<std::weak_ptr<Observer>> attached_;
  std::atomic<std::size_t> attached_count_{0};
  std::vector<std::string> past_;
};

/// Attaches `o` to the relay behind `configured` (a store's observer after the store wrapped it).
inline void attach_to_relay(const std::shared_ptr<Observer>& configured, const std::shared_ptr<Observer>& o) {
  if (auto* relay = dynamic_cast<WarningRelay*>(configured.get())) relay->attach(o);
}

}  // namespace idem::detail
