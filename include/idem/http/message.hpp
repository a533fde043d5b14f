#pragma once
/// @file http/message.hpp Framework-free HTTP request and response, the stored-response codec and
/// the request fingerprint.

#include <fmt/core.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/core/codec.hpp"
#include "idem/core/error.hpp"
#include "idem/core/fingerprint.hpp"

namespace idem::http {

/// True when two header names are equal ignoring ASCII case.
inline bool iequals(std::string_view a, std::string_view b) noexcept {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; };
           return lower(x) == lower(y);
         });
}

/// One header field line of a response.
struct Header {
  std::string name;   ///< field name, as the handler spelled it
  std::string value;  ///< field value
};

/// A request as the policy sees it: views into the framework's request, valid for one call.
struct Request {
  std::string_view method;                                             ///< "POST"
  std::string_view target;                                             ///< path and query, as received
  std::vector<std::pair<std::string_view, std::string_view>> headers;  ///< every field line, in order
  std::string_view body;                                               ///< the whole body (binary-safe)
  std::string_view scope;  ///< whose key this is (an account id): keys of different scopes never meet; "" = one space

  /// The values of every line of field `name`, joined with ", " as HTTP combines them; "" if absent.
  [[nodiscard]] std::string field(std::string_view name) const {
    std::string out;
    for (const auto& [n, v] : headers)
      if (iequals(n, name)) out += (out.empty() ? "" : ", ") + std::string(v);
    return out;
  }
  /// True when field `name` is present at least once.
  [[nodiscard]] bool has(std::string_view name) const {
    return std::any_of(headers.begin(), headers.end(), [&](const auto& h) { return iequals(h.first, name); });
  }
};

/// A response: what the handler returns, what the policy answers, what is stored and replayed.
struct Response {
  int status = 200;             ///< status code
  std::vector<Header> headers;  ///< field lines (no Content-Length: the framework frames the body)
  std::string body;             ///< body bytes (binary-safe)

  /// The first value of field `name`, or "" when absent.
  [[nodiscard]] std::string_view header(std::string_view name) const {
    for (const auto& h : headers)
      if (iequals(h.name, name)) return h.value;
    return {};
  }
  /// Replaces every line of field `name` with one line holding `value`.
  Response& set(std::string_view name, std::string value) {
    std::erase_if(headers, [&](const Header& h) { return iequals(h.name, name); });
    headers.push_back({std::string(name), std::move(value)});
    return *this;
  }
};

namespace detail {

inline void put_u32(std::string& out, std::size_t n) {
  for (int shift = 24; shift >= 0; shift -= 8) out += static_cast<char>((n >> shift) & 0xff);
}

inline std::uint32_t get_u32(std::string_view& in) {
  if (in.size() < 4) throw codec_error("idem::http: stored response is truncated");
  std::uint32_t n = 0;
  for (int i = 0; i < 4; ++i) n = (n << 8) | static_cast<unsigned char>(in[static_cast<std::size_t>(i)]);
  in.remove_prefix(4);
  return n;
}

inline std::string_view get_bytes(std::string_view& in) {
  const std::uint32_t n = get_u32(in);
  if (in.size() < n) throw codec_error("idem::http: stored response is truncated");
  const std::string_view s = in.substr(0, n);
  in.remove_prefix(n);
  return s;
}

inline constexpr std::string_view response_magic = "idem-http/1\n";

}  // namespace detail

/// Encodes a response for the store: a magic line, the status and header count, length-prefixed
/// names and values, then the body bytes to the end (so any body, NULs included, round-trips).
inline std::string encode_response(const Response& r) {
  if (r.status < 100 || r.status > 599)
    throw codec_error(fmt::format("idem::http: status {} is not an HTTP status; return 100..599", r.status));
  std::string out(detail::response_magic);
  std::size_t size = out.size() + 8 + r.body.size();
  for (const auto& h : r.headers) size += 8 + h.name.size() + h.value.size();
  out.reserve(size);
  detail::put_u32(out, static_cast<std::size_t>(r.status));
  detail::put_u32(out, r.headers.size());
  for (const auto& h : r.headers) {
    detail::put_u32(out, h.name.size());
    out += h.name;
    detail::put_u32(out, h.value.size());
    out += h.value;
  }
  out += r.body;
  return out;
}

/// Decodes what encode_response wrote; throws codec_error on anything else (the guard then fails
/// closed with corrupt_record_error, never a replay of garbage).
inline Response decode_response(std::string_view in) {
  if (in.substr(0, detail::response_magic.size()) != detail::response_magic)
    throw codec_error("idem::http: stored value is not an idem::http response");
  in.remove_prefix(detail::response_magic.size());
  Response r;
  const std::uint32_t status = detail::get_u32(in);
  if (status < 100 || status > 599) throw codec_error("idem::http: stored response has a bad status");
  r.status = static_cast<int>(status);
  const std::uint32_t count = detail::get_u32(in);
  if (count > in.size() / 8) throw codec_error("idem::http: stored response has a bad header count");
  r.headers.reserve(count);
  for (std::uint32_t i = 0; i < count; ++i) {
    Header h;
    h.name = std::string(detail::get_bytes(in));
    h.value = std::string(detail::get_bytes(in));
    r.headers.push_back(std::move(h));
  }
  r.body = std::string(in);
  return r;
}

/// What the guard fingerprints: method, target, the listed headers (all their lines) and the
/// body's SHA-256, each length-prefixed so no two different requests serialise alike.
inline std::string request_fingerprint_payload(const Request& req, const std::vector<std::string>& headers) {
  std::string out = "idem-http-request/1\n";
  auto part = [&](std::string_view s) {
    out += std::to_string(s.size());
    out += ':';
    out += s;
  };
  part(req.method);
  part(req.target);
  for (const auto& name : headers) {
    part(name);
    part(req.field(name));
  }
  part(fingerprint(req.body));
  return out;
}

namespace detail {

/// The guard's result type: a response and the byte limit its encoding must respect (not stored).
struct Stored {
  Response response;
  std::size_t limit = static_cast<std::size_t>(-1);
};

}  // namespace detail
}  // namespace idem::http

/// A stored response; over its limit the encoding throws, so the guard's existing unstorable path
/// completes the key without it (the effect already happened) rather than storing it.
template <>
struct idem::codec<idem::http::detail::Stored> {
  /// encode_response, refused (codec_error) above the limit.
  static std::string encode(const idem::http::detail::Stored& s) {
    std::string out = idem::http::encode_response(s.response);
    if (out.size() > s.limit)
      throw codec_error(fmt::format("idem::http: the response is {} bytes encoded, over max_stored_response_bytes ({})",
                                    out.size(), s.limit));
    return out;
  }
  /// decode_response.
  static idem::http::detail::Stored decode(std::string_view s) {
    return {idem::http::decode_response(s), static_cast<std::size_t>(-1)};
  }
};
