// idem-outbox-relay: the outbox relay as a program of its own (docs/relay.md). Drains the outbox of
// one PostgresStore table into Redis Streams, Kafka, RabbitMQ or NATS JetStream until SIGINT /
// SIGTERM (or once, with --once). Settings come from flags, IDEM_RELAY_* environment variables and
// a config file, in that order of precedence; /metrics is served with --metrics-listen.

#include <fmt/format.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "idem/core/error.hpp"
#include "idem/core/version.hpp"
#include "idem/outbox/relay.hpp"
#include "relay_settings.hpp"
#ifdef IDEM_RELAY_WITH_METRICS
#include "relay_metrics.hpp"
#endif

namespace {

using namespace idem_relay;

constexpr const char* env_prefix = "IDEM_RELAY_";

// "--kafka-brokers" -> "IDEM_RELAY_KAFKA_BROKERS".
std::string env_name(std::string flag) {
  flag.erase(0, flag.find_first_not_of('-'));
  std::string out = env_prefix;
  for (const char c : flag) out += c == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

// The config file: CLI11's TOML / INI reader, then two rules of our own. Keys are flag names
// ("kafka-brokers"; "kafka_brokers" and "brokers" under a "[kafka]" section say the same). A key
// whose IDEM_RELAY_* variable is set is dropped, so the environment wins over the file (CLI11 would
// read the file first and ignore the variable); flags win over both, as CLI11 does.
class RelayConfigFile final : public CLI::ConfigTOML {
 public:
  explicit RelayConfigFile(const CLI::App& app) : app_(&app) {}
  std::vector<CLI::ConfigItem> from_config(std::istream& input) const override {
    std::vector<CLI::ConfigItem> out;
    for (CLI::ConfigItem& item : CLI::ConfigTOML::from_config(input)) {
      if (item.name == "++" || item.name == "--") continue;  // section markers: sections are name prefixes here
      std::string name;
      for (const auto& p : item.parents) name += p + "-";
      name += item.name;
      std::replace(name.begin(), name.end(), '_', '-');
      item.parents.clear();
      item.name = name;
      if (const CLI::Option* o = app_->get_option_no_throw("--" + name); o && !o->get_envname().empty()) {
        const char* v = std::getenv(o->get_envname().c_str());
        if (v && *v) continue;
      }
      out.push_back(std::move(item));
    }
    return out;
  }

 private:
  const CLI::App* app_;
};


bool secret_property(const std::string& key) {
  return key.find("password") != std::string::npos || key.find("secret") != std::string::npos ||
         key.find("sasl.oauthbearer.config") != std::string::npos;
}

std::string quoted(const std::string& s) {
  std::string q = "\"";
  for (const char c : s) q += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
  return q + "\"";
}



// "--batch: Value 0 not in range ..." about a value that came from IDEM_RELAY_BATCH or the config
// file, not the command line: says which, so the operator knows where to look.
std::string with_source(std::string message, const CLI::App& app, int argc, char** argv) {
  const auto colon = message.find(':');
  if (message.rfind("--", 0) != 0 || colon == std::string::npos) return message;
  const std::string flag = message.substr(0, colon);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == flag || a.rfind(flag + "=", 0) == 0) return message;
  }
  const CLI::Option* o = app.get_option_no_throw(flag);
  if (!o) return message;
  const char* v = o->get_envname().empty() ? nullptr : std::getenv(o->get_envname().c_str());
  return message + (v && *v ? " (from " + o->get_envname() + ")" : std::string(" (from the config file)"));
}

