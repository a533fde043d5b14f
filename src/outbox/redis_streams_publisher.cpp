// RedisStreamsPublisher: XADD of each outbox message over one connection, pipelined; on a Redis
// Cluster each XADD routed to its stream's master.

#include "idem/outbox/redis_streams_publisher.hpp"

#include <fmt/format.h>
#include <hiredis/hiredis.h>

#include <cerrno>
#include <cstring>
#include <string_view>
#include <utility>
#include <vector>

#include "client.hpp"
#include "idem/core/error.hpp"
#include "tls.hpp"

namespace idem {

namespace {

using detail::redis::Client;
using detail::redis::Command;
using detail::redis::Link;
using detail::redis::Pipeline;
using detail::redis::ReplyPtr;

RedisStreamsPublisherOptions checked(RedisStreamsPublisherOptions o) {
  o.redis = detail::redis::resolve_options(std::move(o.redis));
  return o;
}

}  // namespace

// The connection comes from the factory every Redis entry point uses (Client::open_ready: TLS and
// its checks, AUTH, SELECT, Sentinel discovery and ROLE check); the XADDs are this file's own.
struct RedisStreamsPublisher::Impl {
  RedisStreamsPublisherOptions opt;
  std::unique_ptr<Client> factory;
  Link link;

  void close() noexcept { link = Link{}; }

  std::string where() const { return factory->where(); }

  // A Redis Cluster: each XADD goes to the master of its stream's slot (the stores' routing,
  // following MOVED / ASK), one at a time in the batch's order, so a key's messages keep theirs.
  void publish_clustered(std::span<const OutboxMessage> batch) {
    for (const OutboxMessage& m : batch) {
      const std::string stream = opt.stream_prefix + m.destination;
      ReplyPtr r;
      try {
        r = factory->call(xadd(m).format(), "XADD", factory->slot_of({stream}));
      } catch (const error& e) {
        throw publish_error(fmt::format("idem: redis-streams publisher: {}", e.what()), e.retryable());
      }
      if (r->type == REDIS_REPLY_ERROR)
        throw publish_error(fmt::format("idem: redis-streams publisher (cluster): XADD {}: {}", stream,
                                        std::string_view(r->str, r->len)),
                            true);
    }
  }

  // The XADD of `m`: views of m's fields (m must outlive format()), the composed parts copied.
  Command xadd(const OutboxMessage& m) const {
    Command cmd;
    cmd.arg("XADD").joined({opt.stream_prefix, m.destination});
    if (opt.maxlen > 0) cmd.arg("MAXLEN").arg("~").arg(opt.maxlen);
    cmd.arg("*").arg("id").arg(m.id).arg("key").arg(m.message_key).arg("payload").arg(m.payload);
    for (const auto& [name, value] : m.headers) cmd.joined({"h:", name}).arg(value);
    return cmd;
  }

  [[noreturn]] void broken(const std::string& what) {
    const int err = errno;
    try {
      factory->throw_if_tls_refused(link, err);  // mutual TLS without a certificate, a TLS alert
    } catch (const error& e) {
      close();
      throw publish_error(fmt::format("idem: redis-streams publisher: {}", e.what()), false);
    }
    std::string why;
    if (link.tls && !link.tls->failure().empty()) why = fmt::format(": {}", link.tls->failure());
    else if (link.context && link->err) why = fmt::format(": {}", link->errstr);
    else if (err != 0) why = fmt::format(": {}", std::strerror(err));
    const std::string m =
        fmt::format("idem: redis-streams publisher ({}): {}{}; the relay retries after its backoff", where(), what, why);
    close();
    factory->doubt_master();
    throw publish_error(m, true);
  }

  void connect() {
    if (link.context && link->err == 0) return;
    close();
    try {
      link = factory->open_ready();
    } catch (const error& e) {
      // A TLS check or a refused AUTH says what to fix and no retry helps; a server down does.
      factory->doubt_master();
      throw publish_error(fmt::format("idem: redis-streams publisher: {}", e.what()), e.retryable());
    }
  }

  void publish(std::span<const OutboxMessage> batch) {
    if (batch.empty()) return;
    if (factory->clustered()) return publish_clustered(batch);
    connect();
    Pipeline xadds;
    for (const OutboxMessage& m : batch) xadds.add(xadd(m).format());
    if (link.write(xadds.all()) != xadds.all().size()) broken("connection lost while sending XADD");
    std::string first_error;
    bool demoted = false;  // a master demoted under us (Sentinel) answered READONLY
    for (std::size_t i = 0; i < batch.size(); ++i) {
      ReplyPtr r = link.read();
      if (!r) broken("connection lost during XADD");
      demoted = demoted || detail::redis::is_not_master(r.get());
      if (r->type == REDIS_REPLY_ERROR && first_error.empty())
        first_error =
            fmt::format("XADD {}{}: {}", opt.stream_prefix, batch[i].destination, std::string_view(r->str, r->len));
    }
    if (!first_error.empty()) {
      if (demoted) {  // the next batch asks the sentinels
        close();
        factory->doubt_master();
      }
      throw publish_error(fmt::format("idem: redis-streams publisher ({}): {}", where(), first_error), true);
    }
  }
};

RedisStreamsPublisher::RedisStreamsPublisher(RedisStreamsPublisherOptions options)
    : impl_(std::make_unique<Impl>()) {
  impl_->opt = checked(std::move(options));
  // On a cluster a routing Client (it maps the slots now: a wrong seed list fails here); otherwise
  // a factory that connects at the first publish.
  impl_->factory = impl_->opt.redis.cluster_nodes.empty()
                       ? std::make_unique<Client>(impl_->opt.redis, Client::FactoryOnly{})
                       : std::make_unique<Client>(impl_->opt.redis);
}

RedisStreamsPublisher::~RedisStreamsPublisher() = default;

void RedisStreamsPublisher::publish(std::span<const OutboxMessage> batch) { impl_->publish(batch); }

}  // namespace idem
