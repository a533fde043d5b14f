#pragma once
/// @file core/hex.hpp Internal: lower-case hex encoding and the escaped form of binary text
/// used in messages. Not part of idem's API.

#include <cstddef>
#include <string>
#include <string_view>

namespace idem::detail {

inline constexpr char hex_digits[] = "0123456789abcdef";

/// Appends the two lower-case hex digits of `c`.
inline void append_hex(std::string& out, unsigned char c) {
  out += hex_digits[c >> 4];
  out += hex_digits[c & 0xf];
}

/// Lower-case hex of `len` bytes (a digest, say).
inline std::string to_hex(const unsigned char* p, std::size_t len) {
  std::string out(len * 2, '\0');
  for (std::size_t i = 0; i < len; ++i) {
    out[2 * i] = hex_digits[p[i] >> 4];
    out[2 * i + 1] = hex_digits[p[i] & 0xf];
  }
  return out;
}

/// Lower-case hex of the bytes of `s`.
inline std::string to_hex(std::string_view s) {
  return to_hex(reinterpret_cast<const unsigned char*>(s.data()), s.size());
}

/// Keys and entities are binary; messages show them escaped (\xNN) and shortened to `max` bytes
/// so a log line stays one line.
inline std::string printable(std::string_view s, std::size_t max = 64) {
  std::string out;
  for (std::size_t i = 0; i < s.size() && i < max; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      append_hex(out, c);
    }
  }
  if (s.size() > max) out += "...";
  return out;
}

}  // namespace idem::detail
