#pragma once
/// @file http/beast.hpp Boost.Beast adapter: answers a Beast request through an idem::http::Endpoint.
/// Link idem::http_beast (Boost headers).

#include <boost/beast/http.hpp>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "idem/http/endpoint.hpp"

namespace idem::http {

/// The request type the Beast adapter takes.
using beast_request = boost::beast::http::request<boost::beast::http::string_body>;
/// The response type the Beast adapter returns.
using beast_response = boost::beast::http::response<boost::beast::http::string_body>;

namespace detail {
// Boost 1.74's beast::string_view is boost::string_view, not std::string_view.
template <class S>
std::string_view sv(const S& s) noexcept {
  return {s.data(), s.size()};
}
}  // namespace detail

/// A view of a Beast request for Endpoint::handle (valid while `r` is).
inline Request from_beast(const beast_request& r, std::string_view scope = {}) {
  Request out;
  out.method = detail::sv(r.method_string());
  out.target = detail::sv(r.target());
  for (const auto& f : r) out.headers.emplace_back(detail::sv(f.name_string()), detail::sv(f.value()));
  out.body = r.body();
  out.scope = scope;
  return out;
}

/// The handler's Beast response as an idem::http::Response (Content-Length is the framework's).
inline Response from_beast(beast_response&& r) {
  Response out;
  out.status = static_cast<int>(r.result_int());
  for (const auto& f : r)
    if (f.name() != boost::beast::http::field::content_length)
      out.headers.push_back({std::string(detail::sv(f.name_string())), std::string(detail::sv(f.value()))});
  out.body = std::move(r.body());
  return out;
}

/// `r` as a Beast response to `req` (its HTTP version and keep-alive), Content-Length set.
inline beast_response to_beast(Response&& r, const beast_request& req) {
  beast_response out{static_cast<boost::beast::http::status>(r.status), req.version()};
  for (const auto& h : r.headers) out.insert(h.name, h.value);
  out.body() = std::move(r.body);
  out.keep_alive(req.keep_alive());
  out.prepare_payload();
  return out;
}

/// Answers `req` with `handler(req)` (or `handler(req, ctx)`, ctx the guard's context) returning a
/// beast_response, run through `endpoint`: at most once per Idempotency-Key, stored and replayed.
template <StateStore Store, class F>
beast_response handle(Endpoint<Store>& endpoint, const beast_request& req, F&& handler) {
  using Ctx = typename Endpoint<Store>::context_type;
  Response answer = endpoint.handle(from_beast(req), [&](const Request&, const Ctx& ctx) {
    if constexpr (std::is_invocable_v<F&, const beast_request&, const Ctx&>)
      return from_beast(handler(req, ctx));
    else
      return from_beast(handler(req));
  });
  return to_beast(std::move(answer), req);
}

}  // namespace idem::http
