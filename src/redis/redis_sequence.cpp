// RedisSequenceStore: a small pool of hiredis connections of its own (RedisStore's is private to
// it), a hand-written RESP request sent with MSG_NOSIGNAL (no SIGPIPE on a dead server), hiredis's
// reply reader, and one EVALSHA of sequence_advance.lua per advance. Error mapping as RedisStore's.

#include "idem/redis_sequence.hpp"

#include <cerrno>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <hiredis/hiredis.h>
#include <openssl/evp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>

#include "idem/error.hpp"
#include "seq/idem_redis_scripts.hpp"

namespace idem {

namespace {

std::string sha1_hex(std::string_view text) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_Digest(text.data(), text.size(), md, &len, EVP_sha1(), nullptr) != 1)
    throw error("idem: OpenSSL EVP_Digest(SHA-1) failed", false);
  static constexpr char hex[] = "0123456789abcdef";
  std::string out(static_cast<std::size_t>(len) * 2, '\0');
  for (unsigned int i = 0; i < len; ++i) {
    out[2 * i] = hex[md[i] >> 4];
    out[2 * i + 1] = hex[md[i] & 0xf];
  }
  return out;
}

// Entities are binary; messages show them escaped and shortened.
std::string printable(std::string_view s, std::size_t max = 64) {
  std::string out;
  static constexpr char hex[] = "0123456789abcdef";
  for (std::size_t i = 0; i < s.size() && i < max; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 0xf];
    }
  }
  if (s.size() > max) out += "...";
  return out;
}

std::string ms(millis d) { return std::to_string(d.count()) + " ms"; }

timeval to_timeval(millis d) {
  timeval tv{};
  tv.tv_sec = static_cast<decltype(tv.tv_sec)>(d.count() / 1000);
  tv.tv_usec = static_cast<decltype(tv.tv_usec)>((d.count() % 1000) * 1000);
  return tv;
}

std::string decimal(std::uint64_t v) {
  char tmp[24];
  auto res = std::to_chars(tmp, tmp + sizeof tmp, v);
  return std::string(tmp, res.ptr);
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
  [[nodiscard]] std::string_view view() const noexcept { return buf_; }

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

// The request never reached the server whole, so it did not run: safe to send again.
struct not_sent {
  std::string why;
};

bool is_error(const redisReply* r) { return r->type == REDIS_REPLY_ERROR; }
std::string_view reply_text(const redisReply* r) { return {r->str, r->len}; }
std::string_view error_code(std::string_view text) { return text.substr(0, text.find(' ')); }

// Maps a Redis error reply to the idem exception that says what to do about it (as RedisStore).
[[noreturn]] void throw_reply_error(std::string_view text, const std::string& what) {
  const std::string code(error_code(text));
  const std::string msg = "idem: Redis refused " + what + ": " + std::string(text);
  if (code == "IDEMCORRUPT")
    throw corrupt_record_error("idem: " + what + ": " + std::string(text.substr(code.size() + 1)) +
                               "; delete or repair the key, idem will not guess the last applied sequence");
  if (code == "IDEMUSAGE") throw usage_error(msg);
  if (code == "OOM")
    throw capacity_error(msg + "; the server is at maxmemory under noeviction: raise maxmemory", code, true);
  if (code == "READONLY")
    throw store_error(msg + "; the server is a read-only replica (failover in progress?): point idem at the primary",
                      code, true);
  if (code == "NOAUTH" || code == "WRONGPASS")
    throw store_error(msg + "; set RedisOptions::user/password (or the URL) to credentials the server accepts", code,
                      false);
  if (code == "NOPERM")
    throw store_error(msg + "; the ACL user needs EVALSHA, SCRIPT LOAD, GET, SET and DEL on the key prefix", code,
                      false);
  if (code == "WRONGTYPE")
    throw store_error(msg + "; another application wrote a non-string value under idem's key prefix: use a prefix "
                            "of idem's own",
                      code, false);
  if (code == "LOADING" || code == "BUSY" || code == "MASTERDOWN" || code == "TRYAGAIN" || code == "CLUSTERDOWN")
    throw store_error(msg + "; the server is temporarily unable to serve, retry later", code, true);
  if (code == "MOVED" || code == "ASK" || code == "CROSSSLOT")
    throw store_error(msg + "; this is a Redis Cluster node, which idem does not support yet", code, false);
  if (text.find("max number of clients") != std::string_view::npos) throw connection_error(msg, code, true);
  throw store_error(msg, code, false);
}

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

}  // namespace

