// RabbitConsumer: one AMQP connection (rabbitmq-c), channel 1, basic.consume with manual acks.

#include "idem/rabbitmq/consumer.hpp"

#include <amqp.h>
#include <amqp_framing.h>
#include <sys/time.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "amqp_connection.hpp"

namespace idem {

namespace {

constexpr amqp_channel_t kChannel = 1;

amqp_bytes_t bytes(const std::string& s) { return amqp_bytes_t{s.size(), const_cast<char*>(s.data())}; }
std::string str(amqp_bytes_t b) { return b.bytes ? std::string(static_cast<const char*>(b.bytes), b.len) : std::string(); }

std::string describe(const amqp_rpc_reply_t& r) {
  switch (r.reply_type) {
    case AMQP_RESPONSE_NORMAL: return "ok";
    case AMQP_RESPONSE_NONE: return "no reply";
    case AMQP_RESPONSE_LIBRARY_EXCEPTION: return amqp_error_string2(r.library_error);
    case AMQP_RESPONSE_SERVER_EXCEPTION:
      if (r.reply.id == AMQP_CONNECTION_CLOSE_METHOD) {
        const auto* m = static_cast<const amqp_connection_close_t*>(r.reply.decoded);
        return fmt::format("the broker closed the connection: {} {}", m->reply_code, str(m->reply_text));
      }
      if (r.reply.id == AMQP_CHANNEL_CLOSE_METHOD) {
        const auto* m = static_cast<const amqp_channel_close_t*>(r.reply.decoded);
        return fmt::format("the broker closed the channel: {} {}", m->reply_code, str(m->reply_text));
      }
      return fmt::format("the broker answered method {:#x}", r.reply.id);
  }
  return "unknown reply";
}

RabbitConsumerOptions checked(RabbitConsumerOptions o) {
  auto bad = [](const char* field, const std::string& why) {
    throw invalid_options_error(fmt::format("idem: RabbitConsumerOptions::{} {}", field, why));
  };
  detail::amqp::apply_url(o, "RabbitConsumerOptions");
  if (o.queue.empty()) bad("queue", "is empty: name the queue to consume");
  if (o.host.empty()) bad("host", "is empty");
  if (o.port < 1 || o.port > 65535) bad("port", fmt::format("is {}; use 1..65535", o.port));
  if (o.prefetch == 0) bad("prefetch", "is 0 (unlimited): give a bound, e.g. 50");
  detail::check_retry(o.retry, "RabbitConsumerOptions::retry");
  if (o.connect_timeout.count() < 1) bad("connect_timeout", "must be positive");
  if (o.heartbeat_s < 0) bad("heartbeat_s", "is negative");
  detail::amqp::check_tls(o, "RabbitConsumerOptions");
  return o;
}

}  // namespace

struct RabbitConsumer::Impl {
  RabbitConsumerOptions opt;
  amqp_connection_state_t conn = nullptr;
  std::uint64_t generation = 0;  // bumped per connection: a delivery answers only on its own
  // Read by stats() from any thread (metrics) while the consumer's own thread counts.
  struct Counters {
    std::atomic<std::uint64_t> delivered{0}, redelivered{0}, acked{0}, dead_lettered{0}, requeued{0}, reconnects{0};
  } stats;

  explicit Impl(RabbitConsumerOptions o) : opt(checked(std::move(o))) {}
  ~Impl() { close(true); }

  std::string where() const { return fmt::format("{}:{}", opt.host, opt.port); }

  void close(bool polite) noexcept {
    if (!conn) return;
    if (polite) {
      amqp_channel_close(conn, kChannel, AMQP_REPLY_SUCCESS);
      amqp_connection_close(conn, AMQP_REPLY_SUCCESS);
    }
    amqp_destroy_connection(conn);
    conn = nullptr;
  }

  [[noreturn]] void broken(const std::string& what) {
    close(false);
    throw connection_error(fmt::format("idem: RabbitMQ at {}: {}; unacked deliveries go back to the queue, the "
                                       "next call reconnects",
                                       where(), what));
  }

  void check(const amqp_rpc_reply_t& r, const char* what) {
    if (r.reply_type != AMQP_RESPONSE_NORMAL) broken(fmt::format("{}: {}", what, describe(r)));
  }
  void check_rpc(const char* what) { check(amqp_get_rpc_reply(conn), what); }
  void check_rc(int rc, const char* what) {
    if (rc != AMQP_STATUS_OK) broken(fmt::format("{}: {}", what, amqp_error_string2(rc)));
  }

