#pragma once
/// @file asio/redis_store.hpp AsyncRedisStore: the Redis store for Boost.Asio programs — one
/// multiplexed connection, every call pipelined, completions through any Asio completion token.

#include <utility>  // before Asio: Boost 1.74's awaitable.hpp uses std::exchange without including it

#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <span>
#include <string_view>
#include <vector>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/post.hpp>

#include "idem/core/batch_store.hpp"
#include "idem/core/record.hpp"
#include "idem/core/store.hpp"
#include "idem/detail/warning_relay.hpp"
#include "idem/redis/options.hpp"
#include "idem/redis/transport.hpp"

namespace idem {

namespace detail::asio_redis {

template <class T, class Handler>
class DoneWith final : public Done<T> {
public:
  DoneWith(Handler h, const boost::asio::any_io_executor& fallback)
      : handler_(std::move(h)), work_(boost::asio::get_associated_executor(handler_, fallback)) {}
  // Posted, never run inline: a handler that sends its next request does so after the reply
  // loop, which then writes everything queued in one go.
  void complete(std::exception_ptr e, T value) override {
    auto ex = work_.get_executor();
    boost::asio::post(ex, [h = std::move(handler_), e = std::move(e), v = std::move(value)]() mutable {
      std::move(h)(std::move(e), std::move(v));
    });
    work_.reset();
  }

private:
  Handler handler_;
  boost::asio::executor_work_guard<boost::asio::associated_executor_t<Handler, boost::asio::any_io_executor>> work_;
};

class EngineStore;
struct BatchState;
struct SequenceRequests;

}  // namespace detail::asio_redis

/**
 * A StateStore's transitions as asynchronous operations on Boost.Asio, over one connection per
 * store that carries every call pipelined: requests are written as they come (all those queued
 * while a write is under way go out in the next one) and replies are matched in order. The same
 * Lua scripts, arguments and answers as RedisStore.
 *
 * Each `async_*` takes any completion token: a callback `void(std::exception_ptr, T)`,
 * `boost::asio::use_awaitable` (then `co_await` it; errors are thrown), `use_future`. Members may
 * be called from any thread; the connection runs on a strand of the executor given, and
 * completions run on the handler's associated executor (the given one when it has none).
 *
 * Failure behaviour is RedisStore's: a request never written is sent on the next connection; a
 * reply lost to a broken connection or command_timeout is asked again once, on a fresh connection,
 * as the same holder (the scripts answer their own step as done), else outcome_unknown_error;
 * `inspect` is never resent. A timeout closes the connection (replies come in order, so everything
 * behind a late one waits for it): every request on it is then in doubt and handled as above.
 * NOSCRIPT reloads the script and sends the request again. Errors are idem's typed errors.
 *
 * Connections are opened as RedisStore's are (TCP or a Unix socket, TLS and mutual TLS with
 * hostname verification, AUTH, SELECT; with Sentinel the master the sentinels name, its ROLE
 * checked, and asked again after a break or a READONLY answer), on the loop itself, every step
 * bounded by connect_timeout or command_timeout: no connect blocks the loop or starts a thread. The constructor connects once to check the
 * address, credentials and settings exactly as RedisStore does (an evicting maxmemory-policy is
 * refused). With min_replica_acks each write carries its WAIT in the same write, as RedisStore's
 * do (durability_error when too few replicas have it). With Redis Cluster (redis-cluster://) it
 * keeps one such connection per master, sends each call to the master of its key's slot and
 * follows MOVED, ASK and TRYAGAIN (at most max_redirects times); auto-batching then coalesces the
 * steps of one slot only.
 *
 * @code
 * boost::asio::io_context io;
 * idem::AsyncRedisStore store{io.get_executor(), {.url = "redis://127.0.0.1:6379"}};
 * idem::IdempotencyGuard guard{store, {.lease = 30s}};
 * co_spawn(io, [&]() -> boost::asio::awaitable<void> {
 *   auto out = co_await guard.run_async(msg.id, msg.body, [&](const idem::Context&) { return charge(msg); });
 * }, boost::asio::detached);
 * @endcode
 */
class AsyncRedisStore {
public:
  /// The executor the connection runs on (a strand of it).
  using executor_type = boost::asio::any_io_executor;

