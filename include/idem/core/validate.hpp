#pragma once
// Input checks shared by the guard and every store, so each rejects bad input with the same words.

#include <cstddef>
#include <string>
#include <string_view>

#include <fmt/core.h>

#include "idem/core/error.hpp"
#include "idem/core/record.hpp"

namespace idem::detail {

/// Default limit on key length in bytes (GuardOptions::max_key_bytes overrides it).
inline constexpr std::size_t default_max_key_bytes = 1024;

inline void check_key(std::string_view key, std::size_t max_bytes = default_max_key_bytes) {
  if (key.empty())
    throw invalid_key_error("idem: the idempotency key is empty; derive it from a stable message id");
  if (key.size() > max_bytes)
    throw invalid_key_error(fmt::format("idem: the idempotency key is {} bytes, over the limit of {}; hash long keys "
                                        "(idem::fingerprint) or raise max_key_bytes",
                                        key.size(), max_bytes));
}

inline void check_lease(millis lease, const char* what = "lease") {
  if (lease <= millis{0})
    throw invalid_options_error(fmt::format("idem: {} must be positive, got {} ms", what, lease.count()));
}

inline void check_retention(millis retention, millis lease) {
  if (retention < lease)
    throw invalid_options_error(fmt::format("idem: retention ({} ms) is shorter than the lease ({} ms); a record "
                                            "must outlive its lease, raise retention",
                                            retention.count(), lease.count()));
}

inline void check_acquire(std::string_view key, const AcquireParams& p) {
  check_key(key, static_cast<std::size_t>(-1));
  check_lease(p.lease);
  check_retention(p.retention, p.lease);
  if (p.token == 0)
    throw invalid_options_error("idem: acquire token must be non-zero random; the guard makes one");
}

inline void check_holder(std::string_view key, const Holder& h) {
  check_key(key, static_cast<std::size_t>(-1));
  if (h.fence == 0 || h.token == 0)
    throw invalid_options_error("idem: holder has a zero fence or token; pass the holder acquire returned");
}

}  // namespace idem::detail