  void connect() {
    if (conn) return;
    conn = amqp_new_connection();
    if (!conn) broken("cannot create a connection (out of memory)");
    const auto ms = opt.connect_timeout.count();
    timeval tv{static_cast<time_t>(ms / 1000), static_cast<suseconds_t>((ms % 1000) * 1000)};
    if (const detail::amqp::Opened opened = detail::amqp::open_socket(conn, opt, &tv); !opened) {
      if (opened.retryable()) broken(opened.what);
      close(false);  // a refused certificate or an unloadable TLS file: reconnecting cannot help
      throw connection_error(fmt::format("idem: RabbitMQ at {}: {}", where(), opened.what), "TLS", false);
    }
    const amqp_rpc_reply_t login = amqp_login(conn, opt.vhost.c_str(), 0, 131072, opt.heartbeat_s,
                                              AMQP_SASL_METHOD_PLAIN, opt.user.c_str(), opt.password.c_str());
    if (login.reply_type == AMQP_RESPONSE_SERVER_EXCEPTION) {  // refused credentials or vhost: no retry helps
      const std::string why = describe(login);
      close(false);
      throw connection_error(fmt::format("idem: RabbitMQ at {} refused the login of '{}' to vhost '{}': {}", where(),
                                         opt.user, opt.vhost, why),
                             "AUTH", false);
    }
    check(login, "login");
    amqp_channel_open(conn, kChannel);
    check_rpc("channel.open");
    if (opt.declare) declare();
    amqp_basic_qos(conn, kChannel, 0, opt.prefetch, 0);
    check_rpc("basic.qos");
    amqp_basic_consume(conn, kChannel, bytes(opt.queue), amqp_empty_bytes, 0, /*no_ack=*/0, 0, amqp_empty_table);
    check_rpc("basic.consume");
    ++generation;
    if (generation > 1) ++stats.reconnects;
  }

  void declare_queue(const std::string& name, amqp_table_t args) {
    amqp_queue_declare(conn, kChannel, bytes(name), 0, /*durable=*/1, 0, /*auto_delete=*/0, args);
    check_rpc(fmt::format("queue.declare of '{}' (an existing queue with other arguments is refused: declare=false "
                          "to keep yours)",
                          name)
                  .c_str());
  }

  // queue -(reject)-> <queue>.dlx -> <queue>.dlq; <queue>.delay -(expired)-> the default exchange -> queue.
  void declare() {
    const std::string dlx = opt.queue + ".dlx", dlq = opt.queue + ".dlq", delay = opt.queue + ".delay";
    amqp_exchange_declare(conn, kChannel, bytes(dlx), amqp_cstring_bytes("fanout"), 0, 1, 0, 0, amqp_empty_table);
    check_rpc("exchange.declare of the dead-letter exchange");
    declare_queue(dlq, amqp_empty_table);
    amqp_queue_bind(conn, kChannel, bytes(dlq), bytes(dlx), amqp_empty_bytes, amqp_empty_table);
    check_rpc("queue.bind of the dead-letter queue");
    amqp_table_entry_t to_dlx;
    to_dlx.key = amqp_cstring_bytes("x-dead-letter-exchange");
    to_dlx.value.kind = AMQP_FIELD_KIND_UTF8;
    to_dlx.value.value.bytes = bytes(dlx);
    declare_queue(opt.queue, amqp_table_t{1, &to_dlx});
    amqp_table_entry_t back[2];
    back[0].key = amqp_cstring_bytes("x-dead-letter-exchange");
    back[0].value.kind = AMQP_FIELD_KIND_UTF8;
    back[0].value.value.bytes = amqp_cstring_bytes("");
    back[1].key = amqp_cstring_bytes("x-dead-letter-routing-key");
    back[1].value.kind = AMQP_FIELD_KIND_UTF8;
    back[1].value.value.bytes = bytes(opt.queue);
    declare_queue(delay, amqp_table_t{2, back});
  }

