#pragma once
// A fixed number of mutex-guarded hash maps keyed by string: the storage of MemoryStore and
// MemorySequenceStore, so neither holds a process-wide lock.

#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

namespace idem::detail {

/// Transparent hash of key bytes, so lookups by string_view do not build a std::string.
struct KeyHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};

}  // namespace idem::detail

#if defined(__GLIBCXX__)
// libstdc++ caches hash codes only for hashers it does not consider cheap, and it assumes any
// user hasher is cheap. Ours hashes whole keys: caching saves rehashing every key when the table
// grows and a string compare on every collision (it was about a third of a new-key acquire).
template <>
struct std::__is_fast_hash<idem::detail::KeyHash> : std::false_type {};
#endif

namespace idem::detail {

template <class V>
class ShardedMap {
public:
  struct Shard {
    mutable std::mutex mu;
    std::unordered_map<std::string, V, KeyHash, std::equal_to<>> map;
  };

  explicit ShardedMap(std::size_t shards) : count_(shards), shards_(std::make_unique<Shard[]>(shards)) {}

  [[nodiscard]] std::size_t shard_count() const noexcept { return count_; }
  Shard& at(std::size_t i) noexcept { return shards_[i]; }

  /// The index of the shard that holds `key` (what shard() picks; a batch groups keys by it).
  [[nodiscard]] std::size_t index_of(std::string_view key) const noexcept {
    // Mix the hash so shard choice and bucket choice do not use the same low bits.
    std::size_t h = KeyHash{}(key);
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9ULL;
    h ^= h >> 32;
    return h % count_;
  }

  Shard& shard(std::string_view key) const noexcept { return shards_[index_of(key)]; }

  /// Entries over all shards, each shard locked in turn.
  [[nodiscard]] std::size_t size() const {
    std::size_t n = 0;
    for (std::size_t i = 0; i < count_; ++i) {
      std::lock_guard lock(shards_[i].mu);
      n += shards_[i].map.size();
    }
    return n;
  }

private:
  std::size_t count_;
  std::unique_ptr<Shard[]> shards_;
};

}  // namespace idem::detail
