#pragma once
// The assertions of tests/contract/contract_suite.hpp for `idem conformance`, without Catch2.
//
// Why not Catch2: the tool is built and installed by users who never build the tests (Catch2 is
// a test-only dependency), and Catch2's session, reporters and global state are made for a test
// binary, not for a command that runs twenty-one cases once and prints a table. The suite only uses
// CHECK, CHECK_FALSE, REQUIRE, CHECK_THROWS, CHECK_THROWS_AS, CHECK_THROWS_WITH and FAIL, so the
// same case functions compile against these: the contract stays written once. A case's first
// failed expectation is kept as its reason; REQUIRE and FAIL end the case like Catch2 does.
// Comparisons are decomposed (`lhs == rhs` shows both values) as Catch2 does, by `<=` binding
// tighter than `==`.

#include <cstdint>
#include <exception>
#include <iterator>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include <fmt/format.h>

#define IDEM_CONTRACT_ASSERTIONS 1

// `Decomposer{} <= a == b` is the trick itself; the file including this header is only the runner.
#pragma GCC diagnostic ignored "-Wparentheses"

namespace idem::conformance {

// Thrown by REQUIRE and FAIL to end the case; never escapes the runner.
struct Abort {};

// What went wrong first in the running case. Cases run one at a time, but a few expectations sit
// in handlers the guard may call on other threads, hence the mutex.
class Recorder {
public:
  void reset() {
    std::lock_guard lock(m_);
    first_.reset();
    failed_ = 0;
  }
  void fail(std::string what) {
    std::lock_guard lock(m_);
    if (!first_) first_ = std::move(what);
    ++failed_;
  }
  std::optional<std::string> first() {
    std::lock_guard lock(m_);
    return first_;
  }
  int failed() {
    std::lock_guard lock(m_);
    return failed_;
  }

private:
  std::mutex m_;
  std::optional<std::string> first_;
  int failed_ = 0;
};

inline Recorder& recorder() {
  static Recorder r;
  return r;
}

inline std::string clip(std::string_view s) {
  std::string out;
  for (unsigned char c : s.substr(0, 60)) out += c >= 0x20 && c < 0x7f ? static_cast<char>(c) : '.';
  return s.size() > 60 ? out + "..." : out;
}

// A value as the reason shows it; "?" for what has no obvious text.
template <class T>
std::string show(const T& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v ? "true" : "false";
  } else if constexpr (std::is_arithmetic_v<T>) {
    return std::to_string(v);
  } else if constexpr (std::is_convertible_v<const T&, std::string_view>) {
    return fmt::format("\"{}\"", clip(std::string_view(v)));
  } else if constexpr (requires { to_string(v); }) {
    return std::string(to_string(v));
  } else if constexpr (requires { v.count(); }) {
    return std::to_string(v.count()) + "ms";
  } else if constexpr (requires { v.fence; v.token; }) {
    return fmt::format("{{fence {}, token {}}}", v.fence, v.token);
  } else if constexpr (requires { v.has_value(); }) {
    return v.has_value() ? "a value" : "none";
  } else {
    return "?";
  }
}

struct Result {
  bool ok;
  std::string shown;
};

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wconversion"
#pragma GCC diagnostic ignored "-Wsign-conversion"
template <class L>
struct Lhs {
  const L& l;
  template <class R>
  Result operator==(const R& r) const {
    return {static_cast<bool>(l == r), fmt::format("{} == {}", show(l), show(r))};
  }
  template <class R>
  Result operator!=(const R& r) const {
    return {static_cast<bool>(l != r), fmt::format("{} != {}", show(l), show(r))};
  }
  template <class R>
  Result operator<(const R& r) const {
    return {static_cast<bool>(l < r), fmt::format("{} < {}", show(l), show(r))};
  }
  template <class R>
  Result operator<=(const R& r) const {
    return {static_cast<bool>(l <= r), fmt::format("{} <= {}", show(l), show(r))};
  }
  template <class R>
  Result operator>(const R& r) const {
    return {static_cast<bool>(l > r), fmt::format("{} > {}", show(l), show(r))};
  }
  template <class R>
  Result operator>=(const R& r) const {
    return {static_cast<bool>(l >= r), fmt::format("{} >= {}", show(l), show(r))};
  }
  operator Result() const { return {static_cast<bool>(l), show(l)}; }  // NOLINT: CHECK(value)
};
#pragma GCC diagnostic pop

struct Decomposer {
  template <class L>
  Lhs<L> operator<=(const L& l) const {
    return {l};
  }
};

inline void failed(int line, std::string_view expr, const std::string& detail, bool abort) {
  std::string what = fmt::format("contract_suite.hpp:{}: {}", line, expr);
  if (!detail.empty()) fmt::format_to(std::back_inserter(what), " (was {})", detail);
  recorder().fail(std::move(what));
  if (abort) throw Abort{};
}

inline void check(const Result& r, bool expect, int line, std::string_view expr, bool abort) {
  if (r.ok != expect) failed(line, expr, r.shown, abort);
}

}  // namespace idem::conformance

#define IDEM_CONF_CHECK_(expect, abort, text, ...) \
  ::idem::conformance::check(::idem::conformance::Decomposer{} <= __VA_ARGS__, expect, __LINE__, text, abort)

#define CHECK(...) IDEM_CONF_CHECK_(true, false, #__VA_ARGS__, __VA_ARGS__)
#define CHECK_FALSE(...) IDEM_CONF_CHECK_(false, false, "!(" #__VA_ARGS__ ")", __VA_ARGS__)
#define REQUIRE(...) IDEM_CONF_CHECK_(true, true, #__VA_ARGS__, __VA_ARGS__)
#define FAIL(msg) ::idem::conformance::failed(__LINE__, msg, "", true)

// The expression must throw (`match` decides whether what it threw is the expected exception).
#define IDEM_CONF_THROWS_(text, expr, catch_expected, match_what)                                        \
  do {                                                                                                  \
    bool idem_threw_ = false;                                                                           \
    try {                                                                                               \
      static_cast<void>(expr);                                                                          \
    } catch_expected catch (const ::idem::conformance::Abort&) {                                        \
      throw;                                                                                            \
    } catch (const std::exception& idem_e_) {                                                           \
      idem_threw_ = true;                                                                               \
      if (!(match_what))                                                                                \
        ::idem::conformance::failed(__LINE__, text, ::fmt::format("threw {}", idem_e_.what()), false);  \
    } catch (...) {                                                                                     \
      idem_threw_ = true;                                                                               \
      ::idem::conformance::failed(__LINE__, text, "threw a non-std exception", false);                  \
    }                                                                                                   \
    if (!idem_threw_) ::idem::conformance::failed(__LINE__, text, "nothing thrown", false);             \
  } while (false)

#define CHECK_THROWS(expr) IDEM_CONF_THROWS_(#expr " throws", expr, , true)
#define CHECK_THROWS_AS(expr, type) \
  IDEM_CONF_THROWS_(#expr " throws " #type, expr, catch (const type&) { idem_threw_ = true; }, false)
#define CHECK_THROWS_WITH(expr, text) \
  IDEM_CONF_THROWS_(#expr " throws \"" text "\"", expr, , std::string_view(idem_e_.what()) == std::string_view(text))
