#pragma once
/// @file guard/run_machine.hpp The guard's decisions, once: a sans-I/O state machine per message.
/// Not part of idem's API.
///
/// Every driver (run, transactional run, run_batch, run_async) is a loop around one machine: it
/// asks what comes next, performs it (a store call, a pause, the handler) and feeds the answer
/// back. The machine never calls a store, sleeps, starts a thread or awaits: it decides. So a new
/// status, a policy branch or an error's retry advice is written here and nowhere else, and the
/// unit tests drive it step by step with scripted answers and a fake clock.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include <fmt/core.h>

#include "idem/core/codec.hpp"
#include "idem/core/error.hpp"
#include "idem/core/observer.hpp"
#include "idem/core/options.hpp"
#include "idem/core/outcome.hpp"
#include "idem/core/record.hpp"
#include "idem/detail/failure.hpp"
#include "idem/core/hex.hpp"
#include "idem/detail/lru_cache.hpp"
#include "idem/detail/random.hpp"
#include "idem/core/validate.hpp"
#include "idem/guard/context.hpp"

namespace idem::detail {

/// The store call a machine asks its driver to make.
enum class Call : std::uint8_t {
  acquire,               ///< acquire(key(), acquire_params()), or begin() on a transactional run
  complete,              ///< complete(key(), holder(), result(), retention()), or tx.commit(result(), retention())
  complete_unavailable,  ///< complete_unavailable(key(), holder(), result() = the reason, retention())
  fail,                  ///< fail(key(), holder(), fail_params()), or tx.fail(fail_params())
};

/// What the driver does next.
enum class Next : std::uint8_t {
  send,         ///< make call(); answer on_acquired / on_written, or on_store_error if it threw
  wait,         ///< pause for pause() (a transactional driver drops its transaction first), then on_waited()
  run_handler,  ///< run the handler with a context from fill(); answer on_returned / on_threw / on_stale
  done,         ///< the run is decided: outcome()
  raise,        ///< the run ends with error(): rethrow it (or keep it, in a batch)
};

/// What every machine of one guard shares; built once by the guard.
struct MachineConfig {
  using clock = std::chrono::steady_clock;
  const GuardOptions* options = nullptr;
  LruCache* cache = nullptr;                                 ///< the in-process cache, or null
  std::size_t max_result_bytes = static_cast<std::size_t>(-1);  ///< the store's limit on an encoded result
  bool transactional = false;          ///< the handler's writes commit with the record (begin/commit)
  bool completes_unavailable = false;  ///< the store can complete a key without its result
  clock::time_point (*now)() = &clock::now;  ///< read only for an observer or a wait; tests set a fake
};

/// The decisions of one message's run, from "a key and a payload arrived" to its Outcome (or the
/// error to raise). R is the handler's result type (void allowed). Not thread-safe: one driver
/// steps it at a time; the config must outlive it.
template <class R>
class RunMachine {
public:
  /// A run of `key`; `fingerprint` is the payload's hash, or empty when not checked.
  RunMachine(const MachineConfig& cfg, std::string_view key, std::string fingerprint)
      : cfg_(&cfg), key_(key), fp_(std::move(fingerprint)) {}
  RunMachine(const RunMachine&) = delete;
  RunMachine& operator=(const RunMachine&) = delete;
  RunMachine(RunMachine&&) noexcept = default;
  RunMachine& operator=(RunMachine&&) noexcept = default;

  /// The first step: a bad key raises, a cache hit is done, anything else asks for the acquire.
  Next start() {
    const GuardOptions& o = *cfg_->options;
    // The clock is read only for an observer: a clock read is a visible share of a memory-store run.
    if (o.observer) started_ = cfg_->now();
    try {
      check_key(key_, o.max_key_bytes);
    } catch (...) {
      return raise(std::current_exception());
    }
    if (cfg_->cache) {
      if (auto hit = cfg_->cache->get(key_)) {
        if (!fp_.empty() && !hit->fingerprint.empty() && fp_ != hit->fingerprint) return finish(Status::mismatch);
        out_.from_cache = true;
        return replay(hit->result);
      }
    }
    ap_.fingerprint = fp_;
    ap_.lease = o.lease;
    ap_.retention = o.retention;
    ap_.owner = o.owner;
    return ask_acquire();
  }

  // ---- Next::send: the request ----

  /// Which store call to make.
  [[nodiscard]] Call call() const noexcept { return call_; }
  /// The key of every call.
  [[nodiscard]] std::string_view key() const noexcept { return key_; }
  /// Call::acquire: its parameters (a fresh token each time).
  [[nodiscard]] const AcquireParams& acquire_params() const noexcept { return ap_; }
  /// complete / complete_unavailable / fail: the holder the acquire returned.
  [[nodiscard]] const Holder& holder() const noexcept { return holder_; }
  /// Call::complete: the encoded result; Call::complete_unavailable: why it is not stored.
  [[nodiscard]] std::string_view result() const noexcept { return encoded_; }
  /// Call::fail: what to write; its text views the machine's own copy (valid while the machine is).
  [[nodiscard]] FailParams fail_params() const noexcept {
    FailParams f = fail_;
    f.error = fail_text_;
    return f;
  }
  /// complete / complete_unavailable: the record's retention.
  [[nodiscard]] millis retention() const noexcept { return cfg_->options->retention; }

  /// The answer to Call::acquire (or the transaction's decision).
  Next on_acquired(AcquireResult ar) {
    const GuardOptions& o = *cfg_->options;
    out_.attempt = ar.attempts;
    switch (ar.status) {
      case AcquireStatus::acquired:
        holder_ = ar.holder;
        out_.fence = holder_.fence;
        out_.takeover = ar.takeover;
        phase_ = Phase::holding;
        return Next::run_handler;
      case AcquireStatus::in_flight:
        // Poll with doubling pauses (10 ms .. 200 ms, never past the holder's lease or the
        // caller's bound), so a redelivery racing the first delivery can still answer duplicate.
        if (o.wait_for_in_flight > millis{0}) {
          const auto now = cfg_->now();
          if (!deadline_) deadline_ = now + o.wait_for_in_flight;
          if (now < *deadline_) {
            const auto left = std::chrono::duration_cast<millis>(*deadline_ - now);
            pause_ = std::min({next_pause_, left, std::max(ar.retry_after, millis{1})});
            next_pause_ = std::min(next_pause_ * 2, millis{200});
            phase_ = Phase::waiting;
            return Next::wait;
          }
        }
        out_.retry_after = ar.retry_after;
        return finish(Status::in_flight);
      case AcquireStatus::duplicate:
        if (ar.result_unavailable) {
          out_.result_unavailable = true;
          out_.error = std::move(ar.payload);
          return finish(Status::duplicate);
        }
        return replay(ar.payload, /*cache_it=*/true);
      case AcquireStatus::previously_failed:
        out_.error = std::move(ar.payload);
        return finish(Status::previously_failed);
      case AcquireStatus::mismatch: return finish(Status::mismatch);
    }
    return raise(std::make_exception_ptr(corrupt_record_error(
        fmt::format("idem: the store answered an unknown acquire status ({}) for key '{}'",
                    static_cast<int>(ar.status), printable(key_)))));
  }

  /// The answer to complete / complete_unavailable / fail.
  Next on_written(WriteStatus ws) {
    switch (phase_) {
      case Phase::completing:
        if (ws != WriteStatus::ok) return finish(Status::lease_lost);
        if (cfg_->cache) cfg_->cache->put(key_, fp_, encoded_);
        return finish(Status::executed);
      case Phase::unstorable:
        // The effect ran: the key is completed (or failed permanently) without its result, so no
        // redelivery runs it again.
        if (ws == WriteStatus::lease_lost) return finish(Status::lease_lost);
        return raise(std::make_exception_ptr(result_not_stored_error(
            cfg_->transactional
                ? fmt::format("idem: the result of key '{}' was not stored: {}; the transaction was rolled back "
                              "and the key failed permanently", printable(key_), why_)
                : fmt::format("idem: the result of key '{}' was not stored: {}; the key is completed without it "
                              "and will not run again", printable(key_), why_))));
      case Phase::failing: return raise(handler_error_);  // recorded or not, the handler's error wins
      case Phase::releasing_stale: return finish(Status::stale);
      case Phase::releasing_unrun: return finish(Status::in_flight);
      default: return raise(std::make_exception_ptr(std::logic_error("idem: RunMachine::on_written out of turn")));
    }
  }

  /// The store call threw. Decides what the message's run ends with, and whether a retry helps.
  Next on_store_error(std::exception_ptr e) {
    switch (phase_) {
      case Phase::acquiring:
        // An acquire in doubt ran no handler: whether or not it took the key, a redelivery is
        // safe (the key frees itself after the lease).
        e = rewrap_in_doubt(e, "the handler did not run: redeliver the message (the key frees itself after the lease)");
        break;
      case Phase::completing:
        // The effect ran and its record is in doubt: the redelivery answers duplicate if the
        // completion landed, or runs again after the lease with a higher fence if it did not.
        // Requeue is the only action that loses nothing (docs/guarantees.md).
        e = rewrap_in_doubt(e, "the handler ran and its completion is in doubt: requeue the message (its redelivery "
                               "answers duplicate if the completion landed, or runs again after the lease with a "
                               "higher fence)");
        break;
      case Phase::failing:
        // The handler's exception wins: an unrecorded failure leaves the key in_progress until the
        // lease lapses (or rolled back), which is safe: the next delivery takes it over.
        report_store_error(e, /*any=*/true);
        return raise(handler_error_);
      case Phase::releasing_unrun: return finish(Status::in_flight);  // its lease lapses instead
      default: break;
    }
    report_store_error(e);
    return raise(std::move(e));
  }

  // ---- Next::wait ----

  /// How long to pause before asking again.
  [[nodiscard]] millis pause() const noexcept { return pause_; }
  /// The pause is over: ask again.
  Next on_waited() { return ask_acquire(); }

  // ---- Next::run_handler ----

  /// Whether the driver keeps the lease alive while the handler runs (heartbeat).
  [[nodiscard]] bool heartbeat() const noexcept { return cfg_->options->heartbeat && !cfg_->transactional; }
  /// Fills what the handler learns about its run; `stop` fires when the lease is lost.
  void fill(Context& ctx, std::stop_token stop) const {
    ctx.key = key_;
    ctx.fence = holder_.fence;
    ctx.attempt = out_.attempt;
    ctx.takeover = out_.takeover;
    ctx.stop = std::move(stop);
  }

  /// The handler returned `value` (nothing, for void): encode it and ask for the completion.
  template <class... V>
  Next on_returned(V&&... value) {
    static_assert(sizeof...(V) == (std::is_void_v<R> ? 0 : 1));
    if constexpr (std::is_void_v<R>) {
      out_.value.emplace();
    } else {
      out_.value.emplace(std::forward<V>(value)...);
      try {
        encoded_ = encode_result<R>(*out_.value);
      } catch (const codec_error& e) {
        return unstorable(e.what());
      }
    }
    if (encoded_.size() > cfg_->max_result_bytes)
      return unstorable(fmt::format("the encoded result is {} bytes, over the store's limit of {}", encoded_.size(),
                                    cfg_->max_result_bytes));
    phase_ = Phase::completing;
    call_ = Call::complete;
    return Next::send;
  }

  /// The handler threw `e` (marked from_handler when it is an idem::error): record it per the
  /// failure policy, then raise it unchanged.
  Next on_threw(std::exception_ptr e) {
    const GuardOptions& o = *cfg_->options;
    if (o.observer) o.observer->on_handler_error(key_, e);
    handler_error_ = std::move(e);
    return ask_fail(Phase::failing, failure_params(o.failure, o.retention, out_.attempt, describe(handler_error_)));
  }

  /// The handler found its event stale (SequenceGate): release the key without counting a failure.
  Next on_stale() { return ask_fail(Phase::releasing_stale, stale_release(cfg_->options->retention)); }

  /// The driver will not run this claim's handler (run_batch: the store stopped taking the batch's
  /// writes): nothing is written, the claim lapses after the lease and the redelivery takes it.
  Next abandon() {
    out_.retry_after = cfg_->options->lease;
    return finish(Status::in_flight);
  }

  /// The driver will not run this claim's handler and releases it for an immediate redelivery
  /// (run_batch's stop_at_first_error): answers in_flight whatever the write answers.
  Next release_unrun() { return ask_fail(Phase::releasing_unrun, stale_release(cfg_->options->retention)); }

  // ---- a batch's items that make no call of their own ----

  /// A batch item whose key an earlier item of the same batch had, decided without a store call
  /// from that first item's answer (`first`, or `first_error` when it raised), as run() would
  /// answer it after the first: another payload (`other_payload`) is mismatch; a run there is a
  /// duplicate here; an error no redelivery can fix (a bad key) is as bad here; any other error
  /// there is a redelivery here (in_flight, retry_after 0: the error is the first item's to
  /// report). Sets `out`, or `error` when the item raises.
  static void repeat_of(const Outcome<R>& first, const std::exception_ptr& first_error, bool other_payload,
                        Outcome<R>& out, std::exception_ptr& error) {
    out = Outcome<R>{};
    if (other_payload) {
      out.status = Status::mismatch;
    } else if (first_error) {
      if (action_of(first_error) == BrokerAction::dead_letter) {
        error = first_error;
        return;
      }
      out.status = Status::in_flight;
    } else {
      out = first;
      if (out.status == Status::executed) out.status = Status::duplicate;
    }
  }

  /// A batch item left untried (stop_at_first_error, before its acquire): in_flight, redeliver it
  /// now.
  static Outcome<R> untried() {
    Outcome<R> out;
    out.status = Status::in_flight;
    return out;
  }

  // ---- the end ----

  /// Next::done: the outcome (the driver may move from it).
  [[nodiscard]] Outcome<R>& outcome() noexcept { return out_; }
  /// Next::raise: what the run ends with.
  [[nodiscard]] const std::exception_ptr& error() const noexcept { return error_; }
  /// True when the held claim's handler threw (its failure is being recorded, or was).
  [[nodiscard]] bool handler_threw() const noexcept { return handler_error_ != nullptr; }
  /// True once the machine answered done or raise.
  [[nodiscard]] bool finished() const noexcept { return phase_ == Phase::done || phase_ == Phase::raised; }

private:
  enum class Phase : std::uint8_t {
    idle, acquiring, waiting, holding, completing, unstorable, failing, releasing_stale, releasing_unrun, done, raised
  };

