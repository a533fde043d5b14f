// StreamsConsumer: XAUTOCLAIM, XREADGROUP, XACK and dead letters as plain commands on the Redis
// engine of a client of its own (the stores' transport: TLS, AUTH, SELECT, Sentinel and a demoted
// master, reconnects). The consumer is one caller, so each command goes on the caller's thread
// over an idle connection, XREADGROUP's BLOCK included. On a Redis Cluster every command names the
// stream (and the dead-letter stream, in its slot), so each goes to the master of the stream's
// slot, following MOVED / ASK like the stores' calls.

#include "idem/redis/streams_consumer.hpp"

#include <algorithm>
#include <string>

#include <fmt/format.h>
#include <hiredis/hiredis.h>

#include "client.hpp"
#include "engine_store.hpp"
#include "idem/core/hex.hpp"
#include "idem/redis/hash_slot.hpp"

namespace idem {

namespace {

using detail::printable;
using detail::redis::Client;
using detail::redis::Command;
using detail::redis::ReplyPtr;

// The dead letter and the ack of its entry in one step: a crash leaves both or neither.
// KEYS: stream, dead-letter stream. ARGV: group, entry id, then the letter's field/value pairs.
constexpr std::string_view dead_letter_lua =
    "redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))\n"
    "return redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])\n";

StreamsConsumerOptions checked(StreamsConsumerOptions o) {
  o.redis = detail::redis::resolve_options(std::move(o.redis));
  auto bad = [](const char* field, const std::string& why) {
    throw invalid_options_error(fmt::format("idem: StreamsConsumerOptions::{} {}", field, why));
  };
  if (o.stream.empty()) bad("stream", "is empty: name the stream to read");
  if (o.group.empty()) bad("group", "is empty: name the consumer group");
  if (o.consumer.empty()) bad("consumer", "is empty: give each live consumer a name of its own");
  if (o.count < 1 || o.count > 10'000) bad("count", fmt::format("is {}; use 1..10000", o.count));
  if (o.block.count() < 0 || o.block >= o.redis.command_timeout)
    bad("block", fmt::format("is {} ms; use 0 up to below redis.command_timeout ({} ms), or the read times out "
                             "while the server is still waiting",
                             o.block.count(), o.redis.command_timeout.count()));
  if (o.claim_idle.count() < 1) bad("claim_idle", "must be positive (keep it at least the guard's lease)");
  if (o.dead_letter == o.stream) bad("dead_letter", "is the stream itself");
  if (o.dead_letter.empty()) {
    o.dead_letter = o.stream + ":dlq";
    // On a cluster the letter and the ack are one script, so both keys must share a slot: a stream
    // named without a hash tag gets its letters in "{stream}:dlq", which hashes as the stream does.
    if (!o.redis.cluster_nodes.empty() && redis_hash_slot(o.dead_letter) != redis_hash_slot(o.stream))
      o.dead_letter = "{" + o.stream + "}:dlq";
  }
  if (!o.redis.cluster_nodes.empty() && redis_hash_slot(o.dead_letter) != redis_hash_slot(o.stream))
    bad("dead_letter",
        fmt::format("('{}') hashes to slot {} and the stream ('{}') to slot {}: on a Redis Cluster the dead "
                    "letter and the ack are one script, so give both names the same hash tag (e.g. {{orders}} and "
                    "{{orders}}:dlq), or leave dead_letter empty",
                    printable(o.dead_letter), redis_hash_slot(o.dead_letter), printable(o.stream),
                    redis_hash_slot(o.stream)));
  return o;
}

std::string text(const redisReply* r) { return r && r->str ? std::string(r->str, r->len) : std::string(); }

// An entry list as XREADGROUP and XAUTOCLAIM answer it: [[id, [field, value, ...]], ...]. An
// entry trimmed away while pending comes back with nil fields (Redis 6.2): it is skipped.
std::vector<StreamEntry> entries_of(const redisReply* list) {
  std::vector<StreamEntry> out;
  if (list == nullptr || list->type != REDIS_REPLY_ARRAY) return out;
  for (std::size_t i = 0; i < list->elements; ++i) {
    const redisReply* e = list->element[i];
    if (e->type != REDIS_REPLY_ARRAY || e->elements < 2 || e->element[1]->type != REDIS_REPLY_ARRAY) continue;
    StreamEntry entry{text(e->element[0]), {}};
    const redisReply* f = e->element[1];
    for (std::size_t k = 0; k + 1 < f->elements; k += 2) entry.fields.emplace_back(text(f->element[k]), text(f->element[k + 1]));
    out.push_back(std::move(entry));
  }
  return out;
}

}  // namespace

struct StreamsConsumer::Impl {
  StreamsConsumerOptions opt;
  Client client;
  StreamsConsumerStats stats;
  std::string claim_cursor = "0-0";  // XAUTOCLAIM's scan position; "0-0" = a new pass
  std::string own_cursor = "0";      // this name's own pending entries (a previous run's), read first
  bool own_done = false;
  std::chrono::steady_clock::time_point next_claim{};
  std::vector<StreamEntry> polled;  // the last batch poll() returned, for settle(verdicts)

