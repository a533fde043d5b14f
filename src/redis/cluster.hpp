#pragma once
// Internal to idem_redis: the Redis Cluster's slot map (CLUSTER SLOTS) for the engine, which routes
// and follows MOVED / ASK / TRYAGAIN itself (engine.cpp, by the reply machine's rules). Read at
// construction through a Client per master (each checked: reachable, the scripts loaded) and
// again by the engine, as requests of its own, when a redirection or a lost connection puts it
// in doubt.
//
// hiredis 0.14 has no cluster support and Debian 12 packages no cluster client, so this is ours;
// its parsing is pure (parse_redirect, parse_slots) and tested alone (redis_cluster_unit_test).

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "client.hpp"

namespace idem::detail::redis {

inline constexpr int slot_count = 16384;

// The redirection an error reply's text names, or nothing when it is not one. An empty host
// (a node that does not know its own address, "MOVED 1 :6380") is `fallback_host`.
std::optional<Redirect> parse_redirect(std::string_view error_text, std::string_view fallback_host = "127.0.0.1");

// One slot range and its master, from CLUSTER SLOTS.
struct SlotRange {
  int first = 0;
  int last = 0;
  Endpoint master;
};
// The ranges of a CLUSTER SLOTS reply; an empty or "?" host is `asked_host` (the node that was
// asked). Throws store_error on a reply of another shape.
std::vector<SlotRange> parse_slots(const redisReply* r, const std::string& asked_host);

class Cluster {
public:
  // Reads the slot map from the first seed that answers; with `check`, connects to every master
  // and loads the scripts there, so a wrong address, password or a cluster that is not ok fails
  // here (without: the operator's tool, which must read a cluster that is not ok).
  explicit Cluster(const RedisOptions& o, bool check = true);
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  // The settings of every master, the least safe first (what RedisStore checks at construction).
  ServerConfig server_config();
  // For a router that does its own I/O (AsyncRedisStore's engine): the master of `slot` in the
  // map as it is (CLUSTERDOWN store_error when there is none; the map is never read again here),
  // a redirection heard (MOVED updates the map), a node that failed under a call, and the options
  // of a connection to the node at `at`.
  Endpoint master_of(int slot);
  void redirected(const Redirect& to);
  void retried() noexcept { tryagain_.fetch_add(1); }  // a TRYAGAIN answer, sent again after its delay
  void doubt() noexcept { suspect(); }
  [[nodiscard]] RedisOptions node_options(const Endpoint& at) const;
  // Reading the map again (the engine's): when the map
  // is in doubt and no reading is under way or was begun in the last 50 ms, begin_refresh() gives
  // the nodes to ask CLUSTER SLOTS, in turn (the known masters, then the seeds); each answer goes to
  // accept_slots() (true: installed; else why not, appended to `why`; store_error on a reply of
  // another shape), and when no node answered, refresh_failed().
  [[nodiscard]] std::vector<Endpoint> begin_refresh();
  bool accept_slots(const Endpoint& at, const redisReply* r, std::string& why);
  void refresh_failed() noexcept;
  // The masters of the current map, "host:port,host:port,...", and as a list.
  [[nodiscard]] std::string masters() const;
  [[nodiscard]] std::vector<Endpoint> master_list() const;
  void add_stats(RedisClientStats& s) const noexcept;

private:
  // The client for the node at `at`, built on first use.
  std::shared_ptr<Client> node_at(const Endpoint& at);
  // Asks `nodes` in turn for CLUSTER SLOTS and installs the first answer; throws when none answers.
  void read_map(const std::vector<Endpoint>& nodes);
  void install(const std::vector<SlotRange>& ranges);
  // The nodes to ask for the map: the known masters, then the seeds not among them.
  std::vector<Endpoint> candidates() const;
  // A MOVED answer: the slot's new master, and the whole map read again soon.
  void moved(const Redirect& to);
  // A node failed under a call: the map may be out of date (a failover), read it again.
  void suspect() noexcept { stale_.store(true); }

  RedisOptions node_options_;  // a node's options: the cluster's, with no seeds and its own address
  std::vector<Endpoint> seeds_;
  bool check_;

  mutable std::mutex mu_;                                     // guards everything below but the atomics
  std::array<std::int16_t, slot_count> owner_{};              // index into masters_; -1 = no master
  std::vector<Endpoint> masters_;
  std::unordered_map<std::string, std::shared_ptr<Client>> nodes_;  // by describe(endpoint)
  std::chrono::steady_clock::time_point last_begun_{};  // begin_refresh's last reading
  bool refreshing_ = false;                              // begin_refresh's reading under way

  std::atomic<bool> stale_{false};
  std::atomic<std::uint64_t> refreshes_{0}, moved_{0}, ask_{0}, tryagain_{0};
};

}  // namespace idem::detail::redis
