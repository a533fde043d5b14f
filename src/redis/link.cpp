// The connection layer under the client (client.hpp): opening a link (TCP or unix socket, TLS on
// top when configured), the one write path and the reply reader for plain and TLS links, and the
// idle check of a pooled link. Shared by the blocking client, the cluster and the async store.

#include "client.hpp"

#include <algorithm>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>

#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <fmt/format.h>

#include "idem/core/error.hpp"

namespace idem::detail::redis {

namespace {
timeval to_timeval(millis d) {
  timeval tv{};
  tv.tv_sec = static_cast<decltype(tv.tv_sec)>(d.count() / 1000);
  tv.tv_usec = static_cast<decltype(tv.tv_usec)>((d.count() % 1000) * 1000);
  return tv;
}
}  // namespace

void add_auth(Pipeline& p, const std::string& user, const std::string& password) {
  if (password.empty()) return;
  Command auth;
  auth.arg("AUTH");
  if (!user.empty()) auth.arg(user);
  p.add(auth.arg(password).format());
}

std::string describe(const Endpoint& e) {
  if (e.port == 0) return e.host;
  return e.host.find(':') != std::string::npos ? fmt::format("[{}]:{}", e.host, e.port)
                                               : fmt::format("{}:{}", e.host, e.port);
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

std::size_t Link::write(std::string_view data) noexcept {
  return tls ? tls->write(data) : write_all(context->fd, data);
}

namespace {
void set_error(redisContext* c, int type, const char* text) noexcept {
  c->err = type;
  std::snprintf(c->errstr, sizeof c->errstr, "%s", text);
}

void* create_limited_array(const redisReadTask* task, int elements);

// hiredis's own reply functions (a table static inside hiredis, which every reader it makes points
// to, so read from one) and the same table with createArray checking the announced count first.
// hiredis takes the table as non-const; it never writes it.
struct ReplyFunctions {
  const redisReplyObjectFunctions* hiredis = nullptr;  // null only if hiredis could not make a reader
  redisReplyObjectFunctions limited{};
};

ReplyFunctions& reply_functions() noexcept {
  static ReplyFunctions f = [] {
    ReplyFunctions out;
    if (redisReader* r = redisReaderCreate()) {
      out.hiredis = r->fn;
      out.limited = *r->fn;
      out.limited.createArray = create_limited_array;
      redisReaderFree(r);
    }
    return out;
  }();
  return f;
}

void* create_limited_array(const redisReadTask* task, int elements) {
  if (elements < 0 || elements > max_reply_elements) return nullptr;
  return reply_functions().hiredis->createArray(task, elements);
}
}  // namespace

void limit_aggregates(redisReader* r) noexcept {
  ReplyFunctions& f = reply_functions();
  if (r != nullptr && f.hiredis != nullptr && r->fn == f.hiredis) r->fn = &f.limited;
}

const char* reader_error(int err, const char* errstr) noexcept {
  if (err != REDIS_ERR_OOM) return errstr;
  static const std::string text = fmt::format(
      "a reply announced more than {} elements (not a Redis server's reply, or a damaged one), or memory ran out",
      max_reply_elements);
  return text.c_str();
}

// Over TLS, decrypted bytes are fed to the context's own reader: hiredis parses them as it would
// what it read from the socket itself.
ReplyPtr Link::read() noexcept {
  redisContext* c = context.get();
  void* reply = nullptr;
  if (!tls) {
    if (redisGetReply(c, &reply) != REDIS_OK) return nullptr;
  } else {
    for (;;) {
      if (redisReaderGetReply(c->reader, &reply) != REDIS_OK) {
        set_error(c, c->reader->err, c->reader->errstr);
        return nullptr;
      }
      if (reply != nullptr) break;
      char buf[16 * 1024];
      const long n = tls->read(buf, sizeof buf);
      if (n == 0) {
        set_error(c, REDIS_ERR_EOF, "Server closed the connection");
        return nullptr;
      }
      if (n < 0) {
        const int err = errno;
        set_error(c, REDIS_ERR_IO, tls->refused() ? tls->failure().c_str() : std::strerror(err));
        errno = err;
        return nullptr;
      }
      if (redisReaderFeed(c->reader, buf, static_cast<std::size_t>(n)) != REDIS_OK) {
        set_error(c, c->reader->err, c->reader->errstr);
        return nullptr;
      }
    }
  }
  if (reply == nullptr) return nullptr;
  answered = true;
  return ReplyPtr(static_cast<redisReply*>(reply));
}

// A pooled connection the server closed while idle (restart, idle timeout, CLIENT KILL) reads as
// ready-with-EOF.
bool Link::idle() noexcept {
  if (tls) return tls->idle();
  pollfd p{context->fd, POLLIN, 0};
  int rc;
  do rc = ::poll(&p, 1, 0);
  while (rc < 0 && errno == EINTR);
  return rc == 0;
}

namespace {

// Whether `to` answers a plain-text PING with RESP (a reply or an error reply), within `budget`
// (at least 50 ms, at most 500 ms). A TLS port never does: it drops a connection whose first
// bytes are no TLS record.
bool answers_plain_ping(const Endpoint& to, const RedisOptions& o, millis budget) {
  RedisOptions probe = o;
  probe.connect_timeout = probe.command_timeout = std::clamp(budget, millis{50}, millis{500});
  try {
    Link plain = open_connection(to, probe, "Redis", nullptr);
    constexpr std::string_view ping = "PING\r\n";
    return plain.write(ping) == ping.size() && plain.read() != nullptr;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

Link open_connection(const Endpoint& to, const RedisOptions& opt_, const char* role, const Tls* tls) {
  const timeval ctv = to_timeval(opt_.connect_timeout);
  redisContext* raw = to.port == 0 ? redisConnectUnixWithTimeout(to.host.c_str(), ctv)
                                   : redisConnectWithTimeout(to.host.c_str(), to.port, ctv);
  if (raw == nullptr) throw connection_error("idem: cannot allocate a Redis connection", "", true);
  ContextPtr c(raw);
  limit_aggregates(c->reader);
  const std::string at = describe(to);
  if (c->err)
    throw connection_error(fmt::format("idem: cannot connect to {} at {} within connect_timeout ({}): {}; is it "
                                       "running there? retry later",
                                       role, at, ms(opt_.connect_timeout), c->errstr),
                           "", true);
  if (redisSetTimeout(c.get(), to_timeval(opt_.command_timeout)) != REDIS_OK)
    throw connection_error(fmt::format("idem: cannot set the command timeout on a Redis socket: {}", c->errstr), "",
                           true);
  Link link{std::move(c), nullptr};
  if (tls == nullptr) return link;
  // A plain-text Redis may stay silent on the handshake, or close: asked over a connection of
  // its own, it answers a PING, and then no retry can help.
  link.tls = tls->connect(link->fd, to.host, at, role, opt_.connect_timeout, [&](millis budget) {
    if (answers_plain_ping(to, opt_, budget))
      throw_plain_text_port(at, role, "it sent no TLS back to the handshake, and answered a PING in plain text", true);
  });
  return link;
}

}  // namespace idem::detail::redis