// --check-config: the settings in force, as a config file would say them (secrets hidden).
void print_settings(const Settings& s, const CLI::App& app) {
  const auto line = [](const char* k, const std::string& v) { fmt::print("{} = {}\n", k, v); };
  const auto hidden = [](const std::string& v) {
    return v.empty() ? std::string("\"\"") : std::string("\"<hidden>\"");
  };
  line("publisher", quoted(s.publisher));
  line("conninfo", hidden(s.conninfo));
  line("conninfo-file", quoted(s.conninfo_file));
  line("schema", quoted(s.schema));
  line("table", quoted(s.table));
  line("batch", std::to_string(s.batch));
  line("poll-ms", std::to_string(s.poll_ms));
  line("retention-ms", std::to_string(s.retention_ms));
  line("backoff-max-ms", std::to_string(s.backoff_max_ms));
  line("claim-idle-timeout-ms", std::to_string(s.claim_idle_timeout_ms));
  line("transaction-pooler", s.transaction_pooler ? "true" : "false");
  line("once", s.once ? "true" : "false");
  line("metrics-listen", quoted(s.metrics_listen));
  line("redis", quoted(without_credentials(s.redis)));
  line("stream-prefix", quoted(s.stream_prefix));
  line("maxlen", std::to_string(s.maxlen));
  line("kafka-brokers", quoted(s.kafka_brokers));
  std::string props;
  for (const auto& p : s.kafka_properties) {
    const auto key = p.substr(0, p.find('='));
    props += (props.empty() ? "" : ", ") + quoted(secret_property(key) ? key + "=<hidden>" : p);
  }
  line("kafka-property", "[" + props + "]");
  line("kafka-timeout-ms", std::to_string(s.kafka_timeout_ms));
  line("kafka-client-id", quoted(s.kafka_client_id));
  line("rabbitmq-url", quoted(without_credentials(s.rabbitmq_url)));
  line("rabbitmq-user", quoted(s.rabbitmq_user));
  line("rabbitmq-password", hidden(s.rabbitmq_password));
  line("rabbitmq-ca-file", quoted(s.rabbitmq_ca_file));
  line("rabbitmq-cert-file", quoted(s.rabbitmq_cert_file));
  line("rabbitmq-key-file", quoted(s.rabbitmq_key_file));
  line("rabbitmq-verify-peer", s.rabbitmq_verify_peer ? "true" : "false");
  line("rabbitmq-verify-hostname", s.rabbitmq_verify_hostname ? "true" : "false");
  line("rabbitmq-timeout-ms", std::to_string(s.rabbitmq_timeout_ms));
  line("rabbitmq-key-header", quoted(s.rabbitmq_key_header));
  line("nats-url", quoted(without_credentials(s.nats_url)));
  line("nats-subject-prefix", quoted(s.nats_subject_prefix));
  line("nats-expect-stream", quoted(s.nats_expect_stream));
  line("nats-timeout-ms", std::to_string(s.nats_timeout_ms));
  const CLI::Option* cfg = app.get_config_ptr();
  fmt::print("# config file: {}\n", cfg && cfg->count() > 0 ? cfg->as<std::string>() : std::string("none"));
}

// CLI11's help, without its generic "Usage: ... [OPTIONS]" line (the description has a real one).
class HelpFormatter final : public CLI::Formatter {
 public:
  HelpFormatter() { column_width(44); }
  std::string make_usage(const CLI::App* /*app*/, std::string /*name*/) const override { return "\n"; }
};

const char* const description =
    "idem-outbox-relay: publishes the committed rows of an idem outbox (PostgreSQL) to Redis Streams, Kafka,\n"
    "RabbitMQ or NATS JetStream, each message with its stable outbox id (consumers deduplicate on it).\n"
    "\n"
    "usage: idem-outbox-relay --conninfo STR | --conninfo-file PATH [--publisher P] <the publisher's settings> "
    "[options]\n"
    "\n"
    "Every setting may also come from the environment variable named after it (IDEM_RELAY_<FLAG>, shown\n"
    "as Env below) or from a config file (--config PATH, `flag-name = value` lines); a flag wins over the\n"
    "environment, which wins over the file. Keep the conninfo and passwords out of the command line:\n"
    "put them in the environment or the file.";

const char* const footer =
    "Destinations: each row's destination names the stream (redis, after --stream-prefix), the topic\n"
    "(kafka), \"exchange/routing-key\" or a queue name (rabbitmq) or the subject (nats, after\n"
    "--nats-subject-prefix). Any number of relays may run against one outbox: rows are claimed with\n"
    "FOR UPDATE SKIP LOCKED, per-message_key order is kept, and a relay killed mid-batch leaves its rows\n"
    "to be published again with the same ids. SIGINT / SIGTERM: the batch in flight is finished, exit 0.\n"
    "Exit status: 0 stopped by a signal (or --once succeeded), 1 a failure, 2 a bad setting.\n"
    "docs/relay.md, docs/outbox.md.";

}  // namespace

