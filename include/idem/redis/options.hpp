#pragma once
/// @file redis/options.hpp RedisOptions, the settings of one RedisClient, and parse_redis_url.

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "idem/core/observer.hpp"
#include "idem/core/pool_options.hpp"
#include "idem/core/record.hpp"

namespace idem {

/// The oldest TLS protocol version a RedisClient accepts.
enum class TlsVersion { tls1_2, tls1_3 };

/// TLS settings of a RedisClient (docs/redis.md, "TLS"); `rediss://` turns TLS on.
struct RedisTlsOptions {
  /// true = every connection to a data node (the server, the Sentinel master, each cluster node) speaks TLS.
  bool enabled = false;
  /// PEM file of the CA certificates trusted to sign the servers'; with ca_dir empty too = the system's trust store.
  std::string ca_file;
  /// Directory of CA certificates named by their hash (openssl rehash); with or instead of ca_file.
  std::string ca_dir;
  /// PEM client certificate (chain) for mutual TLS (`tls-auth-clients yes`); set together with key_file.
  std::string cert_file;
  /// PEM private key of cert_file, not encrypted; read once at construction, never quoted in a message.
  std::string key_file;
  /// Name sent as SNI and checked against the server's certificate; empty = the host connected to.
  std::string server_name;
  /// Check that the certificate names the server (server_name or the host); the chain is checked either way.
  bool verify_hostname = true;
  /// The oldest protocol version accepted.
  TlsVersion min_version = TlsVersion::tls1_2;
  /// Sentinel mode: the sentinels speak TLS too (same files; each checked against its own host unless server_name is set).
  bool sentinels = false;
};

/// Options of RedisClient (and of the stores that build their own). Durations in milliseconds;
/// docs/redis.md explains each choice.
struct RedisOptions {
  /// `redis://[user[:password]@]host[:port][/db]`, `unix://[user[:password]@]/path[?db=N]`,
  /// `redis-cluster://[user[:password]@]host:port[,host:port...]` or
  /// `redis-sentinel://[user[:password]@]host:port[,host:port...]/master-name[/db]` (user and
  /// password percent-decoded: the data nodes'; a sentinel URL may add `?sentinel_user=U&
  /// sentinel_password=P`); when set it overrides host, port, unix_socket, user, password, db and
  /// the cluster and sentinel fields. `rediss://` is `redis://` over TLS; `?tls=yes` turns TLS on for
  /// the other schemes, and tls_ca_file, tls_ca_dir, tls_cert_file, tls_key_file, tls_server_name,
  /// tls_min_version (1.2, 1.3) and sentinel_tls=yes set the `tls` fields. A URL never turns TLS off.
  /// Empty = use those fields.
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
  /// TLS for every connection (the handshake is bounded by connect_timeout); off by default.
  RedisTlsOptions tls{};
  /// `size`: how many blocked callers the client's engine serves at once each on an idle
  /// connection of its own (its lanes, off a cluster; more are multiplexed), > 0. `wait` is not
  /// used by Redis (no call waits for a connection), >= 0.
  PoolOptions pool{};
  /// A RedisStore refuses (store_error, code `EVICTION`) a server whose `maxmemory` > 0 with a
  /// `maxmemory-policy` other than `noeviction`: it could evict live idempotency records, and their
  /// messages would run again. true = accept such a server anyway, with an observer warning.
  bool unsafe_allow_eviction = false;
  /// Redis Cluster seed nodes as "host:port" (any node of the cluster; IPv6 as "[addr]:port");
  /// non-empty = cluster mode: the slot map is read from them (CLUSTER SLOTS), every script runs
  /// on the master of its key's slot, MOVED/ASK are followed, db must be 0 (docs/redis.md, "Cluster").
  std::vector<std::string> cluster_nodes;
  /// Redirections (MOVED, ASK, TRYAGAIN) one call follows before it gives up with a retryable
  /// store_error (code `REDIRECTS`); 1..100.
  int max_redirects = 5;
  /// Sentinels as "host:port" (IPv6 as "[addr]:port"); non-empty = Sentinel mode: the master of
  /// `sentinel_master` is asked of them (host, port and unix_socket are then unused), its role is
  /// checked on every new connection, and a broken connection or a READONLY/LOADING/MASTERDOWN
  /// reply makes the client ask again and reconnect (docs/redis.md, "Sentinel").
  std::vector<std::string> sentinels;
  /// The name the sentinels monitor the master under (`sentinel monitor <name> ...`); required with sentinels.
  std::string sentinel_master;
  /// ACL user for the sentinels (not the data nodes: those use user/password); empty = default user.
  std::string sentinel_user;
  /// Password for the sentinels' AUTH; empty = no AUTH.
  std::string sentinel_password;
  /// Replicas that must acknowledge each write transition (acquire that took the key, complete,
  /// fail, extend, sequence advance, batches) before it counts: `WAIT n replica_ack_timeout` is
  /// sent in the same write, so it costs no extra round trip. Fewer acks = durability_error
  /// (retryable; an acquire then runs no handler). 0 = no WAIT (a write acknowledged by the master
  /// alone can be lost in a failover). docs/guarantees.md says what each setting guarantees.
  int min_replica_acks = 0;
  /// How long WAIT waits for min_replica_acks; > 0 and below command_timeout.
  millis replica_ack_timeout{500};
  /// Auto-batching (RedisStore, AsyncRedisStore): the most one-key steps (acquire, complete, fail,
  /// extend) of different callers that go out as one script call when they queue behind a write in
  /// flight; each caller gets the answer its own call would have had. A lone call goes out at once.
  /// 1 = off (a script call per step); 1..1024 (docs/async.md, "Auto-batching").
  std::size_t auto_batch = 128;
  /// RedisStore, AsyncRedisStore: a connection idle this long sends PING; no answer within command_timeout
  /// drops it, so the next call connects afresh instead of waiting out a dead peer (a host gone
  /// without a FIN, a partition) and ending in doubt. 0 = off; >= 0.
  millis health_check_interval{15'000};
  /// Receives store advisories (on_warning); null = none.
  std::shared_ptr<Observer> observer;
};

/// Parses a `redis://`, `rediss://`, `unix://`, `redis-cluster://` or `redis-sentinel://` URL onto `base`; throws invalid_options_error naming the flaw.
RedisOptions parse_redis_url(std::string_view url, RedisOptions base = {});

}  // namespace idem
