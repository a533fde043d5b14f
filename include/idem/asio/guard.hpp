#pragma once
/// @file asio/guard.hpp IdempotencyGuard::run_async (declared in guard.hpp): the guard on Boost.Asio
/// coroutines, with the same decisions, failure policy, cache and observer as run().

#include <utility>  // before Asio: Boost 1.74's awaitable.hpp uses std::exchange without including it

#include <chrono>
#include <exception>
#include <memory>
#include <stop_token>
#include <string>
#include <type_traits>

#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include "idem/guard/guard.hpp"

namespace idem {

/// A store whose transitions are also asynchronous operations taking an Asio completion token
/// (AsyncRedisStore); run_async awaits them instead of calling the blocking ones.
template <class S>
concept AsyncStateStore = requires(S& s, std::string_view key, const AcquireParams& ap, const Holder& h,
                                   std::string_view result, const FailParams& fp, millis d) {
  s.async_acquire(key, ap, boost::asio::use_awaitable);
  s.async_complete(key, h, result, d, boost::asio::use_awaitable);
  s.async_fail(key, h, fp, boost::asio::use_awaitable);
  s.async_extend(key, h, d, boost::asio::use_awaitable);
};

namespace detail {

template <class T>
struct awaited {
  using type = T;
};
template <class T, class E>
struct awaited<boost::asio::awaitable<T, E>> {
  using type = T;
};
template <class T>
inline constexpr bool is_awaitable_v = !std::is_same_v<typename awaited<T>::type, T>;

// The store's steps as awaitables: awaited on an async store, called inline on any other.
template <class Store>
boost::asio::awaitable<AcquireResult> step_acquire(Store& s, std::string_view key, const AcquireParams& ap) {
  if constexpr (AsyncStateStore<Store>)
    co_return co_await s.async_acquire(key, ap, boost::asio::use_awaitable);
  else
    co_return s.acquire(key, ap);
}
template <class Store>
boost::asio::awaitable<WriteStatus> step_complete(Store& s, std::string_view key, const Holder& h, std::string_view r,
                                                  millis retention) {
  if constexpr (AsyncStateStore<Store>)
    co_return co_await s.async_complete(key, h, r, retention, boost::asio::use_awaitable);
  else
    co_return s.complete(key, h, r, retention);
}
template <class Store>
boost::asio::awaitable<WriteStatus> step_fail(Store& s, std::string_view key, const Holder& h, const FailParams& f) {
  if constexpr (AsyncStateStore<Store>)
    co_return co_await s.async_fail(key, h, f, boost::asio::use_awaitable);
  else
    co_return s.fail(key, h, f);
}
template <class Store>
boost::asio::awaitable<WriteStatus> step_extend(Store& s, std::string_view key, const Holder& h, millis lease) {
  if constexpr (AsyncStateStore<Store>)
    co_return co_await s.async_extend(key, h, lease, boost::asio::use_awaitable);
  else
    co_return s.extend(key, h, lease);
}

// The heartbeat of one async run: extends the lease every lease / 3 on the run's executor (no
// thread of its own, so no blocking call ever waits for the loop it runs on). A lease taken over,
// or not extended for a whole lease, fires the run's stop token.
struct AsyncHeartbeat {
  bool done = false;
  std::unique_ptr<boost::asio::steady_timer> timer;
};

template <class Store>
boost::asio::awaitable<void> keep_lease(Store& s, std::string key, Holder h, millis lease,
                                        std::shared_ptr<AsyncHeartbeat> hb, std::stop_source stop,
                                        std::shared_ptr<Observer> observer) {
  auto last_ok = std::chrono::steady_clock::now();
  while (!hb->done) {
    hb->timer->expires_after(lease / 3);
    try {
      co_await hb->timer->async_wait(boost::asio::use_awaitable);
    } catch (const std::exception&) {
      co_return;  // cancelled: the run ended
    }
    if (hb->done) co_return;
    try {
      if (co_await step_extend(s, key, h, lease) == WriteStatus::lease_lost) {
        if (!hb->done && observer) observer->on_lease_lost(key, h.fence);
        stop.request_stop();
        co_return;
      }
      last_ok = std::chrono::steady_clock::now();
      if (observer) observer->on_lease_extended(key, h.fence);
    } catch (const std::exception&) {
      if (std::chrono::steady_clock::now() - last_ok >= lease) {
        if (!hb->done && observer) observer->on_lease_lost(key, h.fence);
        stop.request_stop();
        co_return;
      }
    }
  }
}

}  // namespace detail

template <StateStore Store>
template <class F>
auto IdempotencyGuard<Store>::run_async(std::string key, std::string payload, F handler) {
  static_assert(takes_context<F> || std::is_invocable_v<F&>,
                "idem: the handler must be callable with () or with (const idem::Context&)");
  static_assert(std::is_void_v<transaction_t<Store>>,
                "idem: run_async does not run transactional stores (PostgresStore): use run() on a worker thread");
  using R = std::decay_t<typename detail::awaited<std::decay_t<typename result_of<F>::type>>::type>;
  static_assert(std::is_void_v<R> || Encodable<R>,
                "idem: the handler's result type needs an idem::codec<T> specialisation (see codec.hpp)");
  return [](IdempotencyGuard* self, std::string k, std::string fp, F h) -> boost::asio::awaitable<Outcome<R>> {
    detail::check_key(k, self->options_.max_key_bytes);
    const GuardOptions& o = self->options_;
    const auto started = std::chrono::steady_clock::now();
    auto report_store_error = [&](const std::exception& e) {
      const auto* ie = dynamic_cast<const error*>(&e);
      const bool store_failed = dynamic_cast<const store_error*>(&e) || dynamic_cast<const corrupt_record_error*>(&e);
      if (o.observer && store_failed && !(ie && ie->from_handler())) o.observer->on_store_error(k, e);
    };
    auto finish = [&](Outcome<R> out) {
      if (o.observer)
        o.observer->on_outcome(OutcomeEvent{k, out.status, std::chrono::steady_clock::now() - started, out.attempt,
                                            out.takeover, out.from_cache});
      return out;
    };
    if (self->cache_) {
      if (auto hit = self->cache_->get(k)) {
        Outcome<R> out;
        if (!fp.empty() && !hit->fingerprint.empty() && fp != hit->fingerprint) {
          out.status = Status::mismatch;
        } else {
          out.status = Status::duplicate;
          out.value = detail::decode_result<R>(k, hit->result);
          out.from_cache = true;
        }
        co_return finish(std::move(out));
      }
    }
    AcquireParams ap;
    ap.fingerprint = fp;
    ap.lease = o.lease;
    ap.retention = o.retention;
    ap.owner = o.owner;
    Store& store = *self->store_;

    // acquire, waiting out an in-flight holder as run() does (timer pauses instead of sleeps)
    AcquireResult ar;
    const auto deadline = std::chrono::steady_clock::now() + o.wait_for_in_flight;
    millis pause{10};
    for (;;) {
      ap.token = detail::random_token();
      try {
        ar = co_await detail::step_acquire(store, k, ap);
      } catch (const outcome_unknown_error& e) {
        report_store_error(e);
        if (e.retryable()) throw;
        throw outcome_unknown_error(std::string(e.what()) + "; the handler did not run: redeliver the message (the key "
                                    "frees itself after the lease)", e.code(), true);
      } catch (const std::exception& e) {
        report_store_error(e);
        throw;
      }
      if (ar.status != AcquireStatus::in_flight || o.wait_for_in_flight == millis{0} ||
          std::chrono::steady_clock::now() >= deadline)
        break;
      auto left = std::chrono::duration_cast<millis>(deadline - std::chrono::steady_clock::now());
      boost::asio::steady_timer t(co_await boost::asio::this_coro::executor);
      t.expires_after(std::min({pause, left, std::max(ar.retry_after, millis{1})}));
      co_await t.async_wait(boost::asio::use_awaitable);
      pause = std::min(pause * 2, millis{200});
    }
    if (ar.status != AcquireStatus::acquired) co_return finish(self->template not_acquired<R>(k, fp, ar));

    const Holder holder = ar.holder;
    Outcome<R> out;
    std::stop_source stop = o.heartbeat ? std::stop_source{} : std::stop_source{std::nostopstate};
    context_type ctx{};
    begin_run(ctx, out, k, ar, stop);
    std::shared_ptr<detail::AsyncHeartbeat> hb;
    if (o.heartbeat) {
      auto ex = co_await boost::asio::this_coro::executor;
      hb = std::make_shared<detail::AsyncHeartbeat>();
      hb->timer = std::make_unique<boost::asio::steady_timer>(ex);
      boost::asio::co_spawn(ex, detail::keep_lease(store, k, holder, o.lease, hb, stop, o.observer),
                            boost::asio::detached);
    }
    auto end_heartbeat = [&] {
      if (!hb) return;
      hb->done = true;
      hb->timer->cancel();
    };
    std::exception_ptr thrown;
    bool stale = false;
    try {
      if constexpr (detail::is_awaitable_v<std::decay_t<typename result_of<F>::type>>) {
        if constexpr (std::is_void_v<R>) {
          co_await self->invoke(h, ctx);
          out.value.emplace();
        } else {
          out.value.emplace(co_await self->invoke(h, ctx));
        }
      } else {
        self->template run_handler<R>(h, ctx, out);
      }
    } catch (const detail::stale_signal&) {
      stale = true;
    } catch (...) {
      thrown = std::current_exception();
    }
    end_heartbeat();
    if (stale) {
      co_await detail::step_fail(store, k, holder, detail::stale_release(o.retention));
      out.status = Status::stale;
      co_return finish(std::move(out));
    }
    if (thrown) {
      if (o.observer) o.observer->on_handler_error(k, thrown);
      try {
        co_await detail::step_fail(store, k, holder,
                                   detail::failure_params(o.failure, o.retention, ar.attempts, detail::describe(thrown)));
      } catch (const std::exception& e) {
        if (o.observer) o.observer->on_store_error(k, e);
      }
      std::rethrow_exception(thrown);
    }
    std::string encoded;
    if (auto why = self->template encode_for_store<R>(out, encoded)) {
      WriteStatus ws;
      if constexpr (CompletesUnavailable<Store> && !AsyncStateStore<Store>)
        ws = store.complete_unavailable(k, holder, *why, o.retention);
      else if constexpr (AsyncStateStore<Store>)
        ws = co_await store.async_complete_unavailable(k, holder, *why, o.retention, boost::asio::use_awaitable);
      else
        ws = co_await detail::step_fail(store, k, holder, self->unstorable_failure(*why));
      if (ws == WriteStatus::lease_lost) {
        out.status = Status::lease_lost;
        co_return finish(std::move(out));
      }
      throw result_not_stored_error("idem: the result of key '" + detail::printable(k) + "' was not stored: " + *why +
                                    "; the key is completed without it and will not run again");
    }
    WriteStatus ws;
    try {
      ws = co_await detail::step_complete(store, k, holder, encoded, o.retention);
    } catch (const std::exception& e) {
      report_store_error(e);
      throw;
    }
    self->template finish_run<R>(k, fp, ws, encoded, out);
    co_return finish(std::move(out));
  }(this, std::move(key), payload.empty() ? std::string{} : fingerprint(payload), std::move(handler));
}

}  // namespace idem
