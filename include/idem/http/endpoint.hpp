#pragma once
/// @file http/endpoint.hpp The Idempotency-Key policy, framework-free: a request and a handler in,
/// the response the draft (draft-ietf-httpapi-idempotency-key-header) requires out.

#include <fmt/core.h>

#include <chrono>
#include <cstddef>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/core/error.hpp"
#include "idem/core/options.hpp"
#include "idem/core/outcome.hpp"
#include "idem/core/store.hpp"
#include "idem/guard/guard.hpp"
#include "idem/guard/verdict.hpp"
#include "idem/http/key.hpp"
#include "idem/http/message.hpp"

namespace idem::http {

/// Options of an Endpoint; checked when it is built (invalid_options_error).
struct HttpOptions {
  /// A request without Idempotency-Key answers 400; false = it runs unguarded.
  bool require_key = true;
  /// Accept an unquoted key (`Idempotency-Key: 8e03978e-...`, as most SDKs send) beside the draft's quoted sf-string.
  bool accept_bare_keys = true;
  /// Longest key accepted, in characters once unescaped; 1.. (a longer one answers 400).
  std::size_t max_key_length = 255;
  /// Largest request body accepted; a larger one answers 413 before anything is stored.
  std::size_t max_request_body_bytes = std::size_t{1} << 20;
  /// Largest encoded response stored for replay (see docs/http.md for what happens above it).
  std::size_t max_stored_response_bytes = std::size_t{1} << 20;
  /// Store 4xx answers of the handler and replay them (as Stripe does); false = release the key.
  bool store_client_errors = true;
  /// Store 5xx answers of the handler; false (default) = release the key so a retry runs again.
  bool store_server_errors = false;
  /// Fingerprint method, target, fingerprint_headers and body: another request under a used key answers 422.
  bool fingerprint = true;
  /// Request headers that are part of the fingerprint (Content-Type, an API version, ...).
  std::vector<std::string> fingerprint_headers;
  /// Response headers stored for replay; empty = every header except hop-by-hop, Date and Set-Cookie.
  std::vector<std::string> stored_headers;
  /// Prefix of every store key, to keep HTTP keys apart from other users of the store.
  std::string key_prefix = "http:";
  /// Header added to a replayed response, with the value "true".
  std::string replay_header = "Idempotent-Replayed";
  /// Prefix of the problem+json "type" URIs (followed by missing-key, key-in-use, ...).
  std::string problem_type_prefix = "urn:idem:http:";
  /// The Retry-After of a 409 (request in progress) and a 503 (store unavailable): idem::verdict's
  /// delay, jittered, in whole seconds (at least 1).
  RetryPolicy retry;
};

/// A problem+json (RFC 9457) response: `kind` completes the type URI, `detail` says what to do.
inline Response problem(const HttpOptions& o, int status, std::string_view kind, std::string_view title,
                        std::string_view detail) {
  auto json = [](std::string_view s) {
    std::string out;
    for (char c : s) {
      if (c == '"' || c == '\\') out += '\\';
      if (static_cast<unsigned char>(c) < 0x20)
        out += fmt::format("\\u{:04x}", static_cast<int>(c));
      else
        out += c;
    }
    return out;
  };
  Response r;
  r.status = status;
  r.set("Content-Type", "application/problem+json");
  r.set("Cache-Control", "no-store");
  r.body = fmt::format(R"({{"type":"{}{}","title":"{}","status":{},"detail":"{}"}})", json(o.problem_type_prefix),
                       json(kind), json(title), status, json(detail));
  return r;
}

namespace detail {

// Thrown through the guard for a handler answer that must not be stored: the guard releases the
// key (and rolls a transaction back), and handle() sends the answer as it is. what() is the reason
// the store records with the released key (inspect shows it).
struct not_stored : std::exception {
  not_stored(Response r, std::string why) : response(std::move(r)), reason(std::move(why)) {}
  [[nodiscard]] const char* what() const noexcept override { return reason.c_str(); }
  Response response;
  std::string reason;
};

inline bool never_stored(std::string_view name) {
  for (std::string_view n : {"connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer",
                             "upgrade", "proxy-authenticate", "proxy-connection", "date", "set-cookie"})
    if (iequals(n, name)) return true;
  return false;
}

inline std::string seconds_up(millis d) { return std::to_string(std::max<long long>(1, (d.count() + 999) / 1000)); }

}  // namespace detail

namespace detail {
struct async_endpoint;  // handle_async's access (idem/http/async.hpp)
}  // namespace detail

/**
 * Makes one HTTP route idempotent under the Idempotency-Key header, on any idem store. Thread-safe
 * (share one per route); the guard must outlive it and use FailureMode::release, so that an answer
 * that is not stored frees its key for the retry.
 *
 * @code
 * idem::http::Endpoint endpoint{guard};
 * idem::http::Response r = endpoint.handle(request, [&](const idem::http::Request& req) {
 *   return idem::http::Response{201, {{"Content-Type", "application/json"}}, create_charge(req.body)};
 * });
 * @endcode
 */
template <StateStore Store>
class Endpoint {
 public:
  /// The context type handlers get as a second argument (ctx.tx in PostgreSQL transactional mode).
  using context_type = context_t<Store>;

