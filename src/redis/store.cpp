// RedisStore: formats one EVALSHA per transition (one pipelined many.lua run per 256 keys for a batch) and
// parses the replies; the client does the rest.

#include "idem/redis/store.hpp"

#include <algorithm>
#include <optional>
#include <span>
#include <string>
#include <unordered_set>
#include <utility>

#include <fmt/format.h>

#include "client.hpp"
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

namespace {

using namespace detail::redis;


// Every script but inspect is a holder's step that recognises itself done, so a lost reply is
// asked again as the same holder (Resend::same_holder); inspect only reads.
Resend resend_of(Script s) { return s == Script::inspect ? Resend::never : Resend::same_holder; }

// many.lua's letter for an acquire that shares the call's lease, retention and owner: 'a' without
// a fingerprint (the token alone), 'b' with one (then acquire_args adds both).
char acquire_step(std::string_view fingerprint) { return fingerprint.empty() ? 'a' : 'b'; }
void acquire_args(Command& cmd, const AcquireParams& p) {
  cmd.token(p.token);
  if (!p.fingerprint.empty()) cmd.arg(p.fingerprint);
}

ReplyPtr run_one(Client& client, Script s, Command& cmd, std::string_view key) {
  ReplyPtr r;
  try {
    r = client.eval(s, cmd.format(), store_hints, resend_of(s), client.slot_of({client.options().key_prefix, key}));
  } catch (const outcome_unknown_error& e) {  // the client knows the script, not the key
    throw outcome_unknown_error(fmt::format("{} (key '{}')", e.what(), printable(key)), e.code());
  } catch (const durability_error& e) {
    throw durability_error(fmt::format("{} (key '{}')", e.what(), printable(key)), e.acks(), e.wanted());
  }
  throw_if_error(r.get(), store_hints, [&] { return fmt::format("{} of key '{}'", script(s).name, printable(key)); });
  return r;
}

// A batch of `items`: one EVALSHA of many.lua per batch_chunk of them, pipelined (the one batch
// format: auto-batching's calls and a store's batches carry their steps alike). `key_of(item)` is the
// idempotency key, `encode(cmd, idx)` adds the arguments after the keys for the items at `idx`,
// `parse(reply, item)` reads one element of a run's reply. On a cluster every script's keys
// share one slot: the items are grouped by slot first (each group in input order), and the
// client sends each master its share.
template <class Out, class Item, class KeyOf, class Encode, class Parse>
std::vector<Out> run_batch(Client& client, std::span<const Item> items, const KeyOf& key_of, const Encode& encode,
                           const Parse& parse, std::size_t chunk = batch_chunk) {
  constexpr Script s = Script::many;
  const std::string_view name = script(s).name;
  const std::string& prefix = client.options().key_prefix;
  std::vector<std::size_t> order(items.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::vector<int> slot_of_item;
  if (client.clustered()) {
    slot_of_item.resize(items.size());
    for (std::size_t i = 0; i < items.size(); ++i) slot_of_item[i] = client.slot_of({prefix, key_of(items[i])});
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return slot_of_item[a] < slot_of_item[b]; });
  }
  // Runs: [from, from + n) of `order`, one slot each on a cluster.
  struct Run {
    std::size_t from, n;
  };
  std::vector<Run> runs;
  std::vector<int> run_slots;
  for (std::size_t from = 0; from < order.size();) {
    std::size_t n = 1;
    while (from + n < order.size() && n < chunk &&
           (slot_of_item.empty() || slot_of_item[order[from + n]] == slot_of_item[order[from]]))
      ++n;
    runs.push_back({from, n});
    run_slots.push_back(slot_of_item.empty() ? -1 : slot_of_item[order[from]]);
    from += n;
  }
  Pipeline pipeline;
  for (const Run& run : runs) {
    Command cmd = Client::evalsha(s, run.n);
    const std::span<const std::size_t> idx(order.data() + run.from, run.n);
    for (std::size_t i : idx) cmd.joined({prefix, key_of(items[i])});
    encode(cmd, idx);
    pipeline.add(cmd.format());
  }
  std::vector<ReplyPtr> replies;
  try {
    replies = client.eval_many(s, pipeline, run_slots, store_hints, resend_of(s));
  } catch (const store_error& e) {
    // A slot half migrated bounces a script of several of its keys between ASK (some keys left)
    // and TRYAGAIN (some not arrived). One key per script always runs somewhere, so the batch is
    // sent again that way; what already ran answers as done (the same token or holder asks again).
    if (e.code() != "REDIRECTS" || chunk == 1) throw;
    return run_batch<Out>(client, items, key_of, encode, parse, 1);
  }
  std::vector<std::optional<Out>> placed(items.size());
  for (std::size_t c = 0; c < replies.size(); ++c) {
    const redisReply* r = replies[c].get();
    const Run& run = runs[c];
    const std::string_view first = key_of(items[order[run.from]]);
    throw_if_error(r, store_hints,
                   [&] { return fmt::format("{} of {} keys from '{}'", name, run.n, printable(first)); });
    if (r->type != REDIS_REPLY_ARRAY || r->elements != run.n) bad_reply(name, first);
    for (std::size_t i = 0; i < run.n; ++i) {
      const std::size_t item = order[run.from + i];
      // many.lua answers one key's error (a damaged record, OOM) in that key's place and goes on.
      throw_if_error(r->element[i], store_hints,
                     [&] { return fmt::format("{} of key '{}'", name, printable(key_of(items[item]))); });
      placed[item] = parse(r->element[i], items[item]);
    }
  }
  std::vector<Out> out;
  out.reserve(items.size());
  for (auto& o : placed) out.push_back(std::move(*o));
  return out;
}

}  // namespace

