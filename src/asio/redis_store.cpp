// AsyncRedisStore: the store's requests, formatted and parsed exactly as RedisStore's
// (store_requests.hpp), carried by one multiplexed connection (connection.hpp); blocking members
// wait for the async ones.

#include "idem/asio/redis_store.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <future>
#include <mutex>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "connection.hpp"
#include "idem/core/error.hpp"
#include "idem/core/hex.hpp"
#include "idem/core/validate.hpp"
#include "idem/redis/hash_slot.hpp"
#include "store_requests.hpp"

namespace idem::detail::asio_redis {

namespace {

// The blocking client whose connection factory opens the store's connections (TLS, AUTH, SELECT,
// Sentinel discovery and ROLE check: the same code as RedisStore's; in cluster mode its slot map
// and one client per master). Its constructor makes the connection check RedisStore makes, and
// check_server reads the limits.
std::shared_ptr<Client> factory_of(const RedisOptions& o, StoreLimits& limits) {
  RedisOptions one = o;
  one.url.clear();
  one.pool.size = 1;
  auto client = std::make_shared<Client>(std::move(one));
  limits = check_server(*client);
  return client;
}

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


}  // namespace

// The answers of many requests sent together (acquire_many, a BatchWriter): each request's
// completion fills its slot on the connection's strand; the caller waits until none is pending.
template <class T>
struct Gather {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<T> values;
  std::vector<std::exception_ptr> errors;
  std::size_t pending = 0;
  std::atomic<bool> failed{false};

  std::size_t add() {
    std::lock_guard lk(mu);
    values.emplace_back();
    errors.emplace_back();
    ++pending;
    return values.size() - 1;
  }
  void wait() {
    std::unique_lock lk(mu);
    cv.wait(lk, [&] { return pending == 0; });
  }
  // After wait(): the answers in order, or the first error.
  std::vector<T> take() {
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
    return std::move(values);
  }
};

template <class T>
struct GatherSlot final : Done<T> {
  GatherSlot(std::shared_ptr<Gather<T>> g, std::size_t i) : g_(std::move(g)), i_(i) {}
  void complete(std::exception_ptr e, T value) override {
    std::lock_guard lk(g_->mu);
    if (e) {
      g_->errors[i_] = std::move(e);
      g_->failed = true;
    } else {
      g_->values[i_] = std::move(value);
    }
    if (--g_->pending == 0) g_->cv.notify_all();
  }

private:
  std::shared_ptr<Gather<T>> g_;
  std::size_t i_;
};

struct BatchState : Gather<WriteStatus> {};

}  // namespace idem::detail::asio_redis

