#pragma once
/// @file http/key.hpp Reads the Idempotency-Key field: a Structured Field String (RFC 8941 sf-string).

#include <fmt/core.h>

#include <cstddef>
#include <string>
#include <string_view>

namespace idem::http {

/// The parsed key, or why the field was refused (a 400: the client must fix the request).
struct KeyParse {
  std::string key;    ///< the unescaped key when ok()
  std::string error;  ///< what is wrong with the field, said to the client; empty when ok()
  /// True when the field held one acceptable String.
  [[nodiscard]] bool ok() const noexcept { return error.empty(); }
};

namespace detail {

// Names what a non-String Structured Field starts with, so the 400 says how to fix it.
inline std::string_view sf_kind(char c) noexcept {
  if ((c >= '0' && c <= '9') || c == '-') return "a number";
  if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '*') return "a token";
  if (c == '?') return "a boolean";
  if (c == ':') return "a byte sequence";
  if (c == '(') return "an inner list";
  return "not a structured field";
}

inline KeyParse key_error(std::string why) { return KeyParse{{}, std::move(why)}; }

// A bare key's characters: RFC 9110's tchar (what a token or a UUID is made of). No space, comma,
// semicolon or quote, so a bare value can never be read as a list, parameters or a string.
inline bool bare_key_char(char c) noexcept {
  if ((c >= '0' && c <= '9') || (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z')) return true;
  return std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}


}  // namespace detail

/// Parses the field value of Idempotency-Key (several field lines joined with ", "): one sf-string
/// of printable ASCII with \" and \\ escapes, or with `accept_bare` one unquoted token of RFC 9110
/// tchar (a UUID, Stripe's keys), 1..max_length bytes; parameters and lists are refused.
inline KeyParse parse_idempotency_key(std::string_view field, std::size_t max_length, bool accept_bare = true) {
  auto is_ows = [](char c) { return c == ' ' || c == '\t'; };
  while (!field.empty() && is_ows(field.front())) field.remove_prefix(1);
  while (!field.empty() && is_ows(field.back())) field.remove_suffix(1);
  if (field.empty())
    return detail::key_error("the Idempotency-Key field is empty; send a quoted string such as \"8e03978e\"");
  if (field.front() != '"' && accept_bare) {
    // "abc" and abc name the same key: a client that switches between the two forms still matches.
    for (char c : field)
      if (!detail::bare_key_char(c)) {
        if (c == ',') return detail::key_error("more than one Idempotency-Key was sent; send exactly one");
        if (c == ';') return detail::key_error("Idempotency-Key parameters are not accepted; send the key alone");
        return detail::key_error(
            "the unquoted Idempotency-Key holds a character outside letters, digits and !#$%&'*+-.^_`|~; quote "
            "the key (\"...\")");
      }
    if (field.size() > max_length)
      return detail::key_error(
          fmt::format("the Idempotency-Key is longer than {} characters; use a shorter key (a UUID)", max_length));
    return KeyParse{std::string(field), {}};
  }
  if (field.front() != '"')
    return detail::key_error(fmt::format("the Idempotency-Key field is {}, not a string; quote the key (\"...\")",
                                         detail::sf_kind(field.front())));
  std::string key;
  std::size_t i = 1;
  for (;; ++i) {
    if (i >= field.size()) return detail::key_error("the Idempotency-Key string has no closing quote");
    const char c = field[i];
    if (c == '"') break;
    if (c == '\\') {
      if (++i >= field.size() || (field[i] != '"' && field[i] != '\\'))
        return detail::key_error("the Idempotency-Key string has a backslash not followed by \" or \\");
      key += field[i];
    } else if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7e) {
      return detail::key_error("the Idempotency-Key string holds a byte that is not printable ASCII");
    } else {
      key += c;
    }
    if (key.size() > max_length)
      return detail::key_error(
          fmt::format("the Idempotency-Key is longer than {} characters; use a shorter key (a UUID)", max_length));
  }
  const std::string_view rest = field.substr(i + 1);
  if (!rest.empty()) {
    if (rest.front() == ';')
      return detail::key_error("Idempotency-Key parameters are not accepted; send the string alone");
    if (rest.find(',') != std::string_view::npos)
      return detail::key_error("more than one Idempotency-Key was sent; send exactly one");
    return detail::key_error("the Idempotency-Key field has text after its string");
  }
  if (key.empty()) return detail::key_error("the Idempotency-Key is an empty string; send a unique key such as a UUID");
  return KeyParse{std::move(key), {}};
}

}  // namespace idem::http
