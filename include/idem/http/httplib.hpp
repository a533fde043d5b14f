#pragma once
/// @file http/httplib.hpp cpp-httplib adapter: wraps an httplib handler in an idem::http::Endpoint.
/// Link idem::http_httplib (pkg-config cpp-httplib).

#include <httplib.h>

#include <string>
#include <type_traits>
#include <utility>

#include "idem/http/endpoint.hpp"

namespace idem::http {

/// A view of an httplib request for Endpoint::handle (valid while `r` is).
inline Request from_httplib(const httplib::Request& r, std::string_view scope = {}) {
  Request out;
  out.method = r.method;
  out.target = r.target.empty() ? std::string_view(r.path) : std::string_view(r.target);
  out.headers.reserve(r.headers.size());
  for (const auto& [name, value] : r.headers) out.headers.emplace_back(name, value);
  out.body = r.body;
  out.scope = scope;
  return out;
}

/// The handler's httplib response as an idem::http::Response (status -1, httplib's "unset", is 200).
inline Response from_httplib(httplib::Response&& r) {
  Response out;
  out.status = r.status < 0 ? 200 : r.status;
  out.headers.reserve(r.headers.size());
  for (auto& [name, value] : r.headers) out.headers.push_back({name, std::move(value)});
  out.body = std::move(r.body);
  return out;
}

/// Writes `r` into the httplib response the server sends.
inline void to_httplib(Response&& r, httplib::Response& out) {
  out.status = r.status;
  out.headers.clear();
  for (auto& h : r.headers) out.headers.emplace(std::move(h.name), std::move(h.value));
  out.body = std::move(r.body);
}

/// An httplib handler that runs `handler(req, res)` (or `handler(req, res, ctx)`, ctx the guard's
/// context) through `endpoint`: at most once per Idempotency-Key, its response stored and replayed.
/// The endpoint must outlive the server.
template <StateStore Store, class F>
httplib::Server::Handler idempotent(Endpoint<Store>& endpoint, F handler) {
  using Ctx = typename Endpoint<Store>::context_type;
  return [&endpoint, handler = std::move(handler)](const httplib::Request& req, httplib::Response& res) mutable {
    Response answer = endpoint.handle(from_httplib(req), [&](const Request&, const Ctx& ctx) {
      httplib::Response inner;
      if constexpr (std::is_invocable_v<F&, const httplib::Request&, httplib::Response&, const Ctx&>)
        handler(req, inner, ctx);
      else
        handler(req, inner);
      return from_httplib(std::move(inner));
    });
    to_httplib(std::move(answer), res);
  };
}

}  // namespace idem::http