namespace idem {

using detail::asio_redis::Engine;
using detail::asio_redis::request;
using detail::asio_redis::send_checked;
using detail::redis::Command;
using detail::redis::Script;

AsyncRedisStore::AsyncRedisStore(executor_type ex, RedisOptions options)
    : ex_(std::move(ex)), options_(detail::redis::resolve_options(std::move(options))),
      engine_(detail::asio_redis::make_engine(ex_, options_, detail::asio_redis::factory_of(options_, limits_))),
      duplicates_first_(std::make_unique<detail::redis::DuplicatesFirst>()) {
  if (options_.min_replica_acks > 0)
    wait_.assign(Command().arg("WAIT").arg(options_.min_replica_acks).arg(options_.replica_ack_timeout.count()).format().view());
}

AsyncRedisStore::~AsyncRedisStore() { detail::asio_redis::shutdown(*engine_); }

AsyncRedisStats AsyncRedisStore::stats() const noexcept { return detail::asio_redis::stats(*engine_); }

using detail::asio_redis::wait_for;

AcquireResult AsyncRedisStore::acquire(std::string_view key, const AcquireParams& p) {
  return wait_for<AcquireResult>([&](auto w) { submit_acquire(key, p, std::move(w)); });
}
WriteStatus AsyncRedisStore::complete(std::string_view key, const Holder& h, std::string_view result, millis retention) {
  return wait_for<WriteStatus>([&](auto w) { submit_complete(key, h, result, retention, false, std::move(w)); });
}
WriteStatus AsyncRedisStore::complete_unavailable(std::string_view key, const Holder& h, std::string_view reason,
                                                  millis retention) {
  return wait_for<WriteStatus>([&](auto w) { submit_complete(key, h, reason, retention, true, std::move(w)); });
}
WriteStatus AsyncRedisStore::fail(std::string_view key, const Holder& h, const FailParams& f) {
  return wait_for<WriteStatus>([&](auto w) { submit_fail(key, h, f, std::move(w)); });
}
WriteStatus AsyncRedisStore::extend(std::string_view key, const Holder& h, millis lease) {
  return wait_for<WriteStatus>([&](auto w) { submit_extend(key, h, lease, std::move(w)); });
}
std::optional<Record> AsyncRedisStore::inspect(std::string_view key) {
  return wait_for<std::optional<Record>>([&](auto w) { submit_inspect(key, std::move(w)); });
}

void AsyncRedisStore::submit_acquire(std::string_view key, const AcquireParams& p, DonePtr<AcquireResult> done) {
  send_checked<AcquireResult>(*engine_, done, [&] {
    Command cmd = detail::redis::acquire_command(options_, key, p);
    return request<AcquireResult>(
        std::move(done),
        [t = p.token](const redisReply* r, std::string_view k) { return detail::redis::parse_acquire(r, k, t); }, cmd,
        Script::acquire, wait_, options_, key);
  });
}

void AsyncRedisStore::submit_complete(std::string_view key, const Holder& h, std::string_view text, millis retention,
                                      bool unavailable, DonePtr<WriteStatus> done) {
  send_checked<WriteStatus>(*engine_, done, [&] {
    Command cmd = detail::redis::complete_command(options_, key, h, text, retention, unavailable);
    return request<WriteStatus>(
        std::move(done), [](const redisReply* r, std::string_view k) { return detail::redis::parse_write(r, "complete", k); },
        cmd, Script::complete, wait_, options_, key);
  });
}

void AsyncRedisStore::submit_fail(std::string_view key, const Holder& h, const FailParams& f, DonePtr<WriteStatus> done) {
  send_checked<WriteStatus>(*engine_, done, [&] {
    Command cmd = detail::redis::fail_command(options_, key, h, f);
    return request<WriteStatus>(
        std::move(done), [](const redisReply* r, std::string_view k) { return detail::redis::parse_write(r, "fail", k); },
        cmd, Script::fail, wait_, options_, key);
  });
}

void AsyncRedisStore::submit_extend(std::string_view key, const Holder& h, millis lease, DonePtr<WriteStatus> done) {
  send_checked<WriteStatus>(*engine_, done, [&] {
    Command cmd = detail::redis::extend_command(options_, key, h, lease);
    return request<WriteStatus>(
        std::move(done), [](const redisReply* r, std::string_view k) { return detail::redis::parse_write(r, "extend", k); },
        cmd, Script::extend, wait_, options_, key);
  });
}

void AsyncRedisStore::submit_inspect(std::string_view key, DonePtr<std::optional<Record>> done) {
  send_checked<std::optional<Record>>(*engine_, done, [&] {
    Command cmd = detail::redis::inspect_command(options_, key);
    return request<std::optional<Record>>(
        std::move(done), [](const redisReply* r, std::string_view k) { return detail::redis::parse_inspect(r, k); }, cmd,
        Script::inspect, wait_, options_, key);
  });
}

std::vector<std::optional<AcquireResult>> AsyncRedisStore::duplicates_first(std::span<const AcquireRequest> requests) {
  using detail::asio_redis::Gather;
  using detail::asio_redis::GatherSlot;
  using detail::redis::batch_chunk;
  using Known = std::vector<std::optional<AcquireResult>>;
  if (!options_.cluster_nodes.empty() || !duplicates_first_->wanted()) return {};
  // Bad input is each request's own error (below), so nothing is read for a batch that has any.
  for (const AcquireRequest& r : requests)
    if (detail::asio_redis::capture([&] { detail::check_acquire(r.key, r.params); })) return {};
  auto g = std::make_shared<Gather<Known>>();
  std::vector<std::unique_ptr<detail::asio_redis::Op>> ops;
  for (std::size_t from = 0; from < requests.size(); from += batch_chunk) {
    const auto chunk = requests.subspan(from, std::min(batch_chunk, requests.size() - from));
    Command cmd = detail::redis::mget_command(options_, chunk);
    auto op = request<Known>(
        std::make_unique<GatherSlot<Known>>(g, g->add()),
        [chunk](const redisReply* r, std::string_view) {
          Known known(chunk.size());
          detail::redis::read_mget(r, chunk, known.data());
          return known;
        },
        cmd, Script::inspect, wait_, options_, chunk.front().key);
    op->same_holder = true;  // a read: asked again after a lost reply
    op->label = fmt::format("MGET of {} keys from '{}'", chunk.size(), detail::printable(chunk.front().key));
    ops.push_back(std::move(op));
  }
  detail::asio_redis::submit(*engine_, std::move(ops));
  g->wait();
  Known known;
  try {
    for (Known& part : g->take()) known.insert(known.end(), part.begin(), part.end());
  } catch (const store_error& e) {
    if (e.code() != "NOPERM") throw;
    if (duplicates_first_->refuse()) detail::redis::warn_mget_refused(options_, e.what());
    return {};
  }
  const bool found = std::any_of(known.begin(), known.end(), [](const auto& k) { return k.has_value(); });
  duplicates_first_->read(found);
  if (!found) return {};
  return known;
}

std::vector<AcquireResult> AsyncRedisStore::acquire_many(std::span<const AcquireRequest> requests) {
  using detail::asio_redis::Gather;
  using detail::asio_redis::GatherSlot;
  std::vector<std::optional<AcquireResult>> known = duplicates_first(requests);
  auto g = std::make_shared<Gather<AcquireResult>>();
  std::vector<std::unique_ptr<detail::asio_redis::Op>> ops;
  ops.reserve(requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    if (!known.empty() && known[i]) continue;
    const AcquireRequest& r = requests[i];
    detail::asio_redis::DonePtr<AcquireResult> done = std::make_unique<GatherSlot<AcquireResult>>(g, g->add());
    std::exception_ptr e = detail::asio_redis::capture([&] {
      Command cmd = detail::redis::acquire_command(options_, r.key, r.params);
      ops.push_back(request<AcquireResult>(
          std::move(done),
          [t = r.params.token](const redisReply* rep, std::string_view k) { return detail::redis::parse_acquire(rep, k, t); },
          cmd, Script::acquire, wait_, options_, r.key));
    });
    if (e) done->complete(e, AcquireResult{});  // bad input: that request's error, nothing sent for it
  }
  if (!ops.empty()) detail::asio_redis::submit(*engine_, std::move(ops));
  g->wait();
  std::vector<AcquireResult> decided = g->take();
  if (known.empty()) return decided;
  std::vector<AcquireResult> out;
  out.reserve(requests.size());
  std::size_t next = 0;
  for (auto& k : known) out.push_back(k ? std::move(*k) : std::move(decided[next++]));
  return out;
}

std::vector<AcquireResult> AsyncRedisStore::acquire_batch(std::span<const std::string_view> keys,
                                                          const AcquireParams& p) {
  for (std::string_view k : keys) detail::check_acquire(k, p);
  detail::redis::check_fingerprint(p);
  std::vector<AcquireRequest> requests;
  requests.reserve(keys.size());
  for (std::string_view k : keys) requests.push_back({k, p});
  std::vector<AcquireResult> out = acquire_many(requests);
  detail::redis::one_holder_per_key(keys, out, p.lease);
  return out;
}

std::vector<WriteStatus> AsyncRedisStore::complete_batch(std::span<const CompleteItem> items, millis retention) {
  using detail::asio_redis::Gather;
  using detail::asio_redis::GatherSlot;
  detail::check_lease(retention, "retention");
  for (const CompleteItem& it : items) detail::check_holder(it.key, it.holder);
  auto g = std::make_shared<Gather<WriteStatus>>();
  std::vector<std::unique_ptr<detail::asio_redis::Op>> ops;
  ops.reserve(items.size());
  for (const CompleteItem& it : items) {
    Command cmd = detail::redis::complete_command(options_, it.key, it.holder, it.result, retention, false);
    ops.push_back(request<WriteStatus>(
        std::make_unique<GatherSlot<WriteStatus>>(g, g->add()),
        [](const redisReply* r, std::string_view k) { return detail::redis::parse_write(r, "complete_batch", k); }, cmd,
        Script::complete, wait_, options_, it.key));
  }
  if (!ops.empty()) detail::asio_redis::submit(*engine_, std::move(ops));
  g->wait();
  return g->take();
}

AsyncRedisStore::BatchWriter::BatchWriter(AsyncRedisStore& store, std::shared_ptr<detail::asio_redis::BatchState> state)
    : store_(&store), state_(std::move(state)) {}
AsyncRedisStore::BatchWriter::BatchWriter(BatchWriter&&) noexcept = default;
AsyncRedisStore::BatchWriter& AsyncRedisStore::BatchWriter::operator=(BatchWriter&&) noexcept = default;
AsyncRedisStore::BatchWriter::~BatchWriter() {
  if (state_) state_->wait();  // the requests' views (keys, results) are the caller's until sent
}

void AsyncRedisStore::BatchWriter::complete(std::string_view key, const Holder& h, std::string_view result,
                                            millis retention) {
  store_->submit_complete(key, h, result, retention, false,
                          std::make_unique<detail::asio_redis::GatherSlot<WriteStatus>>(state_, state_->add()));
}

void AsyncRedisStore::BatchWriter::fail(std::string_view key, const Holder& h, const FailParams& f) {
  store_->submit_fail(key, h, f, std::make_unique<detail::asio_redis::GatherSlot<WriteStatus>>(state_, state_->add()));
}

std::vector<WriteStatus> AsyncRedisStore::BatchWriter::finish() {
  state_->wait();
  auto out = state_->take();
  state_ = std::make_shared<detail::asio_redis::BatchState>();  // the writer may be used again
  return out;
}

bool AsyncRedisStore::BatchWriter::broken() const noexcept { return state_ && state_->failed.load(); }

AsyncRedisStore::BatchWriter AsyncRedisStore::batch_writer() {
  return BatchWriter(*this, std::make_shared<detail::asio_redis::BatchState>());
}

}  // namespace idem