  /// Binds to `guard` (not owned); throws invalid_options_error when the options cannot work.
  explicit Endpoint(IdempotencyGuard<Store>& guard, HttpOptions options = {}) : guard_(&guard), o_(std::move(options)) {
    if (guard.options().failure.mode != FailureMode::release)
      throw invalid_options_error(
          "idem::http: the guard's failure.mode must be release: a response that is not "
          "stored must free its key for the client's retry");
    if (o_.max_key_length == 0) throw invalid_options_error("idem::http: max_key_length is 0; allow at least 1");
    if (o_.key_prefix.size() + o_.max_key_length > guard.options().max_key_bytes)
      throw invalid_options_error(
          fmt::format("idem::http: key_prefix + max_key_length is {} bytes, over the guard's "
                      "max_key_bytes ({}); shorten them or raise max_key_bytes",
                      o_.key_prefix.size() + o_.max_key_length, guard.options().max_key_bytes));
    if (o_.max_stored_response_bytes == 0)
      throw invalid_options_error("idem::http: max_stored_response_bytes is 0; responses could never be replayed");
    if (o_.replay_header.empty()) throw invalid_options_error("idem::http: replay_header is empty; name a header");
    idem::detail::check_retry(o_.retry, "HttpOptions::retry");
    if constexpr (TransactionalStore<Store>) {
      if constexpr (requires {
                      { guard.store().transactional() } -> std::convertible_to<bool>;
                    })
        transactional_ = guard.store().transactional();
      else
        transactional_ = true;
    }
  }

  /// Answers `req`: runs `handler(req)` or `handler(req, ctx)` (returning a Response) at most once
  /// per key, or answers 400 / 409 / 413 / 422 / the stored response, per docs/http.md. Handler
  /// exceptions answer 500 and store errors 503 (with Retry-After) or 500; the key is released.
  template <class F>
  Response handle(const Request& req, F&& handler) {
    Admission a = admit(req);
    if (a.answer) return std::move(*a.answer);
    if (a.unguarded) return unguarded(req, handler);
    RunState st;
    auto run = [&](const context_type& ctx) -> detail::Stored { return stored(call(handler, req, ctx), st); };
    try {
      auto out = o_.fingerprint ? guard_->run(a.key, a.payload, run) : guard_->run(a.key, run);
      return settle(out, st);
    } catch (...) {
      return failed(std::current_exception(), st);
    }
  }

  /// The options in force.  /// The options in force.
  [[nodiscard]] const HttpOptions& options() const noexcept { return o_; }

 private:
  friend struct detail::async_endpoint;

  // What a request gets before any handler runs: an answer (4xx), the unguarded run (no key and
  // !require_key), or the store key and fingerprint payload to run it under.
  struct Admission {
    std::optional<Response> answer;
    bool unguarded = false;
    std::string key;
    std::string payload;
  };
  // The first caller's answer when it cannot be stored, and headers only the first caller gets.
  struct RunState {
    std::optional<Response> ran;
    std::vector<Header> unstored;
  };

