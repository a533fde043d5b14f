#pragma once
/// @file postgres/client.hpp PostgresClient: the one connection to a PostgreSQL server that the
/// PostgreSQL stores share (pool, session setup, error mapping), and its PostgresOptions.

#include <memory>
#include <string>

#include "idem/core/observer.hpp"
#include "idem/core/pool_options.hpp"
#include "idem/core/record.hpp"

namespace idem {

/// How a PostgresClient reaches the server. Durations are milliseconds.
struct PostgresOptions {
  /// libpq conninfo ("host=db port=5432 sslmode=verify-full") or URI ("postgresql://u@db/app");
  /// every libpq parameter passes through; empty = libpq defaults and the PG* environment.
  std::string conninfo;
  /// The sessions every store of this client shares (idem/core/pool_options.hpp); wait 0 fails at once.
  PoolOptions pool{.size = 8, .wait = millis{10'000}};
  /// Session statement_timeout of pooled connections (store calls and handler writes); 0 = none.
  millis statement_timeout{30'000};
  /// How long a write whose answer was lost keeps asking for its outcome (on whichever primary the
  /// conninfo reaches) before outcome_unknown_error; 0 = ask once.
  millis settle_wait{10'000};
  /// A write not answered within statement_timeout + this (a commit held by synchronous replication no standby
  /// confirms) is cancelled: durability_error; 10 s is past any sound sync-rep delay; 0 = wait as the server does.
  millis sync_replication_wait{10'000};
  /// The conninfo reaches a transaction-mode pooler (PgBouncer pool_mode=transaction): statements
  /// are sent unnamed and no session setting is made (statement_timeout is then the role's).
  bool transaction_pooler = false;
  /// Hears the client's advisories (replication settings that let a failover lose completions);
  /// a guard's own observer hears them too (PostgresStore::attach_observer).
  std::shared_ptr<Observer> observer;
};

namespace detail {
class ClientImpl;
struct ClientAccess;
}  // namespace detail

/**
 * A pool of libpq sessions to one server, shared by the PostgresStore and PostgresSequenceStore
 * built on it (so they reach the same server and database by construction). Thread-safe; hold it
 * by std::shared_ptr. The constructor validates the options and takes one look at the server
 * (its replication settings, bounded by 5 s; an unreachable server is not an error there); the
 * pool's sessions are opened as calls need them.
 *
 * @code
 * auto client = std::make_shared<idem::PostgresClient>(idem::PostgresOptions{.conninfo = "postgresql://app@db/app"});
 * idem::PostgresStore store{client, {.mode = idem::PostgresMode::transactional}};
 * idem::PostgresSequenceStore seqs{client};
 * @endcode
 */
class PostgresClient {
 public:
  /// Validates the options and refuses a standby as the only host (invalid_options_error); warns
  /// the observer of replication that a failover can lose completions with (one connection, at
  /// most 5 s); the pool's sessions open as calls need them.
  explicit PostgresClient(PostgresOptions options = {});
  ~PostgresClient();                                          ///< Closes the pooled sessions.
  PostgresClient(const PostgresClient&) = delete;             ///< Shared by pointer, never copied.
  PostgresClient& operator=(const PostgresClient&) = delete;  ///< Shared by pointer, never copied.

  /// The options in force.
  [[nodiscard]] const PostgresOptions& options() const noexcept;

 private:
  friend struct detail::ClientAccess;
  std::unique_ptr<detail::ClientImpl> impl_;
};

}  // namespace idem
