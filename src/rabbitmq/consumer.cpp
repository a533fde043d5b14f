// RabbitConsumer: one AMQP connection (rabbitmq-c), channel 1, basic.consume with manual acks.

#include "idem/rabbitmq/consumer.hpp"

#include <amqp.h>
#include <amqp_framing.h>
#include <sys/time.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstring>
#include <initializer_list>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "amqp_connection.hpp"

namespace idem {

static_assert(Source<RabbitConsumer>);

namespace {

constexpr amqp_channel_t kChannel = 1;

amqp_bytes_t bytes(const std::string& s) { return amqp_bytes_t{s.size(), const_cast<char*>(s.data())}; }
std::string str(amqp_bytes_t b) { return b.bytes ? std::string(static_cast<const char*>(b.bytes), b.len) : std::string(); }

// An AMQP field value as text (RabbitDelivery::headers): nullopt for an array or a nested table.
std::optional<std::string> field_text(const amqp_field_value_t& v) {
  switch (v.kind) {
    case AMQP_FIELD_KIND_UTF8:
    case AMQP_FIELD_KIND_BYTES: return str(v.value.bytes);
    case AMQP_FIELD_KIND_BOOLEAN: return std::string(v.value.boolean ? "1" : "0");
    case AMQP_FIELD_KIND_I8: return std::to_string(v.value.i8);
    case AMQP_FIELD_KIND_U8: return std::to_string(v.value.u8);
    case AMQP_FIELD_KIND_I16: return std::to_string(v.value.i16);
    case AMQP_FIELD_KIND_U16: return std::to_string(v.value.u16);
    case AMQP_FIELD_KIND_I32: return std::to_string(v.value.i32);
    case AMQP_FIELD_KIND_U32: return std::to_string(v.value.u32);
    case AMQP_FIELD_KIND_I64: return std::to_string(v.value.i64);
    case AMQP_FIELD_KIND_U64:
    case AMQP_FIELD_KIND_TIMESTAMP: return std::to_string(v.value.u64);
    case AMQP_FIELD_KIND_F32: return fmt::format("{}", v.value.f32);
    case AMQP_FIELD_KIND_F64: return fmt::format("{}", v.value.f64);
    case AMQP_FIELD_KIND_DECIMAL: {  // value * 10^-decimals
      std::string digits = std::to_string(v.value.decimal.value);
      const std::size_t places = v.value.decimal.decimals;
      if (places == 0) return digits;
      if (digits.size() <= places) digits.insert(0, places + 1 - digits.size(), '0');
      digits.insert(digits.size() - places, 1, '.');
      return digits;
    }
    case AMQP_FIELD_KIND_VOID: return std::string();
    default: return std::nullopt;  // AMQP_FIELD_KIND_ARRAY, AMQP_FIELD_KIND_TABLE
  }
}

// A header's value as a count (idem-attempt, x-delivery-count), or nullopt.
std::optional<std::uint64_t> count_of(const std::string* text) {
  if (!text || text->empty()) return std::nullopt;
  std::uint64_t n = 0;
  const auto [end, ec] = std::from_chars(text->data(), text->data() + text->size(), n);
  if (ec != std::errc() || end != text->data() + text->size()) return std::nullopt;
  return n;
}

amqp_bytes_t pool_dup(amqp_pool_t* pool, amqp_bytes_t b) {
  if (b.len == 0 || !b.bytes) return amqp_empty_bytes;
  amqp_bytes_t out;
  amqp_pool_alloc_bytes(pool, b.len, &out);
  if (!out.bytes) throw std::bad_alloc();
  std::memcpy(out.bytes, b.bytes, b.len);
  return out;
}

bool same(amqp_bytes_t b, std::string_view s) {
  return b.len == s.size() && (s.empty() || std::memcmp(b.bytes, s.data(), s.size()) == 0);
}

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
  if (o.batch == 0) o.batch = std::min<std::size_t>(32, o.prefetch);
  if (o.batch > o.prefetch)
    bad("batch", fmt::format("is {}; use 1..prefetch ({}): a batch is taken from the prefetched deliveries", o.batch,
                             o.prefetch));
  if (o.poll_wait.count() < 1) bad("poll_wait", "must be positive");
  detail::check_retry(o.retry, "RabbitConsumerOptions::retry");
  if (o.connect_timeout.count() < 1) bad("connect_timeout", "must be positive");
  if (o.heartbeat_s < 0) bad("heartbeat_s", "is negative");
  detail::amqp::check_tls(o, "RabbitConsumerOptions");
  return o;
}

}  // namespace

