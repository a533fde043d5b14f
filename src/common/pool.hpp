#pragma once
// Internal to the backends: the PostgreSQL client's connection pool (PoolOptions, documented in
// idem/core/pool_options.hpp). Redis has none: its engine's lanes take pool.size only. Tested alone
// under many threads in tests/core/pool_test.cpp (the tsan preset runs it).
//
// `Traits` adapts a connection type:
//   using connection = ...;                        // move-only handle that closes itself (unique_ptr)
//   connection connect();                          // open a new one, or throw an idem error
//   bool alive(connection&) noexcept;              // may an idle connection be reused? (no blocking)
//   bool reusable(connection&) noexcept;           // may a returned healthy one go back to the pool?

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/core/error.hpp"
#include "idem/core/observer.hpp"
#include "idem/core/pool_options.hpp"

namespace idem::detail {

/// Checks PoolOptions for `owner` ("RedisOptions", "PostgresOptions"); invalid_options_error names the field.
inline void check_pool_options(const PoolOptions& o, const char* owner) {
  if (o.size == 0)
    throw invalid_options_error(
        fmt::format("idem: {}::pool.size is 0; every call needs a connection, use at least 1", owner));
  if (o.wait < millis{0})
    throw invalid_options_error(
        fmt::format("idem: {}::pool.wait is negative; use 0 to fail at once when the pool is busy", owner));
}

template <class Traits>
class Pool {
public:
  using connection = typename Traits::connection;

  /// `what` names the server in messages ("Redis at 127.0.0.1:6379", "PostgreSQL").
  Pool(PoolOptions options, Traits traits, std::string what)
      : options_(options), traits_(std::move(traits)), what_(std::move(what)) {}
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  /// Reports every checkout and return to `observer` (Observer::on_pool) as pool `kind`; both
  /// outlive the pool. Set once, before the pool is shared between threads.
  void observe(Observer* observer, std::string_view kind) noexcept {
    observer_ = observer;
    kind_ = kind;
  }

  /// An idle connection that is still alive, else a new one (up to size), else waits up to `wait`.
  connection checkout() {
    const auto started = std::chrono::steady_clock::now();
    std::unique_lock lock(mu_);
    const auto deadline = started + options_.wait;
    bool waited = false;
    for (;;) {
      if (auto c = take_idle(lock)) {
        report(waited ? std::chrono::steady_clock::now() - started : std::chrono::nanoseconds{}, false);
        return std::move(*c);
      }
      if (open_ < options_.size) {
        auto c = open_new(lock);
        report(waited ? std::chrono::steady_clock::now() - started : std::chrono::nanoseconds{}, false);
        return c;
      }
      waited = true;
      if (!cv_.wait_until(lock, deadline, [&] { return !idle_.empty() || open_ < options_.size; })) {
        lock.unlock();
        report(std::chrono::steady_clock::now() - started, true);
        throw timeout_error(fmt::format("idem: all {} connections to {} stayed busy for {} ms; raise pool.size to "
                                        "match the calling threads (or pool.wait)",
                                        options_.size, what_, options_.wait.count()),
                            "POOL", true);
      }
    }
  }

  /// An idle live connection, else a new one if the pool is below size, else an empty handle at
  /// once: for work that can do with fewer connections (a batch's extra completion sessions).
  connection try_checkout() {
    std::unique_lock lock(mu_);
    if (auto c = take_idle(lock)) return std::move(*c);
    if (open_ >= options_.size) return connection{};
    return open_new(lock);
  }

  /// Returns a connection; an unhealthy one (or one Traits::reusable refuses) is closed.
  void checkin(connection c, bool healthy) noexcept {
    if (healthy) healthy = traits_.reusable(c);
    if (!healthy) c = connection{};
    {
      std::lock_guard lock(mu_);
      if (healthy)
        idle_.push_back(std::move(c));
      else
        --open_;
      counted();
    }
    cv_.notify_one();
    report(std::chrono::nanoseconds{}, false);
  }

  /// A checked-out connection returned on destruction; healthy only once the caller says so.
  class Lease {
  public:
    explicit Lease(Pool& p) : pool_(&p), c_(p.checkout()) {}
    ~Lease() { pool_->checkin(std::move(c_), healthy_); }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    connection& get() noexcept { return c_; }
    void healthy(bool h = true) noexcept { healthy_ = h; }

  private:
    Pool* pool_;
    connection c_;
    bool healthy_ = false;
  };

  [[nodiscard]] const PoolOptions& options() const noexcept { return options_; }
  [[nodiscard]] Traits& traits() noexcept { return traits_; }
  [[nodiscard]] const std::string& what() const noexcept { return what_; }

private:
  // `lock` held: an idle connection that is still alive (the lock released), else nullopt (the
  // lock still held). One closed by the server while idle is replaced, never sent on.
  std::optional<connection> take_idle(std::unique_lock<std::mutex>& lock) {
    while (!idle_.empty()) {
      connection c = std::move(idle_.back());
      idle_.pop_back();
      counted();
      lock.unlock();
      if (traits_.alive(c)) return c;
      c = connection{};
      lock.lock();
      --open_;
      counted();
    }
    return std::nullopt;
  }

  // `lock` held and the pool below size: a new connection, counted before connecting so no other
  // caller opens past size meanwhile (the lock released while connecting).
  connection open_new(std::unique_lock<std::mutex>& lock) {
    ++open_;
    counted();
    lock.unlock();
    try {
      return traits_.connect();
    } catch (...) {
      lock.lock();
      --open_;
      counted();
      cv_.notify_one();
      throw;
    }
  }

  // The counts are read without the lock: a report is a sample, and a racing one is as good.
  void report(std::chrono::nanoseconds waited, bool exhausted) noexcept {
    if (!observer_) return;
    const std::size_t open = open_atomic();
    const std::size_t idle = idle_count_.load(std::memory_order_relaxed);
    observer_->on_pool(PoolEvent{kind_, open > idle ? open - idle : 0, open, options_.size, waited, exhausted});
  }
  std::size_t open_atomic() const noexcept { return open_count_.load(std::memory_order_relaxed); }
  // `mu_` held: publishes the counts report() reads.
  void counted() noexcept {
    open_count_.store(open_, std::memory_order_relaxed);
    idle_count_.store(idle_.size(), std::memory_order_relaxed);
  }

  PoolOptions options_;
  Traits traits_;
  std::string what_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<connection> idle_;
  std::size_t open_ = 0;
  Observer* observer_ = nullptr;
  std::string_view kind_;
  std::atomic<std::size_t> open_count_{0}, idle_count_{0};  // open_ and idle_.size() for report()
};

}  // namespace idem::detail
