#pragma once
/// @file guard.hpp IdempotencyGuard: runs a handler at most once per key, records and replays its result.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>

#include <fmt/core.h>

#include "idem/core/codec.hpp"
#include "idem/detail/lease_keeper.hpp"
#include "idem/detail/lru_cache.hpp"
#include "idem/guard/run_machine.hpp"
#include "idem/guard/context.hpp"
#include "idem/core/error.hpp"
#include "idem/core/fingerprint.hpp"
#include "idem/core/observer.hpp"
#include "idem/core/options.hpp"
#include "idem/core/outcome.hpp"
#include "idem/core/record.hpp"
#include "idem/core/store.hpp"
#include "idem/core/batch_store.hpp"
#include "idem/guard/batch.hpp"

namespace idem {

/**
 * Wraps a message handler so that its effect happens once per idempotency key, on a StateStore.
 * Thread-safe when the store is (every idem store is): share one guard between worker threads.
 * The store must outlive the guard.
 *
 * @code
 * idem::MemoryStore store;
 * idem::IdempotencyGuard guard{store, {.lease = 30s, .retention = 24h}};
 * auto out = guard.run(msg.id, msg.body, [&](const idem::Context& ctx) {
 *   return charge(msg, ctx.fence);          // runs at most once per msg.id
 * });
 * if (out.action() == idem::BrokerAction::ack) consumer.ack(msg);
 * @endcode
 */
template <StateStore Store>
class IdempotencyGuard {
public:
  /// The context type handlers of this guard receive.
  using context_type = context_t<Store>;

  /// Binds to `store` (not owned); throws invalid_options_error when the options cannot work.
  explicit IdempotencyGuard(Store& store, GuardOptions options = {})
      : store_(&store), options_(std::move(options)) {
    detail::check_options(options_);
    if constexpr (HasStoreLimits<Store>) {
      const StoreLimits limits = store.limits();
      if (options_.max_key_bytes > limits.max_key_bytes)
        throw invalid_options_error(fmt::format("idem: GuardOptions::max_key_bytes is {}, above the {} bytes this store "
                                                "takes; lower it (hash long keys with idem::fingerprint)",
                                                options_.max_key_bytes, limits.max_key_bytes));
      machine_config_.max_result_bytes = limits.max_result_bytes;
    }
    if (options_.owner.empty()) options_.owner = detail::default_owner();
    if (options_.cache_capacity > 0)
      cache_ = std::make_unique<detail::LruCache>(options_.cache_capacity, options_.retention);
    if (options_.heartbeat)
      keeper_ = std::make_unique<detail::LeaseKeeper<Store>>(store, options_.lease, options_.observer);
    // The store's advisories (eviction, replicas, degradation) reach this guard's observer too.
    if constexpr (requires(Store& s, const std::shared_ptr<Observer>& o) { s.attach_observer(o); })
      if (options_.observer) store.attach_observer(options_.observer);
    machine_config_.options = &options_;
    machine_config_.cache = cache_.get();
    if constexpr (TransactionalStore<Store>) {
      if constexpr (requires { { store.transactional() } -> std::convertible_to<bool>; })
        machine_config_.transactional = store.transactional();
      else
        machine_config_.transactional = true;
    }
    machine_config_.completes_unavailable = CompletesUnavailable<Store>;
  }
  /// Moves the guard; not while runs are in flight on it.
  IdempotencyGuard(IdempotencyGuard&& o) noexcept
      : store_(o.store_), options_(std::move(o.options_)), cache_(std::move(o.cache_)), keeper_(std::move(o.keeper_)),
        machine_config_(o.machine_config_) {
    machine_config_.options = &options_;
  }
  IdempotencyGuard(const IdempotencyGuard&) = delete;             ///< Not copyable: runs share its cache and keeper.
  IdempotencyGuard& operator=(const IdempotencyGuard&) = delete;  ///< Not assignable.

  /// Runs `handler` unless `key` was already handled (or is being handled); see Outcome.
  /// Handler exceptions are recorded per the failure policy and rethrown unchanged.
  template <class F>
  auto run(std::string_view key, F&& handler) {
    return run_impl(key, std::string{}, handler, nullptr);
  }

  /// Like run(key, handler), and also fingerprints `payload`: a key reused with a different
  /// payload answers Status::mismatch and the handler does not run.
  template <class F>
  auto run(std::string_view key, std::string_view payload, F&& handler) {
    return run_impl(key, fingerprint(payload), handler, nullptr);
  }

  /// Extension point for writing more in the completion's atomic step (SequenceGate on Redis): like
  /// run(key, payload, handler) (run(key, handler) when `payload` is empty), but a lease-mode run
  /// completes through `complete(const Holder&, std::string_view encoded_result, millis retention)
  /// -> WriteStatus` instead of the store's complete(). Transactional runs never call it.
  template <class F, class Complete>
  auto run_with_completion(std::string_view key, std::string_view payload, F&& handler, Complete&& complete) {
    return run_impl(key, payload.empty() ? std::string{} : fingerprint(payload), handler, complete);
  }

