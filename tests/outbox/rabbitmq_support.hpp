#pragma once
// A real rabbitmq-server for the outbox tests (tests/support/rabbitmq_broker.sh) and a small AMQP
// client to set up queues and read messages back with basic.get.
//
// RabbitBroker::shared() is the CTest fixture's broker (its port file, IDEM_RABBITMQ_FIXTURE_PORT_FILE);
// when the test runs outside CTest (no such file) it starts a private one. RabbitBroker::start_private()
// is a broker of the test's own, which it may halt and resume. A broker that cannot start throws:
// the test fails.

#include <amqp.h>
#include <amqp_framing.h>
#include <amqp_tcp_socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#ifndef IDEM_RABBITMQ_BROKER_SCRIPT
#error "IDEM_RABBITMQ_BROKER_SCRIPT must name tests/support/rabbitmq_broker.sh"
#endif
#ifndef IDEM_RABBITMQ_FIXTURE_PORT_FILE
#define IDEM_RABBITMQ_FIXTURE_PORT_FILE ""
#endif

namespace idem::test {

class RabbitBroker {
public:
  // The fixture's broker, or a private one if there is no fixture.
  static std::unique_ptr<RabbitBroker> shared() {
    std::ifstream in(IDEM_RABBITMQ_FIXTURE_PORT_FILE);
    int port = 0;
    if (in >> port && port > 0) return std::unique_ptr<RabbitBroker>(new RabbitBroker(port, {}));
    return start_private();
  }
  static std::unique_ptr<RabbitBroker> start_private() {
    char tmpl[] = "/tmp/idem-outbox-rmq-state.XXXXXX";
    if (!::mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
    std::string state = std::string(tmpl) + "/s";
    run("start", state);
    std::ifstream in(state + "/port");
    int port = 0;
    if (!(in >> port)) throw std::runtime_error("rabbitmq_broker.sh start wrote no port");
    return std::unique_ptr<RabbitBroker>(new RabbitBroker(port, state));
  }
  ~RabbitBroker() {
    if (!state_.empty()) {
      std::system(("'" + std::string(IDEM_RABBITMQ_BROKER_SCRIPT) + "' stop '" + state_ + "' >/dev/null 2>&1").c_str());
      ::rmdir(state_.substr(0, state_.rfind('/')).c_str());
    }
  }
  RabbitBroker(const RabbitBroker&) = delete;
  RabbitBroker& operator=(const RabbitBroker&) = delete;

  int port() const { return port_; }
  // A broker outage (private brokers only): the node stops; resume() brings it back, same port and data.
  void halt() { run("halt", own_state()); }
  void resume() { run("resume", own_state()); }

private:
  RabbitBroker(int port, std::string state) : port_(port), state_(std::move(state)) {}
  const std::string& own_state() const {
    if (state_.empty()) throw std::logic_error("halt/resume need a private broker (start_private)");
    return state_;
  }
  static void run(const char* cmd, const std::string& state) {
    const std::string line = "'" + std::string(IDEM_RABBITMQ_BROKER_SCRIPT) + "' " + cmd + " '" + state + "'";
    if (std::system(line.c_str()) != 0) throw std::runtime_error("FAILED: " + line);
  }
  int port_;
  std::string state_;  // empty: the fixture's broker, not ours to stop
};

struct AmqpMessage {
  std::string message_id, body, exchange, routing_key;
  int delivery_mode = 0;
  std::vector<std::pair<std::string, std::string>> headers;
  std::string header(const std::string& name) const {
    for (const auto& [n, v] : headers)
      if (n == name) return v;
    return {};
  }
};

// One connection, channel 1: topology and basic.get, every failure a std::runtime_error.
class AmqpAdmin {
public:
  explicit AmqpAdmin(int port, const std::string& host = "127.0.0.1") : conn_(amqp_new_connection()) {
    amqp_socket_t* sock = amqp_tcp_socket_new(conn_);
    timeval tv{5, 0};
    if (!sock || amqp_socket_open_noblock(sock, host.c_str(), port, &tv) != AMQP_STATUS_OK)
      throw std::runtime_error("admin: cannot connect to port " + std::to_string(port));
    check(amqp_login(conn_, "/", 0, 131072, 0, AMQP_SASL_METHOD_PLAIN, "guest", "guest"), "login");
    amqp_channel_open(conn_, 1);
    check(amqp_get_rpc_reply(conn_), "channel.open");
  }
  ~AmqpAdmin() {
    amqp_channel_close(conn_, 1, AMQP_REPLY_SUCCESS);
    amqp_connection_close(conn_, AMQP_REPLY_SUCCESS);
    amqp_destroy_connection(conn_);
  }
  AmqpAdmin(const AmqpAdmin&) = delete;
  AmqpAdmin& operator=(const AmqpAdmin&) = delete;

