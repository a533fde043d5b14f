// Auto-batching on AsyncRedisStore's connection (connection.hpp): where a one-key step sits in its
// single-key EVALSHA, and the `many` call (src/redis/lua/many.lua) that carries several callers'
// steps at once, its reply split back to each caller as its own call's would have been.

#include <charconv>
#include <cstdint>
#include <string_view>

#include <fmt/format.h>
#include <hiredis/hiredis.h>

#include "connection.hpp"

namespace idem::detail::asio_redis {

namespace {
// Parses the decimal in `text`; -1 when it is not one.
long long decimal(std::string_view text) {
  long long v = -1;
  const auto res = std::from_chars(text.data(), text.data() + text.size(), v);
  return res.ec == std::errc() && res.ptr == text.data() + text.size() ? v : -1;
}
// The end of the RESP bulk string at `at` in `b`, or npos.
std::size_t bulk_end(std::string_view b, std::size_t at) {
  if (at >= b.size() || b[at] != '$') return std::string_view::npos;
  const std::size_t eol = b.find("\r\n", at);
  if (eol == std::string_view::npos) return eol;
  const long long len = decimal(b.substr(at + 1, eol - at - 1));
  if (len < 0 || eol + 4 + static_cast<std::size_t>(len) > b.size()) return std::string_view::npos;
  return eol + 4 + static_cast<std::size_t>(len);
}
}  // namespace

void locate_step(Op& op, Script s) {
  const std::string_view b = op.bytes;
  const std::size_t eol = b.find("\r\n");
  if (b.empty() || b[0] != '*' || eol == std::string_view::npos) return;
  const long long argc = decimal(b.substr(1, eol - 1));
  std::size_t at = eol + 2;
  for (int i = 0; i < 3 && at != std::string_view::npos; ++i) at = bulk_end(b, at);  // EVALSHA sha 1
  const std::size_t args = at == std::string_view::npos ? at : bulk_end(b, at);
  if (args == std::string_view::npos || b.size() > UINT32_MAX) return;
  const long long nargs = argc - 4;
  char step = 0;
  switch (s) {
    case Script::acquire: step = nargs == 5 ? 'A' : 0; break;
    case Script::complete:
      if (nargs == 4) step = 'C';
      else if (nargs == 5) step = b.substr(b.size() - 7) == "$1\r\n1\r\n" ? 'U' : 'C';
      break;
    case Script::fail: step = nargs == 7 ? 'f' : 0; break;
    case Script::extend: step = nargs == 3 ? 'e' : 0; break;
    default: break;
  }
  if (step == 0) return;
  op.step = step;
  op.key_at = static_cast<std::uint32_t>(at);
  op.args_at = static_cast<std::uint32_t>(args);
  op.script_end = static_cast<std::uint32_t>(b.size());
}

namespace {
// A located step's arguments, each its whole bulk string ("$3\r\nabc\r\n"); at most 7 (fail).
struct StepArgs {
  std::string_view arg[7];
  int n = 0;
};

StepArgs step_args(const Op& m) {
  const std::string_view b = std::string_view(m.bytes).substr(0, m.script_end);
  StepArgs out;
  for (std::size_t at = m.args_at; at < b.size() && out.n < 7;) {
    const std::size_t end = bulk_end(b, at);
    if (end == std::string_view::npos) break;  // not reached: locate_step parsed these bytes
    out.arg[out.n++] = b.substr(at, end - at);
    at = end;
  }
  return out;
}

// The bulk string of `text`.
void append_bulk(std::string& out, std::string_view text) {
  out.append(fmt::format("${}\r\n", text.size())).append(text).append("\r\n");
}
}  // namespace

// Several callers' one-key steps sent as one `many` call (auto-batching). Each member gets the
// reply element its own call would have had: the same answer, the same error (a damaged record,
// OOM), the same durability check (a WAIT after the call counts for the members whose step wrote),
// and, when the call had to be sent again after a lost reply, the same in-doubt error.
struct Group final : Op {
  std::vector<std::unique_ptr<Op>> members;
  const RedisOptions* opt = nullptr;
  const std::string* where = nullptr;
  ReplyPtr wait;  // with `waits`: the WAIT's reply

  bool keeps_wait(ReplyPtr& w) noexcept override {
    wait = std::move(w);
    return true;
  }

  std::vector<std::unique_ptr<Op>> dissolve() override {
    for (auto& m : members) {
      m->solo = true;
      m->attempt = attempt;  // the call's resend and redirections; each reloads for itself
      m->attempt.reloaded = false;
    }
    return std::move(members);
  }

