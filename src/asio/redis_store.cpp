// AsyncRedisStore: the Redis store's transitions on the engine (src/redis/engine_store.hpp, the
// code RedisStore runs too), on the caller's executor; blocking members wait for the async ones.

#include "idem/asio/redis_store.hpp"

#include "engine_store.hpp"

namespace idem {

using detail::asio_redis::EngineStore;

namespace {
std::unique_ptr<EngineStore> make_core(const AsyncRedisStore::executor_type& ex, const RedisOptions& o, StoreLimits& limits) {
  auto factory = detail::asio_redis::factory_of(o, limits);
  return std::make_unique<EngineStore>(ex, o, std::move(factory));
}
}  // namespace

AsyncRedisStore::AsyncRedisStore(executor_type ex, RedisOptions options)
    : ex_(std::move(ex)), options_(detail::redis::resolve_options(std::move(options))),
      core_(make_core(ex_, options_, limits_)) {}

AsyncRedisStore::~AsyncRedisStore() = default;

AsyncRedisStats AsyncRedisStore::stats() const noexcept { return core_->stats(); }

AcquireResult AsyncRedisStore::acquire(std::string_view key, const AcquireParams& p) { return core_->acquire(key, p); }
WriteStatus AsyncRedisStore::complete(std::string_view key, const Holder& h, std::string_view result, millis retention) {
  return core_->complete(key, h, result, retention);
}
WriteStatus AsyncRedisStore::complete_unavailable(std::string_view key, const Holder& h, std::string_view reason,
                                                  millis retention) {
  return core_->complete_unavailable(key, h, reason, retention);
}
WriteStatus AsyncRedisStore::fail(std::string_view key, const Holder& h, const FailParams& f) { return core_->fail(key, h, f); }
WriteStatus AsyncRedisStore::extend(std::string_view key, const Holder& h, millis lease) { return core_->extend(key, h, lease); }
std::optional<Record> AsyncRedisStore::inspect(std::string_view key) { return core_->inspect(key); }

void AsyncRedisStore::submit_acquire(std::string_view key, const AcquireParams& p, DonePtr<AcquireResult> done) {
  core_->submit_acquire(key, p, std::move(done));
}
void AsyncRedisStore::submit_complete(std::string_view key, const Holder& h, std::string_view text, millis retention,
                                      bool unavailable, DonePtr<WriteStatus> done) {
  core_->submit_complete(key, h, text, retention, unavailable, std::move(done));
}
void AsyncRedisStore::submit_fail(std::string_view key, const Holder& h, const FailParams& f, DonePtr<WriteStatus> done) {
  core_->submit_fail(key, h, f, std::move(done));
}
void AsyncRedisStore::submit_extend(std::string_view key, const Holder& h, millis lease, DonePtr<WriteStatus> done) {
  core_->submit_extend(key, h, lease, std::move(done));
}
void AsyncRedisStore::submit_inspect(std::string_view key, DonePtr<std::optional<Record>> done) {
  core_->submit_inspect(key, std::move(done));
}

std::vector<AcquireResult> AsyncRedisStore::acquire_many(std::span<const AcquireRequest> requests) {
  return core_->acquire_many(requests);
}
std::vector<AcquireResult> AsyncRedisStore::acquire_batch(std::span<const std::string_view> keys, const AcquireParams& p) {
  return core_->acquire_batch(keys, p);
}
std::vector<WriteStatus> AsyncRedisStore::complete_batch(std::span<const CompleteItem> items, millis retention) {
  return core_->complete_batch(items, retention);
}

using detail::asio_redis::BatchState;
using detail::asio_redis::GatherSlot;

AsyncRedisStore::BatchWriter::BatchWriter(AsyncRedisStore& store, std::shared_ptr<BatchState> state)
    : store_(&store), state_(std::move(state)) {}
AsyncRedisStore::BatchWriter::BatchWriter(BatchWriter&&) noexcept = default;
AsyncRedisStore::BatchWriter& AsyncRedisStore::BatchWriter::operator=(BatchWriter&&) noexcept = default;
AsyncRedisStore::BatchWriter::~BatchWriter() {
  if (state_) state_->wait();  // the requests' views (keys, results) are the caller's until sent
}

void AsyncRedisStore::BatchWriter::complete(std::string_view key, const Holder& h, std::string_view result,
                                            millis retention) {
  store_->submit_complete(key, h, result, retention, false, std::make_unique<GatherSlot<WriteStatus>>(state_, state_->add()));
}

void AsyncRedisStore::BatchWriter::fail(std::string_view key, const Holder& h, const FailParams& f) {
  store_->submit_fail(key, h, f, std::make_unique<GatherSlot<WriteStatus>>(state_, state_->add()));
}

std::vector<WriteStatus> AsyncRedisStore::BatchWriter::finish() {
  auto out = state_->finish();
  state_ = std::make_shared<BatchState>();  // the writer may be used again
  return out;
}

bool AsyncRedisStore::BatchWriter::broken() const noexcept { return state_ && state_->failed.load(); }

AsyncRedisStore::BatchWriter AsyncRedisStore::batch_writer() { return BatchWriter(*this, std::make_shared<BatchState>()); }

}  // namespace idem
