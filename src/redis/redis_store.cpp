// RedisStore: a pool of hiredis connections, our own RESP writer (send with MSG_NOSIGNAL, so a
// dead server never raises SIGPIPE in the host process), hiredis's reply reader — all in
// connection.hpp, shared with RedisSequenceStore — and one EVALSHA per transition.

#include "idem/redis/store.hpp"

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

#include <hiredis/hiredis.h>

#include "idem/detail/validate.hpp"
#include "idem/core/error.hpp"
#include "idem_redis_scripts.hpp"

#include "connection.hpp"

namespace idem {

namespace {

using namespace detail::redis;

enum ScriptId : std::size_t {
  s_acquire, s_complete, s_fail, s_extend, s_inspect, s_acquire_batch, s_complete_batch, s_count
};

constexpr std::array<std::string_view, s_count> script_names{"acquire", "complete",      "fail",          "extend",
                                                             "inspect", "acquire_batch", "complete_batch"};
constexpr std::array<std::string_view, s_count> script_sources{
    detail::redis_lua::acquire,       detail::redis_lua::complete,      detail::redis_lua::fail,
    detail::redis_lua::extend,        detail::redis_lua::inspect,       detail::redis_lua::acquire_batch,
    detail::redis_lua::complete_batch};

// Keys per batch script run: bounds the server's time inside one script (other clients wait
// while it runs) and the reply size; longer batches are several runs in the same round trip.
constexpr std::size_t batch_chunk = 256;

std::uint64_t token_value(std::string_view s) {
  std::uint64_t t = 0;
  for (char c : s) t = (t << 8) | static_cast<unsigned char>(c);
  return t;
}

// The advice RedisStore's error messages carry (RedisSequenceStore's differs).
constexpr ReplyErrorHints store_hints{
    "; delete or repair the key, idem will not guess its state",
    "; the server is at maxmemory under noeviction: raise maxmemory or lower retention",
    "; the ACL user needs EVALSHA, SCRIPT LOAD and access to the key prefix (docs/redis.md)", "RedisStore", false};

[[noreturn]] void throw_reply_error(std::string_view text, std::string_view what) {
  detail::redis::throw_reply_error(text, what, store_hints);
}

std::uint16_t crc16(std::string_view s) noexcept {
  std::uint16_t crc = 0;
  for (char ch : s) {
    crc = static_cast<std::uint16_t>(crc ^ (static_cast<unsigned char>(ch) << 8));
    for (int i = 0; i < 8; ++i)
      crc = static_cast<std::uint16_t>((crc & 0x8000) ? ((crc << 1) ^ 0x1021) : (crc << 1));
  }
  return crc;
}

std::string percent_decode(std::string_view s, const std::string& url_shown) {
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      out += s[i];
      continue;
    }
    auto hexval = [](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    const int hi = i + 2 < s.size() ? hexval(s[i + 1]) : -1;
    const int lo = i + 2 < s.size() ? hexval(s[i + 2]) : -1;
    if (hi < 0 || lo < 0)
      throw invalid_options_error("idem: bad Redis URL '" + url_shown + "': a '%' escape needs two hex digits");
    out += static_cast<char>(hi * 16 + lo);
    i += 2;
  }
  return out;
}

int parse_int(std::string_view s, int lo, int hi, const std::string& what, const std::string& url_shown) {
  int v = 0;
  auto res = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || res.ec != std::errc{} || res.ptr != s.data() + s.size() || v < lo || v > hi)
    throw invalid_options_error("idem: bad Redis URL '" + url_shown + "': " + what + " '" + std::string(s) +
                                "' is not an integer in " + std::to_string(lo) + ".." + std::to_string(hi));
  return v;
}

// The URL as it may appear in a message: the password replaced by ***.
std::string redact(std::string_view url) {
  const auto scheme_end = url.find("://");
  if (scheme_end == std::string_view::npos) return printable(url, 200);
  const auto at = url.rfind('@');
  const auto colon = url.find(':', scheme_end + 3);
  if (at == std::string_view::npos || colon == std::string_view::npos || colon > at) return printable(url, 200);
  return printable(std::string(url.substr(0, colon + 1)) + "***" + std::string(url.substr(at)), 200);
}

}  // namespace

