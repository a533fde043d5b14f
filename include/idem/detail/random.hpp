#pragma once
// Per-acquisition tokens: 64 random bits, never zero, with no lock on the hot path; and jittered waits.

#include <chrono>
#include <cstdint>
#include <functional>
#include <random>
#include <thread>

namespace idem::detail {

inline std::uint64_t splitmix64(std::uint64_t& state) noexcept {
  std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Each thread seeds from the OS entropy source once; splitmix64 then yields distinct values per
// thread (it is a bijection of its counter), so tokens only collide across threads by chance
// (2^-64 per pair), which is what the fence+token check needs.
inline std::uint64_t random_token() {
  thread_local std::uint64_t state = [] {
    std::random_device rd;
    std::uint64_t s = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
    s ^= static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    s ^= std::hash<std::thread::id>{}(std::this_thread::get_id());
    return s;
  }();
  std::uint64_t t;
  do t = splitmix64(state);
  while (t == 0);
  return t;
}

// A uniform wait in [0, w] from `entropy` (full jitter; w itself when `jitter` is false), so that
// clients that failed together do not all retry at the same instant.
template <class Duration>
Duration jittered(Duration w, bool jitter = true, std::uint64_t entropy = random_token()) noexcept {
  if (w.count() <= 0) return Duration{0};
  if (!jitter) return w;
  return Duration{static_cast<typename Duration::rep>(entropy % (static_cast<std::uint64_t>(w.count()) + 1))};
}

}  // namespace idem::detail
