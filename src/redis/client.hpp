#pragma once
// Internal to idem_redis: the implementation behind idem::RedisClient — the pool of hiredis
// connections (detail::Pool), the handshake, the one write path, the reply reader, script loading
// with the NOSCRIPT reload, and the not-sent-retry-once rule. The stores only format requests and
// parse replies.

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <hiredis/hiredis.h>

#include "command.hpp"
#include "pool.hpp"
#include "idem/redis/options.hpp"
#include "scripts.hpp"

namespace idem::detail::redis {

struct ReplyFree {
  void operator()(redisReply* r) const noexcept { freeReplyObject(r); }
};
using ReplyPtr = std::unique_ptr<redisReply, ReplyFree>;

struct ContextFree {
  void operator()(redisContext* c) const noexcept { redisFree(c); }
};
using ContextPtr = std::unique_ptr<redisContext, ContextFree>;

inline bool is_error(const redisReply* r) { return r->type == REDIS_REPLY_ERROR; }
inline std::string_view reply_text(const redisReply* r) { return {r->str, r->len}; }
inline std::string_view error_code(std::string_view text) { return text.substr(0, text.find(' ')); }

// What differs between the stores in the advice an error reply carries.
struct ReplyErrorHints {
  std::string_view corrupt;  // after IDEMCORRUPT's text
  std::string_view oom;      // after OOM's
  std::string_view noperm;   // after NOPERM's
  std::string_view who;      // "RedisStore" or "idem", in the Redis Cluster message
  bool usage_code = false;   // IDEMUSAGE (raised by the script) is a usage_error
};
extern const ReplyErrorHints store_hints;
extern const ReplyErrorHints sequence_hints;

// Maps a Redis error reply to the idem exception that says what to do about it.
[[noreturn]] void throw_reply_error(std::string_view text, std::string_view what, const ReplyErrorHints& hints);
// A reply of a shape idem's scripts never send.
[[noreturn]] void throw_bad_reply(std::string_view what);
// A socket failure or timeout while `during` (e.g. "to EVALSHA").
[[noreturn]] void throw_io_error(const redisContext* c, const char* during, bool maybe_ran, const std::string& where,
                                 millis command_timeout);
std::string ms(millis d);

// `what()` is built only when the reply is an error, so the hot path formats no message.
template <class What>
void throw_if_error(const redisReply* r, const ReplyErrorHints& hints, const What& what) {
  if (is_error(r)) throw_reply_error(reply_text(r), what(), hints);
}

// The options with the URL (when set) parsed into them and checked (invalid_options_error naming the field).
RedisOptions resolve_options(RedisOptions o);

class Client {
public:
  explicit Client(RedisOptions o);
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  [[nodiscard]] const RedisOptions& options() const noexcept { return opt_; }

  // Starts an EVALSHA of `s` with `numkeys` keys; the caller adds keys and arguments.
  static Command evalsha(Script s, std::size_t numkeys);
  // One EVALSHA; NOSCRIPT (SCRIPT FLUSH, a restart: the call ran nothing) reloads the script and
  // resends. An error reply is returned, not thrown.
  ReplyPtr eval(Script s, const Request& req, const ReplyErrorHints& hints);
  // Many EVALSHA of `s` in one write and one read pass; NOSCRIPT ones are resent after a reload.
  std::vector<ReplyPtr> eval_many(Script s, const Pipeline& p, const ReplyErrorHints& hints);
  // One plain command (`during` names it in I/O errors); an error reply is returned.
  ReplyPtr call(const Request& req, const char* during);
  // The server's maxmemory-policy, or "" with the reason in `problem`.
  std::string eviction_policy(std::string* problem);

private:
  struct Traits {
    using connection = ContextPtr;
    const Client* client;
    connection connect() const { return client->connect(); }
    static bool alive(connection& c) noexcept;
    static bool reusable(connection& c) noexcept { return c && c->err == 0; }
  };

  // Runs f(connection); a request that never left this process is sent once more on a fresh
  // connection (it cannot have run); anything later is reported, never retried.
  template <class F>
  auto with_connection(F&& f) {
    for (int attempt = 0;; ++attempt) {
      typename Pool<Traits>::Lease lease(pool_);
      try {
        auto result = f(lease.get().get());
        lease.healthy();
        return result;
      } catch (const NotSent& e) {
        if (attempt == 0) continue;
        throw_unsent(e);
      }
    }
  }

  // The request never reached the server whole, so it did not run: safe to send again elsewhere.
  struct NotSent {
    std::string why;
  };
  [[noreturn]] void throw_unsent(const NotSent& e) const;
  [[noreturn]] void throw_io(const redisContext* c, const char* during, bool maybe_ran) const {
    throw_io_error(c, during, maybe_ran, where_, opt_.command_timeout);
  }

  ContextPtr connect() const;
  // Writes `data` whole; throws NotSent when not even its first `first` bytes (its first request) left.
  void send(redisContext* c, std::string_view data, std::size_t first) const;
  // Writes `data` after an earlier request on the same connection: a failure is an I/O error.
  void resend(redisContext* c, std::string_view data, const char* during) const;
  ReplyPtr read_reply(redisContext* c, const char* during) const;
  void load(redisContext* c, Script s, const ReplyErrorHints& hints) const;
  static void check_loaded(const redisReply* r, Script s, const ReplyErrorHints& hints);

  RedisOptions opt_;
  std::string where_;  // for messages: host:port or the socket path
  Pool<Traits> pool_;
};

}  // namespace idem::detail::redis
