// NatsPublisher (include/idem/outbox/nats_publisher.hpp) on a real nats-server -js: a batch the
// relay publishes twice is stored once (Nats-Msg-Id = the outbox id); failures are publish_errors
// that say whether the relay's retry helps.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "idem/outbox/nats_publisher.hpp"
#include "nats_server.hpp"

using idem::test::nats::Client;
using idem::test::nats::NatsServer;

namespace {

NatsServer& server() {
  static NatsServer s;
  return s;
}

}  // namespace

TEST_CASE("NatsPublisher: a re-sent batch is dropped by the server on its Nats-Msg-Id, each message stored once") {
  Client client(server().url());
  client.add_stream("OUTBOX", "out.>");
  idem::NatsPublisher publisher({.url = server().url(), .subject_prefix = "out.", .expect_stream = "OUTBOX"});
  std::vector<idem::OutboxMessage> batch;
  for (int i = 0; i < 3; ++i)
    batch.push_back({.id = "order-7:" + std::to_string(i), .destination = "payments", .message_key = "acct-1",
                     .payload = "p" + std::to_string(i), .headers = {{"trace", "t-1"}}});
  publisher.publish(batch);
  publisher.publish(batch);  // the relay did not learn of the first send and sends again
  CHECK(client.stream_messages("OUTBOX") == 3);
  CHECK(publisher.duplicates() == 3);
  CHECK(publisher.name() == "nats");

  natsMsg* m = client.stream_message("OUTBOX", 2);
  auto header = [&](const char* name) {
    const char* v = nullptr;
    return natsMsgHeader_Get(m, name, &v) == NATS_OK ? std::string(v) : std::string("<none>");
  };
  CHECK(std::string(natsMsg_GetSubject(m)) == "out.payments");
  CHECK(std::string(natsMsg_GetData(m), static_cast<std::size_t>(natsMsg_GetDataLength(m))) == "p1");
  CHECK(header("Nats-Msg-Id") == "order-7:1");
  CHECK(header("idem-outbox-id") == "order-7:1");  // what idem::consume keys on by default
  CHECK(header("Idem-Message-Key") == "acct-1");
  CHECK(header("trace") == "t-1");
  natsMsg_Destroy(m);
}

TEST_CASE("NatsPublisher: failures are publish_errors saying whether a retry helps") {
  CHECK_THROWS_AS(idem::NatsPublisher({.url = ""}), idem::invalid_options_error);
  CHECK_THROWS_AS(idem::NatsPublisher({.url = server().url(), .timeout = idem::millis{0}}), idem::invalid_options_error);
  const std::vector<idem::OutboxMessage> one{{.id = "x-1", .destination = "nowhere.at.all", .payload = "p"}};

  // No stream captures the subject: retryable (a stream may be added), and the message says so.
  idem::NatsPublisher unrouted({.url = server().url(), .timeout = idem::millis{1000}});
  try {
    unrouted.publish(one);
    FAIL("published to a subject no stream captures");
  } catch (const idem::publish_error& e) {
    CHECK(e.retryable());
    CHECK_THAT(e.what(), Catch::Contains("no stream captures"));
  }

  // No server: retryable.
  idem::NatsPublisher nowhere({.url = "nats://127.0.0.1:" + std::to_string(idem::test::nats::free_port()),
                               .timeout = idem::millis{500}});
  try {
    nowhere.publish(one);
    FAIL("published without a server");
  } catch (const idem::publish_error& e) {
    CHECK(e.retryable());
  }
}
