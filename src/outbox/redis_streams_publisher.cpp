// RedisStreamsPublisher: XADD of each outbox message on the Redis engine, pipelined; on a Redis
// Cluster each XADD routed to its stream's master.

#include "idem/outbox/redis_streams_publisher.hpp"

#include <fmt/format.h>
#include <hiredis/hiredis.h>

#include <string_view>
#include <utility>
#include <vector>

#include "client.hpp"
#include "engine_store.hpp"
#include "idem/core/error.hpp"

namespace idem {

namespace {

using detail::asio_redis::EngineStore;
using detail::redis::Client;
using detail::redis::Command;
using detail::redis::ReplyPtr;

RedisStreamsPublisherOptions checked(RedisStreamsPublisherOptions o) {
  o.redis = detail::redis::resolve_options(std::move(o.redis));
  return o;
}

}  // namespace

// The XADDs are plain commands on the Redis engine of a client of the publisher's own (the stores'
// transport: TLS and its checks, AUTH, SELECT, Sentinel and a demoted master, reconnects; on a
// cluster each to its stream's master, MOVED / ASK followed). A batch leaves pipelined; on each
// connection the XADDs keep the batch's order, so a key's messages keep theirs.
struct RedisStreamsPublisher::Impl {
  RedisStreamsPublisherOptions opt;
  std::unique_ptr<Client> client;

  // The XADD of `m`: views of m's fields (m must outlive format()), the composed parts copied.
  Command xadd(const OutboxMessage& m) const {
    Command cmd;
    cmd.arg("XADD").joined({opt.stream_prefix, m.destination});
    if (opt.maxlen > 0) cmd.arg("MAXLEN").arg("~").arg(opt.maxlen);
    cmd.arg("*").arg("id").arg(m.id).arg("key").arg(m.message_key).arg("payload").arg(m.payload);
    for (const auto& [name, value] : m.headers) cmd.joined({"h:", name}).arg(value);
    return cmd;
  }

  // An XADD lost on the way (no reply) is not resent here: the relay sends the batch again after
  // its backoff and the consumers drop the second copy by its id.
  void publish(std::span<const OutboxMessage> batch) {
    if (batch.empty()) return;
    std::vector<EngineStore::PlainCommand> xadds;
    xadds.reserve(batch.size());
    for (const OutboxMessage& m : batch)
      xadds.push_back({std::string(xadd(m).format().view()), "XADD", client->slot_of({opt.stream_prefix, m.destination})});
    std::vector<ReplyPtr> replies;
    try {
      replies = client->core().store.commands(std::move(xadds));
    } catch (const error& e) {
      // A TLS check or a refused AUTH says what to fix and no retry helps; a server down does.
      throw publish_error(fmt::format("idem: redis-streams publisher: {}", e.what()), e.retryable());
    }
    for (std::size_t i = 0; i < batch.size(); ++i)
      if (replies[i]->type == REDIS_REPLY_ERROR)
        throw publish_error(fmt::format("idem: redis-streams publisher ({}): XADD {}{}: {}", client->where(),
                                        opt.stream_prefix, batch[i].destination,
                                        std::string_view(replies[i]->str, replies[i]->len)),
                            true);
  }
};

RedisStreamsPublisher::RedisStreamsPublisher(RedisStreamsPublisherOptions options)
    : impl_(std::make_unique<Impl>()) {
  impl_->opt = checked(std::move(options));
  // It connects at the first publish, so a relay starts while Redis is down; on a cluster it reads
  // the slot map now (a wrong seed list fails here).
  impl_->client = std::make_unique<Client>(impl_->opt.redis, Client::FactoryOnly{});
}

RedisStreamsPublisher::~RedisStreamsPublisher() = default;

void RedisStreamsPublisher::publish(std::span<const OutboxMessage> batch) { impl_->publish(batch); }

}  // namespace idem
