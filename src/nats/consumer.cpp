// NatsConsumer: a JetStream durable pull consumer over one connection, with a keeper thread that
// sends InProgress for the unsettled messages of the batch being handled.

#include "idem/nats/consumer.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>

#include <fmt/format.h>

#include "nats_util.hpp"

namespace idem {

namespace {

namespace nx = detail::nats;

// JetStream refuses these in stream and consumer names (they are subject tokens).
bool bad_name(const std::string& n) { return n.find_first_of(" \t.*>/\\") != std::string::npos; }

NatsConsumerOptions checked(NatsConsumerOptions o) {
  auto bad = [](const char* field, const std::string& why) {
    throw invalid_options_error(fmt::format("idem: NatsConsumerOptions::{} {}", field, why));
  };
  if (o.url.empty()) bad("url", "is empty: name the NATS server (nats://host:4222)");
  if (o.stream.empty() || bad_name(o.stream)) bad("stream", fmt::format("'{}' is not a stream name (no spaces, '.', '*', '>')", o.stream));
  if (o.durable.empty() || bad_name(o.durable))
    bad("durable", fmt::format("'{}' is not a durable name: name it, shared by every instance (no spaces, '.', '*', '>')", o.durable));
  if (o.subject.empty()) bad("subject", "is empty: name the filter subject (wildcards allowed)");
  if (o.batch < 1 || o.batch > 1000) bad("batch", fmt::format("is {}; use 1..1000", o.batch));
  if (o.fetch_wait.count() < 1) bad("fetch_wait", "must be positive");
  if (o.ack_wait.count() < 1) bad("ack_wait", "must be positive (keep it at least the guard's lease)");
  if (o.max_deliver == 0 || o.max_deliver < -1) bad("max_deliver", fmt::format("is {}; use -1 (unlimited) or >= 1", o.max_deliver));
  if (o.in_progress_every.count() < 0) bad("in_progress_every", "is negative; use 0 for a third of AckWait");
  if (o.create_consumer && o.in_progress_every >= o.ack_wait)
    bad("in_progress_every", "is not below ack_wait: the server would redeliver between two signals");
  if (o.timeout.count() < 1) bad("timeout", "must be positive");
  if (o.dead_letter.empty()) o.dead_letter = "idem.dlq." + o.stream;
  if (o.dead_letter == o.subject) bad("dead_letter", "is the consumed subject itself: a dead letter would come back");
  if (o.stream_subjects.empty()) o.stream_subjects.push_back(o.subject);
  return o;
}

std::string str(const char* s) { return s != nullptr ? std::string(s) : std::string(); }

}  // namespace

struct NatsConsumer::Impl {
  NatsConsumerOptions opt;
  nx::ConnectionPtr nc;
  nx::JsPtr js;
  natsSubscription* sub = nullptr;
  millis heartbeat{0};
  std::int64_t max_deliver = -1;  // the durable's own, as the server reports it
  NatsConsumerStats stats;

  // The polled batch; `live` is what the keeper keeps alive (guarded by mu).
  natsMsgList batch{};
  std::vector<std::uint64_t> delivered;
  std::vector<std::uint64_t> sequence;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<natsMsg*> live;
  bool stopping = false;
  std::atomic<std::uint64_t> in_progress{0};
  std::thread keeper;

  explicit Impl(NatsConsumerOptions o) : opt(checked(std::move(o))) {}

  ~Impl() {
    {
      std::lock_guard lock(mu);
      stopping = true;
    }
    cv.notify_all();
    if (keeper.joinable()) keeper.join();
    release();
    close();
  }

  void close() noexcept {
    if (sub != nullptr) natsSubscription_Destroy(sub);
    sub = nullptr;
    js.reset();
    nc.reset();
  }

  void open() {
    nc = nx::connect(opt.url, opt.timeout, "NatsConsumerOptions");
    js = nx::jetstream(nc.get(), opt.timeout);
    if (opt.create_stream) ensure_stream();
    if (opt.create_consumer) ensure_consumer();
    inspect_consumer();
    jsSubOptions so;
    jsSubOptions_Init(&so);
    so.Stream = opt.stream.c_str();
    so.Consumer = opt.durable.c_str();
    jsErrCode code{};
    const natsStatus s = js_PullSubscribe(&sub, js.get(), opt.subject.c_str(), opt.durable.c_str(), nullptr, &so, &code);
    if (s != NATS_OK)
      nx::fail(s, code, fmt::format("binding to durable '{}' of stream '{}'", opt.durable, opt.stream),
               "the durable's filter subject must be NatsConsumerOptions::subject");
  }

