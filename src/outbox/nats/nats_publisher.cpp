// NatsPublisher: acknowledged JetStream publishes carrying the outbox id as Nats-Msg-Id.

#include "idem/outbox/nats_publisher.hpp"

#include <fmt/format.h>

#include "nats_util.hpp"

namespace idem {

namespace {

namespace nx = detail::nats;

NatsPublisherOptions checked(NatsPublisherOptions o) {
  if (o.url.empty()) throw invalid_options_error("idem: NatsPublisherOptions::url is empty: name the NATS server (nats://host:4222)");
  if (o.timeout.count() < 1) throw invalid_options_error("idem: NatsPublisherOptions::timeout must be positive");
  return o;
}

}  // namespace

struct NatsPublisher::Impl {
  NatsPublisherOptions opt;
  nx::ConnectionPtr nc;
  nx::JsPtr js;
  std::uint64_t duplicates = 0;

  explicit Impl(NatsPublisherOptions o) : opt(checked(std::move(o))) {}

  void open() {
    js.reset();
    nc = nx::connect(opt.url, opt.timeout, "NatsPublisherOptions");
    js = nx::jetstream(nc.get(), opt.timeout);
  }

  void send(const OutboxMessage& m) {
    const std::string subject = opt.subject_prefix + m.destination;
    natsMsg* raw = nullptr;
    natsStatus s = natsMsg_Create(&raw, subject.c_str(), nullptr, m.payload.data(), static_cast<int>(m.payload.size()));
    if (s != NATS_OK)
      throw publish_error(fmt::format("idem: NatsPublisher: message {} for '{}' cannot be built: {} (check the subject)",
                                      m.id, subject, natsStatus_GetText(s)), false);
    nx::MsgPtr msg(raw);
    for (const auto& [k, v] : m.headers) (void)natsMsgHeader_Add(msg.get(), k.c_str(), nx::header_value(v).c_str());
    if (!m.message_key.empty()) (void)natsMsgHeader_Set(msg.get(), "Idem-Message-Key", m.message_key.c_str());
    (void)natsMsgHeader_Set(msg.get(), "Nats-Msg-Id", m.id.c_str());  // JetStream's own deduplication window
    (void)natsMsgHeader_Set(msg.get(), "idem-outbox-id", m.id.c_str());  // what idem sources key on by default
    jsPubOptions po;
    jsPubOptions_Init(&po);
    po.MaxWait = opt.timeout.count();
    if (!opt.expect_stream.empty()) po.ExpectStream = opt.expect_stream.c_str();
    jsPubAck* ack = nullptr;
    jsErrCode code{};
    s = js_PublishMsg(&ack, js.get(), msg.get(), &po, &code);
    if (ack != nullptr) {
      if (ack->Duplicate) ++duplicates;
      jsPubAck_Destroy(ack);
    }
    if (s == NATS_OK) return;
    const bool retry = nx::transient(s, code);
    throw publish_error(
        fmt::format("idem: NatsPublisher: publishing outbox message {} to '{}' failed: {}{}; {}", m.id, subject,
                    natsStatus_GetText(s), code != 0 ? fmt::format(" (JetStream error {})", static_cast<int>(code)) : "",
                    s == NATS_NO_RESPONDERS ? "no stream captures this subject: add it to a stream"
                    : retry                 ? "the relay retries once the server answers"
                                            : "check the stream's configuration (expect_stream, limits)"),
        retry);
  }
};

NatsPublisher::NatsPublisher(NatsPublisherOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}

NatsPublisher::~NatsPublisher() = default;

void NatsPublisher::publish(std::span<const OutboxMessage> batch) {
  try {
    if (!impl_->nc || natsConnection_IsClosed(impl_->nc.get())) impl_->open();
  } catch (const error& e) {
    throw publish_error(e.what(), e.retryable());
  }
  for (const OutboxMessage& m : batch) impl_->send(m);
}

std::uint64_t NatsPublisher::duplicates() const noexcept { return impl_->duplicates; }

}  // namespace idem
