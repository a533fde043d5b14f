// RabbitMqPublisher against a real rabbitmq-server (tests/support/rabbitmq_broker.sh): confirmed
// batches read back with basic.get (message_id, headers, persistence, order), exchange/routing-key
// destinations, unroutable messages and missing exchanges refused, a broker outage and its end.

#include <catch2/catch.hpp>

#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "idem/outbox/rabbitmq_publisher.hpp"
#include "rabbitmq_support.hpp"

using namespace std::chrono_literals;
using idem::test::AmqpAdmin;
using idem::test::RabbitBroker;

namespace {

std::string unique(const std::string& base) { return base + "." + std::to_string(::getpid()); }

std::vector<idem::OutboxMessage> make_batch(const std::string& destination, int n, const std::string& tag) {
  std::vector<idem::OutboxMessage> out;
  for (int i = 0; i < n; ++i) {
    idem::OutboxMessage m;
    m.id = tag + "-" + std::to_string(i);
    m.destination = destination;
    m.message_key = "key-" + std::to_string(i % 3);
    m.payload = "body " + std::to_string(i) + std::string("\0\xff", 2);
    m.headers = {{"content-kind", "test"}, {"n", std::to_string(i)}};
    m.sequence = i + 1;
    out.push_back(std::move(m));
  }
  return out;
}

idem::RabbitMqPublisherOptions options_for(int port, std::chrono::milliseconds timeout = 10s) {
  idem::RabbitMqPublisherOptions o;
  o.port = port;
  o.timeout = timeout;
  return o;
}

}  // namespace

TEST_CASE("RabbitMqPublisher: a confirmed batch is in the queue with message_id, headers, persistence and order",
          "[rabbitmq]") {
  auto broker = RabbitBroker::shared();
  AmqpAdmin admin(broker->port());
  const std::string q = unique("outbox.plain");
  admin.declare_queue(q);
  idem::RabbitMqPublisher pub(options_for(broker->port()));
  CHECK(pub.name() == "rabbitmq");
  const auto batch = make_batch(q, 300, "a");
  pub.publish(batch);
  pub.publish({});
  // Confirmed means enqueued: no wait needed before reading.
  const auto got = admin.drain(q);
  REQUIRE(got.size() == batch.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CHECK(got[i].message_id == batch[i].id);
    CHECK(got[i].body == batch[i].payload);
    CHECK(got[i].delivery_mode == 2);
    CHECK(got[i].header("content-kind") == "test");
    CHECK(got[i].header("n") == std::to_string(i));
    CHECK(got[i].header("idem-message-key") == batch[i].message_key);
    CHECK(got[i].header("idem-outbox-id") == batch[i].id);  // what idem::consume keys on by default
  }
  CHECK(pub.connections() == 1);
  admin.delete_queue(q);
}

TEST_CASE("RabbitMqPublisher: \"exchange/routing_key\" destinations go through the exchange", "[rabbitmq]") {
  auto broker = RabbitBroker::shared();
  AmqpAdmin admin(broker->port());
  const std::string q = unique("outbox.routed"), x = unique("outbox-x");
  admin.declare_queue(q);
  admin.declare_exchange(x);
  admin.bind(q, x, "eu/created");  // a routing key may hold '/': the split is at the first one
  idem::RabbitMqPublisher pub(options_for(broker->port()));
  pub.publish(make_batch(x + "/eu/created", 5, "r"));
  pub.publish(make_batch("/" + q, 2, "d"));  // a leading '/' = the default exchange, explicitly
  const auto got = admin.drain(q);
  REQUIRE(got.size() == 7);
  CHECK(got[0].exchange == x);
  CHECK(got[0].routing_key == "eu/created");
  CHECK(got[0].message_id == "r-0");
  CHECK(got[5].exchange.empty());
  CHECK(got[5].message_id == "d-0");
  admin.delete_queue(q);
}

TEST_CASE("RabbitMqPublisher: an unroutable message is not sent -> publish_error, the connection stays", "[rabbitmq]") {
  auto broker = RabbitBroker::shared();
  AmqpAdmin admin(broker->port());
  const std::string q = unique("outbox.some");
  admin.declare_queue(q);
  idem::RabbitMqPublisher pub(options_for(broker->port()));
  auto batch = make_batch(q, 6, "u");
  batch[3].destination = unique("no.such.queue");
  try {
    pub.publish(batch);
    FAIL("no publish_error");
  } catch (const idem::publish_error& e) {
    CHECK(e.retryable());  // a queue bound later lets it through
    const std::string what = e.what();
    CHECK(what.find("unroutable") != std::string::npos);
    CHECK(what.find("u-3") != std::string::npos);
  }
  // The routable ones of the batch did arrive: the relay sends them again and the consumer's
  // guard drops the copies (same message_id).
  CHECK(admin.drain(q).size() == 5);
  pub.publish(make_batch(q, 4, "after"));
  CHECK(admin.drain(q).size() == 4);
  CHECK(pub.connections() == 1);
  admin.delete_queue(q);
}

TEST_CASE("RabbitMqPublisher: a missing exchange -> publish_error, the next publish reconnects", "[rabbitmq]") {
  auto broker = RabbitBroker::shared();
  AmqpAdmin admin(broker->port());
  const std::string q = unique("outbox.after-404");
  admin.declare_queue(q);
  idem::RabbitMqPublisher pub(options_for(broker->port()));
  try {
    pub.publish(make_batch(unique("no-such-exchange") + "/k", 3, "x"));
    FAIL("no publish_error");
  } catch (const idem::publish_error& e) {
    CHECK(e.retryable());
    CHECK(std::string(e.what()).find("404") != std::string::npos);
  }
  pub.publish(make_batch(q, 3, "y"));
  CHECK(admin.drain(q).size() == 3);
  CHECK(pub.connections() == 2);
  admin.delete_queue(q);
}

// A real node halted and resumed (~20 s): in the dev build only; sanitizers add nothing to it here.
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
TEST_CASE("RabbitMqPublisher: broker stopped -> publish_error, broker back -> the batch goes", "[rabbitmq][outage]") {
  auto broker = RabbitBroker::start_private();
  const std::string q = unique("outbox.outage");
  {
    AmqpAdmin admin(broker->port());
    admin.declare_queue(q);  // durable: it survives the restart
  }
  idem::RabbitMqPublisher pub(options_for(broker->port(), 3s));
  pub.publish(make_batch(q, 2, "before"));

  broker->halt();
  const auto batch = make_batch(q, 10, "during");
  for (int i = 0; i < 2; ++i) {  // the old connection breaks, then no connection can be made
    const auto t0 = std::chrono::steady_clock::now();
    try {
      pub.publish(batch);
      FAIL("no publish_error while the broker is down");
    } catch (const idem::publish_error& e) {
      CHECK(e.retryable());
    }
    CHECK(std::chrono::steady_clock::now() - t0 < 8s);
  }

  broker->resume();
  pub.publish(batch);
  AmqpAdmin admin(broker->port());
  const auto got = admin.drain(q);
  REQUIRE(got.size() == 12);  // persistent messages of a durable queue survive the restart
  CHECK(got[0].message_id == "before-0");
  CHECK(got[2].message_id == "during-0");
  CHECK(got[11].message_id == "during-9");
  CHECK(pub.connections() == 2);
}

#endif

TEST_CASE("RabbitMqPublisher: nothing listening -> publish_error (retryable), bad options refused", "[rabbitmq]") {
  idem::RabbitMqPublisher pub(options_for(1, 1s));  // nothing listens on port 1
  REQUIRE_THROWS_AS(pub.publish(make_batch("q", 1, "n")), idem::publish_error);
  auto bad = [](auto change) {
    auto o = options_for(5672);
    change(o);
    return o;
  };
  using idem::invalid_options_error;
  CHECK_THROWS_AS(idem::RabbitMqPublisher(bad([](auto& o) { o.port = 0; })), invalid_options_error);
  CHECK_THROWS_AS(idem::RabbitMqPublisher(bad([](auto& o) { o.host.clear(); })), invalid_options_error);
  CHECK_THROWS_AS(idem::RabbitMqPublisher(bad([](auto& o) { o.timeout = 0ms; })), invalid_options_error);
  CHECK_THROWS_AS(idem::RabbitMqPublisher(bad([](auto& o) { o.key_header.clear(); })), invalid_options_error);
  idem::RabbitMqPublisher long_dest(options_for(1, 1s));
  try {
    long_dest.publish(make_batch(std::string(300, 'q'), 1, "l"));
    FAIL("no publish_error");
  } catch (const idem::publish_error& e) {
    CHECK_FALSE(e.retryable());
  }
  idem::RabbitMqPublisher moved(std::move(long_dest));
  CHECK_THROWS_AS(long_dest.publish({}), idem::usage_error);  // NOLINT(bugprone-use-after-move)
}

TEST_CASE("RabbitMqPublisher: a wrong password -> publish_error naming the login", "[rabbitmq]") {
  auto broker = RabbitBroker::shared();
  auto o = options_for(broker->port(), 5s);
  o.password = "not-the-password";
  idem::RabbitMqPublisher pub(o);
  try {
    pub.publish(make_batch("q", 1, "p"));
    FAIL("no publish_error");
  } catch (const idem::publish_error& e) {
    CHECK(std::string(e.what()).find("login") != std::string::npos);
    CHECK(std::string(e.what()).find("not-the-password") == std::string::npos);
  }
}
