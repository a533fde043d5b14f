#pragma once
// The sequence stores' shared race: `threads` threads each advance every (entity, 1..per_entity)
// in their own shuffled order. Every entity must end at per_entity, the highest sequence must win
// exactly once, and no sequence may win twice (each winning advance is unique).

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace idem::contract {

template <class SequenceStore>
void advance_race(SequenceStore& s, const std::string& base, int threads, int entities, int per_entity) {
  std::mutex mu;
  std::vector<std::multiset<std::uint64_t>> won(static_cast<std::size_t>(entities));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t) * 7919u + 1u);
      std::vector<std::pair<int, std::uint64_t>> work;
      for (int e = 0; e < entities; ++e)
        for (std::uint64_t q = 1; q <= static_cast<std::uint64_t>(per_entity); ++q) work.emplace_back(e, q);
      std::shuffle(work.begin(), work.end(), rng);
      for (auto [e, q] : work) {
        const auto r = s.advance(base + std::to_string(e), q);
        if (r.advanced) {
          std::lock_guard lk(mu);
          won[static_cast<std::size_t>(e)].insert(q);
        }
      }
    });
  }
  for (auto& th : pool) th.join();
  const auto top = static_cast<std::uint64_t>(per_entity);
  for (int e = 0; e < entities; ++e) {
    CHECK(s.last_applied(base + std::to_string(e)) == top);
    const auto& w = won[static_cast<std::size_t>(e)];
    CHECK(w.count(top) == 1);                                                // the max won exactly once
    CHECK(std::set<std::uint64_t>(w.begin(), w.end()).size() == w.size());  // each advance unique
  }
}

}  // namespace idem::contract