RedisOptions parse_redis_url(std::string_view url, RedisOptions o) {
  const std::string shown = redact(url);
  auto bad = [&](const std::string& why) { throw invalid_options_error("idem: bad Redis URL '" + shown + "': " + why); };
  const auto scheme_end = url.find("://");
  if (scheme_end == std::string_view::npos) bad("expected redis://host[:port][/db] or unix:///path");
  const std::string_view scheme = url.substr(0, scheme_end);
  std::string_view rest = url.substr(scheme_end + 3);
  if (scheme == "rediss") bad("TLS (rediss://) is not supported: idem's hiredis is built without TLS");
  if (scheme != "redis" && scheme != "unix") bad("unknown scheme '" + printable(scheme) + "'; use redis:// or unix://");
  const bool unix_scheme = scheme == "unix";

  std::string_view query;
  if (const auto q = rest.find('?'); q != std::string_view::npos) {
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
  }
  std::string_view authority = rest, path;
  if (unix_scheme) {
    // unix://[user[:password]@]/path: the path starts at the first '/' after any userinfo.
    const auto at = rest.rfind('@');
    const auto slash = rest.find('/');
    if (at != std::string_view::npos && (slash == std::string_view::npos || at < slash)) {
      authority = rest.substr(0, at + 1);
      path = rest.substr(at + 1);
    } else {
      authority = {};
      path = rest;
    }
  } else if (const auto slash = rest.find('/'); slash != std::string_view::npos) {
    authority = rest.substr(0, slash);
    path = rest.substr(slash);
  }

  std::string user, password;
  std::string_view hostport = authority;
  if (const auto at = authority.rfind('@'); at != std::string_view::npos) {
    const std::string_view info = authority.substr(0, at);
    hostport = authority.substr(at + 1);
    if (const auto colon = info.find(':'); colon != std::string_view::npos) {
      user = percent_decode(info.substr(0, colon), shown);
      password = percent_decode(info.substr(colon + 1), shown);
    } else {
      // redis://secret@host is read as a password (the default user), as redis-cli does.
      password = percent_decode(info, shown);
    }
    if (password.empty() && !user.empty()) bad("user '" + printable(user) + "' has no password");
  }

  int db = 0;
  if (unix_scheme) {
    if (path.empty() || path.front() != '/') bad("a unix:// URL needs an absolute socket path, as unix:///run/redis.sock");
    o.unix_socket = percent_decode(path, shown);
  } else {
    if (hostport.empty()) bad("no host");
    std::string_view host = hostport, port;
    if (hostport.front() == '[') {
      const auto close = hostport.find(']');
      if (close == std::string_view::npos) bad("unterminated [IPv6] host");
      host = hostport.substr(1, close - 1);
      const std::string_view after = hostport.substr(close + 1);
      if (!after.empty()) {
        if (after.front() != ':') bad("expected ':' after the [IPv6] host");
        port = after.substr(1);
      }
    } else if (const auto colon = hostport.rfind(':'); colon != std::string_view::npos) {
      host = hostport.substr(0, colon);
      port = hostport.substr(colon + 1);
    }
    if (host.empty()) bad("no host");
    o.host = std::string(host);
    o.port = port.empty() ? 6379 : parse_int(port, 1, 65535, "port", shown);
    o.unix_socket.clear();
    if (!path.empty() && path != "/") db = parse_int(path.substr(1), 0, 1'000'000, "database index", shown);
  }
  while (!query.empty()) {
    const auto amp = query.find('&');
    const std::string_view kv = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view{} : query.substr(amp + 1);
    if (kv.substr(0, 3) == "db=")
      db = parse_int(kv.substr(3), 0, 1'000'000, "database index", shown);
    else
      bad("unknown parameter '" + printable(kv) + "'; only db=N is understood");
  }
  o.user = std::move(user);
  o.password = std::move(password);
  o.db = db;
  o.url = std::string(url);
  return o;
}

struct RedisStore::Impl : detail::redis::Pool {
  std::array<std::string, s_count> sha;

  explicit Impl(RedisOptions o) : Pool(Pool::resolve(std::move(o)), store_hints) {
    for (std::size_t i = 0; i < s_count; ++i) sha[i] = sha1_hex(script_sources[i]);
  }

  void load_script(redisContext* c, std::size_t id) {
    Pool::load_script(c, script_sources[id], sha[id], script_names[id], true);
  }

