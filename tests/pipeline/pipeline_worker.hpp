#pragma once
// What the worker processes of the pipeline tests share (pipeline_worker.cpp for the NATS pipeline,
// http_pipeline_worker.cpp for the HTTP / RabbitMQ one): the stop signal, the guard's outcomes as
// stats lines (pipeline_plan.hpp's Stats), the guard's and the PostgreSQL client's settings.

#include <chrono>
#include <csignal>
#include <exception>
#include <memory>
#include <stop_token>
#include <string>
#include <string_view>
#include <utility>

#include <unistd.h>

#include "idem/idem.hpp"
#include "idem/postgres.hpp"
#include "pipeline_plan.hpp"

namespace pipeline {

// SIGTERM / SIGINT: stop after the work in hand.
inline std::stop_source g_stop;
inline void on_stop_signal(int) { g_stop.request_stop(); }
inline void install_signals() {
  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGPIPE, SIG_IGN);
}

inline char status_char(idem::Status s) {
  switch (s) {
    case idem::Status::executed: return 'X';
    case idem::Status::duplicate: return 'U';
    case idem::Status::in_flight: return 'I';
    case idem::Status::previously_failed: return 'F';
    case idem::Status::stale: return 'S';
    case idem::Status::lease_lost: return 'L';
    case idem::Status::mismatch: return 'M';
  }
  return '?';
}

// The guard's outcomes, one stats line each (idem::consume runs batches, idem::http answers the
// request: this is where a worker sees whether a run was executed or answered as a duplicate).
class StatsObserver final : public idem::Observer {
public:
  explicit StatsObserver(const Stats& s) : stats_(s) {}
  void on_outcome(const idem::OutcomeEvent& e) noexcept override { stats_.note(status_char(e.status)); }
  void on_store_error(std::string_view, const std::exception&) noexcept override { stats_.note('E'); }
  void on_handler_error(std::string_view, const std::exception_ptr&) noexcept override { stats_.note('E'); }

private:
  const Stats& stats_;
};

inline idem::PostgresOptions pg_client(const std::string& conninfo, std::size_t pool = 2) {
  return {.conninfo = conninfo + " connect_timeout=2",
          .pool = {.size = pool, .wait = idem::millis{3000}},
          .statement_timeout = idem::millis{5000}};
}

inline idem::GuardOptions guard_options(const std::string& owner, std::shared_ptr<idem::Observer> observer) {
  using namespace std::chrono_literals;
  idem::GuardOptions go;
  go.lease = 2s;      // a SIGKILLed holder's session dies with it; the lease only bounds a stuck one
  go.retention = 1h;  // longer than the run: every redelivery is answered as a duplicate
  go.failure.mode = idem::FailureMode::release;
  go.owner = owner + ":" + std::to_string(::getpid());
  go.observer = std::move(observer);
  return go;
}

}  // namespace pipeline