  /// Runs a polled batch: `handler(item, ctx)` (or `handler(item)`) once for each item whose key
  /// it acquires, in input order, with the Context run() gives; every other item gets the outcome
  /// run() would give it (duplicate with the stored value, in_flight, previously_failed, mismatch).
  /// A handler's exception is recorded per the failure policy for its item and the batch goes on
  /// (BatchOptions::stop_at_first_error to stop); an item's key repeated later in the batch runs
  /// once and the repeats answer duplicate. On a BatchStore the acquisitions take one call and each
  /// item's completion is sent as soon as its handler returns, the answers collected at the end;
  /// other stores run one call per item. A transactional store runs one transaction per item.
  /// The handler gets `items[i]` itself, so `&item - items.data()` is its index. A bad key is its
  /// item's error (invalid_key_error: dead-letter); if the store stops taking the batch's writes,
  /// the handlers not yet run are not run (in_flight: redeliver). Throws only what concerns the
  /// whole batch (the acquisition failing: no handler ran).
  template <class F>
  auto run_batch(std::span<const BatchItem> items, F&& handler, BatchOptions batch = {});

  /// run() for event loops: returns a `boost::asio::awaitable<Outcome<R>>` to `co_await` (or to
  /// `co_spawn` with a completion callback), defined in idem/asio/guard.hpp (include it). On a
  /// store with async operations (AsyncRedisStore) no thread blocks: one thread keeps any number
  /// of runs in flight; other stores are called inline (fine for MemoryStore, blocking for a
  /// networked one). The handler returns a value or an awaitable of one; a non-empty `payload`
  /// is fingerprinted as in run(key, payload, handler). Key and payload are copied.
  template <class F>
  auto run_async(std::string key, std::string payload, F handler);

  /// Extension point for writing more in the completion's atomic step (SequenceGate::run_async):
  /// run_async(key, payload, handler), but a lease-mode run completes through `complete(const
  /// Holder&, std::string_view encoded_result, millis retention)`, which returns a
  /// `boost::asio::awaitable<WriteStatus>`, instead of the store's complete. Defined in idem/asio/guard.hpp.
  template <class F, class Complete>
  auto run_async_with_completion(std::string key, std::string payload, F handler, Complete complete);

  /// run_async(key, payload, handler) spawned on `ex` (an executor or an execution context) and
  /// delivered to any Asio completion token: a callback taking `(std::exception_ptr, Outcome<R>)`,
  /// `use_future`, `use_awaitable`, `deferred`. Defined in idem/asio/guard.hpp.
  template <class Executor, class F, class Token>
  auto run_async(Executor&& ex, std::string key, std::string payload, F handler, Token&& token);

  /// The options in force (owner filled in).
  [[nodiscard]] const GuardOptions& options() const noexcept { return options_; }
  /// The store this guard runs on.
  [[nodiscard]] Store& store() const noexcept { return *store_; }

private:
  template <class F>
  static constexpr bool takes_context = std::is_invocable_v<F&, const context_type&>;
  template <class F>
  static constexpr bool batch_takes_context = std::is_invocable_v<F&, const BatchItem&, const context_type&>;
  template <class F>
  using batch_result_of = std::conditional_t<batch_takes_context<F>,
                                             std::invoke_result<F&, const BatchItem&, const context_type&>,
                                             std::invoke_result<F&, const BatchItem&>>;

  template <class F>
  using result_of = std::conditional_t<takes_context<F>, std::invoke_result<F&, const context_type&>,
                                       std::invoke_result<F&>>;

  template <class R>
  using machine = detail::RunMachine<R>;

  // `complete` is nullptr (the store's complete) or run_with_completion's callable.
  template <class F, class Complete>
  auto run_impl(std::string_view key, std::string fp, F& handler, Complete&& complete) {
    static_assert(takes_context<F> || std::is_invocable_v<F&>,
                  "idem: the handler must be callable with () or with (const idem::Context&)");
    using R = std::decay_t<typename result_of<F>::type>;
    static_assert(std::is_void_v<R> || Encodable<R>,
                  "idem: the handler's result type needs an idem::codec<T> specialisation (see codec.hpp)");
    machine<R> m(machine_config_, key, std::move(fp));
    if constexpr (TransactionalStore<Store>) {
      if (machine_config_.transactional) return drive_tx(m, handler, m.start());
    }
    return drive(m, handler, complete, m.start());
  }

  // The blocking driver: performs each step the machine asks for.
  template <class R, class F, class Complete>
  Outcome<R> drive(machine<R>& m, F& handler, Complete& complete, detail::Next next) {
    for (;;) {
      switch (next) {
        case detail::Next::send: next = send(m, complete); break;
        case detail::Next::wait:
          std::this_thread::sleep_for(m.pause());
          next = m.on_waited();
          break;
        case detail::Next::run_handler: {
          // A stop_source allocates its shared state; only the heartbeat can fire it, so without
          // a heartbeat the handler gets a token that can never stop.
          std::stop_source stop = m.heartbeat() ? std::stop_source{} : std::stop_source{std::nostopstate};
          typename detail::LeaseKeeper<Store>::Registration kept(keeper_.get(), m.key(), m.holder(), stop);
          context_type ctx{};
          m.fill(ctx, stop.get_token());
          next = run_handler(m, handler, ctx);
          break;
        }
        case detail::Next::done: return std::move(m.outcome());
        case detail::Next::raise: std::rethrow_exception(m.error());
      }
    }
  }

