#pragma once
// idem-outbox-relay's /metrics (docs/relay.md): a prometheus-cpp Exposer whose one collectable reads,
// at each scrape, the relay's counters (OutboxRelay::stats(), thread-safe) and the outbox's backlog
// (a PostgreSQL session of its own: unsent rows and the age of the oldest), plus idem_build_info.
// Built into the program only where prometheus-cpp is found (IDEM_RELAY_WITH_METRICS).

#include <memory>
#include <string>

#include "idem/outbox/relay.hpp"

namespace idem::relay_program {

/// What the metrics describe: the labels and where the backlog is counted.
struct MetricsSource {
  std::string publisher;            ///< the `publisher` label: redis, kafka, rabbitmq, nats
  std::string conninfo;             ///< the relay's database
  bool transaction_pooler = false;  ///< no session setting (statement_timeout) behind a pooler
  std::string schema;               ///< the store's schema
  std::string table;                ///< the store's table; the outbox is <table>_outbox
};

/// Serves http://<listen>/metrics until destroyed. `relay` must outlive it.
class RelayMetrics {
 public:
  /// Listens on "host:port" (port 0: any free one, see port()); std::runtime_error when it cannot.
  RelayMetrics(const std::string& listen, const OutboxRelay& relay, MetricsSource source);
  ~RelayMetrics();
  RelayMetrics(const RelayMetrics&) = delete;
  RelayMetrics& operator=(const RelayMetrics&) = delete;
  /// The port it listens on.
  [[nodiscard]] int port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace idem::relay_program
