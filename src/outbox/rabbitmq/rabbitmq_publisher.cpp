// idem::RabbitMqPublisher: one AMQP connection, one channel in confirm mode. publish() sends the
// whole batch, then reads frames until every delivery tag of the batch is acked or nacked,
// collecting basic.return on the way (an unroutable mandatory message is returned, then acked).

#include "idem/outbox/rabbitmq_publisher.hpp"

#include <amqp.h>
#include <fmt/format.h>
#include <amqp_framing.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <string_view>
#include <vector>

#include "amqp_connection.hpp"  // src/rabbitmq: the URL, the TLS checks and the socket, shared with RabbitConsumer

namespace idem {

namespace {

using Clock = std::chrono::steady_clock;
constexpr amqp_channel_t kChannel = 1;

timeval to_timeval(std::chrono::microseconds d) {
  if (d.count() < 1'000) d = std::chrono::microseconds(1'000);
  return timeval{static_cast<time_t>(d.count() / 1'000'000), static_cast<suseconds_t>(d.count() % 1'000'000)};
}

amqp_bytes_t bytes(std::string_view s) { return amqp_bytes_t{s.size(), const_cast<char*>(s.data())}; }
std::string str(const amqp_bytes_t& b) { return b.bytes ? std::string(static_cast<const char*>(b.bytes), b.len) : ""; }

std::string describe(const amqp_rpc_reply_t& r) {
  switch (r.reply_type) {
    case AMQP_RESPONSE_NORMAL:
      return "ok";
    case AMQP_RESPONSE_NONE:
      return "no reply";
    case AMQP_RESPONSE_LIBRARY_EXCEPTION:
      return amqp_error_string2(r.library_error);
    case AMQP_RESPONSE_SERVER_EXCEPTION:
      if (r.reply.id == AMQP_CONNECTION_CLOSE_METHOD) {
        const auto* m = static_cast<const amqp_connection_close_t*>(r.reply.decoded);
        return fmt::format("server closed the connection: {} {}", m->reply_code, str(m->reply_text));
      }
      if (r.reply.id == AMQP_CHANNEL_CLOSE_METHOD) {
        const auto* m = static_cast<const amqp_channel_close_t*>(r.reply.decoded);
        return fmt::format("server closed the channel: {} {}", m->reply_code, str(m->reply_text));
      }
      return fmt::format("server exception, method {}", r.reply.id);
  }
  return "unknown reply";
}

struct Route {
  std::string_view exchange, routing_key;
};
// "exchange/routing_key", split at the first '/'; no '/' = the default exchange.
Route route_of(std::string_view destination) {
  const auto slash = destination.find('/');
  if (slash == std::string_view::npos) return {{}, destination};
  return {destination.substr(0, slash), destination.substr(slash + 1)};
}

}  // namespace

class RabbitMqPublisher::Impl {
public:
  explicit Impl(RabbitMqPublisherOptions o) : options_(std::move(o)) {
    auto bad = [](const std::string& what) {
      throw invalid_options_error(fmt::format("RabbitMqPublisherOptions: {}", what));
    };
    detail::amqp::apply_url(options_, "RabbitMqPublisherOptions");
    if (options_.host.empty()) bad("host is empty");
    if (options_.port < 1 || options_.port > 65535) bad(fmt::format("port {} is not 1..65535", options_.port));
    if (options_.timeout.count() <= 0) bad("timeout must be > 0 ms");
    if (options_.user.empty()) bad("user is empty (RabbitMQ's default is \"guest\")");
    if (options_.key_header.empty() || options_.key_header.size() > 255)
      bad("key_header must be 1..255 bytes (an AMQP header name)");
    detail::amqp::check_tls(options_, "RabbitMqPublisherOptions");
  }
  ~Impl() { disconnect(/*graceful=*/true); }

  const RabbitMqPublisherOptions& options() const noexcept { return options_; }
  std::uint64_t connections() const noexcept { return connections_.load(); }