  bool is_noscript(const redisReply* r) const {
    return is_error(r) && error_code(reply_text(r)) == "NOSCRIPT";
  }

  // One EVALSHA request (already encoded) and its reply; reloads the script once on NOSCRIPT
  // (SCRIPT FLUSH or a restart), which is safe because a NOSCRIPT call ran nothing.
  ReplyPtr eval(std::size_t id, std::string_view request, std::string_view key) {
    ReplyPtr r = with_connection([&](redisContext* c) {
      send(c, request);
      ReplyPtr reply = read_reply(c, "to EVALSHA");
      if (is_noscript(reply.get())) {
        load_script(c, id);
        if (!send_all(c, request)) throw_io(c, "while sending EVALSHA", false);
        reply = read_reply(c, "to EVALSHA");
      }
      return reply;
    });
    if (is_error(r.get())) throw_reply_error(reply_text(r.get()), std::string(script_names[id]) + " of key '" + printable(key) + "'");
    return r;
  }

  // Many EVALSHA requests in one write and one read pass; NOSCRIPT items are resent after a reload.
  std::vector<ReplyPtr> eval_many(std::size_t id, const std::vector<std::string>& requests) {
    std::vector<ReplyPtr> out(requests.size());
    with_connection([&](redisContext* c) {
      std::string all;
      for (const auto& r : requests) all += r;
      send(c, all);
      std::vector<std::size_t> again;
      for (std::size_t i = 0; i < requests.size(); ++i) {
        out[i] = read_reply(c, "to a batch of EVALSHA");
        if (is_noscript(out[i].get())) again.push_back(i);
      }
      if (!again.empty()) {
        load_script(c, id);
        all.clear();
        for (std::size_t i : again) all += requests[i];
        if (!send_all(c, all)) throw_io(c, "while sending a batch of EVALSHA", false);
        for (std::size_t i : again) out[i] = read_reply(c, "to a batch of EVALSHA");
      }
      return 0;
    });
    return out;
  }

  std::string key_of(std::string_view key) const {
    std::string k;
    k.reserve(opt.key_prefix.size() + key.size());
    k += opt.key_prefix;
    k += key;
    return k;
  }

  void begin_eval(Request& req, std::size_t id, std::size_t nargs, std::string_view key) const {
    req.command(4 + nargs);
    req.arg("EVALSHA");
    req.arg(sha[id]);
    req.arg("1");
    req.arg(key_of(key));
  }

  void encode_acquire(Request& req, std::string_view key, const AcquireParams& p) const {
    begin_eval(req, s_acquire, 5, key);
    req.arg(token_bytes(p.token));
    req.arg(static_cast<std::int64_t>(p.lease.count()));
    req.arg(static_cast<std::int64_t>(p.retention.count()));
    req.arg(p.fingerprint);
    req.arg(p.owner.substr(0, 255));
  }

  void encode_complete(Request& req, std::string_view key, const Holder& h, std::string_view result,
                       millis retention) const {
    begin_eval(req, s_complete, 4, key);
    req.arg(static_cast<std::int64_t>(h.fence));
    req.arg(token_bytes(h.token));
    req.arg(result);
    req.arg(static_cast<std::int64_t>(retention.count()));
  }

  [[noreturn]] static void bad_reply(std::string_view what, std::string_view key) {
    throw store_error("idem: unexpected Redis reply to " + std::string(what) + " of key '" + printable(key) +
                          "'; is the server a Redis-compatible one running idem's scripts?",
                      "", false);
  }

  static std::int64_t integer(const redisReply* r, std::string_view what, std::string_view key) {
    if (r->type != REDIS_REPLY_INTEGER) bad_reply(what, key);
    return r->integer;
  }

