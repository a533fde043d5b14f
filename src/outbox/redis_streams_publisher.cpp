// RedisStreamsPublisher: XADD of each outbox message over one hiredis connection, pipelined.

#include "idem/outbox/redis_streams_publisher.hpp"

#include <fmt/format.h>
#include <hiredis/hiredis.h>

#include <string_view>
#include <utility>
#include <vector>

#include "idem/core/error.hpp"

namespace idem {

namespace {

RedisStreamsPublisherOptions checked(RedisStreamsPublisherOptions o) {
  if (!o.redis.url.empty()) o.redis = parse_redis_url(o.redis.url, o.redis);
  if (o.redis.tls.enabled || !o.redis.cluster_nodes.empty() || !o.redis.sentinels.empty())
    throw invalid_options_error(
        "idem: RedisStreamsPublisher speaks to one plain Redis server (redis:// or unix://); TLS, cluster "
        "and Sentinel are not supported by this publisher");
  if (o.redis.port < 1 || o.redis.port > 65535)
    throw invalid_options_error("idem: RedisStreamsPublisherOptions::redis.port must be 1..65535");
  if (o.redis.connect_timeout.count() <= 0 || o.redis.command_timeout.count() <= 0)
    throw invalid_options_error("idem: RedisStreamsPublisherOptions: connect_timeout and command_timeout must be > 0");
  return o;
}

timeval tv(millis m) { return {static_cast<time_t>(m.count() / 1000), static_cast<suseconds_t>((m.count() % 1000) * 1000)}; }

struct ReplyDeleter {
  void operator()(void* r) const noexcept { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

}  // namespace

struct RedisStreamsPublisher::Impl {
  RedisStreamsPublisherOptions opt;
  redisContext* c = nullptr;

  ~Impl() { close(); }
  void close() noexcept {
    if (c) redisFree(c);
    c = nullptr;
  }

  std::string where() const {
    return opt.redis.unix_socket.empty() ? fmt::format("{}:{}", opt.redis.host, opt.redis.port) : opt.redis.unix_socket;
  }

  [[noreturn]] void broken(const std::string& what) {
    const std::string m = fmt::format("idem: redis-streams publisher ({}): {}{}; the relay retries after its backoff",
                                      where(), what, c && c->err ? fmt::format(": {}", c->errstr) : std::string());
    close();
    throw publish_error(m, true);
  }

  Reply command(const std::vector<std::string>& args) {
    std::vector<const char*> argv;
    std::vector<std::size_t> lens;
    for (const auto& a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    Reply r(static_cast<redisReply*>(redisCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data())));
    if (!r) broken("connection lost");
    if (r->type == REDIS_REPLY_ERROR) {
      const std::string m(r->str, r->len);
      close();
      throw publish_error(fmt::format("idem: redis-streams publisher ({}): {}", where(), m), true);
    }
    return r;
  }

  void connect() {
    if (c && c->err == 0) return;
    close();
    c = opt.redis.unix_socket.empty()
            ? redisConnectWithTimeout(opt.redis.host.c_str(), opt.redis.port, tv(opt.redis.connect_timeout))
            : redisConnectUnixWithTimeout(opt.redis.unix_socket.c_str(), tv(opt.redis.connect_timeout));
    if (!c || c->err) broken("cannot connect");
    redisSetTimeout(c, tv(opt.redis.command_timeout));
    if (!opt.redis.password.empty()) {
      if (opt.redis.user.empty())
        command({"AUTH", opt.redis.password});
      else
        command({"AUTH", opt.redis.user, opt.redis.password});
    }
    if (opt.redis.db != 0) command({"SELECT", std::to_string(opt.redis.db)});
  }

  void publish(std::span<const OutboxMessage> batch) {
    if (batch.empty()) return;
    connect();
    std::vector<const char*> argv;
    std::vector<std::size_t> lens;
    std::vector<std::string> owned;
    const std::string maxlen = std::to_string(opt.maxlen);
    for (const OutboxMessage& m : batch) {
      std::string stream = opt.stream_prefix + m.destination;
      owned.clear();
      owned.reserve(8 + 2 * m.headers.size());
      owned.push_back("XADD");
      owned.push_back(std::move(stream));
      if (opt.maxlen > 0) {
        owned.push_back("MAXLEN");
        owned.push_back("~");
        owned.push_back(maxlen);
      }
      owned.push_back("*");
      owned.push_back("id");
      owned.push_back(m.id);
      owned.push_back("key");
      owned.push_back(m.message_key);
      owned.push_back("payload");
      owned.push_back(m.payload);
      for (const auto& [name, value] : m.headers) {
        owned.push_back("h:" + name);
        owned.push_back(value);
      }
      argv.clear();
      lens.clear();
      for (const auto& a : owned) {
        argv.push_back(a.data());
        lens.push_back(a.size());
      }
      // hiredis copies the command into its output buffer: `owned` may be reused at once.
      if (redisAppendCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data()) != REDIS_OK)
        broken("cannot queue XADD");
    }
    std::string first_error;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      void* raw = nullptr;
      if (redisGetReply(c, &raw) != REDIS_OK || !raw) broken("connection lost during XADD");
      Reply r(static_cast<redisReply*>(raw));
      if (r->type == REDIS_REPLY_ERROR && first_error.empty())
        first_error =
            fmt::format("XADD {}{}: {}", opt.stream_prefix, batch[i].destination, std::string_view(r->str, r->len));
    }
    if (!first_error.empty())
      throw publish_error(fmt::format("idem: redis-streams publisher ({}): {}", where(), first_error), true);
  }
};

RedisStreamsPublisher::RedisStreamsPublisher(RedisStreamsPublisherOptions options)
    : impl_(std::make_unique<Impl>()) {
  impl_->opt = checked(std::move(options));
}

RedisStreamsPublisher::~RedisStreamsPublisher() = default;

void RedisStreamsPublisher::publish(std::span<const OutboxMessage> batch) { impl_->publish(batch); }

}  // namespace idem
