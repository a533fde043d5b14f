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

#include "idem/detail/lease_watch.hpp"
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
// A machine's holder-checked write, awaited on an async store, called inline on any other.
template <class Store, class M>
boost::asio::awaitable<WriteStatus> step_write(Store& s, const M& m) {
  if constexpr (AsyncStateStore<Store>) {
    switch (m.call()) {
      case Call::complete:
        co_return co_await s.async_complete(m.key(), m.holder(), m.result(), m.retention(), boost::asio::use_awaitable);
      case Call::complete_unavailable:
        co_return co_await s.async_complete_unavailable(m.key(), m.holder(), m.result(), m.retention(),
                                                        boost::asio::use_awaitable);
      default: co_return co_await s.async_fail(m.key(), m.holder(), m.fail_params(), boost::asio::use_awaitable);
    }
  } else {
    switch (m.call()) {
      case Call::complete: co_return s.complete(m.key(), m.holder(), m.result(), m.retention());
      case Call::complete_unavailable:
        if constexpr (CompletesUnavailable<Store>) co_return s.complete_unavailable(m.key(), m.holder(), m.result(), m.retention());
        break;
      default: break;
    }
    co_return s.fail(m.key(), m.holder(), m.fail_params());
  }
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
// or not extended for a whole lease, fires the run's stop token; an extension's error is reported
// to on_store_error, as the keeper thread does.
struct AsyncHeartbeat {
  bool done = false;
  std::unique_ptr<boost::asio::steady_timer> timer;
};

template <class Store>
boost::asio::awaitable<void> keep_lease(Store& s, std::string key, Holder h, millis lease,
                                        std::shared_ptr<AsyncHeartbeat> hb, std::stop_source stop,
                                        std::shared_ptr<Observer> observer) {
  // The keeper thread's rule (lease_watch.hpp), driven by a timer on the run's executor.
  LeaseWatch watch(lease, std::chrono::steady_clock::now());
  while (!hb->done && !watch.lost()) {
    hb->timer->expires_at(watch.due());
    try {
      co_await hb->timer->async_wait(boost::asio::use_awaitable);
    } catch (const std::exception&) {
      co_return;  // cancelled: the run ended
    }
    if (hb->done) co_return;
    LeaseWatch::Event e;
    std::exception_ptr error;
    try {
      e = watch.answered(co_await step_extend(s, key, h, lease), std::chrono::steady_clock::now());
    } catch (const std::exception&) {
      error = std::current_exception();
      e = watch.failed(std::chrono::steady_clock::now());
    }
    if (hb->done) co_return;  // the run ended while the extension was out: nothing left to watch
    try {
      if (error) std::rethrow_exception(error);
      report(e, observer.get(), key, h.fence, nullptr, stop);
    } catch (const std::exception& x) {
      report(e, observer.get(), key, h.fence, &x, stop);
    }
  }
}

}  // namespace detail

template <StateStore Store>
template <class F>
auto IdempotencyGuard<Store>::run_async(std::string key, std::string payload, F handler) {
  return run_async_with_completion(std::move(key), std::move(payload), std::move(handler), nullptr);
}

template <StateStore Store>
template <class F, class Complete>
auto IdempotencyGuard<Store>::run_async_with_completion(std::string key, std::string payload, F handler,
                                                        Complete complete) {
  static_assert(takes_context<F> || std::is_invocable_v<F&>,
                "idem: the handler must be callable with () or with (const idem::Context&)");
  // A PostgresStore in lease mode runs here (its calls inline); its transactional mode cannot: the
  // handler's writes would hold a transaction open across co_awaits on a shared thread.
  if (machine_config_.transactional)
    throw usage_error("idem: run_async does not run a store in transactional mode (the handler's transaction would "
                      "stay open across co_await); use run() on a worker thread, or the store's lease mode");
  using Returned = std::decay_t<typename result_of<F>::type>;
  using R = std::decay_t<typename detail::awaited<Returned>::type>;
  static_assert(std::is_void_v<R> || Encodable<R>,
                "idem: the handler's result type needs an idem::codec<T> specialisation (see codec.hpp)");
  // The coroutine driver: performs each step the machine asks for, awaiting the store.
  return [](IdempotencyGuard* self, std::string k, std::string fp, F h, Complete c) -> boost::asio::awaitable<Outcome<R>> {
    using detail::Next;
    machine<R> m(self->machine_config_, k, std::move(fp));
    Store& store = *self->store_;
    for (Next next = m.start();;) {
      switch (next) {
        case Next::send: {
          std::exception_ptr failed;
          try {
            if (m.call() == detail::Call::acquire)
              next = m.on_acquired(co_await detail::step_acquire(store, m.key(), m.acquire_params()));
            else if constexpr (!std::is_null_pointer_v<Complete>) {
              if (m.call() == detail::Call::complete)
                next = m.on_written(co_await c(m.holder(), m.result(), m.retention()));
              else
                next = m.on_written(co_await detail::step_write(store, m));
            } else {
              next = m.on_written(co_await detail::step_write(store, m));
            }
          } catch (...) {
            failed = std::current_exception();
          }
          if (failed) next = m.on_store_error(failed);
          break;
        }
        case Next::wait: {
          boost::asio::steady_timer t(co_await boost::asio::this_coro::executor);
          t.expires_after(m.pause());
          co_await t.async_wait(boost::asio::use_awaitable);
          next = m.on_waited();
          break;
        }
        case Next::run_handler: {
          std::stop_source stop = m.heartbeat() ? std::stop_source{} : std::stop_source{std::nostopstate};
          context_type ctx{};
          m.fill(ctx, stop.get_token());
          std::shared_ptr<detail::AsyncHeartbeat> hb;
          if (m.heartbeat()) {
            auto ex = co_await boost::asio::this_coro::executor;
            hb = std::make_shared<detail::AsyncHeartbeat>();
            hb->timer = std::make_unique<boost::asio::steady_timer>(ex);
            boost::asio::co_spawn(ex, detail::keep_lease(store, k, m.holder(), self->options_.lease, hb, stop,
                                                          self->options_.observer),
                                  boost::asio::detached);
          }
          if constexpr (detail::is_awaitable_v<Returned>) {
            std::exception_ptr thrown;
            bool stale = false;
            try {
              if constexpr (std::is_void_v<R>) {
                co_await detail::invoke_handler(h, ctx);
                next = m.on_returned();
              } else {
                next = m.on_returned(co_await detail::invoke_handler(h, ctx));
              }
            } catch (const detail::stale_signal&) {
              stale = true;
            } catch (...) {
              thrown = std::current_exception();
            }
            if (stale) next = m.on_stale();
            if (thrown) next = m.on_threw(thrown);
          } else {
            next = run_handler(m, h, ctx);
          }
          if (hb) {
            hb->done = true;
            hb->timer->cancel();
          }
          break;
        }
        case Next::done: co_return std::move(m.outcome());
        case Next::raise: std::rethrow_exception(m.error());
      }
    }
  }(this, std::move(key), payload.empty() ? std::string{} : fingerprint(payload), std::move(handler),
         std::move(complete));
}

template <StateStore Store>
template <class Executor, class F, class Token>
auto IdempotencyGuard<Store>::run_async(Executor&& ex, std::string key, std::string payload, F handler,
                                        Token&& token) {
  return boost::asio::co_spawn(std::forward<Executor>(ex), run_async(std::move(key), std::move(payload), std::move(handler)),
                               std::forward<Token>(token));
}

}  // namespace idem
