// RedisStore: the store's transitions on the engine (engine_store.hpp, AsyncRedisStore's code),
// on a loop of its own; and what every Redis store shares: the record's parsing, the server check.

#include "idem/redis/store.hpp"

#include <algorithm>
#include <optional>
#include <span>
#include <string>
#include <unordered_set>
#include <utility>

#include <fmt/format.h>

#include "client.hpp"
#include "engine_store.hpp"
#include "store_requests.hpp"
#include "idem/core/error.hpp"
#include "idem/core/hex.hpp"
#include "idem/core/validate.hpp"

namespace idem {

namespace detail::redis {

using detail::printable;

namespace {
std::uint64_t token_value(std::string_view s) {
  std::uint64_t t = 0;
  for (char c : s) t = (t << 8) | static_cast<unsigned char>(c);
  return t;
}

std::int64_t integer(const redisReply* r, std::string_view what, std::string_view key) {
  if (r->type != REDIS_REPLY_INTEGER) bad_reply(what, key);
  return r->integer;
}
}  // namespace

void bad_reply(std::string_view what, std::string_view key) {
  throw_bad_reply(fmt::format("{} of key '{}'; is the server a Redis-compatible one running idem's scripts?", what,
                              printable(key)));
}

// The usual completed records, read where the script answers with the record itself and where a
// batch reads its keys first (duplicates_first): header 0xA2 (a result), a 1-byte generation, the
// token and a 32-bit length reaching the last byte; or header 0x82 (an empty result), 10 bytes.
// Sets `out` to the duplicate answer and returns true, or false for any other value.
bool usual_completed(const redisReply* r, AcquireResult& out) {
  if (r->type != REDIS_REPLY_STRING || r->len < 10) return false;
  const auto* b = reinterpret_cast<const unsigned char*>(r->str);
  if (b[1] == 0) return false;
  if (b[0] == 0x82 && r->len == 10) {
    out.payload.clear();
  } else if (b[0] == 0xA2 && r->len >= 14 &&
             (std::uint32_t{b[10]} << 24 | std::uint32_t{b[11]} << 16 | std::uint32_t{b[12]} << 8 | b[13]) == r->len - 14) {
    out.payload.assign(r->str + 14, r->len - 14);
  } else {
    return false;
  }
  out.status = AcquireStatus::duplicate;
  out.attempts = b[1];
  return true;
}

void one_holder_per_key(std::span<const std::string_view> keys, std::vector<AcquireResult>& out, millis lease) {
  if (keys.size() < 2) return;
  std::unordered_set<std::string_view> taken;
  for (std::size_t i = 0; i < keys.size(); ++i)
    if (out[i].status == AcquireStatus::acquired && !taken.insert(keys[i]).second)
      out[i] = AcquireResult{.status = AcquireStatus::in_flight, .attempts = out[i].attempts, .retry_after = lease};
}

Command mget_command(const RedisOptions& o, std::span<const AcquireRequest> requests) {
  Command cmd;
  cmd.arg("MGET");
  for (const AcquireRequest& r : requests) cmd.joined({o.key_prefix, r.key});
  return cmd;
}

void read_mget(const redisReply* r, std::span<const AcquireRequest> requests, std::optional<AcquireResult>* known) {
  if (r->type != REDIS_REPLY_ARRAY || r->elements != requests.size()) bad_reply("MGET", requests.front().key);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    AcquireResult dup;
    if (usual_completed(r->element[i], dup)) known[i] = std::move(dup);
  }
}

void warn_mget_refused(const RedisOptions& o, std::string_view error_text) {
  if (o.observer)
    o.observer->on_warning(
        fmt::format("idem: Redis refused MGET ({}): batches now answer duplicates through the script, which costs "
                    "the server more; grant the ACL user +mget",
                    error_text));
}

AcquireResult parse_acquire(const redisReply* r, std::string_view key, std::uint64_t token) {
  AcquireResult out;
  // 1: a new key acquired (fence 1, no takeover), the scripts' integer for the common answer
  if (r->type == REDIS_REPLY_INTEGER) {
    if (r->integer != 1) bad_reply("acquire", key);
    out.status = AcquireStatus::acquired;
    out.attempts = 1;
    out.holder = {1, token};
    return out;
  }
  // A duplicate of a usual completed record: the record itself (completed_reply in record.lua).
  if (r->type == REDIS_REPLY_STRING) {
    if (!usual_completed(r, out)) bad_reply("acquire", key);
    return out;
  }
  if (r->type != REDIS_REPLY_ARRAY || r->elements < 2) bad_reply("acquire", key);
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
    case 4:
    case 6: {  // 6: a duplicate completed without its result; the payload says why
      const redisReply* p = third();
      if (p->type != REDIS_REPLY_STRING) bad_reply("acquire", key);
      out.status = code == 4 ? AcquireStatus::previously_failed : AcquireStatus::duplicate;
      out.result_unavailable = code == 6;
      out.payload.assign(p->str, p->len);
      break;
    }
    case 5: out.status = AcquireStatus::mismatch; break;
    default: bad_reply("acquire", key);
  }
  return out;
}

WriteStatus parse_write(const redisReply* r, std::string_view what, std::string_view key) {
  return integer(r, what, key) == 1 ? WriteStatus::ok : WriteStatus::lease_lost;
}

// The record stores the fingerprint's length in 16 bits.
void check_fingerprint(const AcquireParams& p) {
  if (p.fingerprint.size() > 65535)
    throw invalid_options_error(
        fmt::format("idem: RedisStore keeps fingerprints of up to 65535 bytes, got {}; pass a hash (idem::fingerprint)",
                    p.fingerprint.size()));
}

Command eval_one(const RedisOptions& o, Script s, std::string_view key) {
  Command cmd = Client::evalsha(s, 1);
  cmd.joined({o.key_prefix, key});
  return cmd;
}

Command acquire_command(const RedisOptions& o, std::string_view key, const AcquireParams& p) {
  detail::check_acquire(key, p);
  check_fingerprint(p);
  Command cmd = eval_one(o, Script::acquire, key);
  cmd.token(p.token).arg(p.lease.count()).arg(p.retention.count()).arg(p.fingerprint).arg(p.owner.substr(0, 255));
  return cmd;
}

Command complete_command(const RedisOptions& o, std::string_view key, const Holder& h, std::string_view text,
                         millis retention, bool unavailable) {
  detail::check_holder(key, h);
  detail::check_lease(retention, "retention");
  Command cmd = eval_one(o, Script::complete, key);
  cmd.arg(h.fence).token(h.token).arg(text).arg(retention.count());
  if (unavailable) cmd.arg("1");
  return cmd;
}

Command fail_command(const RedisOptions& o, std::string_view key, const Holder& h, const FailParams& f) {
  detail::check_holder(key, h);
  detail::check_lease(f.retention, "retention");
  Command cmd = eval_one(o, Script::fail, key);
  cmd.arg(h.fence).token(h.token).arg(f.error).arg(f.release ? "1" : "0").arg(f.permanent ? "1" : "0");
  cmd.arg(std::max<std::int64_t>(0, f.backoff.count())).arg(f.retention.count());
  return cmd;
}

Command extend_command(const RedisOptions& o, std::string_view key, const Holder& h, millis lease) {
  detail::check_holder(key, h);
  detail::check_lease(lease);
  Command cmd = eval_one(o, Script::extend, key);
  cmd.arg(h.fence).token(h.token).arg(lease.count());
  return cmd;
}

Command inspect_command(const RedisOptions& o, std::string_view key) {
  detail::check_key(key, static_cast<std::size_t>(-1));
  return eval_one(o, Script::inspect, key);
}

