#pragma once
/// @file memory/memory_sequence_store.hpp MemorySequenceStore: the in-process SequenceStore.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include <fmt/core.h>

#include "idem/core/error.hpp"
#include "idem/detail/sharded_map.hpp"
#include "idem/sequence/sequence_store.hpp"

namespace idem {

/// Options of MemorySequenceStore.
struct MemorySequenceStoreOptions {
  /// Number of independently locked shards; more shards, less contention. Must be > 0.
  std::size_t shards = 64;
  /// Upper bound on tracked entities (0 = unbounded). At the bound, advancing a new entity throws
  /// capacity_error: an entry is never evicted, since forgetting it would let stale events apply.
  std::size_t max_entities = 1'000'000;
};

/**
 * In-process SequenceStore: thread-safe, sharded (one mutex per shard), one entry per entity that
 * lives as long as the store (sequences have no retention: forgetting one would let an old event
 * apply again). Pair it with MemoryStore; like it, it protects one process only.
 */
class MemorySequenceStore {
public:
  /// Creates an empty store; throws invalid_options_error on zero shards.
  explicit MemorySequenceStore(MemorySequenceStoreOptions options = {}) : options_(options) {
    if (options_.shards == 0) throw invalid_options_error("idem: MemorySequenceStoreOptions::shards must be > 0");
    per_shard_cap_ = options_.max_entities == 0
                         ? 0
                         : std::max<std::size_t>(1, (options_.max_entities + options_.shards - 1) / options_.shards);
  }
  MemorySequenceStore(MemorySequenceStore&&) noexcept = default;             ///< Movable; not copyable.
  MemorySequenceStore& operator=(MemorySequenceStore&&) noexcept = default;  ///< Movable; not copyable.

  /// The last applied sequence of `entity`, or nullopt when none was applied.
  std::optional<std::uint64_t> last_applied(std::string_view entity) const {
    detail::check_entity(entity, static_cast<std::size_t>(-1));
    const Shard& sh = shard(entity);
    std::lock_guard lock(sh.mu);
    auto it = sh.map.find(entity);
    if (it == sh.map.end()) return std::nullopt;
    return it->second;
  }

  /// Atomic compare-and-set: sets `entity` to `seq` iff none applied yet or the stored one is < seq.
  AdvanceResult advance(std::string_view entity, std::uint64_t seq) {
    detail::check_entity(entity, static_cast<std::size_t>(-1));
    Shard& sh = shard(entity);
    std::lock_guard lock(sh.mu);
    auto it = sh.map.find(entity);
    if (it == sh.map.end()) {
      if (per_shard_cap_ != 0 && sh.map.size() >= per_shard_cap_)
        throw capacity_error(
            fmt::format("idem: MemorySequenceStore is full (max_entities={}); raise max_entities", options_.max_entities),
            "FULL");
      sh.map.emplace(std::string(entity), seq);
      return {true, std::nullopt};
    }
    const std::uint64_t prev = it->second;
    if (prev >= seq) return {false, prev};
    it->second = seq;
    return {true, prev};
  }

  /// Forgets `entity` (its next event of any sequence applies); true if it was tracked. For tests
  /// and for deleting an entity for good; never call it to "fix" a stale event.
  bool erase(std::string_view entity) {
    detail::check_entity(entity, static_cast<std::size_t>(-1));
    Shard& sh = shard(entity);
    std::lock_guard lock(sh.mu);
    auto it = sh.map.find(entity);
    if (it == sh.map.end()) return false;
    sh.map.erase(it);
    return true;
  }

  /// Number of tracked entities.
  [[nodiscard]] std::size_t size() const { return shards_.size(); }

private:
  using Shard = detail::ShardedMap<std::uint64_t>::Shard;

  Shard& shard(std::string_view entity) const noexcept { return shards_.shard(entity); }

  MemorySequenceStoreOptions options_;
  std::size_t per_shard_cap_ = 0;
  detail::ShardedMap<std::uint64_t> shards_{options_.shards};
};

static_assert(SequenceStore<MemorySequenceStore>);

}  // namespace idem
