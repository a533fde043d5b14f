// RedisSequenceStore: a small pool of hiredis connections of its own (a RedisStore's pool stays
// private to that store), the connection layer shared with RedisStore (connection.hpp: RESP sent
// with MSG_NOSIGNAL, hiredis's reply reader, the same error mapping), and one EVALSHA of
// sequence_advance.lua per advance, or of complete_advance.lua for a RedisStore completion and
// the advance together.

#include "idem/redis/sequence_store.hpp"

#include <charconv>
#include <string>
#include <utility>
#include <vector>

#include <hiredis/hiredis.h>

#include "idem/detail/validate.hpp"
#include "idem/core/error.hpp"
#include "seq/idem_redis_scripts.hpp"

#include "connection.hpp"

namespace idem {

namespace {

using namespace detail::redis;

std::string decimal(std::uint64_t v) {
  char tmp[24];
  auto res = std::to_chars(tmp, tmp + sizeof tmp, v);
  return std::string(tmp, res.ptr);
}

// The advice RedisSequenceStore's error messages carry (RedisStore's differs); IDEMUSAGE comes
// from sequence_advance.lua refusing its arguments.
constexpr ReplyErrorHints sequence_hints{
    "; delete or repair the key, idem will not guess the last applied sequence",
    "; the server is at maxmemory under noeviction: raise maxmemory",
    "; the ACL user needs EVALSHA, SCRIPT LOAD, GET, SET and DEL on the key prefix", "idem", true};

// A stored value must be a canonical decimal uint64; anything else fails closed.
std::uint64_t parse_seq(std::string_view s, std::string_view entity) {
  std::uint64_t v = 0;
  const bool canonical = !s.empty() && s.size() <= 20 && (s.size() == 1 || s[0] != '0');
  auto res = std::from_chars(s.data(), s.data() + s.size(), v);
  if (!canonical || res.ec != std::errc{} || res.ptr != s.data() + s.size())
    throw corrupt_record_error("idem: the Redis sequence of entity '" + printable(entity) + "' holds '" +
                               printable(s, 32) + "', not a decimal uint64; delete or repair the key");
  return v;
}

// advance_seq's reply (sequence.lua): code 1 advanced / 0 not, and the value it found.
// `what()` names the call in an error message; it is built only when one is thrown.
template <class What>
AdvanceResult advance_result(std::int64_t code, std::string_view prev, std::string_view entity, std::uint64_t seq,
                             const What& what) {
  if (code != 0 && code != 1) throw store_error("idem: unexpected Redis reply to " + what(), "", false);
  AdvanceResult out;
  out.advanced = code == 1;
  if (!prev.empty()) out.previous = parse_seq(prev, entity);
  // The script only writes when the value grows; a reply saying otherwise is a broken script.
  if (out.previous && out.advanced != (*out.previous < seq))
    throw store_error("idem: inconsistent Redis reply to " + what(), "", false);
  return out;
}

}  // namespace

struct RedisSequenceStore::Impl : detail::redis::Pool {
  struct Script {
    std::string_view name, source;
    std::string sha;
  };
  Script advance{"sequence_advance", detail::redis_lua::sequence_advance,
                 sha1_hex(detail::redis_lua::sequence_advance)};
  Script complete{"complete_advance", detail::redis_lua::complete_advance,
                  sha1_hex(detail::redis_lua::complete_advance)};

  explicit Impl(RedisOptions o) : Pool(Pool::resolve(std::move(o)), sequence_hints) {}

  void load_script(redisContext* c, const Script& s) { Pool::load_script(c, s.source, s.sha, s.name, false); }

  // One request and its reply (`script`: the EVALSHA's script, else null); an error reply is mapped and thrown.
  // (`what()` is built only for an error message.)
  template <class What>
  ReplyPtr call(std::string_view request, const What& what, const Script* script) {
    ReplyPtr r = with_connection([&](redisContext* c) {
      send(c, request);
      ReplyPtr reply = read_reply(c, script ? "to EVALSHA" : "to the command");
      // NOSCRIPT ran nothing (SCRIPT FLUSH or a restart): load the script and send it once more.
      if (script && is_error(reply.get()) && error_code(reply_text(reply.get())) == "NOSCRIPT") {
        load_script(c, *script);
        if (!send_all(c, request)) throw_io(c, "while sending EVALSHA", false);
        reply = read_reply(c, "to EVALSHA");
      }
      return reply;
    });
    if (is_error(r.get())) throw_reply(reply_text(r.get()), what());
    return r;
  }

  std::string key_of(std::string_view entity) const {
    std::string k;
    k.reserve(opt.key_prefix.size() + entity.size() + 6);
    k += opt.key_prefix;
    k += "seq:{";
    k += entity;
    k += '}';
    return k;
  }