// Every property of a delivery as received, deep-copied (the envelope is destroyed at once).
struct detail::RabbitOriginal {
  amqp_pool_t pool;
  amqp_basic_properties_t props{};
  std::string exchange, routing_key;

  RabbitOriginal(const amqp_basic_properties_t& p, amqp_bytes_t from_exchange, amqp_bytes_t with_key)
      : props(p), exchange(str(from_exchange)), routing_key(str(with_key)) {
    init_amqp_pool(&pool, 1024);
    try {
      for (amqp_bytes_t* b : {&props.content_type, &props.content_encoding, &props.correlation_id, &props.reply_to,
                              &props.expiration, &props.message_id, &props.type, &props.user_id, &props.app_id,
                              &props.cluster_id})
        *b = pool_dup(&pool, *b);
      if (props._flags & AMQP_BASIC_HEADERS_FLAG) {
        if (amqp_table_clone(&p.headers, &props.headers, &pool) != AMQP_STATUS_OK) throw std::bad_alloc();
      } else {
        props.headers = amqp_empty_table;
      }
    } catch (...) {
      empty_amqp_pool(&pool);
      throw;
    }
  }
  ~RabbitOriginal() { empty_amqp_pool(&pool); }
  RabbitOriginal(const RabbitOriginal&) = delete;
  RabbitOriginal& operator=(const RabbitOriginal&) = delete;
};

struct RabbitConsumer::Impl {
  RabbitConsumerOptions opt;
  amqp_connection_state_t conn = nullptr;
  std::uint64_t generation = 0;  // bumped per connection: a delivery answers only on its own
  std::vector<RabbitDelivery> batch;  // the last poll()'s deliveries, until settled or released
  // Released deliveries (tag, connection) the next poll() nacks back to the queue.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> released;
  // Read by stats() from any thread (metrics) while the consumer's own thread counts.
  struct Counters {
    std::atomic<std::uint64_t> delivered{0}, redelivered{0}, acked{0}, dead_lettered{0}, requeued{0}, reconnects{0},
        released{0};
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
    if (p._flags & AMQP_BASIC_TIMESTAMP_FLAG)
      d.timestamp = std::chrono::system_clock::time_point(std::chrono::seconds(static_cast<std::int64_t>(p.timestamp)));
    if (p._flags & AMQP_BASIC_HEADERS_FLAG)
      for (int i = 0; i < p.headers.num_entries; ++i)
        if (auto text = field_text(p.headers.entries[i].value))
          d.headers.emplace_back(str(p.headers.entries[i].key), std::move(*text));
    d.body = str(env.message.body);
    try {
      d.original = std::make_shared<const detail::RabbitOriginal>(p, env.exchange, env.routing_key);
    } catch (...) {
      amqp_destroy_envelope(&env);
      throw;
    }
    amqp_destroy_envelope(&env);
    ++stats.delivered;
    if (d.redelivered) ++stats.redelivered;
    return d;
  }

  static amqp_table_entry_t text_entry(std::string_view name, const std::string& value) {
    amqp_table_entry_t e{};
    e.key = amqp_bytes_t{name.size(), const_cast<char*>(name.data())};
    e.value.kind = AMQP_FIELD_KIND_UTF8;
    e.value.value.bytes = bytes(value);
    return e;
  }