  void declare_queue(const std::string& q) {
    amqp_queue_declare(conn_, 1, amqp_cstring_bytes(q.c_str()), 0, /*durable=*/1, 0, /*auto_delete=*/0,
                       amqp_empty_table);
    check(amqp_get_rpc_reply(conn_), "queue.declare");
    amqp_queue_purge(conn_, 1, amqp_cstring_bytes(q.c_str()));
    check(amqp_get_rpc_reply(conn_), "queue.purge");
  }
  void declare_exchange(const std::string& x, const std::string& type = "direct") {
    amqp_exchange_declare(conn_, 1, amqp_cstring_bytes(x.c_str()), amqp_cstring_bytes(type.c_str()), 0, 1, 0, 0,
                          amqp_empty_table);
    check(amqp_get_rpc_reply(conn_), "exchange.declare");
  }
  void bind(const std::string& q, const std::string& x, const std::string& key) {
    amqp_queue_bind(conn_, 1, amqp_cstring_bytes(q.c_str()), amqp_cstring_bytes(x.c_str()),
                    amqp_cstring_bytes(key.c_str()), amqp_empty_table);
    check(amqp_get_rpc_reply(conn_), "queue.bind");
  }
  // Messages ready in `q` (not those delivered and unacked); the queue must exist.
  std::uint32_t ready(const std::string& q) {
    auto* ok = amqp_queue_declare(conn_, 1, amqp_cstring_bytes(q.c_str()), /*passive=*/1, 0, 0, 0, amqp_empty_table);
    check(amqp_get_rpc_reply(conn_), "queue.declare passive");
    return ok->message_count;
  }
  void delete_queue(const std::string& q) {
    amqp_queue_delete(conn_, 1, amqp_cstring_bytes(q.c_str()), 0, 0);
    check(amqp_get_rpc_reply(conn_), "queue.delete");
  }
  // basic.get with auto-ack; nullopt when the queue is empty.
  std::optional<AmqpMessage> get(const std::string& q) {
    amqp_maybe_release_buffers(conn_);
    const amqp_rpc_reply_t r = amqp_basic_get(conn_, 1, amqp_cstring_bytes(q.c_str()), /*no_ack=*/1);
    check(r, "basic.get");
    if (r.reply.id == AMQP_BASIC_GET_EMPTY_METHOD) return std::nullopt;
    const auto* ok = static_cast<const amqp_basic_get_ok_t*>(r.reply.decoded);
    AmqpMessage m;
    m.exchange = str(ok->exchange);
    m.routing_key = str(ok->routing_key);
    amqp_message_t msg;
    check(amqp_read_message(conn_, 1, &msg, 0), "read message");
    m.body = str(msg.body);
    if (msg.properties._flags & AMQP_BASIC_MESSAGE_ID_FLAG) m.message_id = str(msg.properties.message_id);
    if (msg.properties._flags & AMQP_BASIC_DELIVERY_MODE_FLAG) m.delivery_mode = msg.properties.delivery_mode;
    if (msg.properties._flags & AMQP_BASIC_HEADERS_FLAG)
      for (int i = 0; i < msg.properties.headers.num_entries; ++i) {
        const auto& e = msg.properties.headers.entries[i];
        m.headers.emplace_back(str(e.key), e.value.kind == AMQP_FIELD_KIND_UTF8 ? str(e.value.value.bytes) : "?");
      }
    amqp_destroy_message(&msg);
    return m;
  }
  // Everything in the queue now (until basic.get answers empty).
  std::vector<AmqpMessage> drain(const std::string& q) {
    std::vector<AmqpMessage> out;
    while (auto m = get(q)) out.push_back(std::move(*m));
    return out;
  }

private:
  static std::string str(const amqp_bytes_t& b) {
    return b.bytes ? std::string(static_cast<const char*>(b.bytes), b.len) : std::string();
  }
  void check(const amqp_rpc_reply_t& r, const char* what) {
    if (r.reply_type != AMQP_RESPONSE_NORMAL)
      throw std::runtime_error(std::string("admin: ") + what + " failed (reply type " + std::to_string(r.reply_type) + ")");
  }
  amqp_connection_state_t conn_;
};

}  // namespace idem::test