  int slot;  // on a cluster, the stream's slot (every command goes to its master); -1 otherwise

  explicit Impl(StreamsConsumerOptions o)
      : opt(checked(std::move(o))), client(opt.redis), slot(client.slot_of({opt.stream})) {}

  ReplyPtr send(Command& cmd, const char* what) {
    return client.core().store.command({std::string(cmd.format().view()), what, slot});
  }

  // One command; an error reply is a store_error naming it (retryable when the server is not the
  // master now, as the reply machine reads it, or a slot is moving: a failover or resharding).
  ReplyPtr call(Command& cmd, const char* what) {
    ReplyPtr r = send(cmd, what);
    if (r->type == REDIS_REPLY_ERROR) {
      const std::string t = text(r.get());
      const bool transient = detail::redis::is_not_master(r.get()) || detail::redis::error_code(t) == "TRYAGAIN";
      throw store_error(fmt::format("idem: {} on stream '{}' failed: {}", what, printable(opt.stream), t),
                        t.substr(0, t.find(' ')), transient);
    }
    return r;
  }

  void create_group() {
    Command cmd;
    cmd.arg("XGROUP").arg("CREATE").arg(opt.stream).arg(opt.group).arg("0").arg("MKSTREAM");
    ReplyPtr r = send(cmd, "XGROUP CREATE");
    if (r->type == REDIS_REPLY_ERROR && text(r.get()).rfind("BUSYGROUP", 0) != 0)
      throw store_error(fmt::format("idem: XGROUP CREATE of group '{}' on stream '{}' failed: {}", printable(opt.group),
                                    printable(opt.stream), text(r.get())),
                        "", false);
  }

  // XAUTOCLAIM, at most every quarter of claim_idle (and on through a pass it has started).
  std::vector<StreamEntry> claim() {
    const auto now = std::chrono::steady_clock::now();
    if (claim_cursor == "0-0" && now < next_claim) return {};
    Command cmd;
    cmd.arg("XAUTOCLAIM").arg(opt.stream).arg(opt.group).arg(opt.consumer).arg(opt.claim_idle.count());
    cmd.arg(claim_cursor).arg("COUNT").arg(opt.count);
    ReplyPtr r = call(cmd, "XAUTOCLAIM");
    if (r->type != REDIS_REPLY_ARRAY || r->elements < 2) throw store_error("idem: XAUTOCLAIM answered an unexpected reply", "", false);
    claim_cursor = text(r->element[0]);
    if (claim_cursor == "0-0") next_claim = now + std::max(opt.claim_idle / 4, millis{100});
    auto got = entries_of(r->element[1]);
    stats.claimed += got.size();
    return got;
  }

  // A consumer restarted under its name resumes what its previous run read and never acked, at
  // once rather than after claim_idle: XREADGROUP from an id re-reads the name's own pending entries.
  std::vector<StreamEntry> read_own() {
    Command cmd;
    cmd.arg("XREADGROUP").arg("GROUP").arg(opt.group).arg(opt.consumer).arg("COUNT").arg(opt.count);
    cmd.arg("STREAMS").arg(opt.stream).arg(own_cursor);
    auto got = entries_in(call(cmd, "XREADGROUP of its own pending entries"));
    if (got.empty()) own_done = true;
    else own_cursor = got.back().id;
    stats.resumed += got.size();
    return got;
  }

