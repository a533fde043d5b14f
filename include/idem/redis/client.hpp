#pragma once
/// @file redis/client.hpp RedisClient: the one connection to a Redis server that RedisStore and
/// RedisSequenceStore share (pool, handshake, scripts, error mapping).

#include <cstdint>
#include <memory>
#include <string>

#include "idem/redis/options.hpp"

namespace idem {

class RedisClient;

/// What a RedisClient has followed since it was built (each counter only grows).
struct RedisClientStats {
  std::uint64_t discoveries = 0;    ///< Sentinel: masters looked up through the sentinels
  std::uint64_t map_refreshes = 0;  ///< Cluster: slot maps read (CLUSTER SLOTS)
  std::uint64_t moved = 0;          ///< Cluster: MOVED redirections followed
  std::uint64_t ask = 0;            ///< Cluster: ASK redirections followed
  std::uint64_t tryagain = 0;       ///< Cluster: TRYAGAIN answers retried (a slot in migration)
};

namespace detail::redis {
class Client;

/// What every Redis store is: a share of one RedisClient. Move-only; a moved-from store throws usage_error.
class ClientHandle {
public:
  /// The options in force (URL applied): the client's.
  [[nodiscard]] const RedisOptions& options() const;
  /// The client the store runs on, to build another store over it.
  [[nodiscard]] const std::shared_ptr<RedisClient>& client() const;
  /// Hands the store's advisories (Observer::on_warning: an evicting policy, missing replicas) to
  /// `o` as well, those raised so far first. A guard attaches its own observer.
  void attach_observer(const std::shared_ptr<Observer>& o) const;

protected:
  /// `owner` names the store in the moved-from message.
  ClientHandle(std::shared_ptr<RedisClient> client, const char* owner);
  ~ClientHandle();
  ClientHandle(ClientHandle&&) noexcept;
  ClientHandle& operator=(ClientHandle&&) noexcept;
  ClientHandle(const ClientHandle&) = delete;
  ClientHandle& operator=(const ClientHandle&) = delete;
  /// The client's implementation; usage_error on a moved-from store.
  [[nodiscard]] Client& impl() const;

private:
  std::shared_ptr<RedisClient> client_;
  const char* owner_;
};
}  // namespace detail::redis

/**
 * One Redis server (or Sentinel-resolved master, or cluster) with idem's Lua scripts loaded: what
 * every Redis store is built on. It owns the engine the stores send through (URL, TLS, AUTH,
 * SELECT, Sentinel, the slot map; its lanes and multiplexed connections, shared by every store
 * built on it); its pool serves the construction's checks. Build it once and hand it to each store, so they
 * are on the same server by construction; a sequence store built from the store also shares the
 * store's connection:
 *
 * @code
 * auto redis = std::make_shared<idem::RedisClient>(idem::RedisOptions{.url = "redis://127.0.0.1:6379/0"});
 * idem::RedisStore store{redis};
 * idem::RedisSequenceStore seqs{store};
 * @endcode
 *
 * The constructor checks the options (invalid_options_error naming the field), connects once,
 * authenticates, selects the database and loads every script in one round trip, so a wrong
 * address or password fails here and not on the first message (connection_error, timeout_error,
 * store_error such as WRONGPASS). Thread-safe; neither copyable nor movable (share it through
 * std::shared_ptr). Nothing it writes can raise SIGPIPE in the host process.
 */
class RedisClient {
public:
  /// Checks the options (URL applied), connects once and loads the scripts.
  explicit RedisClient(RedisOptions options = {});
  ~RedisClient();                                       ///< Fails calls still pending, closes every connection.
  RedisClient(const RedisClient&) = delete;             ///< One pool, one owner: share the client by pointer.
  RedisClient& operator=(const RedisClient&) = delete;  ///< One pool, one owner.

  /// The options in force (URL applied).
  [[nodiscard]] const RedisOptions& options() const noexcept;
  /// Where new connections go now: "host:port" or the socket path; in Sentinel mode the master
  /// last discovered ("" before the first discovery); in cluster mode the masters of the slot
  /// map, comma-separated.
  [[nodiscard]] std::string address() const;
  /// Redirections and lookups followed so far.
  [[nodiscard]] RedisClientStats stats() const noexcept;
  /// Times the master was (re)discovered through the sentinels (0 outside Sentinel mode).
  [[nodiscard]] std::uint64_t discoveries() const noexcept;
  /// The server's `maxmemory-policy`, or "" when it cannot be read (e.g. CONFIG denied by ACL).
  [[nodiscard]] std::string eviction_policy();

private:
  friend class detail::redis::ClientHandle;
  std::unique_ptr<detail::redis::Client> impl_;
};

}  // namespace idem
