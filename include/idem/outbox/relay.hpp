#pragma once
/// @file outbox/relay.hpp OutboxRelay: publishes the committed rows of a PostgresStore's outbox
/// through an OutboxPublisher, in order per message_key, at least once, any number of relays at once.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stop_token>
#include <string>

#include "idem/core/observer.hpp"
#include "idem/core/record.hpp"
#include "idem/outbox/publisher.hpp"
#include "idem/postgres/client.hpp"

namespace idem {

/// Options of one OutboxRelay. Durations are milliseconds.
struct OutboxRelayOptions {
  /// The database of the outbox (conninfo and statement_timeout; the relay opens two sessions of its own).
  PostgresOptions postgres;
  /// Schema of the store whose outbox this relay drains (PostgresStoreOptions::schema).
  std::string schema = "idem";
  /// Table of the store (PostgresStoreOptions::table); the outbox is `<table>_outbox`.
  std::string table = "idem_records";
  /// Rows claimed (and handed to the publisher) per batch; 1..10000.
  std::size_t batch = 256;
  /// Longest wait between two claims when no NOTIFY arrives (rows in backoff, a lost notification); > 0.
  millis poll_interval{1000};
  /// Wait before the first retry of a row whose publish failed; doubled per attempt up to backoff_max; > 0.
  millis backoff_initial{100};
  /// Longest backoff; >= backoff_initial.
  millis backoff_max{30'000};
  /// How long sent rows are kept before the purge deletes them; 0 = delete a row as soon as it is sent.
  millis retention{std::chrono::hours(24)};
  /// How often the long-running loop purges; > 0.
  millis purge_interval{60'000};
  /// A claiming transaction idle for longer (a relay paused mid-publish) is ended by the server,
  /// its rows released to other relays (which publish them again: same ids). 0 = never; else >= 1000.
  millis claim_idle_timeout{60'000};
  /// Create the outbox table (and the store's schema) at start, as PostgresStore::migrate() does.
  bool migrate = true;
};

/// What a relay has done since it was built (each counter only grows).
struct OutboxRelayStats {
  std::uint64_t published = 0;       ///< rows published and marked sent
  std::uint64_t batches = 0;         ///< batches published
  std::uint64_t publish_failures = 0;  ///< batches the publisher refused (their rows back off)
  std::uint64_t errors = 0;          ///< claims or marks that failed on the database (retried)
  std::uint64_t held_back = 0;       ///< claimed rows held back behind an earlier unsent row of their key
  std::uint64_t purged = 0;          ///< sent rows deleted after the retention
  std::uint64_t notifications = 0;   ///< wake-ups by NOTIFY
};

// OutboxRelayEvent, what the relay reports to the observer given to set_observer(), is in
// idem/core/observer.hpp.

/**
 * Drains the outbox of one PostgresStore table (docs/outbox.md). Each batch is one transaction:
 * claim up to `batch` unsent rows that are due (`FOR UPDATE SKIP LOCKED`, so relays never claim
 * the same row), hold back every row with an earlier unsent row of its message_key, publish the
 * rest, mark them sent, commit. A relay killed after the publish leaves its rows unsent (the
 * server rolls the claim back) and they are published again with the same ids: at least once,
 * deduplicated downstream on the id. A publish that fails backs its rows off (attempts,
 * next_attempt_at); nothing is dropped, whatever the error.
 *
 * Use run_once() from your own loop or a test, run(stop) on a thread of yours, or start()/stop()
 * for a thread of the relay's own. The long-running loop wakes on the outbox's NOTIFY (sent by
 * every committed writer), else every poll_interval, and purges sent rows every purge_interval.
 * One thread drives a relay at a time; stats() may be read from any thread.
 *
 * @code
 * idem::RedisStreamsPublisher pub{{.redis = {.url = "redis://127.0.0.1:6379"}}};
 * idem::OutboxRelay relay{pub, {.postgres = {.conninfo = ci}, .schema = "app", .table = "idem_records"}};
 * relay.start();   // ... relay.stop() at shutdown
 * @endcode
 */
class OutboxRelay {
 public:
  /// Checks the options (invalid_options_error); `publisher` must outlive the relay. Connects lazily.
  OutboxRelay(OutboxPublisher& publisher, OutboxRelayOptions options);
  /// The same, owning its publisher.
  OutboxRelay(std::unique_ptr<OutboxPublisher> publisher, OutboxRelayOptions options);
  ~OutboxRelay();                                  ///< stop(), then closes its sessions.
  OutboxRelay(const OutboxRelay&) = delete;        ///< One relay, one pair of sessions.
  OutboxRelay& operator=(const OutboxRelay&) = delete;  ///< Not copyable.

  /// One batch: claims, publishes, marks sent (or backs off); returns the rows published. Throws
  /// the database's typed error (connection_error, store_error...); a publisher's failure is not
  /// thrown but recorded on the rows (and in stats / the observer).
  std::size_t run_once();
  /// Deletes rows sent longer than `retention` ago, in batches; returns how many.
  std::size_t purge();
  /// Runs batches until `stop` is requested: back to back while there is work, else waiting for
  /// a NOTIFY or poll_interval. Errors are reported to the observer and retried after poll_interval.
  void run(std::stop_token stop);
  /// Runs run() on a thread of the relay's own (usage_error if already started).
  void start();
  /// Stops the relay's thread and waits for it (a batch under way finishes first); idempotent.
  void stop();
  /// Creates the outbox table now (idempotent), as migrate in the options does at the first batch.
  void migrate();

  /// Counters since construction.
  [[nodiscard]] OutboxRelayStats stats() const noexcept;
  /// Called on the relay's thread for every published batch, failure, error and purge.
  void set_observer(std::function<void(const OutboxRelayEvent&)> observer);
  /// The same events to `observer`'s on_relay (with the guard's metrics: PrometheusObserver, TeeObserver).
  void set_observer(std::shared_ptr<Observer> observer);
  /// The options in force.
  [[nodiscard]] const OutboxRelayOptions& options() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem
