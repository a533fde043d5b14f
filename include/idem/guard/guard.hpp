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

#include <unistd.h>

#include "idem/core/codec.hpp"
#include "idem/detail/lru_cache.hpp"
#include "idem/detail/random.hpp"
#include "idem/detail/validate.hpp"
#include "idem/guard/context.hpp"
#include "idem/guard/failure.hpp"
#include "idem/guard/lease_keeper.hpp"
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
      limits_ = store.limits();
      if (options_.max_key_bytes > limits_.max_key_bytes)
        throw invalid_options_error("idem: GuardOptions::max_key_bytes is " + std::to_string(options_.max_key_bytes) +
                                    ", above the " + std::to_string(limits_.max_key_bytes) +
                                    " bytes this store takes; lower it (hash long keys with idem::fingerprint)");
    }
    if (options_.owner.empty()) options_.owner = default_owner();
    if (options_.cache_capacity > 0)
      cache_ = std::make_unique<detail::LruCache>(options_.cache_capacity, options_.retention);
    if (options_.heartbeat)
      keeper_ = std::make_unique<detail::LeaseKeeper<Store>>(store, options_.lease, options_.observer);
  }

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

  // `complete` is nullptr (the store's complete) or run_with_completion's callable.
  template <class F, class Complete>
  auto run_impl(std::string_view key, std::string fp, F& handler, Complete&& complete) {
    static_assert(takes_context<F> || std::is_invocable_v<F&>,
                  "idem: the handler must be callable with () or with (const idem::Context&)");
    using R = std::decay_t<typename result_of<F>::type>;
    static_assert(std::is_void_v<R> || Encodable<R>,
                  "idem: the handler's result type needs an idem::codec<T> specialisation (see codec.hpp)");
    detail::check_key(key, options_.max_key_bytes);
    // The clock is read only for an observer: a clock read is a visible share of a memory-store run.
    const auto started = options_.observer ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
    Outcome<R> out;
    try {
      out = decide<R>(key, fp, handler, complete);
    } catch (const error& e) {
      // The handler's own idem errors were reported as handler errors already.
      const bool store_failed = dynamic_cast<const store_error*>(&e) || dynamic_cast<const corrupt_record_error*>(&e);
      if (options_.observer && store_failed && !e.from_handler()) options_.observer->on_store_error(key, e);
      throw;
    }
    if (options_.observer) {
      options_.observer->on_outcome(OutcomeEvent{key, out.status, std::chrono::steady_clock::now() - started,
                                                 out.attempt, out.takeover, out.from_cache});
    }
    return out;
  }

  template <class R, class F, class Complete>
  Outcome<R> decide(std::string_view key, const std::string& fp, F& handler, Complete& complete) {
    if (cache_) {
      if (auto hit = cache_->get(key)) {
        Outcome<R> out;
        if (!fp.empty() && !hit->fingerprint.empty() && fp != hit->fingerprint) {
          out.status = Status::mismatch;
        } else {
          out.status = Status::duplicate;
          out.value = detail::decode_result<R>(key, hit->result);
          out.from_cache = true;
        }
        return out;
      }
    }
    AcquireParams ap;
    ap.fingerprint = fp;
    ap.lease = options_.lease;
    ap.retention = options_.retention;
    ap.owner = options_.owner;
    if constexpr (TransactionalStore<Store>) {
      if (use_transactions()) return decide_tx<R>(key, fp, ap, handler);
    }
    AcquireResult ar = acquire_waiting(key, ap);
    if (ar.status != AcquireStatus::acquired) return not_acquired<R>(key, fp, ar);

    const Holder holder = ar.holder;
    Outcome<R> out;
    // A stop_source allocates its shared state; only the heartbeat can fire it, so without a
    // heartbeat the handler gets a token that can never stop.
    std::stop_source stop = options_.heartbeat ? std::stop_source{} : std::stop_source{std::nostopstate};
    context_type ctx{};
    begin_run(ctx, out, key, ar, stop);
    {
      typename detail::LeaseKeeper<Store>::Registration kept(keeper_.get(), key, holder, stop);
      try {
        run_handler<R>(handler, ctx, out);
      } catch (const detail::stale_signal&) {
        kept.end();
        store_->fail(key, holder, detail::stale_release(options_.retention));
        out.status = Status::stale;
        return out;
      } catch (...) {
        kept.end();
        record_failure(key, ar.attempts, std::current_exception(),
                       [&](const FailParams& f) { store_->fail(key, holder, f); });
        throw;
      }
    }
    std::string encoded;
    if (auto why = encode_for_store<R>(out, encoded)) {
      // The effect ran: complete the key without its result, so no redelivery runs it again.
      WriteStatus ws;
      if constexpr (CompletesUnavailable<Store>)
        ws = store_->complete_unavailable(key, holder, *why, options_.retention);
      else
        ws = store_->fail(key, holder, unstorable_failure(*why));
      if (ws == WriteStatus::lease_lost) {
        out.status = Status::lease_lost;
        return out;
      }
      throw result_not_stored_error("idem: the result of key '" + detail::printable(key) + "' was not stored: " +
                                    *why + "; the key is completed without it and will not run again");
    }
    WriteStatus ws;
    if constexpr (std::is_null_pointer_v<Complete>)
      ws = store_->complete(key, holder, encoded, options_.retention);
    else
      ws = complete(holder, std::string_view(encoded), options_.retention);
    finish_run(key, fp, ws, encoded, out);
    return out;
  }

  template <class R, class F>
  Outcome<R> decide_tx(std::string_view key, const std::string& fp, AcquireParams& ap, F& handler) {
    const auto deadline = std::chrono::steady_clock::now() + options_.wait_for_in_flight;
    millis pause{10};
    for (;;) {
      ap.token = detail::random_token();
      auto tx = store_->begin(key, ap);
      const AcquireResult& ar = tx.decision();
      if (ar.status == AcquireStatus::in_flight && std::chrono::steady_clock::now() < deadline) {
        pause = wait_pause(ar, deadline, pause);
        continue;  // tx is rolled back by its destructor before the pause
      }
      if (ar.status != AcquireStatus::acquired) return not_acquired<R>(key, fp, ar);
      Outcome<R> out;
      std::stop_source stop{std::nostopstate};  // no heartbeat in transactional mode: the row lock is the lease
      context_type ctx{};
      begin_run(ctx, out, key, ar, stop);
      ctx.tx = &tx;
      try {
        run_handler<R>(handler, ctx, out);
      } catch (const detail::stale_signal&) {
        tx.fail(detail::stale_release(options_.retention));  // rolls back the claim and whatever the handler wrote
        out.status = Status::stale;
        return out;
      } catch (...) {
        record_failure(key, ar.attempts, std::current_exception(), [&](const FailParams& f) { tx.fail(f); });
        throw;
      }
      std::string encoded;
      if (auto why = encode_for_store<R>(out, encoded)) {
        // The handler's writes are in the transaction: roll them back with the claim and record
        // a permanent failure, so the effect neither happens without its record nor runs again.
        tx.fail(unstorable_failure(*why));
        throw result_not_stored_error("idem: the result of key '" + detail::printable(key) + "' was not stored: " +
                                      *why + "; the transaction was rolled back and the key failed permanently");
      }
      finish_run(key, fp, tx.commit(encoded, options_.retention), encoded, out);
      return out;
    }
  }

  template <class R>
  static void begin_run(Context& ctx, Outcome<R>& out, std::string_view key, const AcquireResult& ar,
                        const std::stop_source& stop) {
    ctx.key = key;
    ctx.fence = out.fence = ar.holder.fence;
    ctx.attempt = out.attempt = ar.attempts;
    ctx.takeover = out.takeover = ar.takeover;
    ctx.stop = stop.get_token();
  }

  // Runs the handler and keeps its value in `out`.
  template <class R, class F>
  void run_handler(F& handler, const context_type& ctx, Outcome<R>& out) {
    if constexpr (std::is_void_v<R>) {
      invoke(handler, ctx);
      out.value.emplace();
    } else {
      out.value.emplace(invoke(handler, ctx));
    }
  }

  // Encodes the handler's value into `encoded`; returns why it cannot be stored (the codec threw,
  // or it is over the store's limit), or nothing.
  template <class R>
  std::optional<std::string> encode_for_store(const Outcome<R>& out, std::string& encoded) const {
    if constexpr (!std::is_void_v<R>) {
      try {
        encoded = detail::encode_result<R>(*out.value);
      } catch (const codec_error& e) {
        return std::string(e.what());
      }
    }
    if (encoded.size() > limits_.max_result_bytes)
      return "the encoded result is " + std::to_string(encoded.size()) + " bytes, over the store's limit of " +
             std::to_string(limits_.max_result_bytes);
    return std::nullopt;
  }

  FailParams unstorable_failure(const std::string& why) const {
    FailParams f;
    f.error = "result not stored: " + why;
    f.permanent = true;
    f.retention = options_.retention;
    return f;
  }

  template <class R>
  void finish_run(std::string_view key, const std::string& fp, WriteStatus ws, const std::string& encoded,
                  Outcome<R>& out) {
    out.status = ws == WriteStatus::ok ? Status::executed : Status::lease_lost;
    if (ws == WriteStatus::ok && cache_) cache_->put(key, fp, encoded);
  }

  bool use_transactions() const {
    if constexpr (requires(const Store& s) {
                    { s.transactional() } -> std::convertible_to<bool>;
                  })
      return store_->transactional();
    else
      return true;
  }

  // Polls an in-flight key with doubling pauses (10 ms .. 200 ms, never past the holder's lease
  // or the caller's bound), so a redelivery that races the first delivery can still answer
  // Duplicate instead of InFlight.
  AcquireResult acquire_waiting(std::string_view key, AcquireParams& ap) {
    AcquireResult ar = acquire_once(key, ap);
    if (ar.status != AcquireStatus::in_flight || options_.wait_for_in_flight == millis{0}) return ar;
    const auto deadline = std::chrono::steady_clock::now() + options_.wait_for_in_flight;
    millis pause{10};
    while (ar.status == AcquireStatus::in_flight && std::chrono::steady_clock::now() < deadline) {
      pause = wait_pause(ar, deadline, pause);
      ar = acquire_once(key, ap);
    }
    return ar;
  }

  // An acquire in doubt ran no handler: whether or not it took the key, a redelivery is safe
  // (the key frees itself after the lease), so the caller is told it may retry.
  AcquireResult acquire_once(std::string_view key, AcquireParams& ap) {
    ap.token = detail::random_token();
    try {
      return store_->acquire(key, ap);
    } catch (const outcome_unknown_error& e) {
      if (e.retryable()) throw;
      throw outcome_unknown_error(std::string(e.what()) + "; the handler did not run: redeliver the message (the key "
                                  "frees itself after the lease)", e.code(), true);
    }
  }

  static millis wait_pause(const AcquireResult& ar, std::chrono::steady_clock::time_point deadline, millis pause) {
    auto left = std::chrono::duration_cast<millis>(deadline - std::chrono::steady_clock::now());
    millis sleep = std::min({pause, left, std::max(ar.retry_after, millis{1})});
    if (sleep > millis{0}) std::this_thread::sleep_for(sleep);
    return std::min(pause * 2, millis{200});
  }

  template <class R>
  Outcome<R> not_acquired(std::string_view key, const std::string& fp, const AcquireResult& ar) {
    Outcome<R> out;
    out.attempt = ar.attempts;
    switch (ar.status) {
      case AcquireStatus::duplicate:
        out.status = Status::duplicate;
        if (ar.result_unavailable) {
          out.result_unavailable = true;
          out.error = ar.payload;
          break;
        }
        out.value = detail::decode_result<R>(key, ar.payload);
        if (cache_) cache_->put(key, fp, ar.payload);
        break;
      case AcquireStatus::previously_failed:
        out.status = Status::previously_failed;
        out.error = ar.payload;
        break;
      case AcquireStatus::mismatch: out.status = Status::mismatch; break;
      case AcquireStatus::in_flight:
        out.status = Status::in_flight;
        out.retry_after = ar.retry_after;
        break;
      case AcquireStatus::acquired: break;  // not reached: callers handle acquired themselves
    }
    return out;
  }

  template <class F>
  decltype(auto) invoke(F& handler, const context_type& ctx) {
    try {
      if constexpr (takes_context<F>)
        return std::invoke(handler, ctx);
      else
        return std::invoke(handler);
    } catch (error& e) {
      detail::mark_from_handler(e);  // the same object is rethrown: the caller can tell it was the handler's
      throw;
    }
  }

  // The handler's exception wins: a failure that cannot be recorded leaves the key in_progress
  // until its lease lapses (or, in transactional mode, rolled back), which is safe: the next
  // delivery takes it over.
  template <class Write>
  void record_failure(std::string_view key, std::uint32_t attempts, const std::exception_ptr& ep, Write&& write) {
    if (options_.observer) options_.observer->on_handler_error(key, ep);
    try {
      write(detail::failure_params(options_.failure, options_.retention, attempts, detail::describe(ep)));
    } catch (const std::exception& e) {
      if (options_.observer) options_.observer->on_store_error(key, e);
    }
  }

  static std::string default_owner() {
    char host[256] = {};
    if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
    return std::string(host) + ":" + std::to_string(::getpid());
  }

  Store* store_;
  GuardOptions options_;
  std::unique_ptr<detail::LruCache> cache_;
  std::unique_ptr<detail::LeaseKeeper<Store>> keeper_;  // heartbeat only
  StoreLimits limits_;                                  // the store's, when it states them
};

}  // namespace idem

#include "idem/guard/batch_run.hpp"
