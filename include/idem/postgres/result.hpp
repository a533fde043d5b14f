#pragma once
/// @file postgres/result.hpp PostgresResult: the rows of a statement run through a PostgresStore
/// transaction, and the typed parameters such statements take.

#include <array>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

namespace idem {

namespace detail {
struct ResultAccess;
}  // namespace detail

/// The result of a statement run through a PostgresStore transaction; move-only, owns its rows.
class PostgresResult {
 public:
  PostgresResult() noexcept = default;                        ///< No rows.
  PostgresResult(PostgresResult&& o) noexcept;                ///< Move-only.
  PostgresResult& operator=(PostgresResult&& o) noexcept;     ///< Move-only.
  PostgresResult(const PostgresResult&) = delete;             ///< Move-only.
  PostgresResult& operator=(const PostgresResult&) = delete;  ///< Move-only.
  ~PostgresResult();                                          ///< Frees the rows.

  /// Number of rows returned.
  [[nodiscard]] int rows() const noexcept;
  /// Number of columns returned.
  [[nodiscard]] int columns() const noexcept;
  /// True when the value is SQL NULL.
  [[nodiscard]] bool is_null(int row, int col) const noexcept;
  /// The value in PostgreSQL's text format; valid while this result lives.
  [[nodiscard]] std::string_view get(int row, int col) const noexcept;
  /// Rows inserted, updated or deleted by the statement.
  [[nodiscard]] std::uint64_t affected() const noexcept;

 private:
  friend struct detail::ResultAccess;
  void* r_ = nullptr;  // the libpq result, kept opaque so that this header needs no libpq
};

namespace detail {

/// One text-format statement parameter; nullopt is SQL NULL.
struct TextParam {
  std::optional<std::string> text;
};
/// Strings as they are.
inline TextParam text_param(std::string_view s) { return {std::string(s)}; }
/// A C string as it is; a null pointer is NULL.
inline TextParam text_param(const char* s) { return s ? TextParam{std::string(s)} : TextParam{}; }
/// Strings as they are.
inline TextParam text_param(const std::string& s) { return {s}; }
/// bool as t/f.
inline TextParam text_param(bool b) { return {std::string(b ? "t" : "f")}; }
/// NULL.
inline TextParam text_param(std::nullopt_t) { return {}; }
/// Numbers in decimal.
template <class T>
requires std::is_arithmetic_v<T> TextParam text_param(T v) {
  std::array<char, 64> buf{};
  auto res = std::to_chars(buf.data(), buf.data() + buf.size(), v);
  return {std::string(buf.data(), res.ptr)};
}
/// The value, or NULL.
template <class T>
TextParam text_param(const std::optional<T>& v) {
  return v ? text_param(*v) : TextParam{};
}

}  // namespace detail
}  // namespace idem