  void ensure_stream() {
    jsStreamInfo* si = nullptr;
    jsErrCode code{};
    natsStatus s = js_GetStreamInfo(&si, js.get(), opt.stream.c_str(), nullptr, &code);
    if (s == NATS_OK) {
      jsStreamInfo_Destroy(si);
      return;
    }
    if (code != JSStreamNotFoundErr) nx::fail(s, code, fmt::format("looking up stream '{}'", opt.stream));
    std::vector<const char*> subjects;
    for (const auto& x : opt.stream_subjects) subjects.push_back(x.c_str());
    jsStreamConfig cfg;
    jsStreamConfig_Init(&cfg);
    cfg.Name = opt.stream.c_str();
    cfg.Subjects = subjects.data();
    cfg.SubjectsLen = static_cast<int>(subjects.size());
    cfg.Storage = js_FileStorage;  // survives a server restart, so nothing acked-later is lost
    s = js_AddStream(&si, js.get(), &cfg, nullptr, &code);
    if (s != NATS_OK && code != JSStreamNameExistErr)  // another instance created it first
      nx::fail(s, code, fmt::format("creating stream '{}'", opt.stream), "check stream_subjects overlap no other stream");
    if (si != nullptr) jsStreamInfo_Destroy(si);
  }

  void ensure_consumer() {
    jsConsumerConfig cfg;
    jsConsumerConfig_Init(&cfg);
    cfg.Durable = opt.durable.c_str();
    cfg.AckPolicy = js_AckExplicit;
    cfg.AckWait = static_cast<std::int64_t>(opt.ack_wait.count()) * 1'000'000;  // nanoseconds
    cfg.MaxDeliver = opt.max_deliver;
    cfg.FilterSubject = opt.subject.c_str();
    jsConsumerInfo* ci = nullptr;
    jsErrCode code{};
    natsStatus s = js_AddConsumer(&ci, js.get(), opt.stream.c_str(), &cfg, nullptr, &code);
    if (s != NATS_OK && code != 0) {  // exists with another config: bring it to these options
      s = js_UpdateConsumer(&ci, js.get(), opt.stream.c_str(), &cfg, nullptr, &code);
    }
    if (s != NATS_OK)
      nx::fail(s, code, fmt::format("creating durable '{}' on stream '{}'", opt.durable, opt.stream),
               code == JSStreamNotFoundErr ? "create the stream first, or set create_stream" : "");
    jsConsumerInfo_Destroy(ci);
  }

  // The durable's real settings decide the keeper's interval and the last delivery.
  void inspect_consumer() {
    jsConsumerInfo* ci = nullptr;
    jsErrCode code{};
    const natsStatus s = js_GetConsumerInfo(&ci, js.get(), opt.stream.c_str(), opt.durable.c_str(), nullptr, &code);
    if (s != NATS_OK)
      nx::fail(s, code, fmt::format("looking up durable '{}' on stream '{}'", opt.durable, opt.stream),
               code == JSConsumerNotFoundErr ? "create it, or set create_consumer" : "");
    const jsAckPolicy policy = ci->Config->AckPolicy;
    const millis ack_wait{ci->Config->AckWait / 1'000'000};
    max_deliver = ci->Config->MaxDeliver;
    jsConsumerInfo_Destroy(ci);
    if (policy != js_AckExplicit)
      throw usage_error(fmt::format("idem: durable '{}' does not use explicit acks; a NatsConsumer acks each message "
                                    "after its outcome (recreate it with AckPolicy explicit)", opt.durable));
    heartbeat = opt.in_progress_every.count() > 0 ? opt.in_progress_every : std::max(ack_wait / 3, millis{10});
    if (ack_wait.count() > 0 && heartbeat >= ack_wait)
      throw invalid_options_error(fmt::format("idem: NatsConsumerOptions::in_progress_every ({} ms) is not below the "
                                              "durable's AckWait ({} ms)", heartbeat.count(), ack_wait.count()));
  }

  void keep_alive() {
    std::unique_lock lock(mu);
    while (!stopping) {
      cv.wait_for(lock, heartbeat);
      if (stopping) break;
      // Under the lock: settle() takes a message out of `live` before it acks or destroys it.
      for (natsMsg* m : live)
        if (natsMsg_InProgress(m, nullptr) == NATS_OK) in_progress.fetch_add(1, std::memory_order_relaxed);
    }
  }

  // Drops the batch unsettled: the server redelivers it after AckWait.
  void release() noexcept {
    {
      std::lock_guard lock(mu);
      live.clear();
    }
    if (batch.Msgs != nullptr) natsMsgList_Destroy(&batch);
    batch = natsMsgList{};
  }