struct RedisSequenceStore::Impl {
  RedisOptions opt;
  std::string sha;
  std::string where;

  std::mutex mu;
  std::condition_variable cv;
  std::vector<redisContext*> idle;
  std::size_t open = 0;

  explicit Impl(RedisOptions o) : opt(std::move(o)) {
    if (!opt.url.empty()) {
      const std::string url = opt.url;
      opt = parse_redis_url(url, std::move(opt));
    }
    auto bad = [](const std::string& why) { throw invalid_options_error("idem: RedisOptions: " + why); };
    if (opt.unix_socket.empty() && opt.host.empty()) bad("host is empty; set host, unix_socket or url");
    if (opt.unix_socket.empty() && (opt.port < 1 || opt.port > 65535)) bad("port must be 1..65535");
    if (opt.db < 0) bad("db must be >= 0");
    if (opt.connect_timeout <= millis{0}) bad("connect_timeout must be > 0");
    if (opt.command_timeout <= millis{0}) bad("command_timeout must be > 0");
    if (opt.pool_size == 0) bad("pool_size must be > 0");
    if (opt.pool_wait < millis{0}) bad("pool_wait must be >= 0");
    where = opt.unix_socket.empty() ? opt.host + ":" + std::to_string(opt.port) : opt.unix_socket;
    sha = sha1_hex(detail::redis_lua::sequence_advance);
  }

  ~Impl() {
    for (redisContext* c : idle) redisFree(c);
  }

  [[noreturn]] void throw_io(redisContext* c, const char* during, bool maybe_ran) const {
    const int err = errno;
    const std::string text = c->errstr[0] ? c->errstr : std::strerror(err);
    const std::string tail = maybe_ran ? "; the command may or may not have run, so nothing is assumed (retry later)"
                                       : "; retry later";
    const bool timed_out = c->err == REDIS_ERR_IO && (err == EAGAIN || err == EWOULDBLOCK || err == ETIMEDOUT ||
                                                      text.find("temporarily unavailable") != std::string::npos);
    if (timed_out)
      throw timeout_error("idem: Redis at " + where + " did not answer " + during + " within command_timeout (" +
                              ms(opt.command_timeout) + ")" + tail,
                          "", true);
    throw connection_error("idem: connection to Redis at " + where + " broke " + during + ": " + text + tail, "", true);
  }

  static bool send_all(redisContext* c, std::string_view data) {
    while (!data.empty()) {
      const ssize_t n = ::send(c->fd, data.data(), data.size(), MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EINTR) continue;
        return false;
      }
      data.remove_prefix(static_cast<std::size_t>(n));
    }
    return true;
  }

  ReplyPtr read_reply(redisContext* c, const char* during) const {
    void* r = nullptr;
    if (redisGetReply(c, &r) != REDIS_OK || r == nullptr) throw_io(c, during, true);
    return ReplyPtr(static_cast<redisReply*>(r));
  }

  ContextPtr connect() {
    const timeval ctv = to_timeval(opt.connect_timeout);
    redisContext* raw = opt.unix_socket.empty() ? redisConnectWithTimeout(opt.host.c_str(), opt.port, ctv)
                                                : redisConnectUnixWithTimeout(opt.unix_socket.c_str(), ctv);
    if (raw == nullptr) throw connection_error("idem: cannot allocate a Redis connection", "", true);
    ContextPtr c(raw);
    if (c->err)
      throw connection_error("idem: cannot connect to Redis at " + where + " within connect_timeout (" +
                                 ms(opt.connect_timeout) + "): " + c->errstr +
                                 "; is redis-server running there? retry later",
                             "", true);
    if (redisSetTimeout(c.get(), to_timeval(opt.command_timeout)) != REDIS_OK)
      throw connection_error("idem: cannot set the command timeout on a Redis socket: " + std::string(c->errstr), "",
                             true);
    Request req;
    std::size_t n = 0;
    if (!opt.password.empty()) {
      req.command(opt.user.empty() ? 2 : 3);
      req.arg("AUTH");
      if (!opt.user.empty()) req.arg(opt.user);
      req.arg(opt.password);
      ++n;
    }
    if (opt.db != 0) {
      req.command(2);
      req.arg("SELECT");
      req.arg(std::to_string(opt.db));
      ++n;
    }
    if (n == 0) return c;
    if (!send_all(c.get(), req.view())) throw_io(c.get(), "while authenticating", false);
    std::string first_error;
    for (std::size_t i = 0; i < n; ++i) {
      ReplyPtr r = read_reply(c.get(), "while authenticating");
      if (is_error(r.get()) && first_error.empty()) first_error = std::string(reply_text(r.get()));
    }
    if (!first_error.empty()) throw_reply_error(first_error, "the connection handshake (AUTH/SELECT)");
    return c;
  }

  // A pooled connection the server closed while idle reads as ready-with-EOF: dropped before use.
  static bool looks_alive(redisContext* c) {
    pollfd p{c->fd, POLLIN, 0};
    int rc;
    do rc = ::poll(&p, 1, 0);
    while (rc < 0 && errno == EINTR);
    return rc == 0;
  }

  redisContext* checkout() {
    std::unique_lock lock(mu);
    const auto deadline = std::chrono::steady_clock::now() + opt.pool_wait;
    for (;;) {
      if (!idle.empty()) {
        redisContext* c = idle.back();
        idle.pop_back();
        lock.unlock();
        if (looks_alive(c)) return c;
        redisFree(c);
        lock.lock();
        --open;
        continue;
      }
      if (open < opt.pool_size) {
        ++open;
        lock.unlock();
        try {
          return connect().release();
        } catch (...) {
          lock.lock();
          --open;
          cv.notify_one();
          throw;
        }
      }
      if (!cv.wait_until(lock, deadline, [&] { return !idle.empty() || open < opt.pool_size; }))
        throw timeout_error("idem: all " + std::to_string(opt.pool_size) + " Redis connections stayed busy for " +
                                ms(opt.pool_wait) + "; raise RedisOptions::pool_size to match the calling threads",
                            "", true);
    }
  }

  void checkin(redisContext* c, bool healthy) noexcept {
    if (!healthy) redisFree(c);
    {
      std::lock_guard lock(mu);
      if (healthy)
        idle.push_back(c);
      else
        --open;
    }
    cv.notify_one();
  }

  class Lease {
  public:
    explicit Lease(Impl& im) : im_(&im), c_(im.checkout()) {}
    ~Lease() { im_->checkin(c_, healthy_); }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    redisContext* get() const noexcept { return c_; }
    void healthy() noexcept { healthy_ = true; }

  private:
    Impl* im_;
    redisContext* c_;
    bool healthy_ = false;
  };

  // Runs f(connection); a request that never left this process is sent once more on a fresh
  // connection (it cannot have run), anything later is reported, never retried.
  template <class F>
  ReplyPtr with_connection(F&& f) {
    for (int attempt = 0;; ++attempt) {
      Lease lease(*this);
      try {
        ReplyPtr result = f(lease.get());
        lease.healthy();
        return result;
      } catch (const not_sent& e) {
        if (attempt == 0) continue;
        throw connection_error("idem: cannot send to Redis at " + where + ": " + e.why + "; retry later", "", true);
      }
    }
  }

  void send(redisContext* c, std::string_view data) {
    if (!send_all(c, data)) throw not_sent{std::strerror(errno)};
  }

  void load_script(redisContext* c) {
    Request req;
    req.command(3);
    req.arg("SCRIPT");
    req.arg("LOAD");
    req.arg(detail::redis_lua::sequence_advance);
    if (!send_all(c, req.view())) throw_io(c, "while sending SCRIPT LOAD", false);
    ReplyPtr r = read_reply(c, "to SCRIPT LOAD");
    if (is_error(r.get())) throw_reply_error(reply_text(r.get()), "SCRIPT LOAD of sequence_advance");
    if (r->type != REDIS_REPLY_STRING || reply_text(r.get()) != sha)
      throw store_error("idem: SCRIPT LOAD of sequence_advance answered an unexpected SHA1", "", false);
  }

  // One request and its reply; an error reply is mapped and thrown.
  ReplyPtr call(std::string_view request, const std::string& what, bool script) {
    ReplyPtr r = with_connection([&](redisContext* c) {
      send(c, request);
      ReplyPtr reply = read_reply(c, script ? "to EVALSHA" : "to the command");
      // NOSCRIPT ran nothing (SCRIPT FLUSH or a restart): load the script and send it once more.
      if (script && is_error(reply.get()) && error_code(reply_text(reply.get())) == "NOSCRIPT") {
        load_script(c);
        if (!send_all(c, request)) throw_io(c, "while sending EVALSHA", false);
        reply = read_reply(c, "to EVALSHA");
      }
      return reply;
    });
    if (is_error(r.get())) throw_reply_error(reply_text(r.get()), what);
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
};