  Admission admit(const Request& req) const {
    Admission a;
    if (req.body.size() > o_.max_request_body_bytes) {
      a.answer = problem(o_, 413, "body-too-large", "Content Too Large",
                         fmt::format("the request body is {} bytes, over the limit of {}", req.body.size(),
                                     o_.max_request_body_bytes));
      return a;
    }
    if (!req.has("Idempotency-Key")) {
      if (o_.require_key)
        a.answer = problem(o_, 400, "missing-key", "Idempotency-Key required",
                           fmt::format("this endpoint requires an Idempotency-Key header holding a unique key{}; "
                                       "keys are kept for {} s",
                                       o_.accept_bare_keys ? " (a UUID, or a quoted string \"...\")" : ", quoted (\"...\")",
                                       guard_->options().retention.count() / 1000));
      else
        a.unguarded = true;
      return a;
    }
    const KeyParse parsed = parse_idempotency_key(req.field("Idempotency-Key"), o_.max_key_length, o_.accept_bare_keys);
    if (!parsed.ok()) {
      a.answer = problem(o_, 400, "invalid-key", "Invalid Idempotency-Key", parsed.error);
      return a;
    }
    a.key = store_key(req.scope, parsed.key);
    if (o_.fingerprint) a.payload = request_fingerprint_payload(req, o_.fingerprint_headers);
    return a;
  }

  // The handler's answer as the guard stores it, or not_stored (the key is released).
  detail::Stored stored(Response r, RunState& st) const {
    if (!storable(r.status)) {
      const bool server = r.status >= 500;
      std::string why = fmt::format("idem::http: the handler answered status {}, which is not stored "
                                    "(HttpOptions::store_{}_errors is off): the key is released for a retry",
                                    r.status, server ? "server" : "client");
      throw detail::not_stored(std::move(r), std::move(why));
    }
    st.unstored = strip(r);
    if (encoded_size(r) > o_.max_stored_response_bytes) {
      if (transactional_)  // rolls back: no effect without its answer
        throw detail::not_stored(too_large(r), fmt::format("idem::http: the response ({} bytes) is over "
                                                           "max_stored_response_bytes ({}); rolled back, not stored",
                                                           encoded_size(r), o_.max_stored_response_bytes));
      st.ran = r;  // the guard completes the key without it; this caller still gets it
      st.ran->headers.insert(st.ran->headers.end(), st.unstored.begin(), st.unstored.end());
    }
    return detail::Stored{std::move(r), o_.max_stored_response_bytes};
  }

  Response settle(Outcome<detail::Stored>& out, RunState& st) {
    Response r = answer(out);
    if (out.status == Status::executed || (out.status == Status::lease_lost && !transactional_))
      r.headers.insert(r.headers.end(), st.unstored.begin(), st.unstored.end());
    return r;
  }

  // What a run that threw answers.
  Response failed(std::exception_ptr e, RunState& st) const {
    try {
      std::rethrow_exception(std::move(e));
    } catch (detail::not_stored& n) {
      return std::move(n.response);
    } catch (const result_not_stored_error& x) {
      // Lease mode: the effect happened and the key is completed without its answer; this caller
      // still gets the answer, retries get a problem saying so.
      if (st.ran) return std::move(*st.ran);
      return problem(o_, 500, "response-not-stored", "Response not stored", x.what());
    } catch (const invalid_key_error& x) {
      return problem(o_, 400, "invalid-key", "Invalid Idempotency-Key", x.what());
    } catch (const idem::error& x) {
      // Error texts name hosts and keys: they go to the guard's observer and logs, not to clients.
      if (x.from_handler() || !x.retryable())
        return problem(o_, 500, "internal-error", "Internal Server Error", "the request failed on the server");
      Response r = problem(o_, 503, "store-unavailable", "Service Unavailable",
                           "the idempotency store is unavailable; retry the same request with the same key");
      r.set("Retry-After", detail::seconds_up(verdict(std::current_exception(), o_.retry).delay));
      return r;
    } catch (const std::exception&) {
      return problem(o_, 500, "internal-error", "Internal Server Error",
                     "the request failed on the server; a retry with the same key runs it again");
    }
  }