  void dead_letter(natsMsg* m, std::size_t i, const std::string& reason) {
    natsMsg* raw = nullptr;
    natsStatus s = natsMsg_Create(&raw, opt.dead_letter.c_str(), nullptr, natsMsg_GetData(m), natsMsg_GetDataLength(m));
    if (s != NATS_OK) nx::fail(s, jsErrCode{}, "creating a dead letter");
    nx::MsgPtr letter(raw);
    const char** keys = nullptr;
    int nkeys = 0;
    if (natsMsgHeader_Keys(m, &keys, &nkeys) == NATS_OK) {
      for (int k = 0; k < nkeys; ++k) {
        const char** values = nullptr;
        int nvalues = 0;
        if (natsMsgHeader_Values(m, keys[k], &values, &nvalues) != NATS_OK) continue;
        for (int v = 0; v < nvalues; ++v) (void)natsMsgHeader_Add(letter.get(), keys[k], values[v]);
        std::free(static_cast<void*>(values));
      }
      std::free(static_cast<void*>(keys));
    }
    (void)natsMsgHeader_Set(letter.get(), "Idem-Reason", nx::header_value(reason).c_str());
    (void)natsMsgHeader_Set(letter.get(), "Idem-Subject", natsMsg_GetSubject(m));
    (void)natsMsgHeader_Set(letter.get(), "Idem-Stream", opt.stream.c_str());
    (void)natsMsgHeader_Set(letter.get(), "Idem-Stream-Sequence", std::to_string(sequence[i]).c_str());
    (void)natsMsgHeader_Set(letter.get(), "Idem-Delivered", std::to_string(delivered[i]).c_str());
    // A Term lost in a crash brings the message back and it is dead-lettered again: the id lets
    // JetStream drop that second letter inside the stream's duplicate window.
    const std::string id = fmt::format("idem-dlq:{}:{}", opt.stream, sequence[i]);
    (void)natsMsgHeader_Set(letter.get(), "Nats-Msg-Id", id.c_str());
    jsErrCode code{};
    if (opt.dead_letter_jetstream) {
      jsPubAck* ack = nullptr;
      s = js_PublishMsg(&ack, js.get(), letter.get(), nullptr, &code);
      if (ack != nullptr) jsPubAck_Destroy(ack);
    } else {
      s = natsConnection_PublishMsg(nc.get(), letter.get());
      if (s == NATS_OK) s = natsConnection_FlushTimeout(nc.get(), opt.timeout.count());
    }
    if (s != NATS_OK)
      nx::fail(s, code, fmt::format("publishing a dead letter to '{}'", opt.dead_letter),
               opt.dead_letter_jetstream ? "the dead-letter subject needs a stream that captures it" : "");
    s = natsMsg_Term(m, nullptr);
    if (s != NATS_OK) nx::fail(s, jsErrCode{}, "terminating a dead-lettered message");
    ++stats.dead_lettered;
  }
};

NatsConsumer::NatsConsumer(NatsConsumerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  impl_->open();
  impl_->keeper = std::thread([impl = impl_.get()] { impl->keep_alive(); });
}

NatsConsumer::~NatsConsumer() = default;

std::vector<NatsMessage> NatsConsumer::poll() {
  Impl& m = *impl_;
  m.release();
  if (!m.nc || natsConnection_IsClosed(m.nc.get())) {
    m.close();
    m.open();
    ++m.stats.reconnects;
  }
  jsErrCode code{};
  const natsStatus s = natsSubscription_Fetch(&m.batch, m.sub, static_cast<int>(m.opt.batch), m.opt.fetch_wait.count(), &code);
  if (s == NATS_TIMEOUT && m.batch.Count == 0) return {};  // nothing within fetch_wait
  if (s != NATS_OK) {
    m.release();
    nx::fail(s, code, fmt::format("fetching from durable '{}' of stream '{}'", m.opt.durable, m.opt.stream));
  }
  std::vector<NatsMessage> out;
  out.reserve(static_cast<std::size_t>(m.batch.Count));
  m.delivered.assign(static_cast<std::size_t>(m.batch.Count), 0);
  m.sequence.assign(static_cast<std::size_t>(m.batch.Count), 0);
  for (int i = 0; i < m.batch.Count; ++i) {
    natsMsg* msg = m.batch.Msgs[i];
    NatsMessage x;
    x.subject = str(natsMsg_GetSubject(msg));
    x.data.assign(natsMsg_GetData(msg) != nullptr ? natsMsg_GetData(msg) : "", static_cast<std::size_t>(natsMsg_GetDataLength(msg)));
    const char** keys = nullptr;
    int nkeys = 0;
    if (natsMsgHeader_Keys(msg, &keys, &nkeys) == NATS_OK) {
      for (int k = 0; k < nkeys; ++k) {
        const char** values = nullptr;
        int nvalues = 0;
        if (natsMsgHeader_Values(msg, keys[k], &values, &nvalues) != NATS_OK) continue;
        for (int v = 0; v < nvalues; ++v) x.headers.emplace_back(keys[k], values[v]);
        std::free(static_cast<void*>(values));
      }
      std::free(static_cast<void*>(keys));
    }
    jsMsgMetaData* meta = nullptr;
    if (natsMsg_GetMetaData(&meta, msg) == NATS_OK) {
      x.stream_sequence = meta->Sequence.Stream;
      x.delivered = meta->NumDelivered;
      jsMsgMetaData_Destroy(meta);
    }
    m.sequence[static_cast<std::size_t>(i)] = x.stream_sequence;
    m.delivered[static_cast<std::size_t>(i)] = x.delivered;
    out.push_back(std::move(x));
  }
  {
    std::lock_guard lock(m.mu);
    m.live.assign(m.batch.Msgs, m.batch.Msgs + m.batch.Count);
  }
  m.stats.fetched += out.size();
  return out;
}

void NatsConsumer::settle(std::span<const NatsDecision> decisions) {
  Impl& m = *impl_;
  const std::size_t n = static_cast<std::size_t>(m.batch.Count);
  if (decisions.size() != n)
    throw usage_error(fmt::format("idem: NatsConsumer::settle: {} messages polled but {} decisions", n, decisions.size()));
  struct Release {
    Impl& m;
    ~Release() { m.release(); }  // settled or not, the batch is done: what is left comes back after AckWait
  } release{m};
  for (std::size_t i = 0; i < n; ++i) {
    natsMsg* msg = m.batch.Msgs[i];
    {
      std::lock_guard lock(m.mu);
      std::erase(m.live, msg);
    }
    const NatsDecision& d = decisions[i];
    switch (d.action) {
      case BrokerAction::ack: {
        jsErrCode code{};
        const natsStatus s = natsMsg_AckSync(msg, nullptr, &code);
        if (s != NATS_OK) nx::fail(s, code, "acking a message", "it is redelivered after AckWait and answered as a duplicate");
        ++m.stats.acked;
        break;
      }
      case BrokerAction::dead_letter: m.dead_letter(msg, i, d.reason); break;
      case BrokerAction::requeue: {
        // JetStream drops a message after its last delivery without a word: set it aside instead.
        if (m.max_deliver > 0 && m.delivered[i] >= static_cast<std::uint64_t>(m.max_deliver)) {
          m.dead_letter(msg, i, fmt::format("max_deliver ({}) reached; last: {}", m.max_deliver,
                                            d.reason.empty() ? "requeued" : d.reason));
          break;
        }
        // The delay is idem::verdict's (jittered); 0 redelivers at once, as the verdict asked.
        const natsStatus s = natsMsg_NakWithDelay(msg, std::max<millis::rep>(d.delay.count(), 0), nullptr);
        if (s != NATS_OK) nx::fail(s, jsErrCode{}, "handing a message back (NakWithDelay)");
        ++m.stats.nacked;
        break;
      }
    }
  }
}

void NatsConsumer::release() noexcept { impl_->release(); }

Delivery NatsConsumer::delivery(const NatsMessage& m) {
  Delivery d;
  d.id = std::to_string(m.stream_sequence);
  if (const std::string* id = m.header("Nats-Msg-Id")) d.key = *id;
  d.payload = m.data;
  d.headers.reserve(m.headers.size());
  for (const auto& [k, v] : m.headers) d.headers.emplace_back(k, v);
  d.attempt = static_cast<std::uint32_t>(std::min<std::uint64_t>(std::max<std::uint64_t>(m.delivered, 1), UINT32_MAX));
  return d;
}

void NatsConsumer::settle(std::span<const Verdict> verdicts) {
  std::vector<NatsDecision> decisions;
  decisions.reserve(verdicts.size());
  for (const Verdict& v : verdicts) decisions.push_back({v.action, v.reason, v.delay});
  settle(std::span<const NatsDecision>(decisions));
}

NatsDecision NatsConsumer::decide(const std::exception_ptr& e, const RetryPolicy& retry) {
  Verdict v = verdict(e, retry);
  return {v.action, std::move(v.reason), v.delay};
}

NatsConsumerStats NatsConsumer::stats() const noexcept {
  NatsConsumerStats s = impl_->stats;
  s.in_progress = impl_->in_progress.load(std::memory_order_relaxed);
  return s;
}

const NatsConsumerOptions& NatsConsumer::options() const noexcept { return impl_->opt; }

}  // namespace idem
