#pragma once
/// @file redis/options.hpp RedisOptions, the settings of one RedisClient, and parse_redis_url.

#include <memory>
#include <string>
#include <string_view>

#include "idem/core/observer.hpp"
#include "idem/core/pool_options.hpp"
#include "idem/core/record.hpp"

namespace idem {

/// Options of RedisClient (and of the stores that build their own). Durations in milliseconds;
/// docs/redis.md explains each choice.
struct RedisOptions {
  /// `redis://[user[:password]@]host[:port][/db]` or `unix://[user[:password]@]/path[?db=N]`
  /// (user and password percent-decoded); when set it overrides host, port, unix_socket, user,
  /// password and db. Empty = use those fields. `rediss://` is refused: no TLS support.
  std::string url;
  /// Server host name or address, used when unix_socket is empty.
  std::string host = "127.0.0.1";
  /// Server TCP port, 1..65535.
  int port = 6379;
  /// Path of the server's Unix socket; non-empty = connect there instead of host:port.
  std::string unix_socket;
  /// ACL user name (Redis 6+); empty = the `default` user (AUTH with the password alone).
  std::string user;
  /// Password for AUTH; empty = no AUTH.
  std::string password;
  /// Logical database index (SELECT), >= 0.
  int db = 0;
  /// Prepended to every idempotency key. No braces unless it is one whole `{tag}`, which pins every
  /// key to one cluster slot; without braces, a `{tag}` inside a user key decides the slot.
  std::string key_prefix = "idem:";
  /// Bound on establishing a connection (TCP connect); > 0.
  millis connect_timeout{1'000};
  /// Bound on one command's send and reply; > 0. A timed-out call throws timeout_error, retryable.
  millis command_timeout{1'000};
  /// The connection pool (idem/core/pool_options.hpp): size > 0, wait >= 0 (0 = fail at once).
  PoolOptions pool{};
  /// A RedisStore refuses (store_error, code `EVICTION`) a server whose `maxmemory` > 0 with a
  /// `maxmemory-policy` other than `noeviction`: it could evict live idempotency records, and their
  /// messages would run again. true = accept such a server anyway, with an observer warning.
  bool unsafe_allow_eviction = false;
  /// Receives store advisories (on_warning); null = none.
  std::shared_ptr<Observer> observer;
};

/// Parses a `redis://` or `unix://` URL onto `base`; throws invalid_options_error naming the flaw.
RedisOptions parse_redis_url(std::string_view url, RedisOptions base = {});

}  // namespace idem
