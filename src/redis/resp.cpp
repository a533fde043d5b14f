// What every Redis connection shares (client.hpp): the I/O steps and how their failures read,
// hiredis's reply reader with the bound on aggregates, AUTH, and how an endpoint is named in messages.

#include "client.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>
#include <string>
#include <utility>

#include <sys/socket.h>

#include <fmt/format.h>

#include "idem/core/error.hpp"

namespace idem::detail::redis {

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
// server closed; send with MSG_NOSIGNAL turns that into EPIPE.
IoStep write_step(int fd, TlsSession* tls, std::string_view data, std::size_t& done) noexcept {
  while (done < data.size()) {
    if (tls) {
      done += tls->write(data.substr(done));
      if (done < data.size()) break;
      continue;
    }
    const ssize_t n = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    done += static_cast<std::size_t>(n);
  }
  if (done == data.size()) return IoStep::done;
  return errno == EAGAIN || errno == EWOULDBLOCK ? IoStep::wait : IoStep::failed;
}

IoStep read_step(int fd, TlsSession* tls, RespReader& reader, char* buf, std::size_t size) noexcept {
  for (;;) {
    const long n = tls ? tls->read(buf, size) : static_cast<long>(::recv(fd, buf, size, MSG_DONTWAIT));
    if (n > 0) {
      reader.feed(buf, static_cast<std::size_t>(n));
      return IoStep::done;
    }
    if (n == 0) {
      errno = 0;  // the server ended the connection (io_reason's "closed")
      return IoStep::failed;
    }
    if (errno == EINTR && !tls) continue;
    const bool refused = tls && tls->refused();
    return !refused && (errno == EAGAIN || errno == EWOULDBLOCK) ? IoStep::wait : IoStep::failed;
  }
}

std::string io_reason(const TlsSession* tls, int err) {
  if (tls && tls->refused()) return tls->failure();
  return err == 0 ? "the server closed it" : std::strerror(err);
}

IoFailure io_broke(std::string_view where, std::string_view why, std::string_view during) {
  return {fmt::format("connection to Redis at {} broke{}{}: {}", where, during.empty() ? "" : " ", during, why), false};
}

IoFailure io_timed_out(std::string_view where, millis command_timeout, std::string_view during) {
  return {fmt::format("Redis at {} did not answer{}{} within command_timeout ({})", where, during.empty() ? "" : " ",
                      during, ms(command_timeout)),
          true};
}

namespace {
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

RespReader::RespReader() : r_(redisReaderCreate()) {
  if (!r_) throw std::bad_alloc();
  limit_aggregates(r_.get());
}

bool RespReader::feed(const char* data, std::size_t n) noexcept {
  failed_ = redisReaderFeed(r_.get(), data, n) != REDIS_OK;
  return !failed_;
}

ReplyPtr RespReader::next() noexcept {
  void* raw = nullptr;
  if (redisReaderGetReply(r_.get(), &raw) != REDIS_OK) {
    failed_ = true;
    return nullptr;
  }
  return ReplyPtr(static_cast<redisReply*>(raw));
}

std::string RespReader::error(std::string_view where) const {
  return fmt::format("Redis at {} sent a reply that is not RESP: {}", where, reader_error(r_->err, r_->errstr));
}

}  // namespace idem::detail::redis