  static std::vector<StreamEntry> entries_in(const ReplyPtr& r) {
    if (r->type != REDIS_REPLY_ARRAY || r->elements == 0) return {};  // nil: nothing within `block`
    const redisReply* s = r->element[0];
    return s->type == REDIS_REPLY_ARRAY && s->elements >= 2 ? entries_of(s->element[1]) : std::vector<StreamEntry>{};
  }

  std::vector<StreamEntry> read_new() {
    Command cmd;
    cmd.arg("XREADGROUP").arg("GROUP").arg(opt.group).arg(opt.consumer).arg("COUNT").arg(opt.count);
    cmd.arg("BLOCK").arg(opt.block.count()).arg("STREAMS").arg(opt.stream).arg(">");
    ReplyPtr r = call(cmd, "XREADGROUP");
    auto got = entries_in(r);
    stats.read += got.size();
    return got;
  }

  void dead_letter(const StreamEntry& e, const std::string& reason) {
    Command cmd;
    cmd.arg("EVAL").arg(dead_letter_lua).arg(2).arg(opt.stream).arg(opt.dead_letter).arg(opt.group).arg(e.id);
    cmd.arg("source_id").arg(e.id).arg("error").arg(reason);
    for (const auto& [k, v] : e.fields) cmd.arg(k).arg(v);
    (void)call(cmd, "the dead letter (XADD and XACK)");
    ++stats.dead_lettered;
  }
};

StreamsConsumer::StreamsConsumer(StreamsConsumerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  if (impl_->opt.create_group) impl_->create_group();
}

StreamsConsumer::~StreamsConsumer() = default;

std::vector<StreamEntry> StreamsConsumer::poll() {
  impl_->polled.clear();
  std::vector<StreamEntry> batch;
  if (!impl_->own_done) batch = impl_->read_own();
  if (batch.empty()) batch = impl_->claim();
  if (batch.empty()) batch = impl_->read_new();
  impl_->polled = batch;
  return batch;
}

Delivery StreamsConsumer::delivery(const StreamEntry& e) {
  Delivery d;
  d.id = e.id;
  if (const std::string* id = e.field("id")) d.key = *id;
  if (const std::string* payload = e.field("payload")) d.payload = *payload;
  d.headers.reserve(e.fields.size());
  for (const auto& [k, v] : e.fields) d.headers.emplace_back(k, v);
  return d;
}

void StreamsConsumer::settle(std::span<const Verdict> verdicts) {
  std::vector<StreamDecision> decisions;
  decisions.reserve(verdicts.size());
  for (const Verdict& v : verdicts) decisions.push_back({v.action, v.reason});
  const std::vector<StreamEntry> batch = std::move(impl_->polled);
  impl_->polled.clear();
  settle(batch, decisions);
}

void StreamsConsumer::release() noexcept { impl_->polled.clear(); }

void StreamsConsumer::settle(std::span<const StreamEntry> entries, std::span<const StreamDecision> decisions) {
  if (entries.size() != decisions.size())
    throw usage_error(fmt::format("idem: StreamsConsumer::settle: {} entries but {} decisions", entries.size(),
                                  decisions.size()));
  Command ack;
  ack.arg("XACK").arg(impl_->opt.stream).arg(impl_->opt.group);
  std::size_t acks = 0;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    switch (decisions[i].action) {
      case BrokerAction::ack:
        ack.arg(entries[i].id);
        ++acks;
        break;
      case BrokerAction::dead_letter: impl_->dead_letter(entries[i], decisions[i].reason); break;
      case BrokerAction::requeue: ++impl_->stats.left_pending; break;
    }
  }
  if (acks == 0) return;
  (void)impl_->call(ack, "XACK");
  impl_->stats.acked += acks;
}

StreamDecision StreamsConsumer::decide(const std::exception_ptr& e) {
  Verdict v = verdict(e);
  return {v.action, std::move(v.reason)};
}

StreamsConsumerStats StreamsConsumer::stats() const noexcept { return impl_->stats; }
const StreamsConsumerOptions& StreamsConsumer::options() const noexcept { return impl_->opt; }

}  // namespace idem