  static AcquireResult parse_acquire(const redisReply* r, std::string_view key, std::uint64_t token) {
    if (r->type != REDIS_REPLY_ARRAY || r->elements < 2) bad_reply("acquire", key);
    AcquireResult out;
    const std::int64_t code = integer(r->element[0], "acquire", key);
    const auto gen = static_cast<std::uint64_t>(integer(r->element[1], "acquire", key));
    out.attempts = static_cast<std::uint32_t>(gen);
    auto third = [&]() -> const redisReply* {
      if (r->elements < 3) bad_reply("acquire", key);
      return r->element[2];
    };
    switch (code) {
      case 1:
        out.status = AcquireStatus::acquired;
        out.holder = {gen, token};
        out.takeover = integer(third(), "acquire", key) != 0;
        break;
      case 2:
        out.status = AcquireStatus::in_flight;
        out.retry_after = millis{std::max<std::int64_t>(0, integer(third(), "acquire", key))};
        break;
      case 3:
      case 4: {
        const redisReply* p = third();
        if (p->type != REDIS_REPLY_STRING) bad_reply("acquire", key);
        out.status = code == 3 ? AcquireStatus::duplicate : AcquireStatus::previously_failed;
        out.payload.assign(p->str, p->len);
        break;
      }
      case 5: out.status = AcquireStatus::mismatch; break;
      default: bad_reply("acquire", key);
    }
    return out;
  }

  static WriteStatus parse_write(const redisReply* r, std::string_view what, std::string_view key) {
    return integer(r, what, key) == 1 ? WriteStatus::ok : WriteStatus::lease_lost;
  }

  std::string eviction_policy(std::string* problem) {
    Request req;
    req.command(3);
    req.arg("CONFIG");
    req.arg("GET");
    req.arg("maxmemory-policy");
    ReplyPtr r = with_connection([&](redisContext* c) {
      send(c, req.view());
      return read_reply(c, "to CONFIG GET");
    });
    if (is_error(r.get())) {
      if (problem) *problem = std::string(reply_text(r.get()));
      return {};
    }
    if (r->type == REDIS_REPLY_ARRAY && r->elements == 2 && r->element[1]->type == REDIS_REPLY_STRING)
      return std::string(reply_text(r->element[1]));
    if (problem) *problem = "unexpected reply to CONFIG GET maxmemory-policy";
    return {};
  }
};

RedisStore::RedisStore(RedisOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  Impl& im = *impl_;
  // One connection now, so a wrong address or password fails here and not mid-message; the
  // scripts are loaded on it in one round trip.
  im.with_connection([&](redisContext* c) {
    Request req;
    for (std::size_t i = 0; i < s_count; ++i) {
      req.command(3);
      req.arg("SCRIPT");
      req.arg("LOAD");
      req.arg(script_sources[i]);
    }
    im.send(c, req.view());
    std::array<ReplyPtr, s_count> replies;
    for (auto& r : replies) r = im.read_reply(c, "to SCRIPT LOAD");
    for (std::size_t i = 0; i < s_count; ++i) {
      if (is_error(replies[i].get()))
        throw_reply_error(reply_text(replies[i].get()), "SCRIPT LOAD of " + std::string(script_names[i]));
      if (replies[i]->type != REDIS_REPLY_STRING || reply_text(replies[i].get()) != im.sha[i])
        throw store_error("idem: SCRIPT LOAD of " + std::string(script_names[i]) + " answered an unexpected SHA1",
                          "", false);
    }
    return 0;
  });
  if (im.opt.check_eviction_policy && im.opt.observer) {
    std::string problem;
    const std::string policy = im.eviction_policy(&problem);
    if (policy.empty()) {
      im.opt.observer->on_warning("idem: cannot read Redis maxmemory-policy (" + problem +
                                  "); make sure it is noeviction, or idempotency records can be evicted");
    } else if (policy != "noeviction") {
      im.opt.observer->on_warning("idem: Redis maxmemory-policy is '" + policy +
                                  "': under memory pressure Redis may evict idempotency records (every one has a "
                                  "TTL, so volatile-* policies evict them too) and their messages would run again; "
                                  "set maxmemory-policy noeviction");
    }
  }
}

RedisStore::~RedisStore() = default;
RedisStore::RedisStore(RedisStore&&) noexcept = default;
RedisStore& RedisStore::operator=(RedisStore&&) noexcept = default;

RedisStore::Impl& RedisStore::impl() const {
  if (!impl_) throw usage_error("idem: this RedisStore was moved from; use the store it was moved to");
  return *impl_;
}

// The record stores the fingerprint's length in 16 bits.
static void check_fingerprint(const AcquireParams& p) {
  if (p.fingerprint.size() > 65535)
    throw invalid_options_error("idem: RedisStore keeps fingerprints of up to 65535 bytes, got " +
                                std::to_string(p.fingerprint.size()) + "; pass a hash (idem::fingerprint)");
}

