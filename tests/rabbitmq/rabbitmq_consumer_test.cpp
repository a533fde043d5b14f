// RabbitConsumer (include/idem/rabbitmq/consumer.hpp) against a real rabbitmq-server (the outbox
// tests' broker fixture, tests/support/rabbitmq_broker.sh): every payment applied once across two
// consumers, the poison and the id-less message dead-lettered once, a delayed requeue coming back
// after its delay, deliveries of a consumer that went away (and of a channel the broker closed)
// redelivered and answered as duplicates, and a connection killed mid-prefetch (a proxy cuts it).
// As an idem::Source: idem::consume with duplicates and a poison message (dead-lettered with its
// reason and original headers), headers and timestamp through Delivery, a delayed requeue that
// keeps them and counts the attempt, a released batch nacked back, and every verdict's broker action.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <csignal>

#include <sys/wait.h>

#include "idem/idem.hpp"
#include "idem/rabbitmq/consumer.hpp"
#include "rabbitmq_support.hpp"
#include "support/tcp_proxy.hpp"

using namespace std::chrono_literals;

namespace {

std::string random_name(const char* stem) {
  static std::mt19937_64 rng{std::random_device{}()};
  return std::string(stem) + "-" + std::to_string(rng() % 1'000'000'000);
}

// Publishes with a message-id (or none), persistent, to the default exchange.
class Publisher {
public:
  explicit Publisher(int port) : conn_(amqp_new_connection()) {
    amqp_socket_t* sock = amqp_tcp_socket_new(conn_);
    timeval tv{5, 0};
    if (!sock || amqp_socket_open_noblock(sock, "127.0.0.1", port, &tv) != AMQP_STATUS_OK)
      throw std::runtime_error("publisher: cannot connect");
    if (amqp_login(conn_, "/", 0, 131072, 0, AMQP_SASL_METHOD_PLAIN, "guest", "guest").reply_type != AMQP_RESPONSE_NORMAL)
      throw std::runtime_error("publisher: login");
    amqp_channel_open(conn_, 1);
    if (amqp_get_rpc_reply(conn_).reply_type != AMQP_RESPONSE_NORMAL) throw std::runtime_error("publisher: channel");
  }
  ~Publisher() {
    amqp_channel_close(conn_, 1, AMQP_REPLY_SUCCESS);
    amqp_connection_close(conn_, AMQP_REPLY_SUCCESS);
    amqp_destroy_connection(conn_);
  }
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;
  // A message with every property the Source tests look at.
  struct Full {
    std::string id, body, content_type;
    std::optional<std::uint64_t> timestamp;                     // seconds
    std::vector<std::pair<std::string, std::string>> text;       // long-string headers
    bool typed = false;  // also n (i32 42), big (i64 -7), flag (bool true), price (decimal 123.45), list (array)
  };
  void send(const std::string& queue, const Full& m) {
    amqp_basic_properties_t p{};
    p._flags = AMQP_BASIC_DELIVERY_MODE_FLAG;
    p.delivery_mode = 2;
    if (!m.id.empty()) {
      p._flags |= AMQP_BASIC_MESSAGE_ID_FLAG;
      p.message_id = amqp_cstring_bytes(m.id.c_str());
    }
    if (!m.content_type.empty()) {
      p._flags |= AMQP_BASIC_CONTENT_TYPE_FLAG;
      p.content_type = amqp_cstring_bytes(m.content_type.c_str());
    }
    if (m.timestamp) {
      p._flags |= AMQP_BASIC_TIMESTAMP_FLAG;
      p.timestamp = *m.timestamp;
    }
    std::vector<amqp_table_entry_t> e;
    for (const auto& [k, v] : m.text) {
      amqp_table_entry_t x{};
      x.key = amqp_cstring_bytes(k.c_str());
      x.value.kind = AMQP_FIELD_KIND_UTF8;
      x.value.value.bytes = amqp_cstring_bytes(v.c_str());
      e.push_back(x);
    }
    amqp_field_value_t item{};
    item.kind = AMQP_FIELD_KIND_UTF8;
    item.value.bytes = amqp_cstring_bytes("a");
    if (m.typed) {
      amqp_table_entry_t x{};
      x.key = amqp_cstring_bytes("n");
      x.value.kind = AMQP_FIELD_KIND_I32;
      x.value.value.i32 = 42;
      e.push_back(x);
      x = {};
      x.key = amqp_cstring_bytes("big");
      x.value.kind = AMQP_FIELD_KIND_I64;
      x.value.value.i64 = -7;
      e.push_back(x);
      x = {};
      x.key = amqp_cstring_bytes("flag");
      x.value.kind = AMQP_FIELD_KIND_BOOLEAN;
      x.value.value.boolean = 1;
      e.push_back(x);
      x = {};
      x.key = amqp_cstring_bytes("price");
      x.value.kind = AMQP_FIELD_KIND_DECIMAL;
      x.value.value.decimal = {2, 12345};
      e.push_back(x);
      x = {};
      x.key = amqp_cstring_bytes("list");
      x.value.kind = AMQP_FIELD_KIND_ARRAY;
      x.value.value.array = amqp_array_t{1, &item};
      e.push_back(x);
    }
    if (!e.empty()) {
      p._flags |= AMQP_BASIC_HEADERS_FLAG;
      p.headers = amqp_table_t{static_cast<int>(e.size()), e.data()};
    }
    if (amqp_basic_publish(conn_, 1, amqp_empty_bytes, amqp_cstring_bytes(queue.c_str()), 0, 0, &p,
                           amqp_bytes_t{m.body.size(), const_cast<char*>(m.body.data())}) != AMQP_STATUS_OK)
      throw std::runtime_error("publisher: basic.publish");
  }
  void send(const std::string& queue, const std::string& id, const std::string& body) {
    amqp_basic_properties_t p{};
    p._flags = AMQP_BASIC_DELIVERY_MODE_FLAG;
    p.delivery_mode = 2;
    if (!id.empty()) {
      p._flags |= AMQP_BASIC_MESSAGE_ID_FLAG;
      p.message_id = amqp_cstring_bytes(id.c_str());
    }
    if (amqp_basic_publish(conn_, 1, amqp_empty_bytes, amqp_cstring_bytes(queue.c_str()), 0, 0, &p,
                           amqp_cstring_bytes(body.c_str())) != AMQP_STATUS_OK)
      throw std::runtime_error("publisher: basic.publish");
  }

private:
  amqp_connection_state_t conn_;
};

// next() until the consumer says its connection is gone (a retryable connection_error), up to 5 s.
bool loses_connection(idem::RabbitConsumer& c) {
  for (int i = 0; i < 50; ++i) {
    try {
      (void)c.next(100ms);
    } catch (const idem::connection_error& e) {
      return e.retryable();
    }
  }
  return false;
}

idem::RabbitConsumerOptions options(int port, const std::string& queue) {
  idem::RabbitConsumerOptions o;
  o.port = port;
  o.queue = queue;
  o.prefetch = 20;
  o.retry.cap = 300ms;
  return o;
}

std::string header(const idem::RabbitDelivery& d, std::string_view name) {
  const std::string* v = d.header(name);
  return v ? *v : std::string("<none>");
}

// The dead letters in `<queue>.dlq`, read with a RabbitConsumer (every property and header), acked.
std::vector<idem::RabbitDelivery> dead_letters(int port, const std::string& queue, std::size_t expected) {
  auto o = options(port, queue + ".dlq");
  o.declare = false;
  idem::RabbitConsumer reader(o);
  std::vector<idem::RabbitDelivery> out;
  while (out.size() < expected) {
    auto d = reader.next(3s);
    if (!d) break;
    reader.settle(*d, {idem::BrokerAction::ack, {}});
    out.push_back(std::move(*d));
  }
  if (auto extra = reader.next(100ms)) out.push_back(std::move(*extra));  // one too many is a failure
  return out;
}

constexpr std::uint64_t kStamp = 1'700'000'000;  // 2023-11-14, a whole second

void check_original(const idem::RabbitDelivery& d, const std::string& id) {
  CHECK(d.message_id == id);
  CHECK(d.content_type == "application/x-payment");
  REQUIRE(d.timestamp);
  CHECK(d.timestamp->time_since_epoch() == std::chrono::seconds(kStamp));
  CHECK(header(d, "tenant") == "t1");
  CHECK(header(d, "n") == "42");
  CHECK(header(d, "price") == "123.45");
}

}  // namespace

TEST_CASE("RabbitConsumer: bad options are refused at construction, naming the field") {
  auto refused = [](idem::RabbitConsumerOptions o, const char* field) {
    try {
      idem::RabbitConsumer c(std::move(o));
      FAIL("accepted");
    } catch (const idem::invalid_options_error& e) {
      CHECK_THAT(e.what(), Catch::Contains(field));
    }
  };
  idem::RabbitConsumerOptions o;
  refused(o, "queue");
  o.queue = "q";
  o.prefetch = 0;
  refused(o, "prefetch");
  o.prefetch = 10;
  o.batch = 11;
  refused(o, "batch");  // more than prefetch (0, the default, takes min(32, prefetch))
  o.batch = 0;
  o.retry.cap = 1ms;
  o.retry.base = 5ms;
  refused(o, "retry");
}

TEST_CASE("RabbitConsumer: two consumers, duplicates and a poison message: every payment once, dead letters once") {
  auto broker = idem::test::RabbitBroker::shared();
  const std::string q = random_name("pay");
  idem::MemoryStore store;
  idem::IdempotencyGuard guard{store, {.lease = 5s, .failure = {.mode = idem::FailureMode::record, .max_attempts = 2,
                                                                 .backoff = 0ms, .max_backoff = 0ms}}};
  std::mutex mu;
  std::map<std::string, int> applied;
  auto handle = [&](idem::RabbitConsumer& c, const idem::RabbitDelivery& d) -> idem::RabbitDecision {
    if (d.message_id.empty()) return {idem::BrokerAction::dead_letter, {}};  // no key: never guess one
    try {
      auto out = guard.run(d.message_id, d.body, [&] {
        if (d.body == "poison") throw std::runtime_error("poison payment");
        std::lock_guard lk(mu);
        return ++applied[d.message_id];
      });
      return c.decide(out);
    } catch (...) {
      return c.decide(std::current_exception());
    }
  };
  idem::RabbitConsumer a(options(broker->port(), q)), b(options(broker->port(), q));  // declares the topology
  constexpr int events = 300;
  {
    Publisher pub(broker->port());
    std::mt19937_64 rng(11);
    for (int i = 0; i < events; ++i) {
      pub.send(q, "ev-" + std::to_string(i), "body-" + std::to_string(i));
      if (rng() % 5 == 0) pub.send(q, "ev-" + std::to_string(i), "body-" + std::to_string(i));
    }
    pub.send(q, "poison-1", "poison");
    pub.send(q, "", "no id");
  }
  std::stop_source stop;
  std::thread ta([&] { a.run(stop.get_token(), [&](const idem::RabbitDelivery& d) { return handle(a, d); }); });
  std::thread tb([&] { b.run(stop.get_token(), [&](const idem::RabbitDelivery& d) { return handle(b, d); }); });
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  auto dead = [&] { return a.stats().dead_lettered + b.stats().dead_lettered; };
  while (std::chrono::steady_clock::now() < deadline) {
    {
      std::lock_guard lk(mu);
      if (applied.size() == events && dead() == 2) break;
    }
    std::this_thread::sleep_for(20ms);
  }
  std::this_thread::sleep_for(300ms);  // the duplicates still queued behind
  stop.request_stop();
  ta.join();
  tb.join();
  CHECK(applied.size() == events);
  for (const auto& [id, n] : applied) CHECK(n == 1);
  idem::test::AmqpAdmin admin(broker->port());
  const auto dlq = admin.drain(q + ".dlq");
  REQUIRE(dlq.size() == 2);
  CHECK(admin.drain(q).empty());
  INFO("requeued: " << a.stats().requeued + b.stats().requeued);
  CHECK(a.stats().delivered + b.stats().delivered >= events + 2);
}

TEST_CASE("RabbitConsumer: a delayed requeue comes back after its delay, a lost consumer's and a closed channel's "
          "deliveries are redelivered and answered as duplicates") {
  auto broker = idem::test::RabbitBroker::shared();
  const std::string q = random_name("redo");
  idem::MemoryStore store;
  idem::IdempotencyGuard guard{store, {.lease = 5s}};
  std::map<std::string, int> applied;
  auto run = [&](const idem::RabbitDelivery& d) {
    return guard.run(d.message_id, d.body, [&] { return ++applied[d.message_id]; });
  };
  idem::RabbitConsumer c(options(broker->port(), q));
  Publisher pub(broker->port());

  // Requeued with 300 ms: through the delay queue, back in the queue after about that long.
  pub.send(q, "later", "x");
  auto first = c.next(5s);
  REQUIRE(first);
  const auto t0 = std::chrono::steady_clock::now();
  c.settle(*first, {idem::BrokerAction::requeue, 300ms});
  auto again = c.next(5s);
  REQUIRE(again);
  CHECK(again->message_id == "later");
  CHECK(std::chrono::steady_clock::now() - t0 >= 250ms);
  c.settle(*again, {idem::BrokerAction::ack, {}});

  // A consumer that ran its handlers and went away before acking: the broker redelivers to the
  // next (on a queue of their own, so `c` takes none of them).
  const std::string q2 = random_name("gone");
  idem::test::AmqpAdmin(broker->port()).declare_queue(q2);
  for (int i = 0; i < 10; ++i) pub.send(q2, "m-" + std::to_string(i), "b");
  auto o2 = options(broker->port(), q2);
  o2.declare = false;  // a plain queue: no dead letters or delays in this part
  {
    idem::RabbitConsumer gone(o2);
    for (int i = 0; i < 10; ++i) {
      auto d = gone.next(5s);
      REQUIRE(d);
      CHECK(run(*d).status == idem::Status::executed);  // the effect, never acked
    }
  }
  idem::RabbitConsumer next_one(o2);
  int duplicates = 0;
  for (int i = 0; i < 10; ++i) {
    auto d = next_one.next(5s);
    REQUIRE(d);
    CHECK(d->redelivered);
    const auto out = run(*d);
    if (out.status == idem::Status::duplicate) ++duplicates;
    next_one.settle(*d, next_one.decide(out));
  }
  CHECK(duplicates == 10);

  // The broker closes the channel (an ack of a tag it never delivered): the next call says so,
  // retryable; the one after reconnects and gets the unacked delivery again.
  pub.send(q, "held", "b");
  auto held = c.next(5s);
  REQUIRE(held);
  CHECK(run(*held).status == idem::Status::executed);
  auto bogus = *held;
  bogus.tag += 1000;
  c.settle(bogus, {idem::BrokerAction::ack, {}});
  REQUIRE(loses_connection(c));
  c.settle(*held, {idem::BrokerAction::ack, {}});  // its connection is gone: answered by nobody
  auto back = c.next(5s);
  REQUIRE(back);
  CHECK(back->message_id == "held");
  CHECK(run(*back).status == idem::Status::duplicate);
  c.settle(*back, {idem::BrokerAction::ack, {}});
  CHECK(c.stats().reconnects == 1);
  for (const auto& [id, n] : applied) CHECK(n == 1);
}

#ifdef IDEM_RABBITMQ_TEMPLATE
TEST_CASE("rabbitmq_consumer template: a consumer process applies each payment once and dead-letters two") {
  auto broker = idem::test::RabbitBroker::shared();
  const std::string q = random_name("tpl");
  { idem::RabbitConsumer declare(options(broker->port(), q)); }  // the topology, before anything is published
  {
    Publisher pub(broker->port());
    for (int i = 0; i < 200; ++i) {
      pub.send(q, "ev-" + std::to_string(i), "acct-" + std::to_string(i % 7) + ";" + std::to_string(i));
      if (i % 5 == 0) pub.send(q, "ev-" + std::to_string(i), "acct-" + std::to_string(i % 7) + ";" + std::to_string(i));
    }
    pub.send(q, "ev-poison", "poison;1");
    pub.send(q, "", "acct-1;5");
  }
  int out[2];
  REQUIRE(::pipe(out) == 0);
  const std::string port = std::to_string(broker->port());
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::dup2(out[1], 1);
    ::execl(IDEM_RABBITMQ_TEMPLATE, IDEM_RABBITMQ_TEMPLATE, "--port", port.c_str(), "--queue", q.c_str(), "--prefetch",
            "20", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(out[1]);
  idem::test::AmqpAdmin admin(broker->port());
  std::size_t dead = 0;
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (std::chrono::steady_clock::now() < deadline &&
         (dead < 2 || admin.ready(q) > 0 || admin.ready(q + ".delay") > 0)) {
    dead += admin.drain(q + ".dlq").size();
    std::this_thread::sleep_for(50ms);
  }
  std::this_thread::sleep_for(1s);  // what it holds (prefetched) is handled by now
  ::kill(pid, SIGTERM);
  std::string printed;
  char buf[512];
  for (ssize_t n; (n = ::read(out[0], buf, sizeof buf)) > 0;) printed.append(buf, static_cast<std::size_t>(n));
  ::close(out[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(dead == 2);  // the poison payment (after its two attempts) and the one without a message-id
  CHECK_THAT(printed, Catch::Contains("applied 200 payments to 7 accounts"));
}
#endif

TEST_CASE("RabbitConsumer: the connection killed mid-prefetch, the consumer reconnects and the unacked deliveries "
          "come back as duplicates") {
  auto broker = idem::test::RabbitBroker::shared();
  const std::string q = random_name("cut");
  idem::test::TcpProxy proxy{broker->port()};
  auto o = options(proxy.port(), q);
  idem::RabbitConsumer c(o);
  idem::MemoryStore store;
  idem::IdempotencyGuard guard{store, {.lease = 5s}};
  std::map<std::string, int> applied;
  auto run = [&](const idem::RabbitDelivery& d) {
    return guard.run(d.message_id, d.body, [&] { return ++applied[d.message_id]; });
  };
  Publisher pub(broker->port());
  for (int i = 0; i < 10; ++i) pub.send(q, "k-" + std::to_string(i), "b");
  // Five handled and acked, five handled (the effect done) and not yet acked when the link dies.
  std::vector<idem::RabbitDelivery> held;
  for (int i = 0; i < 10; ++i) {
    auto d = c.next(5s);
    REQUIRE(d);
    const auto out = run(*d);
    CHECK(out.status == idem::Status::executed);
    if (i < 5) c.settle(*d, c.decide(out));
    else held.push_back(*d);
  }
  proxy.cut_next_reply();
  pub.send(q, "k-10", "b");  // its delivery is what the proxy cuts: the connection closes under the consumer
  REQUIRE(loses_connection(c));
  for (const auto& d : held) c.settle(d, {idem::BrokerAction::ack, {}});  // their connection is gone: nothing sent
  int duplicates = 0, executed = 0;
  for (int i = 0; i < 6; ++i) {  // the five unacked come back, and k-10
    auto d = c.next(5s);
    REQUIRE(d);
    const auto out = run(*d);
    (out.status == idem::Status::duplicate ? duplicates : executed) += 1;
    c.settle(*d, c.decide(out));
  }
  CHECK(duplicates == 5);
  CHECK(executed == 1);
  CHECK(c.stats().reconnects == 1);
  CHECK(applied.size() == 11);
  for (const auto& [id, n] : applied) CHECK(n == 1);
}

static_assert(idem::Source<idem::RabbitConsumer>);

TEST_CASE("RabbitConsumer as a Source: batch and poll_wait are checked") {
  idem::RabbitConsumerOptions o;
  o.queue = "q";
  o.prefetch = 10;
  o.batch = 11;
  try {
    idem::RabbitConsumer c(o);
    FAIL("accepted");
  } catch (const idem::invalid_options_error& e) {
    CHECK_THAT(e.what(), Catch::Contains("batch"));
  }
  o.batch = 10;
  o.poll_wait = 0ms;
  try {
    idem::RabbitConsumer c(o);
    FAIL("accepted");
  } catch (const idem::invalid_options_error& e) {
    CHECK_THAT(e.what(), Catch::Contains("poll_wait"));
  }
}

TEST_CASE("RabbitConsumer as a Source: idem::consume with duplicates and a poison message applies every payment once "
          "and dead-letters the poison with its reason and original headers") {
  auto broker = idem::test::RabbitBroker::shared();
  const std::string q = random_name("src");
  auto o = options(broker->port(), q);
  o.poll_wait = 100ms;
  idem::RabbitConsumer c(o);
  constexpr int events = 60;
  {
    Publisher pub(broker->port());
    for (int i = 0; i < events; ++i) {
      pub.send(q, "ev-" + std::to_string(i), "body-" + std::to_string(i));
      if (i % 4 == 0) pub.send(q, "ev-" + std::to_string(i), "body-" + std::to_string(i));
    }
    pub.send(q, {.id = "poison-1", .body = "poison", .content_type = "application/x-payment", .timestamp = kStamp,
                 .text = {{"tenant", "t1"}}, .typed = true});
  }
  idem::MemoryStore store;
  idem::IdempotencyGuard guard{store, {.lease = 5s, .failure = {.mode = idem::FailureMode::record, .max_attempts = 2,
                                                                 .backoff = 0ms, .max_backoff = 0ms}}};
  std::mutex mu;
  std::map<std::string, int> applied;
  std::set<std::uint32_t> poison_attempts;
  std::stop_source stop;
  std::thread t([&] {
    idem::consume(c, guard, stop.get_token(), [&](const idem::Delivery& d) {
      std::lock_guard lk(mu);
      if (d.payload == "poison") {
        poison_attempts.insert(d.attempt);
        throw std::runtime_error("poison payment");
      }
      return ++applied[std::string(d.key)];
    }, {.retry = o.retry});
  });
  idem::test::AmqpAdmin admin(broker->port());
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (std::chrono::steady_clock::now() < deadline) {
    {
      std::lock_guard lk(mu);
      if (applied.size() == events && c.stats().dead_lettered == 1) break;
    }
    std::this_thread::sleep_for(20ms);
  }
  stop.request_stop();
  t.join();
  CHECK(applied.size() == events);
  for (const auto& [id, n] : applied) CHECK(n == 1);
  CHECK(c.stats().dead_lettered == 1);
  CHECK(poison_attempts.count(1) == 1);
  CHECK(poison_attempts.count(2) == 1);  // its delayed requeue counted through idem-attempt
  CHECK(admin.ready(q) == 0);
  const auto dlq = dead_letters(broker->port(), q, 1);
  REQUIRE(dlq.size() == 1);
  check_original(dlq[0], "poison-1");
  CHECK(dlq[0].body == "poison");
  CHECK(header(dlq[0], "idem-reason") == "failed permanently: poison payment");
  CHECK(header(dlq[0], "idem-queue") == q);
}

TEST_CASE("RabbitConsumer as a Source: headers and timestamp reach the handler, idem-outbox-id is the key") {
  auto broker = idem::test::RabbitBroker::shared();
  const std::string q = random_name("hdr");
  auto o = options(broker->port(), q);
  o.poll_wait = 100ms;
  idem::RabbitConsumer c(o);
  {
    Publisher pub(broker->port());
    // Two sends of one outbox row under different message ids (a relay re-send): one effect.
    pub.send(q, {.id = "mid-1", .body = "x", .content_type = "application/x-payment", .timestamp = kStamp,
                 .text = {{"tenant", "t1"}, {"idem-outbox-id", "ob-1"}}, .typed = true});
    pub.send(q, {.id = "mid-2", .body = "x", .text = {{"idem-outbox-id", "ob-1"}}});
  }
  idem::MemoryStore store;
  idem::IdempotencyGuard guard{store, {.lease = 5s}};
  std::vector<idem::Delivery> seen;  // copies of the views (only fields that own their data are kept)
  std::vector<std::map<std::string, std::string>> headers;
  std::vector<std::string> keys;
  int ran = 0;
  auto handler = [&](const idem::Delivery& d) {
    ++ran;
    std::map<std::string, std::string> h;
    for (const auto& [k, v] : d.headers) h[std::string(k)] = std::string(v);
    headers.push_back(std::move(h));
    keys.push_back(idem::key_of(d));
    idem::Delivery copy;
    copy.id = d.id;
    copy.timestamp = d.timestamp;
    copy.attempt = d.attempt;
    seen.push_back(std::move(copy));
    return 1;
  };
  std::size_t acked = 0;
  for (int i = 0; i < 50 && acked < 2; ++i) acked += idem::consume_batch(c, guard, handler).acked;
  CHECK(acked == 2);
  REQUIRE(ran == 1);  // the second is a duplicate of ob-1
  CHECK(keys[0] == "ob-1");
  REQUIRE(seen[0].timestamp);
  CHECK(seen[0].timestamp->time_since_epoch() == std::chrono::seconds(kStamp));
  CHECK(seen[0].attempt == 1);
  CHECK_FALSE(seen[0].id.empty());
  const auto& h = headers[0];
  CHECK(h.at("tenant") == "t1");
  CHECK(h.at("n") == "42");
  CHECK(h.at("big") == "-7");
  CHECK(h.at("flag") == "1");
  CHECK(h.at("price") == "123.45");
  CHECK(h.count("list") == 0);  // an array: not text
  CHECK(store.inspect("ob-1"));
  CHECK_FALSE(store.inspect("mid-1"));
  CHECK(c.stats().acked == 2);
}

TEST_CASE("RabbitConsumer as a Source: a delayed requeue keeps the properties and headers and counts the attempt, a "
          "released batch is nacked back by the next poll") {
  auto broker = idem::test::RabbitBroker::shared();
  const std::string q = random_name("again");
  auto o = options(broker->port(), q);
  o.poll_wait = 100ms;
  idem::RabbitConsumer c(o);
  {
    Publisher pub(broker->port());
    pub.send(q, {.id = "k-1", .body = "b", .content_type = "application/x-payment", .timestamp = kStamp,
                 .text = {{"tenant", "t1"}}, .typed = true});
  }
  auto poll_one = [&] {
    for (int i = 0; i < 30; ++i)
      if (auto batch = c.poll(); !batch.empty()) return batch;
    return std::vector<idem::RabbitDelivery>{};
  };
  auto batch = poll_one();
  REQUIRE(batch.size() == 1);
  CHECK(idem::RabbitConsumer::delivery(batch[0]).attempt == 1);
  for (std::uint32_t expected = 2; expected <= 3; ++expected) {
    const idem::Verdict requeue{.action = idem::BrokerAction::requeue, .delay = 150ms};
    const auto t0 = std::chrono::steady_clock::now();
    c.settle(std::span<const idem::Verdict>(&requeue, 1));
    batch = poll_one();
    REQUIRE(batch.size() == 1);
    CHECK(std::chrono::steady_clock::now() - t0 >= 100ms);
    check_original(batch[0], "k-1");
    CHECK(header(batch[0], "idem-attempt") == std::to_string(expected));
    CHECK(header(batch[0], "big") == "-7");
    CHECK(idem::RabbitConsumer::delivery(batch[0]).attempt == expected);
  }
  // Released: still unacked, the next poll nacks it back (redelivered: one more attempt).
  c.release();
  batch = poll_one();
  REQUIRE(batch.size() == 1);
  CHECK(batch[0].redelivered);
  CHECK(idem::RabbitConsumer::delivery(batch[0]).attempt == 4);
  CHECK(c.stats().released == 1);
  const idem::Verdict ack{};
  c.settle(std::span<const idem::Verdict>(&ack, 1));
  CHECK(c.poll().empty());
  CHECK_THROWS_AS(c.settle(std::span<const idem::Verdict>(&ack, 1)), idem::usage_error);  // nothing polled
  idem::test::AmqpAdmin admin(broker->port());
  CHECK(admin.ready(q) == 0);
  CHECK(admin.ready(q + ".delay") == 0);
}

TEST_CASE("RabbitConsumer: every status and exception kind maps to its broker action (issue 40)") {
  auto broker = idem::test::RabbitBroker::shared();
  const std::string q = random_name("verdicts");
  auto o = options(broker->port(), q);
  o.poll_wait = 100ms;
  o.retry = {.base = 50ms, .cap = 300ms, .jitter = false};
  idem::RabbitConsumer c(o);

  // The exceptions as the guard throws them.
  idem::MemoryStore store;
  idem::IdempotencyGuard guard{store};
  std::exception_ptr handler_error, bad_key;
  try {
    (void)guard.run("k", "p", []() -> int { throw std::runtime_error("handler broke"); });
  } catch (...) {
    handler_error = std::current_exception();
  }
  try {
    (void)guard.run("", "p", [] { return 1; });
  } catch (...) {
    bad_key = std::current_exception();
  }
  REQUIRE(handler_error);
  REQUIRE(bad_key);
  const auto store_down = std::make_exception_ptr(idem::store_error("the store is down", "DOWN", true));

  struct Case {
    idem::BrokerAction action;
    idem::Verdict verdict;
    idem::RabbitDecision decided;
    std::string reason;  // a dead letter's
  };
  std::map<std::string, Case> cases;
  auto status = [&](idem::Status s, idem::BrokerAction expected, std::string reason = {}) {
    idem::Outcome<int> out;
    out.status = s;
    if (s == idem::Status::in_flight) out.retry_after = 100ms;
    if (s == idem::Status::previously_failed) out.error = "stored failure";
    cases[std::string(idem::to_string(s))] = {expected, idem::verdict(out, o.retry), c.decide(out), std::move(reason)};
  };
  status(idem::Status::executed, idem::BrokerAction::ack);
  status(idem::Status::duplicate, idem::BrokerAction::ack);
  status(idem::Status::stale, idem::BrokerAction::ack);
  status(idem::Status::lease_lost, idem::BrokerAction::ack);
  status(idem::Status::in_flight, idem::BrokerAction::requeue);
  status(idem::Status::previously_failed, idem::BrokerAction::dead_letter, "failed permanently: stored failure");
  status(idem::Status::mismatch, idem::BrokerAction::dead_letter, "the key was reused with a different payload");
  auto thrown = [&](const char* name, const std::exception_ptr& e, idem::BrokerAction expected) {
    const idem::Verdict v = idem::verdict(e, o.retry);
    cases[name] = {expected, v, c.decide(e), expected == idem::BrokerAction::dead_letter ? v.reason : ""};
  };
  thrown("handler_error", handler_error, idem::BrokerAction::requeue);
  thrown("store_error", store_down, idem::BrokerAction::requeue);
  thrown("invalid_key", bad_key, idem::BrokerAction::dead_letter);
  REQUIRE(cases.size() == 10);
  for (const auto& [name, k] : cases) {
    INFO(name);
    CHECK(k.verdict.action == k.action);
    CHECK(k.decided.action == k.action);  // decide() agrees
    CHECK(k.decided.delay == k.verdict.delay);
    CHECK(k.decided.reason == k.verdict.reason);
    if (k.action == idem::BrokerAction::requeue) CHECK(k.verdict.delay > 0ms);
    if (k.action == idem::BrokerAction::dead_letter) CHECK(k.verdict.reason == k.reason);
  }
  CHECK(cases["in_flight"].verdict.delay == 150ms);  // retry_after + half of it, unjittered
  CHECK(cases["handler_error"].verdict.delay == 50ms);

  {
    Publisher pub(broker->port());
    for (const auto& [name, k] : cases) pub.send(q, {.id = name, .body = "b", .text = {{"case", name}}});
  }
  // Settle each polled batch with the cases' verdicts; a requeued one comes back: ack it then.
  std::map<std::string, int> deliveries;
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  std::size_t finished = 0;
  while (finished < cases.size() && std::chrono::steady_clock::now() < deadline) {
    const auto batch = c.poll();
    std::vector<idem::Verdict> verdicts;
    for (const auto& d : batch) {
      const Case& k = cases.at(d.message_id);
      const int n = ++deliveries[d.message_id];
      CHECK(header(d, "case") == d.message_id);
      if (n == 1) {
        verdicts.push_back(k.verdict);
        if (k.action != idem::BrokerAction::requeue) ++finished;
      } else {
        CHECK(idem::RabbitConsumer::delivery(d).attempt == 2);  // through the delay queue: idem-attempt
        verdicts.push_back({});
        ++finished;
      }
    }
    c.settle(verdicts);
  }
  CHECK(finished == cases.size());
  for (const auto& [name, k] : cases) {
    INFO(name);
    CHECK(deliveries[name] == (k.action == idem::BrokerAction::requeue ? 2 : 1));
  }
  const auto st = c.stats();
  CHECK(st.acked == 4 + 3);  // the four acks, then the three requeued ones on their return
  CHECK(st.requeued == 3);
  CHECK(st.dead_lettered == 3);
  const auto dlq = dead_letters(broker->port(), q, 3);
  REQUIRE(dlq.size() == 3);
  for (const auto& d : dlq) {
    INFO(d.message_id);
    REQUIRE(cases.count(d.message_id) == 1);
    CHECK(cases.at(d.message_id).action == idem::BrokerAction::dead_letter);
    CHECK(header(d, "idem-reason") == cases.at(d.message_id).reason);
    CHECK(header(d, "case") == d.message_id);
  }
  idem::test::AmqpAdmin admin(broker->port());
  CHECK(admin.ready(q) == 0);
  CHECK(admin.ready(q + ".delay") == 0);
}

TEST_CASE("RabbitConsumer: a dead letter the broker refuses (no dead-letter exchange) is not lost, the original "
          "comes back") {
  auto broker = idem::test::RabbitBroker::shared();
  const std::string q = random_name("nodlx");
  idem::test::AmqpAdmin(broker->port()).declare_queue(q);  // a plain queue: no <q>.dlx
  auto o = options(broker->port(), q);
  o.declare = false;
  idem::RabbitConsumer c(o);
  Publisher(broker->port()).send(q, "d-1", "b");
  auto d = c.next(5s);
  REQUIRE(d);
  c.settle(*d, {idem::BrokerAction::dead_letter, {}, "refused"});  // publish 404s: the channel closes before the ack
  REQUIRE(loses_connection(c));
  auto back = c.next(5s);
  REQUIRE(back);
  CHECK(back->message_id == "d-1");
  CHECK(back->redelivered);
  c.settle(*back, {idem::BrokerAction::ack, {}});
  CHECK(c.stats().reconnects == 1);
}
