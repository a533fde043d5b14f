#pragma once
/// @file http/async.hpp handle_async: an Endpoint answered through IdempotencyGuard::run_async, for
/// a Boost.Asio / Beast server on AsyncRedisStore. Link idem::http_beast and idem::asio.

#include <boost/asio/awaitable.hpp>
#include <exception>
#include <string>
#include <type_traits>
#include <utility>

#include "idem/asio/guard.hpp"
#include "idem/http/beast.hpp"
#include "idem/http/endpoint.hpp"

namespace idem::http {

namespace detail {

template <class T>
struct is_awaitable : std::false_type {};
template <class T, class E>
struct is_awaitable<boost::asio::awaitable<T, E>> : std::true_type {};

// The handler's answer, awaited when it is an awaitable.
template <class F, class... Args>
boost::asio::awaitable<Response> answer_of(F& handler, Args&&... args) {
  using R = std::invoke_result_t<F&, Args...>;
  if constexpr (is_awaitable<R>::value)
    co_return co_await handler(std::forward<Args>(args)...);
  else
    co_return handler(std::forward<Args>(args)...);
}

// The synchronous handle()'s steps (admit, stored, settle, failed) with the guard's run_async in
// the middle: every answer a request can get is decided in one place, Endpoint.
struct async_endpoint {
  template <StateStore Store, class F>
  static boost::asio::awaitable<Response> handle(Endpoint<Store>& ep, const Request& req, F handler) {
    using Ctx = typename Endpoint<Store>::context_type;
    auto a = ep.admit(req);
    if (a.answer) co_return std::move(*a.answer);
    std::exception_ptr error;
    if (a.unguarded) {
      Response r;
      try {
        if constexpr (std::is_invocable_v<F&, const Request&, const Ctx&>)
          r = co_await answer_of(handler, req, Ctx{});
        else
          r = co_await answer_of(handler, req);
      } catch (const std::exception&) {
        error = std::current_exception();
      }
      co_return error ? ep.unguarded_failed() : r;
    }
    typename Endpoint<Store>::RunState st;
    auto run = [&](const Ctx& ctx) -> boost::asio::awaitable<Stored> {
      Response r;
      if constexpr (std::is_invocable_v<F&, const Request&, const Ctx&>)
        r = co_await answer_of(handler, req, ctx);
      else
        r = co_await answer_of(handler, req);
      co_return ep.stored(std::move(r), st);
    };
    Response out;
    try {
      auto o = co_await ep.guard_->run_async(a.key, a.payload, run);
      out = ep.settle(o, st);
    } catch (...) {
      error = std::current_exception();
    }
    co_return error ? ep.failed(error, st) : out;
  }
};

}  // namespace detail

/// Answers `req` as Endpoint::handle does, awaiting the store (IdempotencyGuard::run_async, so a
/// store with async_* calls such as AsyncRedisStore) and `handler(req)` or `handler(req, ctx)`,
/// which returns a Response or an awaitable<Response>. `req`'s views must outlive the await.
template <StateStore Store, class F>
boost::asio::awaitable<Response> handle_async(Endpoint<Store>& endpoint, const Request& req, F handler) {
  return detail::async_endpoint::handle(endpoint, req, std::move(handler));
}

/// The Beast form of handle_async: `handler(req)` (or `handler(req, ctx)`) returns a beast_response
/// or an awaitable of one; `req` must outlive the await.
template <StateStore Store, class F>
boost::asio::awaitable<beast_response> handle_async(Endpoint<Store>& endpoint, const beast_request& req, F handler) {
  using Ctx = typename Endpoint<Store>::context_type;
  const Request view = from_beast(req);
  Response answer = co_await detail::async_endpoint::handle(
      endpoint, view, [&req, h = std::move(handler)](const Request&, const Ctx& ctx) mutable
      -> boost::asio::awaitable<Response> {
        beast_response r;
        if constexpr (std::is_invocable_v<F&, const beast_request&, const Ctx&>) {
          using R = std::invoke_result_t<F&, const beast_request&, const Ctx&>;
          if constexpr (detail::is_awaitable<R>::value) r = co_await h(req, ctx);
          else r = h(req, ctx);
        } else {
          using R = std::invoke_result_t<F&, const beast_request&>;
          if constexpr (detail::is_awaitable<R>::value) r = co_await h(req);
          else r = h(req);
        }
        co_return from_beast(std::move(r));
      });
  co_return to_beast(std::move(answer), req);
}

}  // namespace idem::http