AcquireResult RedisStore::acquire(std::string_view key, const AcquireParams& p) {
  detail::check_acquire(key, p);
  check_fingerprint(p);
  Impl& im = impl();
  Request req;
  im.encode_acquire(req, key, p);
  ReplyPtr r = im.eval(s_acquire, req.view(), key);
  return Impl::parse_acquire(r.get(), key, p.token);
}

WriteStatus RedisStore::complete(std::string_view key, const Holder& h, std::string_view result, millis retention) {
  detail::check_holder(key, h);
  detail::check_lease(retention, "retention");
  Impl& im = impl();
  Request req;
  im.encode_complete(req, key, h, result, retention);
  ReplyPtr r = im.eval(s_complete, req.view(), key);
  return Impl::parse_write(r.get(), "complete", key);
}

WriteStatus RedisStore::fail(std::string_view key, const Holder& h, const FailParams& f) {
  detail::check_holder(key, h);
  detail::check_lease(f.retention, "retention");
  Impl& im = impl();
  Request req;
  im.begin_eval(req, s_fail, 7, key);
  req.arg(static_cast<std::int64_t>(h.fence));
  req.arg(token_bytes(h.token));
  req.arg(f.error);
  req.arg(f.release ? "1" : "0");
  req.arg(f.permanent ? "1" : "0");
  req.arg(static_cast<std::int64_t>(std::max<std::int64_t>(0, f.backoff.count())));
  req.arg(static_cast<std::int64_t>(f.retention.count()));
  ReplyPtr r = im.eval(s_fail, req.view(), key);
  return Impl::parse_write(r.get(), "fail", key);
}

WriteStatus RedisStore::extend(std::string_view key, const Holder& h, millis lease) {
  detail::check_holder(key, h);
  detail::check_lease(lease);
  Impl& im = impl();
  Request req;
  im.begin_eval(req, s_extend, 3, key);
  req.arg(static_cast<std::int64_t>(h.fence));
  req.arg(token_bytes(h.token));
  req.arg(static_cast<std::int64_t>(lease.count()));
  ReplyPtr r = im.eval(s_extend, req.view(), key);
  return Impl::parse_write(r.get(), "extend", key);
}

std::optional<Record> RedisStore::inspect(std::string_view key) {
  detail::check_key(key, static_cast<std::size_t>(-1));
  Impl& im = impl();
  Request req;
  im.begin_eval(req, s_inspect, 0, key);
  ReplyPtr r = im.eval(s_inspect, req.view(), key);
  if (r->type == REDIS_REPLY_NIL) return std::nullopt;
  if (r->type != REDIS_REPLY_ARRAY || r->elements != 9) Impl::bad_reply("inspect", key);
  auto str = [&](std::size_t i) {
    const redisReply* e = r->element[i];
    if (e->type != REDIS_REPLY_STRING) Impl::bad_reply("inspect", key);
    return std::string(e->str, e->len);
  };
  auto num = [&](std::size_t i) { return Impl::integer(r->element[i], "inspect", key); };
  Record rec;
  const std::int64_t st = num(0);
  if (st < 1 || st > 3) Impl::bad_reply("inspect", key);
  rec.state = static_cast<State>(st);
  rec.holder.fence = static_cast<std::uint64_t>(num(1));
  rec.attempts = static_cast<std::uint32_t>(rec.holder.fence);
  rec.holder.token = token_value(str(2));
  rec.owner = str(3);
  rec.lease_until_ms = num(4);
  rec.retry_at_ms = num(5);
  rec.permanent = num(6) != 0;
  rec.fingerprint = str(7);
  (rec.state == State::failed ? rec.error : rec.result) = str(8);
  return rec;
}