int main(int argc, char** argv) try {
  Settings s;
  CLI::App app{description, program};
  app.set_help_flag("-h,--help", "This text, and exit");
  app.set_version_flag("--version", fmt::format("{} {}", program, idem::version_string),
                       "Print \"idem-outbox-relay X.Y.Z\" (the idem version) and exit");
  app.footer(footer);
  app.formatter(std::make_shared<HelpFormatter>());
  app.option_defaults()->always_capture_default();

  // The config file; IDEM_RELAY_CONFIG names it too (CLI11 reads the file before the environment,
  // so the variable is given as the option's default, and a file it names must exist).
  const char* env_config = std::getenv("IDEM_RELAY_CONFIG");
  CLI::Option* config = app.set_config("--config", env_config ? env_config : "",
                                       "A config file: `flag-name = value` lines (TOML / INI); [section] prefixes "
                                       "names (\"[kafka]\" then \"brokers = ...\")",
                                       env_config != nullptr && *env_config != '\0');
  config->envname("IDEM_RELAY_CONFIG")->type_name("PATH");
  app.config_formatter(std::make_shared<RelayConfigFile>(app));
  app.allow_config_extras(CLI::config_extras_mode::error);  // a misspelt key is an error, not ignored

  // Every setting's variable: IDEM_RELAY_ and the flag in upper snake case.
  const auto add = [](CLI::Option* o) { return o->envname(env_name(o->get_lnames().front())); };
  const auto positive_ms = CLI::Range(1L, 86'400'000L);

  // The outbox and the relay.
  add(app.add_option("--publisher", s.publisher, "Where to publish: redis, kafka, rabbitmq or nats"))
      ->check(CLI::IsMember({"redis", "kafka", "rabbitmq", "nats"}))
      ->type_name("NAME");
  add(app.add_option("--conninfo", s.conninfo, "libpq conninfo or URI of the database holding the outbox"))
      ->type_name("STR");
  add(app.add_option("--conninfo-file", s.conninfo_file, "Read the conninfo from the first line of PATH"))
      ->check(CLI::ExistingFile)
      ->type_name("PATH");
  add(app.add_option("--schema", s.schema, "The store's schema"))->type_name("NAME");
  add(app.add_option("--table", s.table, "The store's table; the outbox is <table>_outbox"))->type_name("NAME");
  add(app.add_option("--batch", s.batch, "Rows per batch"))
      ->check(CLI::Range(std::size_t{1}, std::size_t{10'000}))
      ->type_name("N");
  add(app.add_option("--poll-ms", s.poll_ms, "Poll interval when no NOTIFY arrives"))
      ->check(CLI::Range(1L, 3'600'000L))
      ->type_name("MS");
  add(app.add_option("--retention-ms", s.retention_ms,
                     "Keep sent rows this long before purging them (0 = delete at once)"))
      ->check(CLI::Range(0L, 1L << 40))
      ->type_name("MS");
  add(app.add_option("--backoff-max-ms", s.backoff_max_ms, "Longest wait before publishing a failed row again"))
      ->check(CLI::Range(100L, 86'400'000L))
      ->type_name("MS");
  add(app.add_option(
          "--claim-idle-timeout-ms", s.claim_idle_timeout_ms,
          "A claim idle this long (a relay paused mid-publish) is ended by the server (0 = never, else >= 1000)"))
      ->check(CLI::Range(0L, 86'400'000L))
      ->type_name("MS");
  add(app.add_flag("--transaction-pooler", s.transaction_pooler,
                   "The conninfo reaches a transaction-mode pooler (PgBouncer): no session settings, unnamed "
                   "statements, polling instead of LISTEN"));
  add(app.add_flag("--once", s.once, "Publish what is due, once, and exit (status 0 when that succeeded)"));
  add(app.add_option("--metrics-listen", s.metrics_listen,
                     "Serve Prometheus metrics at http://HOST:PORT/metrics (off by default)"))
      ->check(
          [](const std::string& v) {
            const auto colon = v.rfind(':');
            const std::string port = colon == std::string::npos ? std::string() : v.substr(colon + 1);
            if (port.empty() || port.size() > 5 || !std::all_of(port.begin(), port.end(), ::isdigit) ||
                std::stol(port) > 65535)
              return std::string("must be HOST:PORT (127.0.0.1:9465, 0.0.0.0:9465, [::]:9465)");
            return std::string();
          },
          "")
      ->type_name("HOST:PORT");
  add(app.add_flag("--check-config", s.check_config,
                   "Check the settings (and build the publisher, without connecting), print them "
                   "(passwords hidden) and exit 0"));

  // Redis Streams.
  add(app.add_option("--redis", s.redis, "redis://[user[:password]@]host[:port][/db], rediss://, unix:///path"))
      ->group("Redis Streams (--publisher redis)")
      ->type_name("URL");
  add(app.add_option("--stream-prefix", s.stream_prefix, "Prepended to each destination to name its stream"))
      ->group("Redis Streams (--publisher redis)")
      ->type_name("P");
  add(app.add_option("--maxlen", s.maxlen, "Trim each stream to about N entries (0 = never)"))
      ->group("Redis Streams (--publisher redis)")
      ->check(CLI::Range(std::size_t{0}, std::size_t{1} << 40))
      ->type_name("N");

  // Kafka.
  const char* const kafka = "Kafka (--publisher kafka; an idempotent producer, acks=all)";
  add(app.add_option("--kafka-brokers", s.kafka_brokers, "bootstrap.servers: HOST:PORT[,HOST:PORT...]"))
      ->group(kafka)
      ->type_name("LIST");
  add(app.add_option("--kafka-property", s.kafka_properties,
                     "A librdkafka producer property (security.protocol=ssl, sasl.password=...); repeatable; in "
                     "the environment, several separated by ';'"))
      ->group(kafka)
      ->type_name("KEY=VALUE")
      ->delimiter(';')
      ->check(
          [](const std::string& v) {
            const auto eq = v.find('=');
            return eq == std::string::npos || eq == 0 ? std::string("must be KEY=VALUE") : std::string();
          },
          "");
  add(app.add_option("--kafka-timeout-ms", s.kafka_timeout_ms, "Bound on one batch's delivery reports"))
      ->group(kafka)
      ->check(positive_ms)
      ->type_name("MS");
  add(app.add_option("--kafka-client-id", s.kafka_client_id, "client.id, as the brokers log it"))->group(kafka);

  // RabbitMQ.
  const char* const rabbit = "RabbitMQ (--publisher rabbitmq; publisher confirms)";
  add(app.add_option("--rabbitmq-url", s.rabbitmq_url,
                     "amqp://[user[:password]@]host[:port][/vhost] or amqps://... (TLS); the vhost \"/\" is %2f"))
      ->group(rabbit)
      ->type_name("URL");
  add(app.add_option("--rabbitmq-user", s.rabbitmq_user, "Login user when the URL has none (default guest)"))
      ->group(rabbit);
  add(app.add_option("--rabbitmq-password", s.rabbitmq_password,
                     "Login password when the URL has none (default guest); better in the environment"))
      ->group(rabbit);
  add(app.add_option("--rabbitmq-ca-file", s.rabbitmq_ca_file,
                     "PEM CA certificates for amqps:// (default: the system's)"))
      ->group(rabbit)
      ->type_name("PATH");
  add(app.add_option("--rabbitmq-cert-file", s.rabbitmq_cert_file, "PEM client certificate (mutual TLS)"))
      ->group(rabbit)
      ->type_name("PATH");
  add(app.add_option("--rabbitmq-key-file", s.rabbitmq_key_file, "PEM private key of --rabbitmq-cert-file"))
      ->group(rabbit)
      ->type_name("PATH");
  add(app.add_option("--rabbitmq-verify-peer", s.rabbitmq_verify_peer, "Check the broker's certificate"))
      ->group(rabbit)
      ->type_name("BOOL");
  add(app.add_option("--rabbitmq-verify-hostname", s.rabbitmq_verify_hostname,
                     "Check that the certificate names the host"))
      ->group(rabbit)
      ->type_name("BOOL");
  add(app.add_option("--rabbitmq-timeout-ms", s.rabbitmq_timeout_ms, "Bound on connecting and on one batch's confirms"))
      ->group(rabbit)
      ->check(positive_ms)
      ->type_name("MS");
  add(app.add_option("--rabbitmq-key-header", s.rabbitmq_key_header, "AMQP header carrying the message_key"))
      ->group(rabbit)
      ->type_name("NAME");

  // NATS.
  const char* const nats = "NATS JetStream (--publisher nats; Nats-Msg-Id = the outbox id)";
  add(app.add_option("--nats-url", s.nats_url, "nats://[user:password@]host:port[,...] (tls:// for TLS)"))
      ->group(nats)
      ->type_name("URL");
  add(app.add_option("--nats-subject-prefix", s.nats_subject_prefix,
                     "Prepended to each destination to name its subject"))
      ->group(nats)
      ->type_name("P");
  add(app.add_option("--nats-expect-stream", s.nats_expect_stream, "Refuse a message stored by any other stream"))
      ->group(nats)
      ->type_name("NAME");
  add(app.add_option("--nats-timeout-ms", s.nats_timeout_ms, "Connect and acknowledgement timeout"))
      ->group(nats)
      ->check(positive_ms)
      ->type_name("MS");

  try {
    app.parse(argc, argv);
  } catch (const CLI::FileError& e) {
    usage(fmt::format("--config (or IDEM_RELAY_CONFIG): {}", e.what()));
  } catch (const CLI::ConfigError& e) {
    usage(fmt::format("--config (or IDEM_RELAY_CONFIG): {}", e.what()));
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    usage(with_source(e.what(), app, argc, argv));
  }

  // The conninfo: one of the two, from wherever it came.
  if (!s.conninfo.empty() && !s.conninfo_file.empty())
    usage(
        "--conninfo and --conninfo-file are both set (flags, IDEM_RELAY_CONNINFO[_FILE] or the config file): keep one");
  if (!s.conninfo_file.empty()) {
    std::ifstream in(s.conninfo_file);
    if (!in || !std::getline(in, s.conninfo) || s.conninfo.empty())
      usage(fmt::format("--conninfo-file: no conninfo on the first line of {}", s.conninfo_file));
  }
  if (s.conninfo.empty())
    usage("give --conninfo or --conninfo-file (or IDEM_RELAY_CONNINFO / IDEM_RELAY_CONNINFO_FILE)");
#ifndef IDEM_RELAY_WITH_METRICS
  if (!s.metrics_listen.empty())
    usage(
        "--metrics-listen: this idem-outbox-relay was built without prometheus-cpp (apt-get install "
        "prometheus-cpp-dev)");
#endif

  idem::OutboxRelayOptions ro;
  ro.postgres.conninfo = s.conninfo;
  ro.postgres.transaction_pooler = s.transaction_pooler;
  ro.schema = s.schema;
  ro.table = s.table;
  ro.batch = s.batch;
  ro.poll_interval = idem::millis{s.poll_ms};
  ro.retention = idem::millis{s.retention_ms};
  ro.backoff_max = idem::millis{s.backoff_max_ms};
  ro.claim_idle_timeout = idem::millis{s.claim_idle_timeout_ms};

  // SIGINT / SIGTERM blocked before any thread exists (the publisher's, the relay's, the exposer's
  // inherit the mask), so only the sigwait below takes them. --once keeps their default action.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  if (!s.once && !s.check_config) pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  Built built;
  std::unique_ptr<idem::OutboxRelay> relay;
  try {
    built = build_publisher(s);
    relay = std::make_unique<idem::OutboxRelay>(std::move(built.publisher), ro);
  } catch (const idem::invalid_options_error& e) {
    usage(e.what());
  }
  if (s.check_config) {
    print_settings(s, app);
    return 0;
  }
  relay->set_observer([](const idem::OutboxRelayEvent& e) {
    if (e.kind == idem::OutboxRelayEvent::Kind::publish_failed || e.kind == idem::OutboxRelayEvent::Kind::error ||
        e.kind == idem::OutboxRelayEvent::Kind::warning)
      std::fprintf(stderr, "%s: %s\n", program, e.error.c_str());
  });

  std::string metrics_note;
#ifdef IDEM_RELAY_WITH_METRICS
  std::unique_ptr<idem::relay_program::RelayMetrics> metrics;
  if (!s.metrics_listen.empty()) {
    try {
      metrics = std::make_unique<idem::relay_program::RelayMetrics>(
          s.metrics_listen, *relay,
          idem::relay_program::MetricsSource{.publisher = s.publisher,
                                             .conninfo = s.conninfo,
                                             .transaction_pooler = s.transaction_pooler,
                                             .schema = s.schema,
                                             .table = s.table});
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: %s\n", program, e.what());
      return exit_failure;
    }
    const auto colon = s.metrics_listen.rfind(':');
    metrics_note = fmt::format("; metrics on http://{}:{}/metrics", s.metrics_listen.substr(0, colon), metrics->port());
  }
#endif
  std::fprintf(stderr, "%s %s: relaying %s.%s_outbox to %s (batch %zu, poll %ld ms)%s\n", program, idem::version_string,
               s.schema.c_str(), s.table.c_str(), built.destination.c_str(), s.batch, s.poll_ms, metrics_note.c_str());

  if (s.once) {
    relay->run_once();
    return relay->stats().publish_failures == 0 ? 0 : exit_failure;
  }
  relay->start();
  int sig = 0;
  sigwait(&stop_signals, &sig);
  std::fprintf(stderr, "%s: %s: finishing the batch in flight (a second signal exits at once)\n", program,
               sig == SIGINT ? "SIGINT" : "SIGTERM");
  std::thread([stop_signals] {
    int again = 0;
    sigwait(&stop_signals, &again);
    std::fprintf(stderr, "%s: second signal: exiting without waiting\n", program);
    ::_exit(exit_failure);
  }).detach();
  relay->stop();
  const auto st = relay->stats();
  std::fprintf(stderr, "%s: stopped; published %llu rows in %llu batches, %llu publish failures\n", program,
               static_cast<unsigned long long>(st.published), static_cast<unsigned long long>(st.batches),
               static_cast<unsigned long long>(st.publish_failures));
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s: %s\n", program, e.what());
  return exit_failure;
}