RedisStore::RedisStore(RedisOptions options) : RedisStore(std::make_shared<RedisClient>(std::move(options))) {}

RedisStore::RedisStore(std::shared_ptr<RedisClient> client)
    : ClientHandle(std::move(client), "RedisStore"), limits_(check_server(impl())) {}

AcquireResult RedisStore::acquire(std::string_view key, const AcquireParams& p) {
  Client& c = impl();
  Command cmd = acquire_command(c.options(), key, p);
  return parse_acquire(run_one(c, Script::acquire, cmd, key).get(), key, p.token);
}

namespace {
WriteStatus complete_one(Client& c, std::string_view key, const Holder& h, std::string_view text, millis retention,
                         bool unavailable) {
  Command cmd = complete_command(c.options(), key, h, text, retention, unavailable);
  return parse_write(run_one(c, Script::complete, cmd, key).get(), "complete", key);
}

}  // namespace

WriteStatus RedisStore::complete(std::string_view key, const Holder& h, std::string_view result, millis retention) {
  return complete_one(impl(), key, h, result, retention, false);
}

WriteStatus RedisStore::complete_unavailable(std::string_view key, const Holder& h, std::string_view reason,
                                             millis retention) {
  return complete_one(impl(), key, h, reason, retention, true);
}

WriteStatus RedisStore::fail(std::string_view key, const Holder& h, const FailParams& f) {
  Client& c = impl();
  Command cmd = fail_command(c.options(), key, h, f);
  return parse_write(run_one(c, Script::fail, cmd, key).get(), "fail", key);
}