  Next ask_acquire() {
    ap_.token = random_token();
    phase_ = Phase::acquiring;
    call_ = Call::acquire;
    return Next::send;
  }

  Next ask_fail(Phase phase, FailParams f) {
    fail_text_ = std::string(f.error);  // owned here: the write may outlive the caller's text
    fail_ = f;
    phase_ = phase;
    call_ = Call::fail;
    return Next::send;
  }

  Next unstorable(std::string why) {
    why_ = std::move(why);
    phase_ = Phase::unstorable;
    if (cfg_->completes_unavailable && !cfg_->transactional) {
      encoded_ = why_;
      call_ = Call::complete_unavailable;
      return Next::send;
    }
    // The transactional run rolls the handler's writes back with the claim: the effect neither
    // happens without its record nor runs again.
    FailParams f;
    f.permanent = true;
    f.retention = cfg_->options->retention;
    fail_text_ = fmt::format("result not stored: {}", why_);
    fail_ = f;
    call_ = Call::fail;
    return Next::send;
  }

  Next replay(std::string_view stored, bool cache_it = false) {
    try {
      out_.value = decode_result<R>(key_, stored);
    } catch (...) {
      // A stored value that cannot be read never passes for a duplicate.
      out_.from_cache = false;
      report_store_error(std::current_exception());
      return raise(std::current_exception());
    }
    if (cache_it && cfg_->cache) cfg_->cache->put(key_, fp_, stored);
    return finish(Status::duplicate);
  }

  Next finish(Status s) {
    out_.status = s;
    phase_ = Phase::done;
    if (const auto& obs = cfg_->options->observer)
      obs->on_outcome(OutcomeEvent{key_, s, cfg_->now() - started_, out_.attempt, out_.takeover, out_.from_cache});
    return Next::done;
  }

  Next raise(std::exception_ptr e) {
    error_ = std::move(e);
    phase_ = Phase::raised;
    return Next::raise;
  }

  // An in-doubt store error that its store marks "do not resend" becomes, for the message, what
  // a redelivery does: said once, here.
  static std::exception_ptr rewrap_in_doubt(const std::exception_ptr& e, std::string_view advice) {
    try {
      std::rethrow_exception(e);
    } catch (const outcome_unknown_error& x) {
      if (!x.retryable()) return std::make_exception_ptr(outcome_unknown_error(fmt::format("{}; {}", x.what(), advice), x.code(), true));
    } catch (...) {
    }
    return e;
  }

  // Store and decode failures reach the observer; the handler's own idem errors (from_handler)
  // and non-idem exceptions do not, unless `any` (a failure write's error).
  void report_store_error(const std::exception_ptr& e, bool any = false) const {
    const auto& obs = cfg_->options->observer;
    if (!obs) return;
    try {
      std::rethrow_exception(e);
    } catch (const idem::error& x) {
      const bool store_failed = dynamic_cast<const store_error*>(&x) || dynamic_cast<const corrupt_record_error*>(&x);
      if (any || (store_failed && !x.from_handler())) obs->on_store_error(key_, x);
    } catch (const std::exception& x) {
      if (any) obs->on_store_error(key_, x);
    } catch (...) {
    }
  }

  const MachineConfig* cfg_;
  std::string_view key_;
  std::string fp_;
  Phase phase_ = Phase::idle;
  Call call_ = Call::acquire;
  AcquireParams ap_;
  Holder holder_;  // the claim, when acquired (its attempts and takeover are in out_)
  std::string encoded_;  // complete: the result; complete_unavailable: why
  std::string why_;      // unstorable: why
  std::string fail_text_;
  FailParams fail_;
  std::exception_ptr handler_error_, error_;
  Outcome<R> out_;
  std::optional<MachineConfig::clock::time_point> deadline_;
  MachineConfig::clock::time_point started_{};
  millis pause_{0}, next_pause_{10};
};

/// Calls a guard handler with the context when it takes one; an idem::error it throws is marked
/// from_handler before it goes on, so no one mistakes it for the guard's own store failing.
template <class Ctx, class F>
decltype(auto) invoke_handler(F& handler, const Ctx& ctx) {
  try {
    if constexpr (std::is_invocable_v<F&, const Ctx&>)
      return std::invoke(handler, ctx);
    else
      return std::invoke(handler);
  } catch (error& e) {
    mark_from_handler(e);  // the same object is rethrown
    throw;
  }
}

}  // namespace idem::detail
