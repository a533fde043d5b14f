#pragma once
// Internal to idem-outbox-relay (relay_main.cpp): its settings, its usage exit, and the publisher
// they ask for (relay_publisher.cpp), apart from the flag, variable and file parsing of main.

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "idem/outbox/publisher.hpp"

namespace idem_relay {

inline constexpr const char* program = "idem-outbox-relay";
inline constexpr int exit_failure = 1;  // a run that failed (database, broker, cannot listen)
inline constexpr int exit_usage = 2;    // a bad or missing setting: restarting will not help

// Every setting, with its default. Names follow the flags (docs/relay.md has the table).
struct Settings {
  std::string publisher = "redis";
  std::string conninfo;
  std::string conninfo_file;
  std::string schema = "idem";
  std::string table = "idem_records";
  std::size_t batch = 256;
  long poll_ms = 1000;
  long retention_ms = 86'400'000;
  long backoff_max_ms = 30'000;
  long claim_idle_timeout_ms = 60'000;
  bool transaction_pooler = false;
  bool once = false;
  bool check_config = false;
  std::string metrics_listen;
  // redis
  std::string redis;
  std::string stream_prefix;
  std::size_t maxlen = 0;
  // kafka
  std::string kafka_brokers;
  std::vector<std::string> kafka_properties;
  long kafka_timeout_ms = 30'000;
  std::string kafka_client_id = "idem-outbox";
  // rabbitmq
  std::string rabbitmq_url;
  std::string rabbitmq_user;
  std::string rabbitmq_password;
  std::string rabbitmq_ca_file;
  std::string rabbitmq_cert_file;
  std::string rabbitmq_key_file;
  bool rabbitmq_verify_peer = true;
  bool rabbitmq_verify_hostname = true;
  long rabbitmq_timeout_ms = 30'000;
  std::string rabbitmq_key_header = "idem-message-key";
  // nats
  std::string nats_url;
  std::string nats_subject_prefix;
  std::string nats_expect_stream;
  long nats_timeout_ms = 5000;
};

// A bad or missing setting: says which on stderr and exits exit_usage.
[[noreturn]] inline void usage(const std::string& why) {
  std::string line = why;
  std::replace(line.begin(), line.end(), '\n', ' ');
  std::fprintf(stderr, "%s: %s (see %s --help)\n", program, line.c_str(), program);
  std::exit(exit_usage);
}

// "scheme://user:password@host/..." -> "scheme://host/..." for each URL of a comma-separated list.
std::string without_credentials(const std::string& urls);

// The publisher the settings ask for, and where it publishes (for the start line: no password).
struct Built {
  std::unique_ptr<idem::OutboxPublisher> publisher;
  std::string destination;
};

// The publisher --publisher names, from its settings; a missing one or one this build lacks is usage().
Built build_publisher(const Settings& s);

}  // namespace idem_relay