  void finish(std::exception_ptr e, ReplyPtr reply) noexcept override {
    if (!e && (reply->type != REDIS_REPLY_ARRAY || reply->elements != members.size()))
      e = capture([&] {
        throw_if_error(reply.get(), store_hints, [&] { return describe(); });
        throw_bad_reply(describe());
      });
    if (e) {
      for (auto& m : members) m->finish(e, nullptr);
      return;
    }
    for (std::size_t i = 0; i < members.size(); ++i) {
      ReplyPtr one(reply->element[i]);
      reply->element[i] = nullptr;  // now owned by `one` (freeReplyObject skips null elements)
      Op& m = *members[i];
      if (attempt.resent && is_error(one.get())) {  // in doubt as the member's own call would be
        m.finish(on_resent_reply(attempt, one.get(), m.describe()).error, nullptr);
        continue;
      }
      if (wait && !is_error(one.get()) && wrote(m.script, one.get()))
        if (auto we = capture([&] { check_wait(wait.get(), m.script, m.describe(), *opt, *where); })) {
          m.finish(we, nullptr);
          continue;
        }
      m.finish(nullptr, std::move(one));
    }
  }
};

std::unique_ptr<Op> coalesce(std::vector<std::unique_ptr<Op>> steps, const RedisOptions& opt,
                             const std::string& where, std::atomic<std::uint64_t>& coalesced) {
  auto g = std::make_unique<Group>();
  // many.lua's layout (src/redis/lua/many.lua): the steps' letters, then a lease, a retention and
  // an owner the short forms share (the first acquire's; else the first completion's retention),
  // then each step's arguments. The arguments are copied as the bulk strings they already are.
  std::vector<StepArgs> args;
  args.reserve(steps.size());
  std::string_view lease = "$0\r\n\r\n", ret = lease, owner = lease;
  bool shared = false, have_ret = false;
  for (const auto& m : steps) {
    args.push_back(step_args(*m));
    const StepArgs& a = args.back();
    if (!shared && m->step == 'A' && a.n == 5) {
      lease = a.arg[1], ret = a.arg[2], owner = a.arg[4];
      shared = have_ret = true;
    } else if (!have_ret && (m->step == 'C' || m->step == 'U') && a.n >= 4) {
      ret = a.arg[3];
      have_ret = true;
    }
  }
  std::string letters(steps.size(), ' ');
  std::size_t argc = 3 + steps.size() + 4;  // EVALSHA sha numkeys, the keys, letters lease ret owner
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const StepArgs& a = args[i];
    char l = steps[i]->step;
    if (l == 'A' && a.arg[1] == lease && a.arg[2] == ret && a.arg[4] == owner)
      l = a.arg[3].size() == 6 ? 'a' : 'b';  // "$0\r\n\r\n": no fingerprint
    else if (l == 'C' && a.arg[3] == ret)
      l = 'c';
    letters[i] = l;
    argc += l == 'a' ? 1 : l == 'b' ? 2 : l == 'c' ? 3 : l == 'C' || l == 'U' ? 4 : static_cast<std::size_t>(a.n);
  }
  const ScriptInfo& many = script(Script::many);
  const std::string keys = std::to_string(steps.size());
  g->bytes = fmt::format("*{}\r\n$7\r\nEVALSHA\r\n${}\r\n{}\r\n${}\r\n{}\r\n", argc, many.sha.size(), many.sha,
                         keys.size(), keys);
  for (const auto& m : steps) g->bytes.append(m->bytes, m->key_at, m->args_at - m->key_at);
  append_bulk(g->bytes, letters);
  g->bytes.append(lease).append(ret).append(owner);
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const StepArgs& a = args[i];
    switch (letters[i]) {
      case 'a': g->bytes.append(a.arg[0]); break;
      case 'b': g->bytes.append(a.arg[0]).append(a.arg[3]); break;
      case 'c': g->bytes.append(a.arg[0]).append(a.arg[1]).append(a.arg[2]); break;
      case 'C':
      case 'U':  // complete.lua's fifth argument (unavailable: "1" or not) is the letter's
        for (int j = 0; j < 4; ++j) g->bytes.append(a.arg[j]);
        break;
      default:
        for (int j = 0; j < a.n; ++j) g->bytes.append(a.arg[j]);
    }
  }
  const Op& first = *steps.front();
  if (first.waits) {  // every step writes, so every one carries the same WAIT
    g->bytes.append(first.bytes, first.script_end);
    g->waits = true;
  }
  g->script = Script::many;
  g->slot = first.slot;  // the connection groups its steps by slot
  g->label = fmt::format("{} steps in one call (auto-batching; the first: {})", steps.size(), first.describe());
  g->opt = &opt;
  g->where = &where;
  coalesced += steps.size();
  g->members = std::move(steps);
  return g;
}

}  // namespace idem::detail::asio_redis