std::optional<Record> parse_inspect(const redisReply* r, std::string_view key) {
  if (r->type == REDIS_REPLY_NIL) return std::nullopt;
  if (r->type != REDIS_REPLY_ARRAY || r->elements != 9) bad_reply("inspect", key);
  auto str = [&](std::size_t i) {
    const redisReply* e = r->element[i];
    if (e->type != REDIS_REPLY_STRING) bad_reply("inspect", key);
    return std::string(e->str, e->len);
  };
  auto num = [&](std::size_t i) { return integer(r->element[i], "inspect", key); };
  Record rec;
  const std::int64_t st = num(0);
  if (st < 1 || st > 3) bad_reply("inspect", key);
  rec.state = static_cast<State>(st);
  rec.holder.fence = static_cast<std::uint64_t>(num(1));
  rec.attempts = static_cast<std::uint32_t>(rec.holder.fence);
  rec.holder.token = token_value(str(2));
  rec.owner = str(3);
  rec.lease_until_ms = num(4);
  rec.retry_at_ms = num(5);
  rec.permanent = num(6) != 0;
  rec.fingerprint = str(7);
  // A completed record's permanent bit: completed without its result, the payload says why.
  (rec.state == State::failed || rec.permanent ? rec.error : rec.result) = str(8);
  return rec;
}

// Bytes of one call kept for everything but the largest argument (script SHA, fence, token,
// numbers, the fingerprint and header the record adds to a result): a generous bound, an eighth
// of a small proto-max-bulk-len (its minimum is 1 MiB).
constexpr std::uint64_t arg_margin = 1 << 20;
constexpr std::uint64_t default_max_bulk_len = 512ULL << 20;  // Redis's default proto-max-bulk-len

// Reads the server's settings once: refuses an evicting configuration (or warns when told to
// accept it, or when the settings cannot be read), and returns what one call can carry.
StoreLimits check_server(Client& client) {
  const RedisOptions& o = client.options();
  const ServerConfig cfg = client.server_config();
  auto warn = [&](const std::string& m) {
    if (o.observer) o.observer->on_warning(m);
  };
  if (!cfg.problem.empty()) {
    warn(
        fmt::format("idem: cannot read the Redis settings maxmemory, maxmemory-policy and proto-max-bulk-len ({}); "
                    "make sure maxmemory-policy is noeviction (or maxmemory 0), or idempotency records can be "
                    "evicted; the ACL user needs +config|get for idem to check it",
                    cfg.problem));
  } else if (cfg.policy != "noeviction") {
    const std::string why = fmt::format(
        "Redis maxmemory-policy is '{}': idem's records all carry a TTL, so every "
        "policy but noeviction (volatile-* included) can evict them, and their "
        "messages would run again",
        cfg.policy);
    if (cfg.maxmemory == 0) {
      warn(
          fmt::format("idem: {} once maxmemory is set (it is 0 now, so nothing is evicted); set maxmemory-policy "
                      "noeviction",
                      why));
    } else if (o.unsafe_allow_eviction) {
      warn(fmt::format("idem: {} (maxmemory {}); accepted because RedisOptions::unsafe_allow_eviction is set", why,
                       cfg.maxmemory));
    } else {
      throw store_error(fmt::format("idem: RedisStore refuses this server: {} (maxmemory {}). Fix: CONFIG SET "
                                    "maxmemory-policy noeviction (at the limit, writes then fail with OOM and are "
                                    "retried), or maxmemory 0; or accept the risk with "
                                    "RedisOptions::unsafe_allow_eviction = true",
                                    why, cfg.maxmemory),
                        "EVICTION", false);
    }
  }
  const std::uint64_t bulk = cfg.max_bulk_len > 0 ? cfg.max_bulk_len : default_max_bulk_len;
  const std::uint64_t most = std::min<std::uint64_t>(bulk - std::min(arg_margin, bulk / 8), static_cast<std::size_t>(-1));
  return StoreLimits{.max_key_bytes = static_cast<std::size_t>(most - std::min<std::uint64_t>(most, o.key_prefix.size())),
                     .max_result_bytes = static_cast<std::size_t>(most)};
}

}  // namespace detail::redis


using detail::asio_redis::BatchState;
using detail::asio_redis::GatherSlot;

