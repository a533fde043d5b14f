// idem::KafkaPublisher: one librdkafka idempotent producer; publish() produces a batch and serves
// delivery reports (rd_kafka_poll, on the calling thread) until every message of the batch has one.

#include "idem/outbox/kafka_publisher.hpp"

#include <fmt/format.h>
#include <librdkafka/rdkafka.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <mutex>
#include <string_view>

namespace idem {

namespace {

using Clock = std::chrono::steady_clock;

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

// Kafka's own rule for topic names; checked here so a bad destination fails at once and says so,
// rather than as a delivery report after the whole timeout.
bool legal_topic(std::string_view t) {
  if (t.empty() || t.size() > 249 || t == "." || t == "..") return false;
  return std::all_of(t.begin(), t.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
  });
}

// Refusals that a later attempt cannot change: the relay should not retry these.
bool permanent(rd_kafka_resp_err_t e) {
  switch (e) {
    case RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE:
    case RD_KAFKA_RESP_ERR_INVALID_MSG:
    case RD_KAFKA_RESP_ERR_INVALID_MSG_SIZE:
    case RD_KAFKA_RESP_ERR_RECORD_LIST_TOO_LARGE:
    case RD_KAFKA_RESP_ERR_INVALID_RECORD:
    case RD_KAFKA_RESP_ERR_TOPIC_EXCEPTION:
    case RD_KAFKA_RESP_ERR__INVALID_ARG:
      return true;
    default:
      return false;
  }
}

long long parse_count(const std::string& name, const std::string& value) {
  long long v = 0;
  const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (ec != std::errc{} || end != value.data() + value.size() || v < 0)
    throw invalid_options_error(
        fmt::format("KafkaPublisherOptions: config {}={} is not a non-negative integer", name, value));
  return v;
}

// One batch's delivery state. Each produced message carries a Ticket (its msg_opaque) that keeps
// the batch alive, so a report that arrives after publish() gave up lands here, not in freed memory.
struct Batch {
  std::size_t pending = 0;
  std::vector<rd_kafka_resp_err_t> errors;
};
struct Ticket {
  std::shared_ptr<Batch> batch;
  std::size_t index;
};

extern "C" void idem_kafka_dr_cb(rd_kafka_t*, const rd_kafka_message_t* m, void*) {
  auto* t = static_cast<Ticket*>(m->_private);
  if (!t) return;
  t->batch->errors[t->index] = m->err;
  --t->batch->pending;
  delete t;
}

}  // namespace

class KafkaPublisher::Impl {
public:
  explicit Impl(KafkaPublisherOptions o) : options_(std::move(o)) {
    if (options_.brokers.empty())
      throw invalid_options_error("KafkaPublisherOptions: brokers is empty; set it to \"host:port[,host:port...]\"");
    if (options_.timeout.count() <= 0)
      throw invalid_options_error("KafkaPublisherOptions: timeout must be > 0 ms");
    for (const auto& [name, value] : options_.config) {
      const std::string n = lower(name), v = lower(value);
      if (n == "enable.idempotence" && v != "true")
        throw invalid_options_error(
            fmt::format("KafkaPublisherOptions: config enable.idempotence={} is refused: without "
                        "the idempotent producer a retried produce can reorder or duplicate a "
                        "key's messages",
                        value));
      if ((n == "acks" || n == "request.required.acks") && v != "all" && v != "-1")
        throw invalid_options_error(
            fmt::format("KafkaPublisherOptions: config {}={} is refused: a message counts as "
                        "sent only once every in-sync replica has it (acks=all)",
                        name, value));
      if ((n == "max.in.flight.requests.per.connection" || n == "max.in.flight") && parse_count(name, value) > 5)
        throw invalid_options_error(
            fmt::format("KafkaPublisherOptions: config {}={} is refused: the idempotent producer "
                        "keeps order with at most 5 requests in flight",
                        name, value));
      if (n == "transactional.id")
        throw invalid_options_error("KafkaPublisherOptions: config transactional.id is not supported: the outbox needs no Kafka "
                                    "transactions (downstream consumers deduplicate on idem-outbox-id)");
      if ((n == "message.timeout.ms" || n == "delivery.timeout.ms") && parse_count(name, value) > options_.timeout.count())
        throw invalid_options_error(
            fmt::format("KafkaPublisherOptions: config {}={} exceeds timeout ({} ms): publish() "
                        "would give up on messages librdkafka still retries",
                        name, value, options_.timeout.count()));
    }
    rk_ = make_producer();  // a bad property fails here, at construction
  }
  ~Impl() { destroy(); }