  /// Checks the options and the server (blocking, once); throws as RedisStore's constructor does.
  AsyncRedisStore(executor_type ex, RedisOptions options);
  ~AsyncRedisStore();                                          ///< Closes the connection; pending calls fail.
  AsyncRedisStore(const AsyncRedisStore&) = delete;            ///< One connection, one owner.
  AsyncRedisStore& operator=(const AsyncRedisStore&) = delete;  ///< One connection, one owner.

  /// The executor given at construction.
  [[nodiscard]] executor_type get_executor() const noexcept { return ex_; }
  /// The options in force (URL applied).
  [[nodiscard]] const RedisOptions& options() const noexcept { return options_; }
  /// Hands the store's advisories (Observer::on_warning) to `o` as well, those raised so far
  /// first. A guard attaches its own observer.
  void attach_observer(const std::shared_ptr<Observer>& o) const { detail::attach_to_relay(options_.observer, o); }
  /// What one call can carry (from the server's proto-max-bulk-len), as RedisStore::limits().
  [[nodiscard]] StoreLimits limits() const noexcept { return limits_; }
  /// Counters of the connection (thread-safe).
  [[nodiscard]] AsyncRedisStats stats() const noexcept;

  /// Blocking acquire (StateStore), so the guard's run() and run_batch() share the one connection
  /// from many threads; waits for the async call. Never call a blocking member on a thread that
  /// runs the executor: it would wait for itself.
  AcquireResult acquire(std::string_view key, const AcquireParams& p);
  /// Blocking complete.
  WriteStatus complete(std::string_view key, const Holder& h, std::string_view result, millis retention);
  /// Blocking complete_unavailable.
  WriteStatus complete_unavailable(std::string_view key, const Holder& h, std::string_view reason, millis retention);
  /// Blocking fail.
  WriteStatus fail(std::string_view key, const Holder& h, const FailParams& f);
  /// Blocking extend.
  WriteStatus extend(std::string_view key, const Holder& h, millis lease);
  /// Blocking inspect.
  std::optional<Record> inspect(std::string_view key);

  /// Decides each request exactly as acquire() would (BatchStore, for run_batch): the usual
  /// completed records are read first, one MGET per 256 keys (not on a cluster, nor once the ACL
  /// refused MGET; after a read that found none, one batch in 8 reads), and the rest are queued at once, so they leave coalesced, up to auto_batch keys
  /// per script call (per slot on a cluster); results in request order. When one fails it throws (the first error) after every
  /// answer is in; keys acquired by the others lapse after their lease (fail closed).
  std::vector<AcquireResult> acquire_many(std::span<const AcquireRequest> requests);

  /// Acquires many keys, all with `p` (as RedisStore::acquire_batch): the inputs checked first
  /// (nothing is sent for a batch with a bad key), then as acquire_many; results in key order; a
  /// key twice is one holder (the second in_flight behind the first).
  std::vector<AcquireResult> acquire_batch(std::span<const std::string_view> keys, const AcquireParams& p);
  /// Completes many keys (as RedisStore::complete_batch): queued at once, so they leave coalesced;
  /// statuses in item order; the first error thrown after every answer is in.
  std::vector<WriteStatus> complete_batch(std::span<const CompleteItem> items, millis retention);

  /// The writes of one batch (BatchWriter): complete() and fail() queue their request at once, so
  /// writes made while one is in flight leave together in one script call; finish() waits for
  /// every answer. An answer lost is asked again as the same holder, as for the single calls. One
  /// thread per writer; many writers (and other callers) may share the store.
  class BatchWriter {
  public:
    BatchWriter(BatchWriter&&) noexcept;             ///< Movable.
    BatchWriter& operator=(BatchWriter&&) noexcept;  ///< Movable.
    ~BatchWriter();                                  ///< Waits for the writes still unanswered (they reference it).
    /// Queues the completion of `key` by `h` now.
    void complete(std::string_view key, const Holder& h, std::string_view result, millis retention);
    /// Queues the failure (or release) of `key` by `h` now.
    void fail(std::string_view key, const Holder& h, const FailParams& f);
    /// Every answer, in the order of the writes; throws the first error after all are in.
    std::vector<WriteStatus> finish();
    /// A write already answered with an error (e.g. the connection broke): run_batch runs no more handlers.
    [[nodiscard]] bool broken() const noexcept;

