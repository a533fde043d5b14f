// idem::RedisClient and the connection layer behind it (client.hpp).

#include "client.hpp"

#include <array>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <utility>

#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>

#include "idem/core/error.hpp"
#include "idem/redis/client.hpp"

namespace idem {

namespace detail::redis {

namespace {

timeval to_timeval(millis d) {
  timeval tv{};
  tv.tv_sec = static_cast<decltype(tv.tv_sec)>(d.count() / 1000);
  tv.tv_usec = static_cast<decltype(tv.tv_usec)>((d.count() % 1000) * 1000);
  return tv;
}

// The one write path. hiredis's own writer uses write(2), which raises SIGPIPE on a socket the
// server closed; send with MSG_NOSIGNAL turns that into EPIPE. Returns the bytes written.
std::size_t write_all(int fd, std::string_view data) noexcept {
  std::size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    done += static_cast<std::size_t>(n);
  }
  return done;
}

std::string describe(const RedisOptions& o) {
  return o.unix_socket.empty() ? o.host + ":" + std::to_string(o.port) : o.unix_socket;
}

Command script_load(Script s) {
  Command cmd;
  cmd.arg("SCRIPT").arg("LOAD").arg(script(s).source);
  return cmd;
}

}  // namespace

// A pooled connection the server closed while idle (restart, idle timeout, CLIENT KILL) reads as
// ready-with-EOF; it is dropped before use, so a restart costs no failed call.
bool Client::Traits::alive(connection& c) noexcept {
  pollfd p{c->fd, POLLIN, 0};
  int rc;
  do rc = ::poll(&p, 1, 0);
  while (rc < 0 && errno == EINTR);
  return rc == 0;
}

Client::Client(RedisOptions o)
    : opt_(resolve_options(std::move(o))),
      where_(describe(opt_)),
      pool_(opt_.pool, Traits{this}, "Redis at " + where_) {
  // One connection now, so a wrong address or password fails here and not mid-message; every
  // script is loaded on it in one round trip (a NOSCRIPT later reloads the one it names).
  with_connection([&](redisContext* c) {
    Pipeline loads;
    for (std::size_t i = 0; i < script_count; ++i) loads.add(script_load(static_cast<Script>(i)).format());
    send(c, loads.all(), loads[0].size());
    std::array<ReplyPtr, script_count> replies;
    for (auto& r : replies) r = read_reply(c, "to SCRIPT LOAD");
    for (std::size_t i = 0; i < script_count; ++i) check_loaded(replies[i].get(), static_cast<Script>(i), store_hints);
    return 0;
  });
}

Command Client::evalsha(Script s, std::size_t numkeys) {
  Command cmd;
  cmd.arg("EVALSHA").arg(script(s).sha).arg(numkeys);
  return cmd;
}

// Sends the handshake (AUTH, SELECT) in one write and checks each answer.
ContextPtr Client::connect() const {
  const timeval ctv = to_timeval(opt_.connect_timeout);
  redisContext* raw = opt_.unix_socket.empty() ? redisConnectWithTimeout(opt_.host.c_str(), opt_.port, ctv)
                                               : redisConnectUnixWithTimeout(opt_.unix_socket.c_str(), ctv);
  if (raw == nullptr) throw connection_error("idem: cannot allocate a Redis connection", "", true);
  ContextPtr c(raw);
  if (c->err)
    throw connection_error("idem: cannot connect to Redis at " + where_ + " within connect_timeout (" +
                               ms(opt_.connect_timeout) + "): " + c->errstr +
                               "; is redis-server running there? retry later",
                           "", true);
  if (redisSetTimeout(c.get(), to_timeval(opt_.command_timeout)) != REDIS_OK)
    throw connection_error("idem: cannot set the command timeout on a Redis socket: " + std::string(c->errstr), "",
                           true);
  Pipeline hello;
  if (!opt_.password.empty()) {
    Command auth;
    auth.arg("AUTH");
    if (!opt_.user.empty()) auth.arg(opt_.user);
    hello.add(auth.arg(opt_.password).format());
  }
  if (opt_.db != 0) hello.add(Command().arg("SELECT").arg(opt_.db).format());
  if (hello.size() == 0) return c;
  if (write_all(c->fd, hello.all()) != hello.all().size()) throw_io(c.get(), "while authenticating", false);
  std::string first_error;
  for (std::size_t i = 0; i < hello.size(); ++i) {
    // No request of the caller's was sent yet: a failure here is an ordinary connection error.
    ReplyPtr r = read_reply(c.get(), "while authenticating", false);
    if (is_error(r.get()) && first_error.empty()) first_error = std::string(reply_text(r.get()));
  }
  if (!first_error.empty()) throw_reply_error(first_error, "the connection handshake (AUTH/SELECT)", store_hints);
  return c;
}

void Client::send(redisContext* c, std::string_view data, std::size_t first) const {
  const std::size_t sent = write_all(c->fd, data);
  if (sent == data.size()) return;
  // A request the server did not get whole cannot run; one after a whole one might have.
  if (sent < first) throw NotSent{std::strerror(errno)};
  throw_io(c, "while sending a pipeline", true);
}

void Client::resend_after(redisContext* c, std::string_view data, const char* during) const {
  if (write_all(c->fd, data) != data.size()) throw_io(c, during, false);
}

ReplyPtr Client::read_reply(redisContext* c, const char* during, bool maybe_ran) const {
  void* r = nullptr;
  if (redisGetReply(c, &r) != REDIS_OK || r == nullptr) throw_io(c, during, maybe_ran);
  return ReplyPtr(static_cast<redisReply*>(r));
}

void Client::throw_io(const redisContext* c, const char* during, bool maybe_ran) const {
  IoFailure f = io_failure(c, during, where_, opt_.command_timeout);
  if (maybe_ran) throw InDoubt{std::move(f)};
  throw_io_error(f, false);
}

void Client::throw_unsent(const NotSent& e) const {
  throw connection_error("idem: cannot send to Redis at " + where_ + ": " + e.why + "; retry later", "", true);
}

void Client::check_loaded(const redisReply* r, Script s, const ReplyErrorHints& hints) {
  const ScriptInfo& info = script(s);
  throw_if_error(r, hints, [&] { return "SCRIPT LOAD of " + std::string(info.name); });
  if (r->type != REDIS_REPLY_STRING || reply_text(r) != info.sha)
    throw store_error("idem: SCRIPT LOAD of " + std::string(info.name) + " answered an unexpected SHA1", "", false);
}

// After NOSCRIPT nothing has run, so a SCRIPT LOAD that cannot be sent may be retried elsewhere.
void Client::load(redisContext* c, Script s, const ReplyErrorHints& hints) const {
  const Request req = script_load(s).format();
  send(c, req.view(), req.size);
  check_loaded(read_reply(c, "to SCRIPT LOAD").get(), s, hints);
}

namespace {
bool is_noscript(const redisReply* r) { return is_error(r) && error_code(reply_text(r)) == "NOSCRIPT"; }
}  // namespace

ReplyPtr Client::eval(Script s, const Request& req, const ReplyErrorHints& hints, Resend resend) {
  return with_resend(
      [&](redisContext* c) {
        send(c, req.view(), req.size);
        ReplyPtr reply = read_reply(c, "to EVALSHA");
        if (is_noscript(reply.get())) {
          load(c, s, hints);
          resend_after(c, req.view(), "while sending EVALSHA");
          reply = read_reply(c, "to EVALSHA");
        }
        return reply;
      },
      resend, script(s).name);
}

std::vector<ReplyPtr> Client::eval_many(Script s, const Pipeline& p, const ReplyErrorHints& hints, Resend resend) {
  if (p.size() == 0) return {};
  return with_resend(
      [&](redisContext* c) {
        std::vector<ReplyPtr> out(p.size());
        send(c, p.all(), p[0].size());
        std::vector<std::size_t> again;
        for (std::size_t i = 0; i < p.size(); ++i) {
          out[i] = read_reply(c, "to a batch of EVALSHA");
          if (is_noscript(out[i].get())) again.push_back(i);
        }
        if (!again.empty()) {
          load(c, s, hints);
          std::string all;
          for (std::size_t i : again) all += p[i];
          resend_after(c, all, "while sending a batch of EVALSHA");
          for (std::size_t i : again) out[i] = read_reply(c, "to a batch of EVALSHA");
        }
        return out;
      },
      resend, script(s).name);
}

ReplyPtr Client::call(const Request& req, const char* during) {
  return with_connection([&](redisContext* c) {
    send(c, req.view(), req.size);
    return read_reply(c, during);
  });
}

namespace {
// The value of `name` in a CONFIG GET reply (name, value, name, value...), or nullptr.
const redisReply* config_value(const redisReply* r, std::string_view name) {
  if (r->type != REDIS_REPLY_ARRAY) return nullptr;
  for (std::size_t i = 0; i + 1 < r->elements; i += 2)
    if (r->element[i]->type == REDIS_REPLY_STRING && reply_text(r->element[i]) == name &&
        r->element[i + 1]->type == REDIS_REPLY_STRING)
      return r->element[i + 1];
  return nullptr;
}

bool config_number(const redisReply* r, std::string_view name, std::uint64_t& out) {
  const redisReply* v = config_value(r, name);
  if (v == nullptr) return false;
  const std::string_view t = reply_text(v);
  return std::from_chars(t.data(), t.data() + t.size(), out).ec == std::errc{};
}
}  // namespace

// `CONFIG GET maxmemory*` rather than naming two settings: Redis < 7 takes one pattern only.
ServerConfig Client::server_config() {
  Pipeline p;
  p.add(Command().arg("CONFIG").arg("GET").arg("maxmemory*").format());
  p.add(Command().arg("CONFIG").arg("GET").arg("proto-max-bulk-len").format());
  std::array<ReplyPtr, 2> r = with_connection([&](redisContext* c) {
    send(c, p.all(), p[0].size());
    std::array<ReplyPtr, 2> out;
    for (auto& one : out) one = read_reply(c, "to CONFIG GET");
    return out;
  });
  ServerConfig cfg;
  for (const ReplyPtr& one : r)
    if (is_error(one.get())) {
      cfg.problem = reply_text(one.get());
      return cfg;
    }
  const redisReply* policy = config_value(r[0].get(), "maxmemory-policy");
  if (policy == nullptr || !config_number(r[0].get(), "maxmemory", cfg.maxmemory) ||
      !config_number(r[1].get(), "proto-max-bulk-len", cfg.max_bulk_len)) {
    cfg.problem = "unexpected reply to CONFIG GET";
    return cfg;
  }
  cfg.policy = reply_text(policy);
  return cfg;
}

}  // namespace detail::redis

