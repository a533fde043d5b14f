#pragma once
// Internal to idem_redis: a Redis reply and what a transport can say about one request — the
// words the client (client.hpp), the cluster router (cluster.hpp), the reply machine
// (reply_machine.hpp) and the multiplexed connection (src/asio) share.

#include <exception>
#include <memory>
#include <string>
#include <string_view>

#include <hiredis/hiredis.h>

namespace idem::detail::redis {

// What f throws, as an exception_ptr (null when it returns).
template <class F>
std::exception_ptr capture(F&& f) noexcept {
  try {
    f();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

struct ReplyFree {
  void operator()(redisReply* r) const noexcept { freeReplyObject(r); }
};
using ReplyPtr = std::unique_ptr<redisReply, ReplyFree>;

inline bool is_error(const redisReply* r) { return r->type == REDIS_REPLY_ERROR; }
inline std::string_view reply_text(const redisReply* r) { return {r->str, r->len}; }
inline std::string_view error_code(std::string_view text) { return text.substr(0, text.find(' ')); }
// NOSCRIPT: the script cache was flushed (or the server restarted); the call ran nothing.
inline bool is_noscript(const redisReply* r) { return is_error(r) && error_code(reply_text(r)) == "NOSCRIPT"; }

// A socket failure or timeout while `during` (e.g. "to EVALSHA"): what happened, without advice.
struct IoFailure {
  std::string text;  // "Redis at host:port did not answer ...", "connection to Redis at ... broke ..."
  bool timed_out = false;
};

// timeout_error or connection_error (retryable), saying whether the request may have run.
[[noreturn]] void throw_io_error(const IoFailure& f, bool maybe_ran);
// A request whose reply was lost was sent once more, as the same holder, and that did not settle
// it either (`second` says why): outcome_unknown_error. `what` names the request.
[[noreturn]] void throw_outcome_unknown(const IoFailure& first, std::string_view what, std::string_view second,
                                        std::string code);

// Whether a request whose reply was lost (it may have run) is sent once more on a fresh
// connection: same_holder for idem's holder scripts, which answer their own step already done as
// done (record.lua); never for anything else.
enum class Resend { never, same_holder };

// A server's address (port 0: `host` is a Unix socket's path).
struct Endpoint {
  std::string host;
  int port = 0;
};

// The replica answered where a master was expected, or the server is not ready: the request ran
// nothing, and (Sentinel) the sentinels may know a better server. Every connection user asks this.
bool is_not_master(const redisReply* r);

// A redirection error reply: "MOVED 3999 127.0.0.1:6381" or "ASK 3999 127.0.0.1:6381".
struct Redirect {
  bool ask = false;
  int slot = 0;
  Endpoint to;
};

}  // namespace idem::detail::redis