namespace {
// A completed record is final (docs/design.md: never overwritten; only its retention, a purge or
// an operator's release ends it), so reading it is deciding its acquire: the answer the script
// would give, at the instant of the read. One MGET per 256 keys answers a batch's duplicates for
// about a sixth of the script's server time per key; the usual completed records (the ones
// completed_reply in record.lua answers with the record itself) are read here, anything else goes
// through many.lua. Empty when the batch goes wholly to the script: on a cluster (its keys
// span slots, and MGET takes one), or when DuplicatesFirst says the read is not worth its round trip.
std::vector<std::optional<AcquireResult>> duplicates_first(Client& c, std::span<const AcquireRequest> requests) {
  if (c.clustered() || !c.duplicates_first.wanted()) return {};
  std::vector<std::optional<AcquireResult>> known(requests.size());
  for (std::size_t from = 0; from < requests.size(); from += batch_chunk) {
    const auto chunk = requests.subspan(from, std::min(batch_chunk, requests.size() - from));
    ReplyPtr r = c.call(mget_command(c.options(), chunk).format(), "MGET");
    if (is_error(r.get())) {
      if (error_code(reply_text(r.get())) != "NOPERM")
        throw_if_error(r.get(), store_hints, [] { return std::string("MGET"); });
      if (c.duplicates_first.refuse()) warn_mget_refused(c.options(), reply_text(r.get()));
      return {};
    }
    read_mget(r.get(), chunk, known.data() + from);
  }
  const bool found = std::any_of(known.begin(), known.end(), [](const auto& k) { return k.has_value(); });
  c.duplicates_first.read(found);
  if (!found) return {};
  return known;
}
}  // namespace

std::vector<AcquireResult> RedisStore::acquire_many(std::span<const AcquireRequest> requests) {
  if (requests.empty()) return {};
  const AcquireParams& first = requests.front().params;
  bool shared = true;
  for (const AcquireRequest& r : requests) {
    detail::check_acquire(r.key, r.params);
    check_fingerprint(r.params);
    shared = shared && r.params.lease == first.lease && r.params.retention == first.retention &&
             r.params.owner == first.owner;
  }
  if (!shared) {  // not the guard's way: one call each
    std::vector<AcquireResult> out;
    for (const AcquireRequest& r : requests) out.push_back(acquire(r.key, r.params));
    return out;
  }
  const std::string_view owner = first.owner.substr(0, 255);
  auto acquire_each = [&](std::span<const AcquireRequest> reqs) {
    return run_batch<AcquireResult>(
        impl(), reqs, [](const AcquireRequest& r) { return r.key; },
        [&](Command& cmd, std::span<const std::size_t> idx) {
          std::string steps;
          for (std::size_t i : idx) steps += acquire_step(reqs[i].params.fingerprint);
          cmd.joined({steps}).arg(first.lease.count()).arg(first.retention.count()).arg(owner);
          for (std::size_t i : idx) acquire_args(cmd, reqs[i].params);
        },
        [](const redisReply* r, const AcquireRequest& req) { return parse_acquire(r, req.key, req.params.token); });
  };
  std::vector<std::optional<AcquireResult>> known = duplicates_first(impl(), requests);
  if (known.empty()) return acquire_each(requests);
  std::vector<AcquireRequest> rest;
  for (std::size_t i = 0; i < requests.size(); ++i)
    if (!known[i]) rest.push_back(requests[i]);
  std::vector<AcquireResult> decided = rest.empty() ? std::vector<AcquireResult>{} : acquire_each(rest);
  std::vector<AcquireResult> out;
  out.reserve(requests.size());
  std::size_t next = 0;
  for (auto& k : known) out.push_back(k ? std::move(*k) : std::move(decided[next++]));
  return out;
}


struct RedisStore::BatchWriter::Impl {
  Client* client;
  Writes writes;
  std::vector<std::pair<std::string, const char*>> made;  // key and step, for messages
};

RedisStore::BatchWriter::BatchWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RedisStore::BatchWriter::BatchWriter(BatchWriter&&) noexcept = default;
RedisStore::BatchWriter& RedisStore::BatchWriter::operator=(BatchWriter&&) noexcept = default;
RedisStore::BatchWriter::~BatchWriter() = default;

void RedisStore::BatchWriter::complete(std::string_view key, const Holder& h, std::string_view result,
                                       millis retention) {
  Client& c = *impl_->client;
  Command cmd = complete_command(c.options(), key, h, result, retention, false);
  impl_->writes.send(Script::complete, cmd.format(), c.slot_of({c.options().key_prefix, key}));
  impl_->made.emplace_back(std::string(key), "complete");
}