namespace detail::redis {

ClientHandle::ClientHandle(std::shared_ptr<RedisClient> client, const char* owner)
    : client_(std::move(client)), owner_(owner) {
  if (!client_) throw usage_error(std::string("idem: ") + owner + " needs a RedisClient, got a null pointer");
}
ClientHandle::~ClientHandle() = default;
ClientHandle::ClientHandle(ClientHandle&&) noexcept = default;
ClientHandle& ClientHandle::operator=(ClientHandle&&) noexcept = default;

Client& ClientHandle::impl() const {
  if (!client_)
    throw usage_error(std::string("idem: this ") + owner_ + " was moved from; use the store it was moved to");
  return *client_->impl_;
}
const RedisOptions& ClientHandle::options() const { return impl().options(); }
const std::shared_ptr<RedisClient>& ClientHandle::client() const {
  (void)impl();  // a moved-from store says so here too
  return client_;
}

}  // namespace detail::redis

RedisClient::RedisClient(RedisOptions options) : impl_(std::make_unique<detail::redis::Client>(std::move(options))) {}
RedisClient::~RedisClient() = default;
const RedisOptions& RedisClient::options() const noexcept { return impl_->options(); }
std::string RedisClient::eviction_policy() { return impl_->server_config().policy; }

}  // namespace idem
