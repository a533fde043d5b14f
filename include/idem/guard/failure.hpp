#pragma once
/// @file guard/failure.hpp Internal to the guard: what a handler failure writes to the store, and
/// how results cross the codec. Not part of idem's API.

#include <algorithm>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>

#include "idem/core/codec.hpp"
#include "idem/core/error.hpp"
#include "idem/core/options.hpp"
#include "idem/core/outcome.hpp"
#include "idem/core/record.hpp"
#include "idem/detail/hex.hpp"

namespace idem::detail {

/// The text stored for a handler's exception.
inline std::string describe(const std::exception_ptr& ep) {
  try {
    std::rethrow_exception(ep);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "non-std exception";
  }
}

/// The fail() of a handler failure under `p`: release, or record with a backoff that doubles per
/// attempt (backoff, 2*backoff, 4*backoff ... capped at max_backoff), permanent after max_attempts.
inline FailParams failure_params(const FailurePolicy& p, millis retention, std::uint32_t attempts,
                                 const std::string& text) {
  FailParams f;
  f.error = text;
  f.retention = retention;
  if (p.mode == FailureMode::release) {
    f.release = true;
    return f;
  }
  f.permanent = attempts >= p.max_attempts;
  std::int64_t b = p.backoff.count();
  for (std::uint32_t i = 1; i < attempts && b < p.max_backoff.count(); ++i) b *= 2;
  f.backoff = millis{std::min<std::int64_t>(b, p.max_backoff.count())};
  return f;
}

/// The fail() that ends a stale run: the key is released, no failure is counted.
inline FailParams stale_release(millis retention) {
  FailParams f;
  f.error = "stale: a newer event of the entity was applied first";
  f.release = true;
  f.retention = retention;
  return f;
}

/// codec<R>::encode, every exception turned into a codec_error that says the result was not recorded.
template <class R>
std::string encode_result(const R& v) {
  try {
    return std::string(codec<R>::encode(v));
  } catch (const codec_error&) {
    throw;
  } catch (const std::exception& e) {
    throw codec_error(std::string("idem: codec<T>::encode threw: ") + e.what() +
                      "; fix the codec, the result was not recorded");
  } catch (...) {
    throw codec_error("idem: codec<T>::encode threw a non-std exception; the result was not recorded");
  }
}

/// codec<R>::decode of a stored result. A stored value that cannot be read must never pass for a
/// duplicate: it is a corrupt record, so the consumer stops instead of acking a message whose
/// result is unknown.
template <class R>
std::optional<typename Outcome<R>::value_type> decode_result(std::string_view key, std::string_view stored) {
  if constexpr (std::is_void_v<R>) {
    return std::monostate{};
  } else {
    const auto fail = [&](const std::string& why) {
      return corrupt_record_error("idem: the stored result of key '" + printable(key) + "' cannot be decoded" + why);
    };
    try {
      return codec<R>::decode(stored);
    } catch (const std::exception& e) {
      throw fail(std::string(" (") + e.what() + "); the record was written by another type or is damaged");
    } catch (...) {
      throw fail("");
    }
  }
}

}  // namespace idem::detail