void RedisStore::BatchWriter::fail(std::string_view key, const Holder& h, const FailParams& f) {
  Client& c = *impl_->client;
  Command cmd = fail_command(c.options(), key, h, f);
  impl_->writes.send(Script::fail, cmd.format(), c.slot_of({c.options().key_prefix, key}));
  impl_->made.emplace_back(std::string(key), "fail");
}

std::vector<WriteStatus> RedisStore::BatchWriter::finish() {
  std::vector<ReplyPtr> replies = impl_->writes.finish(store_hints);
  std::vector<WriteStatus> out;
  out.reserve(replies.size());
  for (std::size_t i = 0; i < replies.size(); ++i) {
    const std::string& key = impl_->made[i].first;
    const char* step = impl_->made[i].second;
    throw_if_error(replies[i].get(), store_hints, [&] { return fmt::format("{} of key '{}'", step, printable(key)); });
    out.push_back(parse_write(replies[i].get(), step, key));
  }
  return out;
}

bool RedisStore::BatchWriter::broken() const noexcept { return impl_->writes.broken(); }

RedisStore::BatchWriter RedisStore::batch_writer() {
  Client& c = impl();
  return BatchWriter(std::unique_ptr<BatchWriter::Impl>(new BatchWriter::Impl{&c, Writes(c), {}}));
}

WriteStatus RedisStore::extend(std::string_view key, const Holder& h, millis lease) {
  Client& c = impl();
  Command cmd = extend_command(c.options(), key, h, lease);
  return parse_write(run_one(c, Script::extend, cmd, key).get(), "extend", key);
}

std::optional<Record> RedisStore::inspect(std::string_view key) {
  Client& c = impl();
  Command cmd = inspect_command(c.options(), key);
  return parse_inspect(run_one(c, Script::inspect, cmd, key).get(), key);
}

std::vector<AcquireResult> RedisStore::acquire_batch(std::span<const std::string_view> keys, const AcquireParams& p) {
  for (std::string_view k : keys) detail::check_acquire(k, p);
  check_fingerprint(p);
  const std::string_view owner = p.owner.substr(0, 255);
  std::vector<AcquireResult> out = run_batch<AcquireResult>(
      impl(), keys, [](std::string_view k) { return k; },
      [&](Command& cmd, std::span<const std::size_t> idx) {
        cmd.joined({std::string(idx.size(), acquire_step(p.fingerprint))})
            .arg(p.lease.count())
            .arg(p.retention.count())
            .arg(owner);
        for (std::size_t i = 0; i < idx.size(); ++i) acquire_args(cmd, p);
      },
      [&](const redisReply* r, std::string_view k) { return parse_acquire(r, k, p.token); });
  one_holder_per_key(keys, out, p.lease);
  return out;
}

std::vector<WriteStatus> RedisStore::complete_batch(std::span<const CompleteItem> items, millis retention) {
  detail::check_lease(retention, "retention");
  for (const CompleteItem& it : items) detail::check_holder(it.key, it.holder);
  return run_batch<WriteStatus>(
      impl(), items, [](const CompleteItem& it) { return it.key; },
      [&](Command& cmd, std::span<const std::size_t> idx) {
        cmd.joined({std::string(idx.size(), 'c')}).arg("").arg(retention.count()).arg("");
        for (std::size_t i : idx) cmd.arg(items[i].holder.fence).token(items[i].holder.token).arg(items[i].result);
      },
      [](const redisReply* r, const CompleteItem& it) { return parse_write(r, "complete_batch", it.key); });
}

std::string RedisStore::redis_key(std::string_view key) const { return impl().options().key_prefix + std::string(key); }

std::string RedisStore::eviction_policy() { return impl().server_config().policy; }

}  // namespace idem
