// A Redis store's transitions on the engine (engine_store.hpp): RedisStore's and
// AsyncRedisStore's, formatted and parsed by store_requests.hpp, carried by the engine.

#include "engine_store.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "idem/core/error.hpp"
#include "idem/core/hex.hpp"
#include "idem/core/validate.hpp"
#include "idem/redis/hash_slot.hpp"
#include "sequence_requests.hpp"
#include "store_requests.hpp"

namespace idem::detail::asio_redis {

namespace {

template <class T, class Parse>
std::unique_ptr<Op> request(DonePtr<T> done, Parse parse, Command& cmd, Script s, const std::string& wait,
                            const RedisOptions& o, std::string_view key) {
  auto op = std::make_unique<Call<T, Parse>>(std::move(done), std::move(parse));
  op->key.assign(key);
  if (!o.cluster_nodes.empty()) op->slot = redis_hash_slot(o.key_prefix + std::string(key));
  op->bytes.assign(cmd.format().view());
  locate_step(*op, s);
  if (!wait.empty() && !reads_only(s)) {
    op->bytes += wait;
    op->waits = true;
  }
  op->script = s;
  op->same_holder = s != Script::inspect;
  return op;
}

// The slot of a key of the store's namespace (-1 off a cluster).
int slot_of(const RedisOptions& o, std::string_view prefixed) {
  return o.cluster_nodes.empty() ? -1 : redis_hash_slot(prefixed);
}

// A sequence request. `resend`: a lost reply is asked again as the same holder (complete_advance,
// which recognises itself done), else it is in doubt (advance: a second run would answer "not
// advanced") or plainly retryable (GET, DEL: Script::inspect, which also sends no WAIT).
template <class T, class Parse>
std::unique_ptr<Op> sequence_op(DonePtr<T> done, Parse parse, Command& cmd, Script s, const std::string& wait,
                                int slot, std::string label) {
  auto op = std::make_unique<Call<T, Parse>>(std::move(done), std::move(parse));
  op->bytes.assign(cmd.format().view());
  op->slot = slot;
  op->script = s;
  op->label = std::move(label);
  op->hints = &sequence_hints;
  op->same_holder = s == Script::complete_advance;
  if (!wait.empty() && !reads_only(s)) {
    op->bytes += wait;
    op->waits = true;
  }
  return op;
}

// A blocking batch's count among the store's blocked callers, held until its answers are in (as a
// Waiter's is): alone, its requests go as call() sends them (on the caller's thread, as one
// coalesced call, when the connection is idle); with others blocked they queue with theirs.
class BlockedBatch {
public:
  explicit BlockedBatch(Engine& e)
      : engine_(e), alone_(count_blocked(e, count_)) {}
  ~BlockedBatch() { count_->fetch_sub(1, std::memory_order_relaxed); }
  BlockedBatch(const BlockedBatch&) = delete;
  BlockedBatch& operator=(const BlockedBatch&) = delete;
  void send(std::vector<std::unique_ptr<Op>> ops) {
    if (alone_) return call(engine_, std::move(ops));
    submit(engine_, std::move(ops));
  }

private:
  Engine& engine_;
  std::shared_ptr<std::atomic<int>> count_;  // before alone_: count_blocked sets it
  bool alone_;
};

}  // namespace

std::shared_ptr<Client> factory_of(const RedisOptions& o, StoreLimits& limits) {
  RedisOptions one = o;
  one.url.clear();
  one.pool.size = 1;
  auto client = std::make_shared<Client>(std::move(one));
  limits = check_server(*client);
  return client;
}

EngineStore::EngineStore(boost::asio::any_io_executor ex, const RedisOptions& o, std::shared_ptr<Client> factory)
    : options(o),
      wait(o.min_replica_acks > 0
               ? std::string(Command().arg("WAIT").arg(o.min_replica_acks).arg(o.replica_ack_timeout.count()).format().view())
               : std::string()),
      engine(make_engine(std::move(ex), options, std::move(factory))),
      duplicates_first_(std::make_unique<DuplicatesFirst>()) {}

EngineStore::~EngineStore() { shutdown(*engine); }

AsyncRedisStats EngineStore::stats() const noexcept { return asio_redis::stats(*engine); }

namespace {
std::unique_ptr<Op> plain_op(EngineStore::PlainCommand c, DonePtr<ReplyPtr> done) {
  auto op = std::make_unique<Plain>(std::move(done));
  op->bytes = std::move(c.bytes);
  op->label = std::move(c.what);
  op->slot = c.slot;
  op->node = std::move(c.node);
  return op;
}
}  // namespace

void EngineStore::submit_command(PlainCommand c, DonePtr<ReplyPtr> done) {
  send_checked<ReplyPtr>(*engine, done, [&] { return plain_op(std::move(c), std::move(done)); });
}

ReplyPtr EngineStore::command(PlainCommand c) {
  return wait_for<ReplyPtr>([&](auto w) { submit_command(std::move(c), std::move(w)); });
}

std::vector<ReplyPtr> EngineStore::commands(std::vector<PlainCommand> cs) {
  auto g = std::make_shared<Gather<ReplyPtr>>();
  std::vector<std::unique_ptr<Op>> ops;
  ops.reserve(cs.size());
  for (PlainCommand& c : cs) ops.push_back(plain_op(std::move(c), std::make_unique<GatherSlot<ReplyPtr>>(g, g->add())));
  BlockedBatch blocked(*engine);
  if (!ops.empty()) blocked.send(std::move(ops));
  g->wait();
  return g->take();
}

AcquireResult EngineStore::acquire(std::string_view key, const AcquireParams& p) {
  return wait_for<AcquireResult>([&](auto w) { submit_acquire(key, p, std::move(w)); });
}
WriteStatus EngineStore::complete(std::string_view key, const Holder& h, std::string_view result, millis retention) {
  return wait_for<WriteStatus>([&](auto w) { submit_complete(key, h, result, retention, false, std::move(w)); });
}
WriteStatus EngineStore::complete_unavailable(std::string_view key, const Holder& h, std::string_view reason,
                                                  millis retention) {
  return wait_for<WriteStatus>([&](auto w) { submit_complete(key, h, reason, retention, true, std::move(w)); });
}
WriteStatus EngineStore::fail(std::string_view key, const Holder& h, const FailParams& f) {
  return wait_for<WriteStatus>([&](auto w) { submit_fail(key, h, f, std::move(w)); });
}
WriteStatus EngineStore::extend(std::string_view key, const Holder& h, millis lease) {
  return wait_for<WriteStatus>([&](auto w) { submit_extend(key, h, lease, std::move(w)); });
}
std::optional<Record> EngineStore::inspect(std::string_view key) {
  return wait_for<std::optional<Record>>([&](auto w) { submit_inspect(key, std::move(w)); });
}

void EngineStore::submit_acquire(std::string_view key, const AcquireParams& p, DonePtr<AcquireResult> done) {
  send_checked<AcquireResult>(*engine, done, [&] {
    Command cmd = acquire_command(options, key, p);
    return request<AcquireResult>(
        std::move(done),
        [t = p.token](const redisReply* r, std::string_view k) { return parse_acquire(r, k, t); }, cmd,
        Script::acquire, wait, options, key);
  });
}

void EngineStore::submit_complete(std::string_view key, const Holder& h, std::string_view text, millis retention,
                                      bool unavailable, DonePtr<WriteStatus> done) {
  send_checked<WriteStatus>(*engine, done, [&] {
    Command cmd = complete_command(options, key, h, text, retention, unavailable);
    return request<WriteStatus>(
        std::move(done), [](const redisReply* r, std::string_view k) { return parse_write(r, "complete", k); },
        cmd, Script::complete, wait, options, key);
  });
}

void EngineStore::submit_fail(std::string_view key, const Holder& h, const FailParams& f, DonePtr<WriteStatus> done) {
  send_checked<WriteStatus>(*engine, done, [&] {
    Command cmd = fail_command(options, key, h, f);
    return request<WriteStatus>(
        std::move(done), [](const redisReply* r, std::string_view k) { return parse_write(r, "fail", k); },
        cmd, Script::fail, wait, options, key);
  });
}

void EngineStore::submit_extend(std::string_view key, const Holder& h, millis lease, DonePtr<WriteStatus> done) {
  send_checked<WriteStatus>(*engine, done, [&] {
    Command cmd = extend_command(options, key, h, lease);
    return request<WriteStatus>(
        std::move(done), [](const redisReply* r, std::string_view k) { return parse_write(r, "extend", k); },
        cmd, Script::extend, wait, options, key);
  });
}

void EngineStore::submit_inspect(std::string_view key, DonePtr<std::optional<Record>> done) {
  send_checked<std::optional<Record>>(*engine, done, [&] {
    Command cmd = inspect_command(options, key);
    return request<std::optional<Record>>(
        std::move(done), [](const redisReply* r, std::string_view k) { return parse_inspect(r, k); }, cmd,
        Script::inspect, wait, options, key);
  });
}

std::vector<std::optional<AcquireResult>> EngineStore::duplicates_first(std::span<const AcquireRequest> requests) {
  using Known = std::vector<std::optional<AcquireResult>>;
  if (!options.cluster_nodes.empty() || !duplicates_first_->wanted()) return {};
  auto g = std::make_shared<Gather<Known>>();
  std::vector<std::unique_ptr<Op>> ops;
  for (std::size_t from = 0; from < requests.size(); from += batch_chunk) {
    const auto chunk = requests.subspan(from, std::min(batch_chunk, requests.size() - from));
    Command cmd = mget_command(options, chunk);
    auto op = request<Known>(
        std::make_unique<GatherSlot<Known>>(g, g->add()),
        [chunk](const redisReply* r, std::string_view) {
          Known known(chunk.size());
          read_mget(r, chunk, known.data());
          return known;
        },
        cmd, Script::inspect, wait, options, chunk.front().key);
    op->same_holder = true;  // a read: asked again after a lost reply
    op->label = fmt::format("MGET of {} keys from '{}'", chunk.size(), detail::printable(chunk.front().key));
    ops.push_back(std::move(op));
  }
  BlockedBatch blocked(*engine);
  blocked.send(std::move(ops));
  g->wait();
  Known known;
  try {
    for (Known& part : g->take()) known.insert(known.end(), part.begin(), part.end());
  } catch (const store_error& e) {
    if (e.code() != "NOPERM") throw;
    if (duplicates_first_->refuse()) warn_mget_refused(options, e.what());
    return {};
  }
  const bool found = std::any_of(known.begin(), known.end(), [](const auto& k) { return k.has_value(); });
  duplicates_first_->read(found);
  if (!found) return {};
  return known;
}

std::vector<AcquireResult> EngineStore::acquire_many(std::span<const AcquireRequest> requests) {
  // Bad input anywhere refuses the whole batch before anything is sent (the BatchStore contract).
  for (const AcquireRequest& r : requests) {
    check_acquire(r.key, r.params);
    check_fingerprint(r.params);
  }
  std::vector<std::optional<AcquireResult>> known = duplicates_first(requests);
  auto g = std::make_shared<Gather<AcquireResult>>();
  std::vector<std::unique_ptr<Op>> ops;
  ops.reserve(requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    if (!known.empty() && known[i]) continue;
    const AcquireRequest& r = requests[i];
    DonePtr<AcquireResult> done = std::make_unique<GatherSlot<AcquireResult>>(g, g->add());
    std::exception_ptr e = capture([&] {
      Command cmd = acquire_command(options, r.key, r.params);
      ops.push_back(request<AcquireResult>(
          std::move(done),
          [t = r.params.token](const redisReply* rep, std::string_view k) { return parse_acquire(rep, k, t); },
          cmd, Script::acquire, wait, options, r.key));
    });
    if (e) done->complete(e, AcquireResult{});  // bad input: that request's error, nothing sent for it
  }
  BlockedBatch blocked(*engine);
  if (!ops.empty()) blocked.send(std::move(ops));
  g->wait();
  std::vector<AcquireResult> decided = g->take();
  if (known.empty()) {
    const auto duplicate = [](const AcquireResult& r) { return r.status == AcquireStatus::duplicate; };
    if (std::any_of(decided.begin(), decided.end(), duplicate)) duplicates_first_->met_duplicate();
    return decided;
  }
  std::vector<AcquireResult> out;
  out.reserve(requests.size());
  std::size_t next = 0;
  for (auto& k : known) out.push_back(k ? std::move(*k) : std::move(decided[next++]));
  return out;
}

std::vector<AcquireResult> EngineStore::acquire_batch(std::span<const std::string_view> keys,
                                                          const AcquireParams& p) {
  std::vector<AcquireRequest> requests;
  requests.reserve(keys.size());
  for (std::string_view k : keys) requests.push_back({k, p});
  std::vector<AcquireResult> out = acquire_many(requests);
  one_holder_per_key(keys, out, p.lease);
  return out;
}

std::vector<WriteStatus> EngineStore::complete_batch(std::span<const CompleteItem> items, millis retention) {
  check_lease(retention, "retention");
  for (const CompleteItem& it : items) check_holder(it.key, it.holder);
  auto g = std::make_shared<Gather<WriteStatus>>();
  std::vector<std::unique_ptr<Op>> ops;
  ops.reserve(items.size());
  for (const CompleteItem& it : items) {
    Command cmd = complete_command(options, it.key, it.holder, it.result, retention, false);
    ops.push_back(request<WriteStatus>(
        std::make_unique<GatherSlot<WriteStatus>>(g, g->add()),
        [](const redisReply* r, std::string_view k) { return parse_write(r, "complete_batch", k); }, cmd,
        Script::complete, wait, options, it.key));
  }
  BlockedBatch blocked(*engine);
  if (!ops.empty()) blocked.send(std::move(ops));
  g->wait();
  return g->take();
}

void EngineStore::check_complete_advance(std::string_view key, std::string_view entity, const char* unpaired) const {
  if (unpaired) throw usage_error(unpaired);
  (void)check_advance_slot(slot_of(options, options.key_prefix + std::string(key)),
                           slot_of(options, sequence_key(options, entity)), key, entity);
}

void EngineStore::submit_last_applied(std::string_view entity, DonePtr<std::optional<std::uint64_t>> done) {
  send_checked(*engine, done, [&] {
    Command cmd = sequence_key_command("GET", options, entity);
    return sequence_op<std::optional<std::uint64_t>>(
        std::move(done), [e = std::string(entity)](const redisReply* r, std::string_view) { return parse_sequence_get(r, e); },
        cmd, Script::inspect, wait, slot_of(options, sequence_key(options, entity)),
        fmt::format("GET of the sequence of entity '{}'", detail::printable(entity)));
  });
}

void EngineStore::submit_advance(std::string_view entity, std::uint64_t seq, DonePtr<AdvanceResult> done) {
  send_checked(*engine, done, [&] {
    Command cmd = sequence_advance_command(options, entity, seq);
    return sequence_op<AdvanceResult>(
        std::move(done),
        [e = std::string(entity), seq](const redisReply* r, std::string_view) { return parse_sequence_advance(r, e, seq); },
        cmd, Script::sequence_advance, wait, slot_of(options, sequence_key(options, entity)),
        fmt::format("sequence_advance of entity '{}'", detail::printable(entity)));
  });
}

void EngineStore::submit_complete_advance(std::string_view key, const Holder& h, std::string_view result,
                                          millis retention, std::string_view entity, std::uint64_t seq,
                                          const char* unpaired, DonePtr<CompleteAdvanceResult> done) {
  send_checked(*engine, done, [&] {
    Command cmd = complete_advance_command(options, key, h, result, retention, entity, seq);
    check_complete_advance(key, entity, unpaired);
    return sequence_op<CompleteAdvanceResult>(
        std::move(done),
        [k = std::string(key), e = std::string(entity), seq](const redisReply* r, std::string_view) {
          return parse_complete_advance(r, k, e, seq);
        },
        cmd, Script::complete_advance, wait, slot_of(options, sequence_key(options, entity)),
        fmt::format("complete_advance of key '{}' and entity '{}'", detail::printable(key), detail::printable(entity)));
  });
}

void EngineStore::submit_erase(std::string_view entity, DonePtr<bool> done) {
  send_checked(*engine, done, [&] {
    Command cmd = sequence_key_command("DEL", options, entity);
    return sequence_op<bool>(
        std::move(done), [e = std::string(entity)](const redisReply* r, std::string_view) { return parse_sequence_del(r, e); },
        cmd, Script::inspect, wait, slot_of(options, sequence_key(options, entity)),
        fmt::format("DEL of the sequence of entity '{}'", detail::printable(entity)));
  });
}

}  // namespace idem::detail::asio_redis