  // The transactional driver: the acquire opens a transaction the handler writes through; the
  // completion is its commit. A pause drops the transaction (rolled back) first.
  template <class R, class F>
  Outcome<R> drive_tx(machine<R>& m, F& handler, detail::Next next) {
    std::optional<transaction_t<Store>> tx;
    for (;;) {
      switch (next) {
        case detail::Next::send:
          try {
            if (m.call() == detail::Call::acquire) {
              tx.reset();
              timed("begin", [&] { tx.emplace(store_->begin(m.key(), m.acquire_params())); });
              next = m.on_acquired(tx->decision());
            } else {
              const bool commit = m.call() == detail::Call::complete;
              next = m.on_written(timed(commit ? "commit" : "fail", [&] {
                return commit ? tx->commit(m.result(), m.retention()) : tx->fail(m.fail_params());
              }));
            }
          } catch (...) {
            next = m.on_store_error(std::current_exception());
          }
          break;
        case detail::Next::wait:
          tx.reset();
          std::this_thread::sleep_for(m.pause());
          next = m.on_waited();
          break;
        case detail::Next::run_handler: {
          context_type ctx{};
          m.fill(ctx, std::stop_token{});  // no heartbeat in transactional mode: the row lock is the lease
          ctx.tx = &*tx;
          next = run_handler(m, handler, ctx);
          break;
        }
        case detail::Next::done: return std::move(m.outcome());
        case detail::Next::raise: std::rethrow_exception(m.error());
      }
    }
  }

  // One store call in lease mode, its answer (or error) fed back.
  template <class R, class Complete>
  detail::Next send(machine<R>& m, Complete& complete) {
    try {
      if (m.call() == detail::Call::acquire)
        return m.on_acquired(timed("acquire", [&] { return store_->acquire(m.key(), m.acquire_params()); }));
      return m.on_written(timed(m.call() == detail::Call::fail ? "fail" : "complete", [&] { return write(m, complete); }));
    } catch (...) {
      return m.on_store_error(std::current_exception());
    }
  }

  // `call()` (a store call named `op`), its time and whether it threw reported to the observer
  // (on_store_call); without one, just `call()`: no clock is read.
  template <class Call>
  decltype(auto) timed(std::string_view op, Call&& call) const {
    Observer* const obs = options_.observer.get();
    if (!obs) return call();
    const auto started = std::chrono::steady_clock::now();
    try {
      if constexpr (std::is_void_v<decltype(call())>) {
        call();
        obs->on_store_call(StoreCallEvent{op, std::chrono::steady_clock::now() - started, true});
      } else {
        decltype(auto) r = call();
        obs->on_store_call(StoreCallEvent{op, std::chrono::steady_clock::now() - started, true});
        return r;
      }
    } catch (...) {
      obs->on_store_call(StoreCallEvent{op, std::chrono::steady_clock::now() - started, false});
      throw;
    }
  }

  // A holder-checked write in lease mode.
  template <class R, class Complete>
  WriteStatus write(const machine<R>& m, Complete& complete) {
    switch (m.call()) {
      case detail::Call::complete:
        if constexpr (std::is_null_pointer_v<std::remove_cvref_t<Complete>>)
          return store_->complete(m.key(), m.holder(), m.result(), m.retention());
        else
          return complete(m.holder(), m.result(), m.retention());
      case detail::Call::complete_unavailable:
        if constexpr (CompletesUnavailable<Store>) return store_->complete_unavailable(m.key(), m.holder(), m.result(), m.retention());
        break;
      default: break;
    }
    return store_->fail(m.key(), m.holder(), m.fail_params());
  }

  // Runs the handler of a held claim and hands the machine its value or its exception.
  template <class R, class F, class Ctx>
  static detail::Next run_handler(machine<R>& m, F& handler, const Ctx& ctx) {
    try {
      if constexpr (std::is_void_v<R>) {
        detail::invoke_handler(handler, ctx);
        return m.on_returned();
      } else {
        return m.on_returned(detail::invoke_handler(handler, ctx));
      }
    } catch (const detail::stale_signal&) {
      return m.on_stale();
    } catch (...) {
      return m.on_threw(std::current_exception());
    }
  }

  Store* store_;
  GuardOptions options_;
  std::unique_ptr<detail::LruCache> cache_;
  std::unique_ptr<detail::LeaseKeeper<Store>> keeper_;  // heartbeat only
  detail::MachineConfig machine_config_;                // what every run's machine reads
};

}  // namespace idem

#define IDEM_GUARD_BODY
#include "idem/guard/batch_run.hpp"
