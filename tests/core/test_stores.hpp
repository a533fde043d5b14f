#pragma once
// A MemoryStore wrapper whose calls can be made to fail, for the guard's fail-closed paths. It is
// not a stand-in for Redis or PostgreSQL: those are tested against real servers.

#include <atomic>

#include "idem/idem.hpp"

namespace idem::test {

struct FaultyStore {
  MemoryStore& inner;
  std::atomic<bool> fail_acquire{false}, fail_complete{false}, fail_fail{false};
  std::atomic<int> acquires{0};

  AcquireResult acquire(std::string_view k, const AcquireParams& p) {
    acquires.fetch_add(1);
    if (fail_acquire) throw connection_error("test: store unreachable", "DOWN");
    return inner.acquire(k, p);
  }
  WriteStatus complete(std::string_view k, const Holder& h, std::string_view r, millis d) {
    if (fail_complete) throw timeout_error("test: complete timed out", "TIMEOUT");
    return inner.complete(k, h, r, d);
  }
  WriteStatus fail(std::string_view k, const Holder& h, const FailParams& f) {
    if (fail_fail) throw connection_error("test: store unreachable", "DOWN");
    return inner.fail(k, h, f);
  }
  WriteStatus extend(std::string_view k, const Holder& h, millis d) { return inner.extend(k, h, d); }
  std::optional<Record> inspect(std::string_view k) { return inner.inspect(k); }
};
static_assert(StateStore<FaultyStore>);

// A MemoryStore that states small limits, as a backend would (Redis, PostgreSQL).
struct LimitedStore {
  MemoryStore& inner;
  StoreLimits caps;
  StoreLimits limits() const { return caps; }
  AcquireResult acquire(std::string_view k, const AcquireParams& p) { return inner.acquire(k, p); }
  WriteStatus complete(std::string_view k, const Holder& h, std::string_view r, millis d) {
    if (r.size() > caps.max_result_bytes) throw store_error("test: the guard sent a result over the limit", "", false);
    return inner.complete(k, h, r, d);
  }
  WriteStatus complete_unavailable(std::string_view k, const Holder& h, std::string_view why, millis d) {
    return inner.complete_unavailable(k, h, why, d);
  }
  WriteStatus fail(std::string_view k, const Holder& h, const FailParams& f) { return inner.fail(k, h, f); }
  WriteStatus extend(std::string_view k, const Holder& h, millis d) { return inner.extend(k, h, d); }
  std::optional<Record> inspect(std::string_view k) { return inner.inspect(k); }
};
static_assert(StateStore<LimitedStore> && HasStoreLimits<LimitedStore> && CompletesUnavailable<LimitedStore>);

}  // namespace idem::test
