// A downstream project: it only knows find_package(idem) and the public headers (the umbrellas).
#include <idem/idem.hpp>
#ifdef CONSUMER_HAS_REDIS
#include <idem/redis.hpp>
#endif
#ifdef CONSUMER_HAS_POSTGRES
#include <idem/postgres.hpp>
#endif
#ifdef CONSUMER_HAS_HTTP
#include <idem/http/endpoint.hpp>
#endif
#ifdef CONSUMER_HAS_HTTP_HTTPLIB  // the exported adapter targets bring their framework along
#include <idem/http/httplib.hpp>
#endif
#ifdef CONSUMER_HAS_HTTP_BEAST
#include <idem/http/beast.hpp>
#endif
#ifdef CONSUMER_HAS_PQXX  // brings libpqxx's headers and library along
#include <idem/pqxx.hpp>
#endif
// The other components: each target's headers and link line (its client libraries) must resolve.
#ifdef CONSUMER_HAS_ASIO
#include <idem/asio/redis_store.hpp>
#endif
#ifdef CONSUMER_HAS_TIERED
#include <idem/tiered.hpp>
#endif
#ifdef CONSUMER_HAS_OUTBOX
#include <idem/outbox/relay.hpp>
#endif
#ifdef CONSUMER_HAS_OUTBOX_KAFKA
#include <idem/outbox/kafka_publisher.hpp>
#endif
#ifdef CONSUMER_HAS_OUTBOX_RABBITMQ
#include <idem/outbox/rabbitmq_publisher.hpp>
#endif
#ifdef CONSUMER_HAS_OUTBOX_NATS
#include <idem/outbox/nats_publisher.hpp>
#endif
#ifdef CONSUMER_HAS_KAFKA
#include <idem/kafka/source.hpp>
#endif
#ifdef CONSUMER_HAS_RABBITMQ
#include <idem/rabbitmq/consumer.hpp>
#endif
#ifdef CONSUMER_HAS_NATS
#include <idem/nats/consumer.hpp>
#endif
#ifdef CONSUMER_HAS_PROMETHEUS
#include <idem/prometheus/observer.hpp>
#endif
#ifdef CONSUMER_HAS_SQLITE
#include <idem/sqlite.hpp>
#endif

#include <cstdio>
#include <string>
#include <type_traits>

int main() {
  idem::MemoryStore store;
  idem::IdempotencyGuard guard(store);
  int effects = 0;
  auto a = guard.run("order-1", [&] { return ++effects; });
  auto b = guard.run("order-1", [&] { return ++effects; });
  std::printf("idem %s: %s then %s, effects=%d\n", idem::version_string, idem::to_string(a.status).data(),
              idem::to_string(b.status).data(), effects);
  bool ok = a.status == idem::Status::executed && b.status == idem::Status::duplicate && effects == 1;
#ifdef CONSUMER_HAS_HTTP
  idem::http::Endpoint<idem::MemoryStore> endpoint(guard);
  idem::http::Request req;
  req.method = "POST";
  req.target = "/charges";
  req.headers.emplace_back("Idempotency-Key", "\"k-1\"");
  auto charge = [&](const idem::http::Request&) { return idem::http::Response{201, {}, "charged"}; };
  const auto first = endpoint.handle(req, charge);
  const auto again = endpoint.handle(req, charge);
  std::printf("http: %d then %d (replayed: %s)\n", first.status, again.status,
              std::string(again.header("Idempotent-Replayed")).c_str());
  ok = ok && first.status == 201 && again.header("Idempotent-Replayed") == "true";
#endif
#ifdef CONSUMER_HAS_HTTP_HTTPLIB
  httplib::Request hr;
  hr.method = "POST";
  ok = ok && idem::http::from_httplib(hr).method == "POST";
  std::printf("http_httplib: linked\n");
#endif
#ifdef CONSUMER_HAS_HTTP_BEAST
  idem::http::beast_request br{boost::beast::http::verb::post, "/charges", 11};
  ok = ok && idem::http::from_beast(br).target == "/charges";
  std::printf("http_beast: linked\n");
#endif
#ifdef CONSUMER_HAS_PQXX
  static_assert(std::is_base_of_v<idem::JoinedConnection, idem::pqxx::Connection>);
  // encrypt_password lives in libpqxx: the link line idem::pqxx brings must name it.
  ok = ok && !pqxx::encrypt_password("u", "p").empty();
  std::printf("pqxx: linked (libpqxx %s)\n", PQXX_VERSION);
#endif
  std::string parts;
#ifdef CONSUMER_HAS_ASIO
  static_assert(sizeof(idem::AsyncRedisStore) > 0);
  parts += " asio";
#endif
#ifdef CONSUMER_HAS_TIERED
  static_assert(sizeof(idem::TieredStore) > 0);
  parts += " tiered";
#endif
#ifdef CONSUMER_HAS_OUTBOX
  static_assert(sizeof(idem::OutboxRelay) > 0);
  parts += " outbox";
#endif
#ifdef CONSUMER_HAS_OUTBOX_KAFKA
  static_assert(sizeof(idem::KafkaPublisher) > 0);
  parts += " outbox_kafka";
#endif
#ifdef CONSUMER_HAS_OUTBOX_RABBITMQ
  static_assert(sizeof(idem::RabbitMqPublisher) > 0);
  parts += " outbox_rabbitmq";
#endif
#ifdef CONSUMER_HAS_OUTBOX_NATS
  static_assert(sizeof(idem::NatsPublisher) > 0);
  parts += " outbox_nats";
#endif
#ifdef CONSUMER_HAS_KAFKA
  static_assert(sizeof(idem::kafka::Source) > 0);
  parts += " kafka";
#endif
#ifdef CONSUMER_HAS_RABBITMQ
  static_assert(sizeof(idem::RabbitConsumer) > 0);
  parts += " rabbitmq";
#endif
#ifdef CONSUMER_HAS_NATS
  static_assert(sizeof(idem::NatsConsumer) > 0);
  parts += " nats";
#endif
#ifdef CONSUMER_HAS_PROMETHEUS
  static_assert(sizeof(idem::PrometheusObserver) > 0);
  parts += " prometheus";
#endif
#ifdef CONSUMER_HAS_SQLITE
  // Refused before SQLite opens anything, but linked through libidem_sqlite and libsqlite3.
  try {
    idem::SqliteStore sq{idem::SqliteOptions{}};
    ok = false;
  } catch (const idem::invalid_options_error&) {
  }
  parts += " sqlite";
#endif
  std::printf("components linked:%s\n", parts.c_str());
#ifdef CONSUMER_OWN_FMT
  std::printf("built on the parent's own fmt::fmt\n");
#endif
  return ok ? 0 : 1;
}