RedisStore::RedisStore(RedisOptions options) : RedisStore(std::make_shared<RedisClient>(std::move(options))) {}

RedisStore::RedisStore(std::shared_ptr<RedisClient> client)
    : ClientHandle(std::move(client), "RedisStore"), limits_(detail::redis::check_server(impl())),
      core_(this->client(), &impl().core()) {}

RedisStore::~RedisStore() = default;
RedisStore::RedisStore(RedisStore&&) noexcept = default;
RedisStore& RedisStore::operator=(RedisStore&&) noexcept = default;

detail::asio_redis::EngineStore& RedisStore::core() const {
  (void)impl();  // usage_error on a moved-from store
  return core_->store;
}

AcquireResult RedisStore::acquire(std::string_view key, const AcquireParams& p) { return core().acquire(key, p); }

WriteStatus RedisStore::complete(std::string_view key, const Holder& h, std::string_view result, millis retention) {
  return core().complete(key, h, result, retention);
}

WriteStatus RedisStore::complete_unavailable(std::string_view key, const Holder& h, std::string_view reason,
                                             millis retention) {
  return core().complete_unavailable(key, h, reason, retention);
}

WriteStatus RedisStore::fail(std::string_view key, const Holder& h, const FailParams& f) { return core().fail(key, h, f); }

WriteStatus RedisStore::extend(std::string_view key, const Holder& h, millis lease) { return core().extend(key, h, lease); }

std::optional<Record> RedisStore::inspect(std::string_view key) { return core().inspect(key); }

std::vector<AcquireResult> RedisStore::acquire_many(std::span<const AcquireRequest> requests) {
  return core().acquire_many(requests);
}

std::vector<AcquireResult> RedisStore::acquire_batch(std::span<const std::string_view> keys, const AcquireParams& p) {
  return core().acquire_batch(keys, p);
}

std::vector<WriteStatus> RedisStore::complete_batch(std::span<const CompleteItem> items, millis retention) {
  return core().complete_batch(items, retention);
}

struct RedisStore::BatchWriter::Impl {
  detail::asio_redis::EngineStore* store;
  std::shared_ptr<BatchState> state = std::make_shared<BatchState>();
  ~Impl() { state->wait(); }  // the requests' views (keys, results) are the caller's until sent
};

RedisStore::BatchWriter::BatchWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RedisStore::BatchWriter::BatchWriter(BatchWriter&&) noexcept = default;
RedisStore::BatchWriter& RedisStore::BatchWriter::operator=(BatchWriter&&) noexcept = default;
RedisStore::BatchWriter::~BatchWriter() = default;

void RedisStore::BatchWriter::complete(std::string_view key, const Holder& h, std::string_view result,
                                       millis retention) {
  auto& s = impl_->state;
  impl_->store->submit_complete(key, h, result, retention, false, std::make_unique<GatherSlot<WriteStatus>>(s, s->add()));
}

void RedisStore::BatchWriter::fail(std::string_view key, const Holder& h, const FailParams& f) {
  auto& s = impl_->state;
  impl_->store->submit_fail(key, h, f, std::make_unique<GatherSlot<WriteStatus>>(s, s->add()));
}

std::vector<WriteStatus> RedisStore::BatchWriter::finish() {
  auto out = impl_->state->finish();
  impl_->state = std::make_shared<BatchState>();  // the writer may be used again
  return out;
}

bool RedisStore::BatchWriter::broken() const noexcept { return impl_->state->failed.load(); }

RedisStore::BatchWriter RedisStore::batch_writer() {
  return BatchWriter(std::unique_ptr<BatchWriter::Impl>(new BatchWriter::Impl{&core()}));
}

AsyncRedisStats RedisStore::stats() const noexcept { return core_ ? core_->store.stats() : AsyncRedisStats{}; }

std::string RedisStore::redis_key(std::string_view key) const { return impl().options().key_prefix + std::string(key); }

std::string RedisStore::eviction_policy() { return impl().server_config().policy; }

}  // namespace idem
