// The connection layer shared by RedisStore and RedisSequenceStore (connection.hpp).

#include "connection.hpp"

#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include <openssl/evp.h>
#include <poll.h>
#include <sys/socket.h>

#include "idem/core/error.hpp"

namespace idem::detail::redis {

std::string sha1_hex(std::string_view text) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_Digest(text.data(), text.size(), md, &len, EVP_sha1(), nullptr) != 1)
    throw error("idem: OpenSSL EVP_Digest(SHA-1) failed", false);
  return to_hex(md, len);
}

std::string ms(millis d) { return std::to_string(d.count()) + " ms"; }

timeval to_timeval(millis d) {
  timeval tv{};
  tv.tv_sec = static_cast<decltype(tv.tv_sec)>(d.count() / 1000);
  tv.tv_usec = static_cast<decltype(tv.tv_usec)>((d.count() % 1000) * 1000);
  return tv;
}

void throw_reply_error(std::string_view text, std::string_view what, const ReplyErrorHints& hints) {
  const std::string code(error_code(text));
  const std::string msg = "idem: Redis refused " + std::string(what) + ": " + std::string(text);
  if (code == "IDEMCORRUPT")
    throw corrupt_record_error("idem: " + std::string(what) + ": " + std::string(text.substr(code.size() + 1)) +
                               std::string(hints.corrupt));
  if (hints.usage_code && code == "IDEMUSAGE") throw usage_error(msg);
  if (code == "OOM") throw capacity_error(msg + std::string(hints.oom), code, true);
  if (code == "READONLY")
    throw store_error(msg + "; the server is a read-only replica (failover in progress?): point idem at the primary",
                      code, true);
  if (code == "NOAUTH" || code == "WRONGPASS")
    throw store_error(msg + "; set RedisOptions::user/password (or the URL) to credentials the server accepts", code,
                      false);
  if (code == "NOPERM") throw store_error(msg + std::string(hints.noperm), code, false);
  if (code == "WRONGTYPE")
    throw store_error(msg + "; another application wrote a non-string value under idem's key prefix: use a prefix "
                            "of idem's own",
                      code, false);
  if (code == "LOADING" || code == "BUSY" || code == "MASTERDOWN" || code == "TRYAGAIN" || code == "CLUSTERDOWN")
    throw store_error(msg + "; the server is temporarily unable to serve, retry later", code, true);
  if (code == "MOVED" || code == "ASK" || code == "CROSSSLOT")
    throw store_error(msg + "; this is a Redis Cluster node, which " + std::string(hints.who) +
                          " does not support yet",
                      code, false);
  if (text.find("max number of clients") != std::string_view::npos) throw connection_error(msg, code, true);
  throw store_error(msg, code, false);
}

Pool::Pool(RedisOptions o, ReplyErrorHints hints) : opt(std::move(o)), hints_(hints) {
  where = opt.unix_socket.empty() ? opt.host + ":" + std::to_string(opt.port) : opt.unix_socket;
}

Pool::~Pool() {
  for (redisContext* c : idle_) redisFree(c);
}

namespace {

void check_options(const RedisOptions& o) {
  auto bad = [](const std::string& why) { throw invalid_options_error("idem: RedisOptions: " + why); };
  if (o.unix_socket.empty()) {
    if (o.host.empty()) bad("host is empty; set host (or unix_socket, or url)");
    if (o.port < 1 || o.port > 65535) bad("port " + std::to_string(o.port) + " is not in 1..65535");
  }
  if (o.db < 0) bad("db " + std::to_string(o.db) + " is negative");
  if (o.connect_timeout <= millis{0}) bad("connect_timeout must be positive, got " + ms(o.connect_timeout));
  if (o.command_timeout <= millis{0}) bad("command_timeout must be positive, got " + ms(o.command_timeout));
  if (o.pool_size == 0) bad("pool_size is 0; every call needs a connection, use at least 1");
  if (o.pool_wait < millis{0}) bad("pool_wait is negative; use 0 to fail at once when the pool is busy");
  if (!o.user.empty() && o.password.empty()) bad("user '" + printable(o.user) + "' is set without a password");
  const auto open = o.key_prefix.find('{');
  const auto close = o.key_prefix.find('}');
  if (open != std::string::npos || close != std::string::npos) {
    const bool one_tag = open != std::string::npos && close != std::string::npos && close > open + 1 &&
                         o.key_prefix.find('{', open + 1) == std::string::npos &&
                         o.key_prefix.find('}', close + 1) == std::string::npos;
    if (!one_tag)
      bad("key_prefix '" + printable(o.key_prefix) +
          "' has stray braces; it may hold one whole {tag} (all keys in one cluster slot) or none");
  }
}

}  // namespace

RedisOptions Pool::resolve(RedisOptions o) {
  if (!o.url.empty()) {
    const std::string url = o.url;
    o = parse_redis_url(url, std::move(o));
  }
  check_options(o);
  return o;
}

void Pool::throw_io(redisContext* c, const char* during, bool maybe_ran) const {
  const int err = errno;
  const std::string text = c->errstr[0] ? c->errstr : std::strerror(err);
  const std::string tail = maybe_ran ? "; the command may or may not have run, so nothing is assumed (retry later)"
                                     : "; retry later";
  const bool timed_out = c->err == REDIS_ERR_IO && (err == EAGAIN || err == EWOULDBLOCK || err == ETIMEDOUT ||
                                                    text.find("temporarily unavailable") != std::string::npos);
  if (timed_out)
    throw timeout_error("idem: Redis at " + where + " did not answer " + during + " within command_timeout (" +
                            ms(opt.command_timeout) + ")" + tail,
                        "", true);
  throw connection_error("idem: connection to Redis at " + where + " broke " + during + ": " + text + tail, "", true);
}