  const KafkaPublisherOptions& options() const noexcept { return options_; }

  void publish(std::span<const OutboxMessage> batch) {
    std::lock_guard lock(mu_);
    if (batch.empty()) return;
    for (const auto& m : batch)
      if (!legal_topic(m.destination))
        throw publish_error(fmt::format("kafka: outbox message {} names topic \"{}\", which Kafka cannot hold (1..249 "
                                        "characters of a-z A-Z 0-9 . _ -); fix the destination the handler writes",
                                        m.id, m.destination),
                            false);
    if (!rk_) rk_ = make_producer();

    const auto deadline = Clock::now() + options_.timeout;
    auto state = std::make_shared<Batch>();
    state->errors.assign(batch.size(), RD_KAFKA_RESP_ERR__STATE);  // "not produced" until a report says otherwise
    std::size_t produced = 0;
    rd_kafka_resp_err_t produce_err = RD_KAFKA_RESP_ERR_NO_ERROR;
    for (; produced < batch.size(); ++produced) {
      produce_err = produce_one(batch[produced], state, produced, deadline);
      if (produce_err != RD_KAFKA_RESP_ERR_NO_ERROR) break;
    }
    while (state->pending > 0 && Clock::now() < deadline) {
      const auto left = std::chrono::duration_cast<millis>(deadline - Clock::now()).count();
      rd_kafka_poll(rk_, static_cast<int>(std::clamp<long long>(left, 1, 100)));
    }
    bool timed_out = false;
    if (state->pending > 0) {
      // Withdraw what is still queued or in flight: its reports come at once (as purged), so the
      // next batch starts clean. An in-flight message may still have been written: harmless,
      // the relay sends it again with the same id.
      timed_out = true;
      rd_kafka_purge(rk_, RD_KAFKA_PURGE_F_QUEUE | RD_KAFKA_PURGE_F_INFLIGHT);
      const auto grace = Clock::now() + std::chrono::seconds(5);
      while (state->pending > 0 && Clock::now() < grace) rd_kafka_poll(rk_, 10);
    }
    char err[512];
    if (rd_kafka_fatal_error(rk_, err, sizeof err) != RD_KAFKA_RESP_ERR_NO_ERROR) {
      // An idempotent producer that hit a fatal error (e.g. its producer id fenced) never sends
      // again: the next batch gets a fresh producer, with a new producer id.
      destroy();
      fail(std::string("the producer hit a fatal error (") + err +
               "); none of the batch counts as sent, a new producer sends it again",
           true);
    }
    report(batch, *state, produced, produce_err, timed_out);
  }

private:
  rd_kafka_t* make_producer() {
    rd_kafka_conf_t* conf = rd_kafka_conf_new();
    auto set = [&](const std::string& name, const std::string& value) {
      char err[512];
      if (rd_kafka_conf_set(conf, name.c_str(), value.c_str(), err, sizeof err) != RD_KAFKA_CONF_OK) {
        rd_kafka_conf_destroy(conf);
        throw invalid_options_error(
            fmt::format("KafkaPublisherOptions: librdkafka refused {}={}: {}", name, value, err));
      }
    };
    set("bootstrap.servers", options_.brokers);
    set("client.id", options_.client_id);
    set("enable.idempotence", "true");
    set("acks", "all");
    set("message.timeout.ms", std::to_string(options_.timeout.count()));
    // publish() hands over a whole batch at once and waits for it: lingering for more messages
    // only adds latency to every batch (5 ms by default, a ceiling of ~20 batches/s).
    set("linger.ms", "0");
    for (const auto& [name, value] : options_.config) set(name, value);
    rd_kafka_conf_set_dr_msg_cb(conf, &idem_kafka_dr_cb);
    char err[512];
    rd_kafka_t* rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, err, sizeof err);
    if (!rk) {
      rd_kafka_conf_destroy(conf);
      throw invalid_options_error(std::string("KafkaPublisher: librdkafka could not create the producer: ") + err);
    }
    return rk;
  }

  void destroy() noexcept {
    if (!rk_) return;
    // Purged messages are reported at once; serving those reports frees their tickets.
    rd_kafka_purge(rk_, RD_KAFKA_PURGE_F_QUEUE | RD_KAFKA_PURGE_F_INFLIGHT);
    rd_kafka_flush(rk_, 2'000);
    rd_kafka_destroy(rk_);
    rk_ = nullptr;
  }

  rd_kafka_resp_err_t produce_one(const OutboxMessage& m, const std::shared_ptr<Batch>& state, std::size_t index,
                                  Clock::time_point deadline) {
    for (;;) {
      rd_kafka_headers_t* hdrs = rd_kafka_headers_new(m.headers.size() + 1);
      rd_kafka_header_add(hdrs, "idem-outbox-id", -1, m.id.data(), static_cast<ssize_t>(m.id.size()));
      for (const auto& [name, value] : m.headers)
        rd_kafka_header_add(hdrs, name.data(), static_cast<ssize_t>(name.size()), value.data(),
                            static_cast<ssize_t>(value.size()));
      auto* ticket = new Ticket{state, index};
      // The key goes as given (an empty key is no key: librdkafka then spreads those messages).
      const rd_kafka_resp_err_t e = rd_kafka_producev(
          rk_, RD_KAFKA_V_TOPIC(m.destination.c_str()), RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY),
          RD_KAFKA_V_KEY(m.message_key.empty() ? nullptr : m.message_key.data(), m.message_key.size()),
          RD_KAFKA_V_VALUE(const_cast<char*>(m.payload.data()), m.payload.size()), RD_KAFKA_V_HEADERS(hdrs),
          RD_KAFKA_V_OPAQUE(ticket), RD_KAFKA_V_END);
      if (e == RD_KAFKA_RESP_ERR_NO_ERROR) {
        ++state->pending;
        return e;
      }
      // On failure the headers and the ticket stay ours.
      rd_kafka_headers_destroy(hdrs);
      delete ticket;
      if (e != RD_KAFKA_RESP_ERR__QUEUE_FULL || Clock::now() >= deadline) {
        state->errors[index] = e;
        return e;
      }
      rd_kafka_poll(rk_, 10);  // the local queue is full: serve reports, which frees room
    }
  }

  [[noreturn]] void fail(const std::string& what, bool retryable) const {
    throw publish_error(fmt::format("kafka ({}): {}", options_.brokers, what), retryable);
  }

  void report(std::span<const OutboxMessage> batch, const Batch& state, std::size_t produced,
              rd_kafka_resp_err_t produce_err, bool timed_out) const {
    if (produce_err != RD_KAFKA_RESP_ERR_NO_ERROR)
      fail(fmt::format("could not queue outbox message {} for topic {}: {}; none of the batch counts as sent",
                       batch[produced].id, batch[produced].destination, rd_kafka_err2str(produce_err)),
           !permanent(produce_err));
    std::size_t failed = 0, first = batch.size();
    bool retryable = true;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      if (state.errors[i] == RD_KAFKA_RESP_ERR_NO_ERROR) continue;
      if (first == batch.size()) first = i;
      ++failed;
      if (permanent(state.errors[i])) retryable = false;
    }
    if (failed == 0) return;
    const std::string count = fmt::format("{} of {} messages", failed, batch.size());
    const OutboxMessage& m = batch[first];
    const std::string why = state.errors[first] == RD_KAFKA_RESP_ERR__STATE ? std::string("no delivery report")
                                                                             : rd_kafka_err2str(state.errors[first]);
    // librdkafka times a message out by itself after message.timeout.ms, which is our own timeout:
    // whichever of the two ends the wait first, the batch was not acknowledged in time.
    if (timed_out || state.errors[first] == RD_KAFKA_RESP_ERR__MSG_TIMED_OUT)
      fail(fmt::format("{} not acknowledged within {} ms (first: {} to topic {}: {}); check that the brokers are "
                       "reachable and the topic exists; the batch will be sent again",
                       count, options_.timeout.count(), m.id, m.destination, why),
           retryable);
    fail(fmt::format("{} refused (first: {} to topic {}: {}){}", count, m.id, m.destination, why,
                     retryable ? "; the batch will be sent again"
                               : "; retrying cannot help: fix the message or the broker's limits"),
         retryable);
  }

  KafkaPublisherOptions options_;
  std::mutex mu_;
  rd_kafka_t* rk_ = nullptr;
};

KafkaPublisher::KafkaPublisher(KafkaPublisherOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
KafkaPublisher::~KafkaPublisher() = default;
KafkaPublisher::KafkaPublisher(KafkaPublisher&&) noexcept = default;
KafkaPublisher& KafkaPublisher::operator=(KafkaPublisher&&) noexcept = default;

void KafkaPublisher::publish(std::span<const OutboxMessage> batch) {
  if (!impl_) throw usage_error("KafkaPublisher: publish() on a moved-from publisher");
  impl_->publish(batch);
}

const KafkaPublisherOptions& KafkaPublisher::options() const {
  if (!impl_) throw usage_error("KafkaPublisher: options() on a moved-from publisher");
  return impl_->options();
}

}  // namespace idem
