#pragma once
// Internal to idem_redis: what RedisStore and RedisSequenceStore share — a pool of hiredis
// connections, our own RESP writer (sent with MSG_NOSIGNAL, so a dead server never raises SIGPIPE
// in the host process), hiredis's reply reader, and the mapping of error replies and socket
// failures to idem's typed errors.

#include <charconv>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include <hiredis/hiredis.h>
#include <sys/time.h>

#include "idem/detail/hex.hpp"
#include "idem/redis/store.hpp"

namespace idem::detail::redis {

using detail::printable;

std::string sha1_hex(std::string_view text);
std::string ms(millis d);
timeval to_timeval(millis d);

// A holder's token as the scripts store it: 8 bytes, big-endian.
inline std::string token_bytes(std::uint64_t t) {
  std::string s(8, '\0');
  for (int i = 7; i >= 0; --i) {
    s[static_cast<std::size_t>(i)] = static_cast<char>(t & 0xff);
    t >>= 8;
  }
  return s;
}

// A RESP request built by hand: hiredis's own writer uses write(2), which raises SIGPIPE.
class Request {
public:
  void command(std::size_t argc) {
    buf_ += '*';
    number(argc);
  }
  void arg(std::string_view s) {
    buf_ += '$';
    number(s.size());
    buf_.append(s);
    buf_ += "\r\n";
  }
  void arg(std::int64_t v) {
    char tmp[24];
    auto res = std::to_chars(tmp, tmp + sizeof tmp, v);
    arg(std::string_view(tmp, static_cast<std::size_t>(res.ptr - tmp)));
  }
  [[nodiscard]] std::string_view view() const noexcept { return buf_; }
  void clear() noexcept { buf_.clear(); }

private:
  void number(std::size_t n) {
    char tmp[24];
    auto res = std::to_chars(tmp, tmp + sizeof tmp, n);
    buf_.append(tmp, res.ptr);
    buf_ += "\r\n";
  }
  std::string buf_;
};

struct ReplyFree {
  void operator()(redisReply* r) const noexcept { freeReplyObject(r); }
};
using ReplyPtr = std::unique_ptr<redisReply, ReplyFree>;

struct ContextFree {
  void operator()(redisContext* c) const noexcept { redisFree(c); }
};
using ContextPtr = std::unique_ptr<redisContext, ContextFree>;

// The request never reached the server whole, so it did not run: safe to send again elsewhere.
struct not_sent {
  std::string why;
};

inline bool is_error(const redisReply* r) { return r->type == REDIS_REPLY_ERROR; }
inline std::string_view reply_text(const redisReply* r) { return {r->str, r->len}; }
inline std::string_view error_code(std::string_view text) { return text.substr(0, text.find(' ')); }

// What differs between the stores in the advice an error reply carries.
struct ReplyErrorHints {
  std::string_view corrupt;    // after IDEMCORRUPT's text
  std::string_view oom;        // after OOM's
  std::string_view noperm;     // after NOPERM's
  std::string_view who;        // "RedisStore" or "idem", in the Redis Cluster message
  bool usage_code = false;     // IDEMUSAGE (raised by the script) is a usage_error
};

// Maps a Redis error reply to the idem exception that says what to do about it.
[[noreturn]] void throw_reply_error(std::string_view text, std::string_view what, const ReplyErrorHints& hints);

// The pool and the connection-level calls; each store's Impl derives from it.
class Pool {
public:
  // `o` is already resolved from its URL and checked.
  Pool(RedisOptions o, ReplyErrorHints hints);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // The options with the URL (when set) parsed into them, checked (invalid_options_error naming
  // the flaw): what each store does first.
  static RedisOptions resolve(RedisOptions o);

  RedisOptions opt;
  std::string where;  // for messages: host:port or the socket path

  [[noreturn]] void throw_io(redisContext* c, const char* during, bool maybe_ran) const;
  static bool send_all(redisContext* c, std::string_view data);
  ReplyPtr read_reply(redisContext* c, const char* during) const;
  // Sends the whole request or throws not_sent (with_connection then retries on a fresh connection).
  void send(redisContext* c, std::string_view data);
  [[noreturn]] void throw_reply(std::string_view text, std::string_view what) const {
    throw_reply_error(text, what, hints_);
  }

  // SCRIPT LOAD of `source`, checked against its expected SHA1. With `unsent_retries` a failed
  // send throws not_sent (retried by with_connection), else it is reported as an I/O error.
  void load_script(redisContext* c, std::string_view source, std::string_view sha, std::string_view name,
                   bool unsent_retries);

  class Lease {
  public:
    explicit Lease(Pool& p) : p_(&p), c_(p.checkout()) {}
    ~Lease() { p_->checkin(c_, healthy_); }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    redisContext* get() const noexcept { return c_; }
    void healthy() noexcept { healthy_ = true; }

  private:
    Pool* p_;
    redisContext* c_;
    bool healthy_ = false;
  };

  // Runs f(connection); a request that never left this process is sent once more on a fresh
  // connection (it cannot have run), anything later is reported, never retried.
  template <class F>
  auto with_connection(F&& f) {
    for (int attempt = 0;; ++attempt) {
      Lease lease(*this);
      try {
        auto result = f(lease.get());
        lease.healthy();
        return result;
      } catch (const not_sent& e) {
        if (attempt == 0) continue;
        throw_unsent(e);
      }
    }
  }

private:
  ContextPtr connect();
  redisContext* checkout();
  void checkin(redisContext* c, bool healthy) noexcept;
  [[noreturn]] void throw_unsent(const not_sent& e) const;

  ReplyErrorHints hints_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<redisContext*> idle_;
  std::size_t open_ = 0;
};

}  // namespace idem::detail::redis
