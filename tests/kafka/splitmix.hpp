#pragma once
// The seeded generator of the offset tracker's tests (both of offset_tracker_test's sources).

#include <cstddef>
#include <cstdint>

namespace {

// splitmix64: the same sequence on every platform and standard library, so a printed seed
// replays anywhere.
struct Rng {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  std::size_t below(std::size_t n) { return static_cast<std::size_t>(next() % n); }
  bool chance(unsigned percent) { return next() % 100 < percent; }
};

}  // namespace
