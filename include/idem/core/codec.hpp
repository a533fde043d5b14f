#pragma once
/// @file codec.hpp How handler results are stored and replayed: the idem::codec<T> customisation point.

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <concepts>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <typeinfo>

#include <exception>
#include <optional>
#include <variant>

#include <fmt/core.h>

#include "idem/core/error.hpp"
#include "idem/core/hex.hpp"

namespace idem {

/**
 * Customisation point: specialise `idem::codec<T>` for your result type with
 * `static std::string encode(const T&)` and `static T decode(std::string_view)`.
 * decode must throw (any exception) on input it cannot read; the guard turns that into
 * corrupt_record_error, never into a duplicate.
 *
 * @code
 * template <> struct idem::codec<Receipt> {
 *   static std::string encode(const Receipt& r) { return r.id; }
 *   static Receipt decode(std::string_view s) { return Receipt{std::string(s)}; }
 * };
 * @endcode
 */
template <class T>
struct codec;

/// Strings are stored as they are.
template <>
struct codec<std::string> {
  /// Identity.
  static std::string encode(const std::string& v) { return v; }
  /// Identity.
  static std::string decode(std::string_view s) { return std::string(s); }
};

/// bool is stored as "0" or "1".
template <>
struct codec<bool> {
  /// "1" or "0".
  static std::string encode(bool v) { return v ? "1" : "0"; }
  /// Accepts exactly "0" or "1".
  static bool decode(std::string_view s) {
    if (s == "1") return true;
    if (s == "0") return false;
    throw codec_error("idem: stored bool is not \"0\" or \"1\"");
  }
};

/// Integers and floating-point numbers are stored as their shortest round-trip decimal text.
template <class T>
  requires(std::is_arithmetic_v<T> && !std::is_same_v<T, bool>)
struct codec<T> {
  /// Decimal text (std::to_chars).
  static std::string encode(T v) {
    char buf[64];
    auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
    if (ec != std::errc{}) throw codec_error("idem: cannot encode arithmetic result");
    return std::string(buf, end);
  }
  /// Parses the whole text or throws codec_error.
  static T decode(std::string_view s) {
    if constexpr (std::is_same_v<T, long double>) {
      // libstdc++'s from_chars(long double) reads its input up to a NUL, past the end it is given.
      const std::string text(s);
      return parse(text);
    } else {
      return parse(s);
    }
  }

private:
  static T parse(std::string_view s) {
    T v{};
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if constexpr (std::is_floating_point_v<T>) {
      // libstdc++'s from_chars(long double) calls a subnormal out of range, yet to_chars writes
      // one: read it back as strto* does, or the handler's own result would be corrupt forever.
      if (ec == std::errc::result_out_of_range && end == s.data() + s.size() && subnormal(s, v)) return v;
    }
    if (ec != std::errc{} || end != s.data() + s.size() || s.empty())
      throw codec_error(fmt::format("idem: stored value is not a valid {}", typeid(T).name()));
    return v;
  }

  static bool subnormal(std::string_view s, T& out) {
    const std::string text(s);  // strto* reads up to a terminator
    char* end = nullptr;
    T v{};
    if constexpr (std::is_same_v<T, float>) v = std::strtof(text.c_str(), &end);
    else if constexpr (std::is_same_v<T, double>) v = std::strtod(text.c_str(), &end);
    else v = std::strtold(text.c_str(), &end);
    if (end != text.c_str() + text.size() || std::fpclassify(v) != FP_SUBNORMAL) return false;
    out = v;
    return true;
  }
};

/// True when idem::codec<T> is specialised with encode and decode of the right shape.
template <class T>
concept Encodable = requires(const T& v, std::string_view s) {
  { codec<T>::encode(v) } -> std::convertible_to<std::string>;
  { codec<T>::decode(s) } -> std::convertible_to<T>;
};

namespace detail {

/// codec<R>::encode, every exception turned into a codec_error that says the result was not recorded.
template <class R>
std::string encode_result(const R& v) {
  try {
    return std::string(codec<R>::encode(v));
  } catch (const codec_error&) {
    throw;
  } catch (const std::exception& e) {
    throw codec_error(fmt::format("idem: codec<T>::encode threw: {}; fix the codec, the result was not recorded", e.what()));
  } catch (...) {
    throw codec_error("idem: codec<T>::encode threw a non-std exception; the result was not recorded");
  }
}

/// codec<R>::decode of a stored result (void: std::monostate). A stored value that cannot be read
/// must never pass for a duplicate: it is a corrupt record, so the consumer stops instead of
/// acking a message whose result is unknown.
template <class R>
std::optional<std::conditional_t<std::is_void_v<R>, std::monostate, R>> decode_result(std::string_view key,
                                                                                      std::string_view stored) {
  if constexpr (std::is_void_v<R>) {
    return std::monostate{};
  } else {
    try {
      return codec<R>::decode(stored);
    } catch (const std::exception& e) {
      throw corrupt_record_error(fmt::format("idem: the stored result of key '{}' cannot be decoded ({}); the record "
                                             "was written by another type or is damaged", printable(key), e.what()));
    } catch (...) {
      throw corrupt_record_error(fmt::format("idem: the stored result of key '{}' cannot be decoded", printable(key)));
    }
  }
}

}  // namespace detail

}  // namespace idem