  void publish(std::span<const OutboxMessage> batch) {
    std::lock_guard lock(mu_);
    if (batch.empty()) return;
    for (const auto& m : batch) {
      const Route r = route_of(m.destination);
      if (r.exchange.size() > 255 || r.routing_key.size() > 255 || m.id.size() > 255)
        throw publish_error(fmt::format("{}: outbox message {}: exchange, routing key and message id are AMQP short "
                                        "strings (at most 255 bytes); fix the destination \"{}...\" the handler "
                                        "writes",
                                        where(), m.id.substr(0, 64), m.destination.substr(0, 64)),
                            false);
    }
    if (!conn_) connect();
    const auto deadline = Clock::now() + options_.timeout;
    const std::uint64_t first = next_tag_;
    send_all(batch);
    wait_confirms(batch, first, deadline);
  }

private:
  std::string where() const { return fmt::format("rabbitmq ({}:{})", options_.host, options_.port); }

  [[noreturn]] void lost(const std::string& what) {
    disconnect(/*graceful=*/false);
    throw publish_error(
        fmt::format("{}: {}; reconnecting at the next publish, the batch will be sent again", where(), what));
  }

  void connect() {
    conn_ = amqp_new_connection();
    if (!conn_) lost("cannot create a connection (out of memory)");
    timeval tv = to_timeval(options_.timeout);
    if (const detail::amqp::Opened opened = detail::amqp::open_socket(conn_, options_, &tv); !opened) {
      if (opened.retryable()) lost(opened.what);
      disconnect(false);  // a refused certificate or an unloadable TLS file: sending again cannot help
      throw publish_error(fmt::format("{}: {}; retrying cannot help", where(), opened.what), false);
    }
    amqp_set_handshake_timeout(conn_, &tv);
    amqp_set_rpc_timeout(conn_, &tv);
    // Sends are bounded too: a broker that stops reading (memory alarm) fails the batch instead of
    // blocking the relay forever.
    ::setsockopt(amqp_get_sockfd(conn_), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    // No heartbeat: rabbitmq-c only answers them inside its calls, and a relay can sit idle for
    // longer than any heartbeat between batches; a dead connection shows up at the next publish.
    const amqp_rpc_reply_t login = amqp_login(conn_, options_.vhost.c_str(), 0, 131072, 0, AMQP_SASL_METHOD_PLAIN,
                                              options_.user.c_str(), options_.password.c_str());
    if (login.reply_type != AMQP_RESPONSE_NORMAL) {
      const std::string why = describe(login);
      disconnect(false);
      // RabbitMQ answers a bad login or vhost by closing the socket: say what to check either way.
      throw publish_error(
          fmt::format("{}: login as {} on vhost {} failed: {}; check user, password, vhost and the "
                      "user's permissions",
                      where(), options_.user, options_.vhost, why));
    }
    amqp_channel_open(conn_, kChannel);
    if (auto r = amqp_get_rpc_reply(conn_); r.reply_type != AMQP_RESPONSE_NORMAL)
      lost(fmt::format("channel.open: {}", describe(r)));
    amqp_confirm_select(conn_, kChannel);
    if (auto r = amqp_get_rpc_reply(conn_); r.reply_type != AMQP_RESPONSE_NORMAL)
      lost(fmt::format("confirm.select: {}", describe(r)));
    next_tag_ = 1;  // delivery tags count per channel from 1
    connections_.fetch_add(1);
  }

  void disconnect(bool graceful) noexcept {
    if (!conn_) return;
    if (graceful) {
      amqp_channel_close(conn_, kChannel, AMQP_REPLY_SUCCESS);
      amqp_connection_close(conn_, AMQP_REPLY_SUCCESS);
    }
    amqp_destroy_connection(conn_);
    conn_ = nullptr;
  }

  void send_all(std::span<const OutboxMessage> batch) {
    std::vector<amqp_table_entry_t> entries;
    for (const auto& m : batch) {
      entries.clear();
      for (const auto& [name, value] : m.headers) entries.push_back(entry(name, value));
      if (!m.message_key.empty()) entries.push_back(entry(options_.key_header, m.message_key));
      // The id twice: message_id for AMQP tools, the header every idem source keys on by default.
      entries.push_back(entry(outbox_id_name, m.id));
      amqp_basic_properties_t props{};
      props._flags = AMQP_BASIC_MESSAGE_ID_FLAG | AMQP_BASIC_DELIVERY_MODE_FLAG;
      props.message_id = bytes(m.id);
      props.delivery_mode = AMQP_DELIVERY_PERSISTENT;
      if (!entries.empty()) {
        props._flags |= AMQP_BASIC_HEADERS_FLAG;
        props.headers = amqp_table_t{static_cast<int>(entries.size()), entries.data()};
      }
      const Route r = route_of(m.destination);
      const int rc = amqp_basic_publish(conn_, kChannel, bytes(r.exchange), bytes(r.routing_key), /*mandatory=*/1,
                                        /*immediate=*/0, &props, bytes(m.payload));
      if (rc != AMQP_STATUS_OK) lost(fmt::format("basic.publish of {}: {}", m.id, amqp_error_string2(rc)));
      ++next_tag_;
    }
  }

  inline static const std::string outbox_id_name = "idem-outbox-id";
  static amqp_table_entry_t entry(const std::string& name, const std::string& value) {
    amqp_table_entry_t e{};
    e.key = bytes(name);
    e.value.kind = AMQP_FIELD_KIND_UTF8;  // a long string: any bytes
    e.value.value.bytes = bytes(value);
    return e;
  }

  struct Returned {
    std::string id, exchange, routing_key, reply;
  };

  // Reads the content header and body frames that follow a basic.return; returns the message id.
  std::string read_returned_content(Clock::time_point deadline) {
    std::string id;
    std::uint64_t body_left = 0;
    bool header_seen = false;
    while (!header_seen || body_left > 0) {
      amqp_frame_t f;
      next_frame(f, deadline, "a returned message");
      if (f.frame_type == AMQP_FRAME_HEADER) {
        header_seen = true;
        body_left = f.payload.properties.body_size;
        const auto* p = static_cast<const amqp_basic_properties_t*>(f.payload.properties.decoded);
        if (p && (p->_flags & AMQP_BASIC_MESSAGE_ID_FLAG)) id = str(p->message_id);
      } else if (f.frame_type == AMQP_FRAME_BODY) {
        body_left -= std::min<std::uint64_t>(body_left, f.payload.body_fragment.len);
      }
    }
    return id;
  }

  void next_frame(amqp_frame_t& f, Clock::time_point deadline, std::string_view waiting_for) {
    for (;;) {
      const auto left = deadline - Clock::now();
      if (left <= Clock::duration::zero())
        lost(fmt::format("no answer within {} ms while waiting for {}", options_.timeout.count(), waiting_for));
      timeval tv = to_timeval(std::chrono::duration_cast<std::chrono::microseconds>(left));
      const int rc = amqp_simple_wait_frame_noblock(conn_, &f, &tv);
      if (rc == AMQP_STATUS_TIMEOUT) continue;
      if (rc != AMQP_STATUS_OK)
        lost(fmt::format("connection lost while waiting for {}: {}", waiting_for, amqp_error_string2(rc)));
      if (f.channel == kChannel || f.channel == 0) return;
    }
  }

  void wait_confirms(std::span<const OutboxMessage> batch, std::uint64_t first, Clock::time_point deadline) {
    const std::size_t n = batch.size();
    enum : std::uint8_t { open, acked, nacked };
    std::vector<std::uint8_t> state(n, open);
    std::size_t settled = 0, lowest_open = 0, nacks = 0;
    std::vector<Returned> returned;
    auto settle = [&](std::uint64_t tag, bool multiple, std::uint8_t how) {
      if (tag < first) return;  // not ours (cannot happen on a fresh batch, harmless if it did)
      const std::size_t upto = std::min<std::uint64_t>(tag - first, n - 1);
      for (std::size_t i = multiple ? lowest_open : upto; i <= upto; ++i)
        if (state[i] == open) {
          state[i] = how;
          ++settled;
          nacks += how == nacked;
        }
      while (lowest_open < n && state[lowest_open] != open) ++lowest_open;
    };
    while (settled < n) {
      amqp_maybe_release_buffers(conn_);
      amqp_frame_t f;
      next_frame(f, deadline, "publisher confirms");
      if (f.frame_type != AMQP_FRAME_METHOD) continue;
      switch (f.payload.method.id) {
        case AMQP_BASIC_ACK_METHOD: {
          const auto* a = static_cast<const amqp_basic_ack_t*>(f.payload.method.decoded);
          settle(a->delivery_tag, a->multiple != 0, acked);
          break;
        }
        case AMQP_BASIC_NACK_METHOD: {
          const auto* a = static_cast<const amqp_basic_nack_t*>(f.payload.method.decoded);
          settle(a->delivery_tag, a->multiple != 0, nacked);
          break;
        }
        case AMQP_BASIC_RETURN_METHOD: {
          const auto* r = static_cast<const amqp_basic_return_t*>(f.payload.method.decoded);
          Returned ret{
              {}, str(r->exchange), str(r->routing_key), fmt::format("{} {}", r->reply_code, str(r->reply_text))};
          ret.id = read_returned_content(deadline);
          returned.push_back(std::move(ret));
          break;
        }
        case AMQP_CHANNEL_CLOSE_METHOD: {
          const auto* c = static_cast<const amqp_channel_close_t*>(f.payload.method.decoded);
          const int code = c->reply_code;
          const std::string text = str(c->reply_text);
          disconnect(false);
          // 404: the exchange does not exist (yet): declaring it lets the batch through, so retry.
          // 403/406: refused for good (permissions, a message over the broker's size limit).
          const bool retryable = code != 403 && code != 406;
          throw publish_error(fmt::format("{}: the broker closed the channel: {} {}{}{}", where(), code, text,
                                          code == 404 ? "; declare the exchange the destination names" : "",
                                          retryable ? "; the batch will be sent again" : "; retrying cannot help"),
                              retryable);
        }
        case AMQP_CONNECTION_CLOSE_METHOD: {
          const auto* c = static_cast<const amqp_connection_close_t*>(f.payload.method.decoded);
          lost(fmt::format("the broker closed the connection: {} {}", c->reply_code, str(c->reply_text)));
        }
        default:
          break;  // connection.blocked/unblocked and the like: the deadline bounds the wait
      }
    }
    if (!returned.empty()) {
      const Returned& r = returned.front();
      throw publish_error(
          fmt::format("{}: {} of {} messages unroutable (first: {} to exchange \"{}\" routing key "
                      "\"{}\": {}); bind a queue to it; the batch will be sent again",
                      where(), returned.size(), n, r.id, r.exchange, r.routing_key, r.reply));
    }
    if (nacks > 0)
      throw publish_error(
          fmt::format("{}: the broker nacked {} of {} messages (it could not store them: disk or memory "
                      "alarm, queue limit with reject-publish); the batch will be sent again",
                      where(), nacks, n));
  }

  RabbitMqPublisherOptions options_;
  std::mutex mu_;
  amqp_connection_state_t conn_ = nullptr;
  std::uint64_t next_tag_ = 1;
  std::atomic<std::uint64_t> connections_{0};
};

RabbitMqPublisher::RabbitMqPublisher(RabbitMqPublisherOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}
RabbitMqPublisher::~RabbitMqPublisher() = default;
RabbitMqPublisher::RabbitMqPublisher(RabbitMqPublisher&&) noexcept = default;
RabbitMqPublisher& RabbitMqPublisher::operator=(RabbitMqPublisher&&) noexcept = default;

void RabbitMqPublisher::publish(std::span<const OutboxMessage> batch) {
  if (!impl_) throw usage_error("RabbitMqPublisher: publish() on a moved-from publisher");
  impl_->publish(batch);
}

const RabbitMqPublisherOptions& RabbitMqPublisher::options() const {
  if (!impl_) throw usage_error("RabbitMqPublisher: options() on a moved-from publisher");
  return impl_->options();
}

std::uint64_t RabbitMqPublisher::connections() const {
  if (!impl_) throw usage_error("RabbitMqPublisher: connections() on a moved-from publisher");
  return impl_->connections();
}

}  // namespace idem