  // GET and DEL of the entity's key: one plain command whose reply must be of `expected` type (or nil).
  ReplyPtr key_command(const char* cmd, std::string_view entity, int expected) {
    auto what = [&] { return std::string(cmd) + " of the sequence of entity '" + printable(entity) + "'"; };
    Request req;
    req.command(2);
    req.arg(cmd);
    req.arg(key_of(entity));
    ReplyPtr r = call(req.view(), what, nullptr);
    if (r->type != expected && r->type != REDIS_REPLY_NIL)
      throw store_error("idem: unexpected Redis reply to " + what(), "", false);
    return r;
  }
};

RedisSequenceStore::RedisSequenceStore(RedisOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  Impl& im = *impl_;
  // Fail fast: one connection now, and the script loaded (a NOSCRIPT later reloads it anyway).
  ReplyPtr ignored = im.with_connection([&](redisContext* c) {
    im.load_script(c, im.advance);
    im.load_script(c, im.complete);
    return ReplyPtr{};
  });
}

RedisSequenceStore::~RedisSequenceStore() = default;
RedisSequenceStore::RedisSequenceStore(RedisSequenceStore&&) noexcept = default;
RedisSequenceStore& RedisSequenceStore::operator=(RedisSequenceStore&&) noexcept = default;

RedisSequenceStore::Impl& RedisSequenceStore::impl() const {
  if (!impl_) throw usage_error("idem: this RedisSequenceStore was moved from; use the store it was moved to");
  return *impl_;
}

std::optional<std::uint64_t> RedisSequenceStore::last_applied(std::string_view entity) {
  detail::check_entity(entity);
  ReplyPtr r = impl().key_command("GET", entity, REDIS_REPLY_STRING);
  if (r->type == REDIS_REPLY_NIL) return std::nullopt;
  return parse_seq(reply_text(r.get()), entity);
}

AdvanceResult RedisSequenceStore::advance(std::string_view entity, std::uint64_t seq) {
  detail::check_entity(entity);
  Impl& im = impl();
  auto what = [&] { return "sequence_advance of entity '" + printable(entity) + "'"; };
  Request req;
  req.command(5);
  req.arg("EVALSHA");
  req.arg(im.advance.sha);
  req.arg("1");
  req.arg(im.key_of(entity));
  req.arg(decimal(seq));
  ReplyPtr r = im.call(req.view(), what, &im.advance);
  if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 || r->element[0]->type != REDIS_REPLY_INTEGER ||
      r->element[1]->type != REDIS_REPLY_STRING)
    throw store_error("idem: unexpected Redis reply to " + what(), "", false);
  return advance_result(r->element[0]->integer, reply_text(r->element[1]), entity, seq, what);
}

CompleteAdvanceResult RedisSequenceStore::complete_advance(RedisStore& store, std::string_view key, const Holder& h,
                                                          std::string_view result, millis retention,
                                                          std::string_view entity, std::uint64_t seq) {
  detail::check_entity(entity);
  detail::check_holder(key, h);
  detail::check_lease(retention, "retention");
  Impl& im = impl();
  // One script writes both keys, so both must live on the server this store talks to.
  const RedisOptions& so = store.options();
  const bool same_server = so.unix_socket == im.opt.unix_socket &&
                           (!so.unix_socket.empty() || (so.host == im.opt.host && so.port == im.opt.port));
  if (!same_server || so.db != im.opt.db)
    throw usage_error("idem: RedisSequenceStore (" + im.where + " db " + std::to_string(im.opt.db) +
                      ") and the RedisStore it completes for point at different servers or databases; give both "
                      "the same url, host/port or unix_socket, and db");
  auto what = [&] { return "complete_advance of key '" + printable(key) + "' and entity '" + printable(entity) + "'"; };
  Request req;
  req.command(10);
  req.arg("EVALSHA");
  req.arg(im.complete.sha);
  req.arg("2");
  req.arg(store.redis_key(key));
  req.arg(im.key_of(entity));
  req.arg(static_cast<std::int64_t>(h.fence));
  req.arg(token_bytes(h.token));
  req.arg(result);
  req.arg(static_cast<std::int64_t>(retention.count()));
  req.arg(decimal(seq));
  ReplyPtr r = im.call(req.view(), what, &im.complete);
  if (r->type != REDIS_REPLY_ARRAY || r->elements != 3 || r->element[0]->type != REDIS_REPLY_INTEGER ||
      r->element[1]->type != REDIS_REPLY_INTEGER || r->element[2]->type != REDIS_REPLY_STRING)
    throw store_error("idem: unexpected Redis reply to " + what(), "", false);
  CompleteAdvanceResult out;
  if (r->element[0]->integer != 1) return out;  // lease lost: the script wrote nothing
  out.status = WriteStatus::ok;
  const std::int64_t code = r->element[1]->integer;
  const std::string_view prev = reply_text(r->element[2]);
  // The result is recorded by now; a damaged sequence key is reported, so the message is not acked
  // and its redelivery (a duplicate) stops at the same key until someone repairs it.
  if (code == -1)
    throw corrupt_record_error("idem: the result of key '" + printable(key) +
                               "' was recorded, but the Redis sequence of entity '" + printable(entity) + "' holds '" +
                               printable(prev) + "', not a decimal uint64, so it was not advanced; repair the key");
  if (code == -2) im.throw_reply(prev, what() + " (the result was recorded; the sequence key is not a string)");
  out.advance = advance_result(code, prev, entity, seq, what);
  return out;
}

bool RedisSequenceStore::erase(std::string_view entity) {
  detail::check_entity(entity);
  ReplyPtr r = impl().key_command("DEL", entity, REDIS_REPLY_INTEGER);
  if (r->type != REDIS_REPLY_INTEGER)
    throw store_error("idem: unexpected Redis reply to DEL of the sequence of entity '" + printable(entity) + "'", "",
                      false);
  return r->integer > 0;
}

std::string RedisSequenceStore::sequence_key(std::string_view entity) const { return impl().key_of(entity); }
const std::string& RedisSequenceStore::script_sha() const { return impl().advance.sha; }
const std::string& RedisSequenceStore::complete_advance_sha() const { return impl().complete.sha; }
std::string_view RedisSequenceStore::script_source() noexcept { return detail::redis_lua::sequence_advance; }
const RedisOptions& RedisSequenceStore::options() const { return impl().opt; }

}  // namespace idem