  std::optional<RabbitDelivery> next(millis wait) {
    connect();
    amqp_maybe_release_buffers(conn);
    const auto us = std::max<long long>(0, std::chrono::duration_cast<std::chrono::microseconds>(wait).count());
    timeval tv{static_cast<time_t>(us / 1'000'000), static_cast<suseconds_t>(us % 1'000'000)};
    amqp_envelope_t env;
    const amqp_rpc_reply_t r = amqp_consume_message(conn, &env, &tv, 0);
    if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION && r.library_error == AMQP_STATUS_TIMEOUT) return std::nullopt;
    if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION && r.library_error == AMQP_STATUS_UNEXPECTED_STATE) {
      // Not a delivery: a broker-side close (or a frame we never asked for) ends this connection.
      amqp_frame_t frame;
      if (amqp_simple_wait_frame(conn, &frame) != AMQP_STATUS_OK) broken("the connection was lost");
      if (frame.frame_type == AMQP_FRAME_METHOD &&
          (frame.payload.method.id == AMQP_CHANNEL_CLOSE_METHOD || frame.payload.method.id == AMQP_CONNECTION_CLOSE_METHOD))
        broken("the broker closed the channel");
      return std::nullopt;
    }
    if (r.reply_type != AMQP_RESPONSE_NORMAL) broken(fmt::format("consume: {}", describe(r)));
    RabbitDelivery d;
    d.tag = env.delivery_tag;
    d.connection = generation;
    d.redelivered = env.redelivered != 0;
    const amqp_basic_properties_t& p = env.message.properties;
    if (p._flags & AMQP_BASIC_MESSAGE_ID_FLAG) d.message_id = str(p.message_id);
    if (p._flags & AMQP_BASIC_CONTENT_TYPE_FLAG) d.content_type = str(p.content_type);
    d.body = str(env.message.body);
    amqp_destroy_envelope(&env);
    ++stats.delivered;
    if (d.redelivered) ++stats.redelivered;
    return d;
  }

  // The copy that comes back after `delay`: persistent, its message id and content type kept.
  void publish_delayed(const RabbitDelivery& d, millis delay) {
    amqp_basic_properties_t props{};
    props._flags = AMQP_BASIC_DELIVERY_MODE_FLAG | AMQP_BASIC_EXPIRATION_FLAG;
    props.delivery_mode = 2;
    const std::string expiration = std::to_string(delay.count());
    props.expiration = bytes(expiration);
    if (!d.message_id.empty()) {
      props._flags |= AMQP_BASIC_MESSAGE_ID_FLAG;
      props.message_id = bytes(d.message_id);
    }
    if (!d.content_type.empty()) {
      props._flags |= AMQP_BASIC_CONTENT_TYPE_FLAG;
      props.content_type = bytes(d.content_type);
    }
    const std::string delay_queue = opt.queue + ".delay";
    check_rc(amqp_basic_publish(conn, kChannel, amqp_empty_bytes, bytes(delay_queue), 0, 0, &props, bytes(d.body)),
             "basic.publish to the delay queue");
  }

  void settle(const RabbitDelivery& d, const RabbitDecision& decision) {
    if (!conn || d.connection != generation) return;  // its connection is gone: the broker requeued it
    switch (decision.action) {
      case BrokerAction::ack:
        check_rc(amqp_basic_ack(conn, kChannel, d.tag, 0), "basic.ack");
        ++stats.acked;
        break;
      case BrokerAction::dead_letter:
        check_rc(amqp_basic_reject(conn, kChannel, d.tag, /*requeue=*/0), "basic.reject");
        ++stats.dead_lettered;
        break;
      case BrokerAction::requeue:
        if (decision.delay.count() <= 0) {
          check_rc(amqp_basic_nack(conn, kChannel, d.tag, 0, /*requeue=*/1), "basic.nack");
        } else {
          publish_delayed(d, decision.delay);  // the same channel: the broker has the copy before the ack
          check_rc(amqp_basic_ack(conn, kChannel, d.tag, 0), "basic.ack of a requeued delivery");
        }
        ++stats.requeued;
        break;
    }
  }
};

RabbitConsumer::RabbitConsumer(RabbitConsumerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  impl_->connect();
}
RabbitConsumer::~RabbitConsumer() = default;

std::optional<RabbitDelivery> RabbitConsumer::next(millis wait) { return impl_->next(wait); }
void RabbitConsumer::settle(const RabbitDelivery& d, const RabbitDecision& decision) { impl_->settle(d, decision); }

RabbitDecision RabbitConsumer::decide(const std::exception_ptr& e) const {
  const Verdict v = verdict(e, impl_->opt.retry);
  return {v.action, v.delay};
}

RabbitConsumerStats RabbitConsumer::stats() const noexcept {
  const auto& c = impl_->stats;
  return {c.delivered.load(), c.redelivered.load(), c.acked.load(), c.dead_lettered.load(), c.requeued.load(),
          c.reconnects.load()};
}
const RabbitConsumerOptions& RabbitConsumer::options() const noexcept { return impl_->opt; }

}  // namespace idem
