// The reply machine (reply_machine.hpp).

#include "reply_machine.hpp"

#include <algorithm>
#include <optional>

#include <fmt/format.h>

#include "cluster.hpp"
#include "idem/core/error.hpp"

namespace idem::detail::redis {

namespace {

Decision fail(std::exception_ptr e) {
  Decision d;
  d.next = Next::fail;
  d.error = std::move(e);
  return d;
}

}  // namespace

bool is_not_master(const redisReply* r) {
  if (!is_error(r)) return false;
  const std::string_view code = error_code(reply_text(r));
  return code == "READONLY" || code == "LOADING" || code == "MASTERDOWN";
}

std::chrono::milliseconds tryagain_delay(int redirects) noexcept {
  return std::chrono::milliseconds(std::min(5 << std::clamp(redirects, 1, 5), 100));
}

namespace {
// The redirection rule of on_reply: deliver when `r` is not MOVED, ASK or TRYAGAIN.
Decision on_redirect(Attempt& a, const redisReply* r, int max_redirects, std::string_view what, int slot) {
  if (!is_error(r)) return {};
  const std::string_view text = reply_text(r);
  std::optional<Redirect> to = parse_redirect(text);
  if (!to && error_code(text) != "TRYAGAIN") return {};
  if (++a.redirects > max_redirects)
    return fail(capture([&] {
      throw store_error(fmt::format("idem: the Redis Cluster redirected the {} of slot {} {} times "
                                    "(RedisOptions::max_redirects), the last answer: {}; a slot is moving or the "
                                    "map is inconsistent: retry later",
                                    what, slot, a.redirects - 1, text),
                        "REDIRECTS", true);
    }));
  Decision d;
  if (!to) {
    // A slot in migration holds some of a multi-key call's keys and not the others: it ran
    // nothing; once the keys are together (or a coalesced call is split) it will run.
    d.next = Next::later;
    d.delay = tryagain_delay(a.redirects);
    return d;
  }
  d.next = to->ask ? Next::ask : Next::moved;
  d.to = std::move(*to);
  return d;
}
}  // namespace

Decision on_reply(Attempt& a, const redisReply* r, const Route& route, std::string_view what, int slot) {
  if (!is_error(r)) return {};
  if (route.cluster)
    if (Decision d = on_redirect(a, r, route.max_redirects, what, slot); d.next != Next::deliver) return d;
  // SCRIPT FLUSH or a restart under us: the call ran nothing. A second NOSCRIPT is an error.
  if (is_noscript(r) && a.idem_script && !a.reloaded) {
    a.reloaded = true;
    return {.next = Next::reload};
  }
  if (route.sentinel && is_not_master(r))
    return {.next = Next::leave_master,
            .why = fmt::format("it answered {} (not the master now)", error_code(reply_text(r)))};
  return on_resent_reply(a, r, what);
}

Decision on_resent_reply(const Attempt& a, const redisReply* r, std::string_view what) {
  // The first sending may have run and this one did not settle it: the request's own error
  // (e.g. a lease taken by another holder since) says nothing about what the first one did.
  if (!a.resent || !is_error(r)) return {};
  const std::string text(reply_text(r));
  return fail(capture([&] { throw_outcome_unknown(a.first, what, text, std::string(error_code(text))); }));
}

Decision on_lost(Attempt& a, const IoFailure& f, Resend resend, std::string_view what) {
  if (a.resent) return fail(capture([&] { throw_outcome_unknown(a.first, what, f.text, ""); }));
  if (resend != Resend::same_holder) return fail(capture([&] { throw_io_error(f, true); }));
  a.resent = true;
  a.first = f;
  return {.next = Next::resend};
}

Decision on_unsent(const Attempt& a, std::exception_ptr e, std::string_view why, std::string_view what) {
  if (!a.resent) return fail(std::move(e));
  return fail(capture([&] { throw_outcome_unknown(a.first, what, why, ""); }));
}

}  // namespace idem::detail::redis
