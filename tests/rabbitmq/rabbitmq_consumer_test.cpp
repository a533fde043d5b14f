// RabbitConsumer (include/idem/rabbitmq/consumer.hpp) against a real rabbitmq-server (the outbox
// tests' broker fixture, tests/support/rabbitmq_broker.sh): every payment applied once across two
// consumers, the poison and the id-less message dead-lettered once, a delayed requeue coming back
// after its delay, deliveries of a consumer that went away (and of a channel the broker closed)
// redelivered and answered as duplicates, and a connection killed mid-prefetch (a proxy cuts it).
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <random>
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