  // A copy of `d` published to `exchange` / `routing_key`: persistent, every property it had but
  // expiration (`expiration` when given) and user-id (the broker would check it against our login),
  // its headers without those named in `replace`, then `added`.
  void publish_copy(const RabbitDelivery& d, const std::string& exchange, const std::string& routing_key,
                    const std::string* expiration, std::span<const amqp_table_entry_t> added,
                    std::initializer_list<std::string_view> replace, const char* what) {
    amqp_basic_properties_t props{};
    std::vector<amqp_table_entry_t> entries;
    auto replaced = [&](amqp_bytes_t key) {
      for (std::string_view r : replace)
        if (same(key, r)) return true;
      return false;
    };
    if (d.original) {
      props = d.original->props;
      if (props._flags & AMQP_BASIC_HEADERS_FLAG)
        for (int i = 0; i < props.headers.num_entries; ++i)
          if (!replaced(props.headers.entries[i].key)) entries.push_back(props.headers.entries[i]);
    } else {  // a delivery built by hand: what it says
      if (!d.message_id.empty()) {
        props._flags |= AMQP_BASIC_MESSAGE_ID_FLAG;
        props.message_id = bytes(d.message_id);
      }
      if (!d.content_type.empty()) {
        props._flags |= AMQP_BASIC_CONTENT_TYPE_FLAG;
        props.content_type = bytes(d.content_type);
      }
      if (d.timestamp) {
        props._flags |= AMQP_BASIC_TIMESTAMP_FLAG;
        props.timestamp = static_cast<std::uint64_t>(
            std::chrono::duration_cast<std::chrono::seconds>(d.timestamp->time_since_epoch()).count());
      }
      for (const auto& [k, v] : d.headers) {
        amqp_table_entry_t e = text_entry(k, v);
        if (!replaced(e.key)) entries.push_back(e);
      }
    }
    entries.insert(entries.end(), added.begin(), added.end());
    props._flags &= ~(AMQP_BASIC_EXPIRATION_FLAG | AMQP_BASIC_USER_ID_FLAG | AMQP_BASIC_HEADERS_FLAG);
    props._flags |= AMQP_BASIC_DELIVERY_MODE_FLAG;
    props.delivery_mode = 2;
    if (expiration) {
      props._flags |= AMQP_BASIC_EXPIRATION_FLAG;
      props.expiration = bytes(*expiration);
    }
    props.headers = amqp_empty_table;
    if (!entries.empty()) {
      props._flags |= AMQP_BASIC_HEADERS_FLAG;
      props.headers = amqp_table_t{static_cast<int>(entries.size()), entries.data()};
    }
    check_rc(amqp_basic_publish(conn, kChannel, bytes(exchange), bytes(routing_key), 0, 0, &props, bytes(d.body)), what);
  }

  // The copy that comes back after `delay` through `<queue>.delay`, counting the attempt; not the
  // quorum queue's x-delivery-count (the copy is a new message, its count starts again).
  void publish_delayed(const RabbitDelivery& d, millis delay) {
    const std::string expiration = std::to_string(delay.count());
    const std::string attempt = std::to_string(static_cast<std::uint64_t>(RabbitConsumer::delivery(d).attempt) + 1);
    const amqp_table_entry_t added[] = {text_entry(rabbit_attempt_header, attempt)};
    publish_copy(d, "", opt.queue + ".delay", &expiration, added, {rabbit_attempt_header, "x-delivery-count"},
                 "basic.publish to the delay queue");
  }

  // The dead letter: to `<queue>.dlx` with the delivery's routing key (what the broker's own
  // dead-lettering uses), saying why and from which queue.
  void publish_dead_letter(const RabbitDelivery& d, const std::string& reason) {
    const std::string routing_key = d.original ? d.original->routing_key : opt.queue;
    const amqp_table_entry_t added[] = {text_entry(rabbit_reason_header, reason), text_entry("idem-queue", opt.queue)};
    publish_copy(d, opt.queue + ".dlx", routing_key, nullptr, added, {rabbit_reason_header, "idem-queue"},
                 "basic.publish to the dead-letter exchange");
  }