bool Pool::send_all(redisContext* c, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::send(c->fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    data.remove_prefix(static_cast<std::size_t>(n));
  }
  return true;
}

ReplyPtr Pool::read_reply(redisContext* c, const char* during) const {
  void* r = nullptr;
  if (redisGetReply(c, &r) != REDIS_OK || r == nullptr) throw_io(c, during, true);
  return ReplyPtr(static_cast<redisReply*>(r));
}

void Pool::send(redisContext* c, std::string_view data) {
  if (!send_all(c, data)) throw not_sent{std::strerror(errno)};
}

void Pool::throw_unsent(const not_sent& e) const {
  throw connection_error("idem: cannot send to Redis at " + where + ": " + e.why + "; retry later", "", true);
}

void Pool::load_script(redisContext* c, std::string_view source, std::string_view sha, std::string_view name,
                       bool unsent_retries) {
  Request req;
  req.command(3);
  req.arg("SCRIPT");
  req.arg("LOAD");
  req.arg(source);
  if (unsent_retries)
    send(c, req.view());
  else if (!send_all(c, req.view()))
    throw_io(c, "while sending SCRIPT LOAD", false);
  ReplyPtr r = read_reply(c, "to SCRIPT LOAD");
  if (is_error(r.get())) throw_reply(reply_text(r.get()), "SCRIPT LOAD of " + std::string(name));
  if (r->type != REDIS_REPLY_STRING || reply_text(r.get()) != sha)
    throw store_error("idem: SCRIPT LOAD of " + std::string(name) + " answered an unexpected SHA1", "", false);
}

// Sends the handshake (AUTH, SELECT) in one write and checks each answer.
ContextPtr Pool::connect() {
  const timeval ctv = to_timeval(opt.connect_timeout);
  redisContext* raw = opt.unix_socket.empty() ? redisConnectWithTimeout(opt.host.c_str(), opt.port, ctv)
                                              : redisConnectUnixWithTimeout(opt.unix_socket.c_str(), ctv);
  if (raw == nullptr) throw connection_error("idem: cannot allocate a Redis connection", "", true);
  ContextPtr c(raw);
  if (c->err)
    throw connection_error("idem: cannot connect to Redis at " + where + " within connect_timeout (" +
                               ms(opt.connect_timeout) + "): " + c->errstr +
                               "; is redis-server running there? retry later",
                           "", true);
  if (redisSetTimeout(c.get(), to_timeval(opt.command_timeout)) != REDIS_OK)
    throw connection_error("idem: cannot set the command timeout on a Redis socket: " + std::string(c->errstr), "",
                           true);
  Request req;
  std::size_t n = 0;
  if (!opt.password.empty()) {
    req.command(opt.user.empty() ? 2 : 3);
    req.arg("AUTH");
    if (!opt.user.empty()) req.arg(opt.user);
    req.arg(opt.password);
    ++n;
  }
  if (opt.db != 0) {
    req.command(2);
    req.arg("SELECT");
    req.arg(static_cast<std::int64_t>(opt.db));
    ++n;
  }
  if (n == 0) return c;
  if (!send_all(c.get(), req.view())) throw_io(c.get(), "while authenticating", false);
  std::string first_error;
  for (std::size_t i = 0; i < n; ++i) {
    ReplyPtr r = read_reply(c.get(), "while authenticating");
    if (is_error(r.get()) && first_error.empty()) first_error = std::string(reply_text(r.get()));
  }
  if (!first_error.empty()) throw_reply(first_error, "the connection handshake (AUTH/SELECT)");
  return c;
}

namespace {

// A pooled connection the server closed while idle (restart, idle timeout, CLIENT KILL) reads
// as ready-with-EOF; it is dropped before use, so a restart costs no failed call.
bool looks_alive(redisContext* c) {
  pollfd p{c->fd, POLLIN, 0};
  int rc;
  do rc = ::poll(&p, 1, 0);
  while (rc < 0 && errno == EINTR);
  return rc == 0;
}

}  // namespace

redisContext* Pool::checkout() {
  std::unique_lock lock(mu_);
  const auto deadline = std::chrono::steady_clock::now() + opt.pool_wait;
  for (;;) {
    if (!idle_.empty()) {
      redisContext* c = idle_.back();
      idle_.pop_back();
      lock.unlock();
      if (looks_alive(c)) return c;
      redisFree(c);
      lock.lock();
      --open_;
      continue;
    }
    if (open_ < opt.pool_size) {
      ++open_;
      lock.unlock();
      try {
        return connect().release();
      } catch (...) {
        lock.lock();
        --open_;
        cv_.notify_one();
        throw;
      }
    }
    if (!cv_.wait_until(lock, deadline, [&] { return !idle_.empty() || open_ < opt.pool_size; }))
      throw timeout_error("idem: all " + std::to_string(opt.pool_size) + " Redis connections stayed busy for " +
                              ms(opt.pool_wait) + "; raise RedisOptions::pool_size to match the calling threads",
                          "", true);
  }
}

void Pool::checkin(redisContext* c, bool healthy) noexcept {
  if (!healthy) redisFree(c);
  {
    std::lock_guard lock(mu_);
    if (healthy)
      idle_.push_back(c);
    else
      --open_;
  }
  cv_.notify_one();
}

}  // namespace idem::detail::redis
