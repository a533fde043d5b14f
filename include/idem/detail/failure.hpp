#pragma once
/// @file detail/failure.hpp What a handler failure writes to the store. Not part of idem's API.

#include <algorithm>
#include <cstdint>
#include <exception>
#include <string>

#include "idem/core/options.hpp"
#include "idem/core/record.hpp"

namespace idem::detail {

/// The text stored for a handler's exception.
inline std::string describe(const std::exception_ptr& ep) {
  try {
    std::rethrow_exception(ep);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "a non-standard exception";
  }
}

/// `base` doubled per attempt after the first (base, 2 base, 4 base ...), at most `cap`: the one
/// backoff of the failure policy and of idem::verdict's requeue delays.
inline millis doubled(millis base, millis cap, std::uint32_t attempt) noexcept {
  std::int64_t b = base.count();
  for (std::uint32_t i = 1; i < attempt && b < cap.count(); ++i) b *= 2;
  return millis{std::min<std::int64_t>(b, cap.count())};
}

/// The fail() of a handler failure under `p`: release, or record with a backoff that doubles per
/// attempt (backoff, 2*backoff, 4*backoff ... capped at max_backoff), permanent after max_attempts.
/// `text` is viewed, not copied: keep it alive until the write is made.
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
  f.backoff = doubled(p.backoff, p.max_backoff, attempts);
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

}  // namespace idem::detail