  void settle(const RabbitDelivery& d, const RabbitDecision& decision) {
    if (!conn || d.connection != generation) return;  // its connection is gone: the broker requeued it
    switch (decision.action) {
      case BrokerAction::ack:
        check_rc(amqp_basic_ack(conn, kChannel, d.tag, 0), "basic.ack");
        ++stats.acked;
        break;
      case BrokerAction::dead_letter:
        // The same channel: the broker routes the letter before it takes the ack, and a letter it
        // refuses (no such exchange) closes the channel before the ack: the original comes back.
        publish_dead_letter(d, decision.reason);
        check_rc(amqp_basic_ack(conn, kChannel, d.tag, 0), "basic.ack of a dead-lettered delivery");
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

  // The released deliveries (and a batch left unsettled) go back to the queue now, when their
  // connection is still the open one (else the broker has requeued them already).
  void nack_released() {
    for (const RabbitDelivery& d : batch) released.emplace_back(d.tag, d.connection);
    batch.clear();
    const auto held = std::exchange(released, {});
    for (const auto& [tag, connection] : held) {
      if (!conn || connection != generation) continue;
      check_rc(amqp_basic_nack(conn, kChannel, tag, 0, /*requeue=*/1), "basic.nack of a released delivery");
      ++stats.released;
    }
  }

  std::vector<RabbitDelivery> poll() {
    nack_released();
    std::vector<RabbitDelivery> out;
    auto first = next(opt.poll_wait);
    if (!first) return out;
    out.push_back(std::move(*first));
    // The rest: only what has arrived already (a zero wait), never past the first's.
    while (out.size() < opt.batch) {
      auto more = next(millis{0});
      if (!more) break;
      out.push_back(std::move(*more));
    }
    batch = out;
    released.reserve(batch.size());  // release() (noexcept) then never allocates
    return out;
  }

  void settle(std::span<const Verdict> verdicts) {
    if (verdicts.size() != batch.size())
      throw usage_error(fmt::format("idem: RabbitConsumer::settle: {} deliveries polled but {} verdicts", batch.size(),
                                    verdicts.size()));
    const auto settling = std::exchange(batch, {});  // settled or not, the batch is done
    for (std::size_t i = 0; i < settling.size(); ++i)
      settle(settling[i], RabbitDecision{verdicts[i].action, verdicts[i].delay, verdicts[i].reason});
  }

  void release() noexcept {
    for (const RabbitDelivery& d : batch) released.emplace_back(d.tag, d.connection);
    batch.clear();
  }
};

RabbitConsumer::RabbitConsumer(RabbitConsumerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  impl_->connect();
}
RabbitConsumer::~RabbitConsumer() = default;

std::optional<RabbitDelivery> RabbitConsumer::next(millis wait) { return impl_->next(wait); }
void RabbitConsumer::settle(const RabbitDelivery& d, const RabbitDecision& decision) { impl_->settle(d, decision); }

std::vector<RabbitDelivery> RabbitConsumer::poll() { return impl_->poll(); }
void RabbitConsumer::settle(std::span<const Verdict> verdicts) { impl_->settle(verdicts); }
void RabbitConsumer::release() noexcept { impl_->release(); }

Delivery RabbitConsumer::delivery(const RabbitDelivery& d) {
  Delivery out;
  out.id = std::to_string(d.tag);
  out.key = d.message_id;
  out.payload = d.body;
  out.headers.reserve(d.headers.size());
  for (const auto& [k, v] : d.headers) out.headers.emplace_back(k, v);
  out.timestamp = d.timestamp;
  // Our delayed copies say which delivery they are; the broker counts the copy's own redeliveries
  // (a quorum queue exactly, a classic queue only as "redelivered").
  std::uint64_t attempt = count_of(d.header(rabbit_attempt_header)).value_or(1);
  if (attempt == 0) attempt = 1;
  if (const auto count = count_of(d.header("x-delivery-count")))
    attempt += *count;
  else if (d.redelivered)
    attempt += 1;
  out.attempt = static_cast<std::uint32_t>(std::min<std::uint64_t>(attempt, UINT32_MAX));
  return out;
}

RabbitDecision RabbitConsumer::decide(const std::exception_ptr& e) const {
  Verdict v = verdict(e, impl_->opt.retry);
  return {v.action, v.delay, std::move(v.reason)};
}

RabbitConsumerStats RabbitConsumer::stats() const noexcept {
  const auto& c = impl_->stats;
  return {c.delivered.load(), c.redelivered.load(), c.acked.load(), c.dead_lettered.load(), c.requeued.load(),
          c.reconnects.load(), c.released.load()};
}
const RabbitConsumerOptions& RabbitConsumer::options() const noexcept { return impl_->opt; }

}  // namespace idem
