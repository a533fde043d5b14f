#pragma once
// Internal to idem_redis: what happens to one Redis request between its sending and its caller,
// decided without I/O. The transport (connection.cpp, engine.cpp, coalesce.cpp) feeds it what it
// saw — a reply, a lost reply, a request that could not be sent — and does what it answers, for
// every Redis entry point. So each rule is written once, here: MOVED / ASK / TRYAGAIN followed at most
// max_redirects times with TRYAGAIN's backoff, NOSCRIPT reloaded once, a demoted master left, a
// lost reply resent once as the same holder, and what is then in doubt reported as
// outcome_unknown_error, never guessed. Tested step by step in tests/redis/reply_machine_test.cpp.

#include <chrono>
#include <exception>
#include <string>
#include <string_view>

#include "reply.hpp"

namespace idem::detail::redis {

// What one request has been through: the machine's state, kept with the request.
struct Attempt {
  int redirects = 0;      // MOVED / ASK / TRYAGAIN answers followed
  bool reloaded = false;  // sent again after NOSCRIPT once already
  // Set by the request, not the machine: it runs one of idem's scripts, so NOSCRIPT is reloaded;
  // false for a caller's plain command, whose NOSCRIPT (its own EVALSHA) is its answer.
  bool idem_script = true;
  bool resent = false;    // this is the second sending, after its reply was lost
  IoFailure first;        // with resent: why the first sending's reply was lost
};

// What the machine knows of where the request runs.
struct Route {
  bool cluster = false;   // the request has a slot and a router: MOVED / ASK / TRYAGAIN are followed
  bool sentinel = false;  // the master was found by the sentinels: a demoted one is left
  int max_redirects = 5;  // RedisOptions::max_redirects
};

// What the transport does next.
enum class Next {
  deliver,       // the reply is the caller's (an error reply too: the caller maps it)
  reload,        // NOSCRIPT ran nothing: SCRIPT LOAD, then the same request at once
  moved,         // ran nothing: to `to`, the slot's master now (the slot map is fixed)
  ask,           // ran nothing: to `to` with ASKING first, for this sending only
  later,         // TRYAGAIN ran nothing: the same route after `delay`
  leave_master,  // a demoted master ran nothing: a new connection (the sentinels asked again), it first
  resend,        // the reply was lost: once more, as the same holder, on a fresh connection
  fail,          // `error` is the caller's answer
};

// The machine's answer.
struct Decision {
  Next next = Next::deliver;
  Redirect to;                          // moved, ask
  std::chrono::milliseconds delay{0};   // later
  std::exception_ptr error;             // fail
  std::string why;                      // leave_master: what the server answered, for the log and the error
};

// A reply to the request `what` (of `slot` on a cluster) arrived; updates `a`. In this order:
// a redirection (cluster only), NOSCRIPT (once, for idem's scripts), a demoted master (Sentinel only), an error
// answering a resend (in doubt), else deliver.
Decision on_reply(Attempt& a, const redisReply* r, const Route& route, std::string_view what, int slot);

// The last rule of on_reply alone: `r`, an error reply, answers a resend (fail: the first
// sending's outcome is unknown), or the first sending (deliver). For replies the transport has
// already passed through the other rules (a pipeline's, a coalesced call's members').
Decision on_resent_reply(const Attempt& a, const redisReply* r, std::string_view what);

// The request was sent and its reply lost (`f`: a broken connection or command_timeout); updates `a`.
// Resend for a holder's first sending; a second loss, or a request that is not a holder's, fails.
Decision on_lost(Attempt& a, const IoFailure& f, Resend resend, std::string_view what);

// The request could not be sent or routed (`why`, the error `e`): `e` for a first sending; for a
// resend the first one's outcome is still unknown.
Decision on_unsent(const Attempt& a, std::exception_ptr e, std::string_view why, std::string_view what);

// TRYAGAIN's wait before the `redirects`-th attempt: 10, 20, 40... ms, at most 100.
std::chrono::milliseconds tryagain_delay(int redirects) noexcept;

}  // namespace idem::detail::redis