  private:
    friend class AsyncRedisStore;
    BatchWriter(AsyncRedisStore& store, std::shared_ptr<detail::asio_redis::BatchState> state);
    AsyncRedisStore* store_;
    std::shared_ptr<detail::asio_redis::BatchState> state_;
  };
  /// A writer for one batch (BatchStore).
  BatchWriter batch_writer();

  /// acquire() of RedisStore, asynchronously: completes with `void(std::exception_ptr, AcquireResult)`.
  template <class Token>
  auto async_acquire(std::string_view key, const AcquireParams& p, Token&& token) {
    return start<AcquireResult>(std::forward<Token>(token), [=, this](auto done) { submit_acquire(key, p, std::move(done)); });
  }
  /// complete(): `void(std::exception_ptr, WriteStatus)`.
  template <class Token>
  auto async_complete(std::string_view key, const Holder& h, std::string_view result, millis retention, Token&& token) {
    return start<WriteStatus>(std::forward<Token>(token),
                              [=, this](auto done) { submit_complete(key, h, result, retention, false, std::move(done)); });
  }
  /// complete_unavailable(): completed without its result, `reason` kept instead.
  template <class Token>
  auto async_complete_unavailable(std::string_view key, const Holder& h, std::string_view reason, millis retention,
                                  Token&& token) {
    return start<WriteStatus>(std::forward<Token>(token),
                              [=, this](auto done) { submit_complete(key, h, reason, retention, true, std::move(done)); });
  }
  /// fail(): `void(std::exception_ptr, WriteStatus)`.
  template <class Token>
  auto async_fail(std::string_view key, const Holder& h, const FailParams& f, Token&& token) {
    return start<WriteStatus>(std::forward<Token>(token), [=, this](auto done) { submit_fail(key, h, f, std::move(done)); });
  }
  /// extend(): `void(std::exception_ptr, WriteStatus)`.
  template <class Token>
  auto async_extend(std::string_view key, const Holder& h, millis lease, Token&& token) {
    return start<WriteStatus>(std::forward<Token>(token),
                              [=, this](auto done) { submit_extend(key, h, lease, std::move(done)); });
  }
  /// inspect(): `void(std::exception_ptr, std::optional<Record>)`; never resent.
  template <class Token>
  auto async_inspect(std::string_view key, Token&& token) {
    return start<std::optional<Record>>(std::forward<Token>(token),
                                        [=, this](auto done) { submit_inspect(key, std::move(done)); });
  }

private:
  friend class AsyncRedisSequenceStore;           // sends on this store's connections
  friend struct detail::asio_redis::SequenceRequests;
  template <class T>
  using DonePtr = std::unique_ptr<detail::asio_redis::Done<T>>;

  // The request is checked and formatted inside the initiation, so bad input fails the call
  // (through its handler) before anything is sent. A lazy token (use_awaitable) runs the
  // initiation only when awaited, so `submit` holds copies: the views stay the caller's, who
  // keeps them alive until the operation completes (as for any Asio buffer).
  template <class T, class Token, class Submit>
  auto start(Token&& token, Submit&& submit) {
    return boost::asio::async_initiate<Token, void(std::exception_ptr, T)>(
        [this, submit = std::forward<Submit>(submit)](auto handler) mutable {
          using H = std::decay_t<decltype(handler)>;
          DonePtr<T> done = std::make_unique<detail::asio_redis::DoneWith<T, H>>(std::move(handler), ex_);
          submit(std::move(done));
        },
        token);
  }

  void submit_acquire(std::string_view key, const AcquireParams& p, DonePtr<AcquireResult> done);
  void submit_complete(std::string_view key, const Holder& h, std::string_view text, millis retention,
                       bool unavailable, DonePtr<WriteStatus> done);
  void submit_fail(std::string_view key, const Holder& h, const FailParams& f, DonePtr<WriteStatus> done);
  void submit_extend(std::string_view key, const Holder& h, millis lease, DonePtr<WriteStatus> done);
  void submit_inspect(std::string_view key, DonePtr<std::optional<Record>> done);

  executor_type ex_;
  RedisOptions options_;
  StoreLimits limits_;
  // The transitions on the engine, RedisStore's code (src/redis/engine_store.hpp).
  std::unique_ptr<detail::asio_redis::EngineStore> core_;
};

}  // namespace idem
