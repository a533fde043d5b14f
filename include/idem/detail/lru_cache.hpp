#pragma once
// Sharded LRU of completed keys: key -> (fingerprint, encoded result), so a duplicate that this
// process has already seen completed costs no store round trip. Safe because a completed record
// never reverts while retained (invariant 2); entries expire after the retention.

#include <chrono>
#include <cstddef>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>

namespace idem::detail {

class LruCache {
public:
  struct Hit {
    std::string fingerprint;
    std::string result;
  };

  LruCache(std::size_t capacity, std::chrono::milliseconds ttl)
      : per_shard_((capacity + kShards - 1) / kShards), ttl_(ttl), shards_(std::make_unique<Shard[]>(kShards)) {}

  std::optional<Hit> get(std::string_view key) {
    Shard& sh = shard(key);
    std::lock_guard lock(sh.mu);
    auto it = sh.index.find(key);
    if (it == sh.index.end()) return std::nullopt;
    if (it->second->expires <= Clock::now()) {
      sh.order.erase(it->second);
      sh.index.erase(it);
      return std::nullopt;
    }
    sh.order.splice(sh.order.begin(), sh.order, it->second);
    return Hit{it->second->fingerprint, it->second->result};
  }

  void put(std::string_view key, std::string_view fingerprint, std::string_view result) {
    Shard& sh = shard(key);
    std::lock_guard lock(sh.mu);
    auto it = sh.index.find(key);
    if (it != sh.index.end()) {
      sh.order.splice(sh.order.begin(), sh.order, it->second);
      return;
    }
    sh.order.push_front(Node{std::string(key), std::string(fingerprint), std::string(result), Clock::now() + ttl_});
    sh.index.emplace(std::string_view(sh.order.front().key), sh.order.begin());
    if (sh.order.size() > per_shard_) {
      sh.index.erase(std::string_view(sh.order.back().key));
      sh.order.pop_back();
    }
  }

private:
  using Clock = std::chrono::steady_clock;
  static constexpr std::size_t kShards = 16;
  struct Node {
    std::string key, fingerprint, result;
    Clock::time_point expires;
  };
  struct Shard {
    std::mutex mu;
    std::list<Node> order;
    std::unordered_map<std::string_view, std::list<Node>::iterator> index;
  };
  Shard& shard(std::string_view key) noexcept { return shards_[std::hash<std::string_view>{}(key) % kShards]; }

  std::size_t per_shard_;
  std::chrono::milliseconds ttl_;
  std::unique_ptr<Shard[]> shards_;
};

}  // namespace idem::detail