  Response unguarded_failed() const {
    return problem(o_, 500, "internal-error", "Internal Server Error", "the request failed on the server");
  }

  template <class F>
  static Response call(F& handler, const Request& req, const context_type& ctx) {
    if constexpr (std::is_invocable_r_v<Response, F&, const Request&, const context_type&>)
      return handler(req, ctx);
    else
      return handler(req);
  }

  template <class F>
  Response unguarded(const Request& req, F& handler) {
    try {
      if constexpr (std::is_invocable_r_v<Response, F&, const Request&, const context_type&>)
        return handler(req, context_type{});
      else
        return handler(req);
    } catch (const std::exception&) {
      return unguarded_failed();
    }
  }

  [[nodiscard]] bool storable(int status) const noexcept {
    if (status >= 500) return o_.store_server_errors;
    if (status >= 400) return o_.store_client_errors;
    return true;
  }

  // Hop-by-hop and per-client headers never reach the store (an allow-list when configured);
  // returns them, so that the caller whose request ran still gets them.
  std::vector<Header> strip(Response& r) const {
    auto stored = [&](const Header& h) {
      if (detail::never_stored(h.name)) return false;
      if (o_.stored_headers.empty()) return true;
      for (const auto& keep : o_.stored_headers)
        if (iequals(keep, h.name)) return true;
      return false;
    };
    std::vector<Header> removed;
    std::vector<Header> kept;
    for (auto& h : r.headers) (stored(h) ? kept : removed).push_back(std::move(h));
    r.headers = std::move(kept);
    return removed;
  }

  static std::size_t encoded_size(const Response& r) {
    std::size_t n = detail::response_magic.size() + 8 + r.body.size();
    for (const auto& h : r.headers) n += 8 + h.name.size() + h.value.size();
    return n;
  }

  Response too_large(const Response& r) const {
    return problem(o_, 500, "response-too-large", "Response too large to store",
                   fmt::format("the response is {} bytes, over max_stored_response_bytes ({}); nothing was committed",
                               encoded_size(r), o_.max_stored_response_bytes));
  }

  // Scope and key are length-prefixed so that no (scope, key) pair can spell another's store key.
  [[nodiscard]] std::string store_key(std::string_view scope, std::string_view key) const {
    if (scope.empty()) return o_.key_prefix + std::string(key);
    return fmt::format("{}{}:{}:{}", o_.key_prefix, scope.size(), scope, key);
  }

  Response answer(Outcome<detail::Stored>& out) {
    switch (out.status) {
      case Status::executed:
        return std::move(out.value->response);
      case Status::duplicate: {
        if (out.result_unavailable)
          return problem(o_, 500, "response-not-stored", "Response not stored",
                         fmt::format("the first request with this key was processed but its response was not stored "
                                     "({}); do not retry it",
                                     out.error));
        Response r = std::move(out.value->response);
        r.set(o_.replay_header, "true");
        return r;
      }
      case Status::in_flight: {
        Response r = problem(o_, 409, "key-in-use", "Request in progress",
                             "a request with this Idempotency-Key is still being processed; retry after Retry-After");
        r.set("Retry-After", detail::seconds_up(verdict(out, o_.retry).delay));
        return r;
      }
      case Status::mismatch:
        return problem(o_, 422, "key-reused", "Idempotency-Key reused",
                       "this Idempotency-Key was used with a different request (method, target, body); use a new key");
      case Status::previously_failed:
        return problem(o_, 500, "previously-failed", "Request failed",
                       fmt::format("the first request with this key failed for good ({}); use a new key", out.error));
      case Status::lease_lost:
        // Lease mode: the effect happened but another request took the key over; transactional:
        // nothing committed. Either way this answer was not stored.
        if (!transactional_ && out.value) return std::move(out.value->response);
        return problem(o_, 503, "lease-lost", "Service Unavailable", "the request's claim on its key was lost; retry");
      case Status::stale:
        break;
    }
    return problem(o_, 500, "internal-error", "Internal Server Error", "unexpected guard outcome");
  }

  IdempotencyGuard<Store>* guard_;
  HttpOptions o_;
  bool transactional_ = false;
};

}  // namespace idem::http