RedisSequenceStore::RedisSequenceStore(RedisOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  Impl& im = *impl_;
  // Fail fast: one connection now, and the script loaded (a NOSCRIPT later reloads it anyway).
  ReplyPtr ignored = im.with_connection([&](redisContext* c) {
    im.load_script(c);
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
  Impl& im = impl();
  Request req;
  req.command(2);
  req.arg("GET");
  req.arg(im.key_of(entity));
  ReplyPtr r = im.call(req.view(), "GET of the sequence of entity '" + printable(entity) + "'", false);
  if (r->type == REDIS_REPLY_NIL) return std::nullopt;
  if (r->type != REDIS_REPLY_STRING)
    throw store_error("idem: unexpected Redis reply to GET of the sequence of entity '" + printable(entity) + "'", "",
                      false);
  return parse_seq(reply_text(r.get()), entity);
}

AdvanceResult RedisSequenceStore::advance(std::string_view entity, std::uint64_t seq) {
  detail::check_entity(entity);
  Impl& im = impl();
  const std::string what = "sequence_advance of entity '" + printable(entity) + "'";
  Request req;
  req.command(5);
  req.arg("EVALSHA");
  req.arg(im.sha);
  req.arg("1");
  req.arg(im.key_of(entity));
  req.arg(decimal(seq));
  ReplyPtr r = im.call(req.view(), what, true);
  if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 || r->element[0]->type != REDIS_REPLY_INTEGER ||
      r->element[1]->type != REDIS_REPLY_STRING)
    throw store_error("idem: unexpected Redis reply to " + what, "", false);
  AdvanceResult out;
  out.advanced = r->element[0]->integer == 1;
  const std::string_view prev = reply_text(r->element[1]);
  if (!prev.empty()) out.previous = parse_seq(prev, entity);
  // The script only writes when the value grows; a reply saying otherwise is a broken script.
  if (out.previous && out.advanced != (*out.previous < seq))
    throw store_error("idem: inconsistent Redis reply to " + what, "", false);
  return out;
}

bool RedisSequenceStore::erase(std::string_view entity) {
  detail::check_entity(entity);
  Impl& im = impl();
  Request req;
  req.command(2);
  req.arg("DEL");
  req.arg(im.key_of(entity));
  ReplyPtr r = im.call(req.view(), "DEL of the sequence of entity '" + printable(entity) + "'", false);
  if (r->type != REDIS_REPLY_INTEGER)
    throw store_error("idem: unexpected Redis reply to DEL of the sequence of entity '" + printable(entity) + "'", "",
                      false);
  return r->integer > 0;
}

std::string RedisSequenceStore::sequence_key(std::string_view entity) const { return impl().key_of(entity); }
const std::string& RedisSequenceStore::script_sha() const { return impl().sha; }
std::string_view RedisSequenceStore::script_source() noexcept { return detail::redis_lua::sequence_advance; }
const RedisOptions& RedisSequenceStore::options() const { return impl().opt; }

}  // namespace idem