std::vector<AcquireResult> RedisStore::acquire_batch(std::span<const std::string_view> keys, const AcquireParams& p) {
  for (std::string_view k : keys) detail::check_acquire(k, p);
  check_fingerprint(p);
  Impl& im = impl();
  std::vector<std::string> requests;
  Request req;
  const std::string token = token_bytes(p.token);
  for (std::size_t from = 0; from < keys.size(); from += batch_chunk) {
    const std::size_t n = std::min(batch_chunk, keys.size() - from);
    req.clear();
    req.command(3 + n + 5);
    req.arg("EVALSHA");
    req.arg(im.sha[s_acquire_batch]);
    req.arg(static_cast<std::int64_t>(n));
    for (std::size_t i = from; i < from + n; ++i) req.arg(im.key_of(keys[i]));
    req.arg(token);
    req.arg(static_cast<std::int64_t>(p.lease.count()));
    req.arg(static_cast<std::int64_t>(p.retention.count()));
    req.arg(p.fingerprint);
    req.arg(p.owner.substr(0, 255));
    requests.emplace_back(req.view());
  }
  std::vector<ReplyPtr> replies = im.eval_many(s_acquire_batch, requests);
  std::vector<AcquireResult> out;
  out.reserve(keys.size());
  for (std::size_t c = 0; c < replies.size(); ++c) {
    const redisReply* r = replies[c].get();
    const std::size_t from = c * batch_chunk, n = std::min(batch_chunk, keys.size() - from);
    if (is_error(r))
      throw_reply_error(reply_text(r), "acquire_batch of " + std::to_string(n) + " keys from '" +
                                           printable(keys[from]) + "'");
    if (r->type != REDIS_REPLY_ARRAY || r->elements != n) Impl::bad_reply("acquire_batch", keys[from]);
    for (std::size_t i = 0; i < n; ++i) out.push_back(Impl::parse_acquire(r->element[i], keys[from + i], p.token));
  }
  return out;
}

std::vector<WriteStatus> RedisStore::complete_batch(std::span<const CompleteItem> items, millis retention) {
  detail::check_lease(retention, "retention");
  for (const CompleteItem& it : items) detail::check_holder(it.key, it.holder);
  Impl& im = impl();
  std::vector<std::string> requests;
  Request req;
  for (std::size_t from = 0; from < items.size(); from += batch_chunk) {
    const std::size_t n = std::min(batch_chunk, items.size() - from);
    req.clear();
    req.command(3 + n + 1 + 3 * n);
    req.arg("EVALSHA");
    req.arg(im.sha[s_complete_batch]);
    req.arg(static_cast<std::int64_t>(n));
    for (std::size_t i = from; i < from + n; ++i) req.arg(im.key_of(items[i].key));
    req.arg(static_cast<std::int64_t>(retention.count()));
    for (std::size_t i = from; i < from + n; ++i) {
      req.arg(static_cast<std::int64_t>(items[i].holder.fence));
      req.arg(token_bytes(items[i].holder.token));
      req.arg(items[i].result);
    }
    requests.emplace_back(req.view());
  }
  std::vector<ReplyPtr> replies = im.eval_many(s_complete_batch, requests);
  std::vector<WriteStatus> out;
  out.reserve(items.size());
  for (std::size_t c = 0; c < replies.size(); ++c) {
    const redisReply* r = replies[c].get();
    const std::size_t from = c * batch_chunk, n = std::min(batch_chunk, items.size() - from);
    if (is_error(r))
      throw_reply_error(reply_text(r), "complete_batch of " + std::to_string(n) + " keys from '" +
                                           printable(items[from].key) + "'");
    if (r->type != REDIS_REPLY_ARRAY || r->elements != n) Impl::bad_reply("complete_batch", items[from].key);
    for (std::size_t i = 0; i < n; ++i)
      out.push_back(Impl::parse_write(r->element[i], "complete_batch", items[from + i].key));
  }
  return out;
}

std::string RedisStore::redis_key(std::string_view key) const { return impl().key_of(key); }

std::uint16_t RedisStore::hash_slot(std::string_view k) noexcept {
  if (const auto open = k.find('{'); open != std::string_view::npos) {
    const auto close = k.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) k = k.substr(open + 1, close - open - 1);
  }
  return static_cast<std::uint16_t>(crc16(k) & 16383);
}

std::string RedisStore::script_sha(std::string_view name) const {
  for (std::size_t i = 0; i < s_count; ++i)
    if (script_names[i] == name) return impl().sha[i];
  throw usage_error("idem: no Redis script named '" + printable(name) +
                    "'; the scripts are acquire, complete, fail, extend, inspect, acquire_batch, complete_batch");
}

std::string RedisStore::eviction_policy() { return impl().eviction_policy(nullptr); }

const RedisOptions& RedisStore::options() const { return impl().opt; }

}  // namespace idem
