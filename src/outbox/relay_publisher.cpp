// idem-outbox-relay's publishers: the one --publisher names, built from its settings.

#include <string>
#include <utility>

#include "idem/outbox/redis_streams_publisher.hpp"
#include "relay_settings.hpp"
#ifdef IDEM_RELAY_WITH_KAFKA
#include "idem/outbox/kafka_publisher.hpp"
#endif
#ifdef IDEM_RELAY_WITH_RABBITMQ
#include "idem/outbox/rabbitmq_publisher.hpp"
#endif
#ifdef IDEM_RELAY_WITH_NATS
#include "idem/outbox/nats_publisher.hpp"
#endif

namespace idem_relay {

std::string without_credentials(const std::string& urls) {
  std::string out;
  std::size_t from = 0;
  while (from <= urls.size()) {
    const std::size_t comma = std::min(urls.find(',', from), urls.size());
    std::string u = urls.substr(from, comma - from);
    if (const auto scheme = u.find("://"); scheme != std::string::npos) {
      const auto host = scheme + 3;
      const auto path = u.find('/', host);
      const auto at = u.rfind('@', path == std::string::npos ? std::string::npos : path);
      if (at != std::string::npos && at >= host) u.erase(host, at + 1 - host);
    }
    out += (out.empty() ? "" : ",") + u;
    if (comma == urls.size()) break;
    from = comma + 1;
  }
  return out;
}

namespace {
[[noreturn, maybe_unused]] void not_built(const char* name, const char* library, const char* package) {
  usage(
      fmt::format("--publisher {}: this {} was built without the {} publisher (build idem with {} installed: "
                  "apt-get install {})",
                  name, program, library, package, package));
}
}  // namespace

Built build_publisher(const Settings& s) {
  if (s.publisher == "redis") {
    if (s.redis.empty()) usage("--publisher redis needs --redis URL (or IDEM_RELAY_REDIS)");
    idem::RedisStreamsPublisherOptions po;
    po.redis.url = s.redis;
    po.stream_prefix = s.stream_prefix;
    po.maxlen = s.maxlen;
    return {std::make_unique<idem::RedisStreamsPublisher>(po), "Redis " + without_credentials(s.redis)};
  }
  if (s.publisher == "kafka") {
#ifdef IDEM_RELAY_WITH_KAFKA
    if (s.kafka_brokers.empty())
      usage("--publisher kafka needs --kafka-brokers HOST:PORT[,...] (or IDEM_RELAY_KAFKA_BROKERS)");
    idem::KafkaPublisherOptions po;
    po.brokers = s.kafka_brokers;
    for (const auto& p : s.kafka_properties) {
      const auto eq = p.find('=');
      po.config.emplace_back(p.substr(0, eq), p.substr(eq + 1));  // the validator made sure there is one
    }
    po.timeout = idem::millis{s.kafka_timeout_ms};
    po.client_id = s.kafka_client_id;
    return {std::make_unique<idem::KafkaPublisher>(std::move(po)), "Kafka " + s.kafka_brokers};
#else
    not_built("kafka", "Kafka", "librdkafka-dev");
#endif
  }
  if (s.publisher == "rabbitmq") {
#ifdef IDEM_RELAY_WITH_RABBITMQ
    if (s.rabbitmq_url.empty())
      usage("--publisher rabbitmq needs --rabbitmq-url amqp[s]://... (or IDEM_RELAY_RABBITMQ_URL)");
    idem::RabbitMqPublisherOptions po;
    // The fields first: the URL replaces those it has (user, password, vhost, host, port).
    if (!s.rabbitmq_user.empty()) po.user = s.rabbitmq_user;
    if (!s.rabbitmq_password.empty()) po.password = s.rabbitmq_password;
    po.url = s.rabbitmq_url;
    po.ca_file = s.rabbitmq_ca_file;
    po.cert_file = s.rabbitmq_cert_file;
    po.key_file = s.rabbitmq_key_file;
    po.verify_peer = s.rabbitmq_verify_peer;
    po.verify_hostname = s.rabbitmq_verify_hostname;
    po.timeout = idem::millis{s.rabbitmq_timeout_ms};
    po.key_header = s.rabbitmq_key_header;
    return {std::make_unique<idem::RabbitMqPublisher>(std::move(po)),
            "RabbitMQ " + without_credentials(s.rabbitmq_url)};
#else
    not_built("rabbitmq", "RabbitMQ", "librabbitmq-dev");
#endif
  }
  // nats (the validator admits nothing else)
#ifdef IDEM_RELAY_WITH_NATS
  if (s.nats_url.empty()) usage("--publisher nats needs --nats-url nats://HOST:PORT[,...] (or IDEM_RELAY_NATS_URL)");
  idem::NatsPublisherOptions po;
  po.url = s.nats_url;
  po.subject_prefix = s.nats_subject_prefix;
  po.expect_stream = s.nats_expect_stream;
  po.timeout = idem::millis{s.nats_timeout_ms};
  return {std::make_unique<idem::NatsPublisher>(std::move(po)), "NATS " + without_credentials(s.nats_url)};
#else
  not_built("nats", "NATS", "libnats-dev");
#endif
}

}  // namespace idem_relay
