#pragma once
/// @file sequence/gate.hpp SequenceGate: skips an event as Status::stale when a newer one of its
/// entity was already applied, on top of an IdempotencyGuard. Semantics: docs/ordering.md.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string_view>
#include <type_traits>
#include <utility>

#include "idem/core/observer.hpp"
#include "idem/core/outcome.hpp"
#include "idem/core/store.hpp"
#include "idem/guard/guard.hpp"
#include "idem/sequence/sequence_store.hpp"

namespace idem {

/**
 * Applies events in entity order on top of an IdempotencyGuard: an event whose sequence is not
 * newer than its entity's last applied one is skipped as Status::stale (handler not run, ack it);
 * otherwise it runs through the guard, and the sequence advances (compare-and-set) when the guard
 * reports executed — or duplicate, which repairs a crash between the completion and the advance.
 * When the sequence store CompletesWithAdvance on the guard's store (Redis), a lease-mode run
 * completes and advances in one atomic step instead, so there is no such crash window.
 * Thread-safe when the sequence store is; share one gate between workers. The store must outlive it.
 *
 * Concurrent events of one entity: the check before the handler and the advance after it are two
 * atomic steps, so two newer events can run at once. The one that finishes last with the lower
 * sequence still reports executed (its result is recorded under its key) with `advanced == false`,
 * and the sequence keeps the higher value: it never goes backwards. When an effect must never be
 * applied after a newer one, make it conditional on the sequence itself (docs/ordering.md).
 *
 * @code
 * idem::MemoryStore store;
 * idem::MemorySequenceStore seqs;
 * idem::IdempotencyGuard guard{store};
 * idem::SequenceGate gate{seqs};
 * auto out = gate.run(guard, {.key = ev.id, .entity = ev.account, .seq = ev.version},
 *                     [&] { set_status(ev.account, ev.status); });
 * if (out.action() == idem::BrokerAction::ack) consumer.ack(msg);  // stale is acked too
 * @endcode
 */
template <SequenceStore Seq>
class SequenceGate {
public:
  /// Binds to `store` (not owned); throws invalid_options_error when the options cannot work.
  explicit SequenceGate(Seq& store, SequenceGateOptions options = {}) : store_(&store), options_(options) {
    if (options_.max_entity_bytes == 0)
      throw invalid_options_error("idem: max_entity_bytes is 0; entity ids need at least one byte");
    if (options_.gap_retry_after < millis{0})
      throw invalid_options_error("idem: gap_retry_after is negative; use 0 to requeue at once");
  }

  /// Runs `handler` through `guard` unless `ev` is stale (or, contiguous, ahead of its entity).
  /// Throws invalid_entity_error / invalid_key_error on bad input, store errors as the guard does,
  /// and the handler's exceptions unchanged (the sequence is not advanced).
  template <StateStore Store, class F>
  auto run(IdempotencyGuard<Store>& guard, const SequencedEvent& ev, F&& handler) {
    using Base = decltype(guard.run(ev.key, handler));
    using R = typename outcome_traits<Base>::type;
    SequencedOutcome<R> out;
    detail::check_entity(ev.entity, options_.max_entity_bytes);
    detail::check_key(ev.key, guard.options().max_key_bytes);
    const auto started = std::chrono::steady_clock::now();

    const std::optional<std::uint64_t> last = store_->last_applied(ev.entity);
    out.last_applied = last;
    if (last && ev.seq <= *last) {
      out.status = Status::stale;
      report(guard, ev.key, Status::stale, started);
      return out;
    }
    if (options_.contiguous) {
      const std::uint64_t want = last ? *last + 1 : options_.first;
      if (ev.seq != want) {
        // Below `first` with nothing applied yet is a bad event, not a gap: it can never run.
        if (!last && ev.seq < options_.first) {
          out.status = Status::stale;
          report(guard, ev.key, Status::stale, started);
          return out;
        }
        out.status = Status::in_flight;
        out.gap = true;
        out.retry_after = options_.gap_retry_after;
        report(guard, ev.key, Status::in_flight, started);
        return out;
      }
    }

    std::optional<AdvanceResult> combined;  // set when the completion advanced in the same step
    if constexpr (CompletesWithAdvance<Seq, Store>) {
      auto complete = [&](const Holder& h, std::string_view encoded, millis retention) {
        CompleteAdvanceResult r =
            store_->complete_advance(guard.store(), ev.key, h, encoded, retention, ev.entity, ev.seq);
        if (r.status == WriteStatus::ok) combined = r.advance;
        return r.status;
      };
      out = SequencedOutcome<R>(guard.run_with_completion(ev.key, ev.payload, handler, complete));
    } else {
      out = SequencedOutcome<R>(ev.payload.empty() ? guard.run(ev.key, handler)
                                                   : guard.run(ev.key, ev.payload, handler));
    }
    out.last_applied = last;
    if (combined) {
      out.advanced = combined->advanced;
      out.last_applied = combined->advanced ? std::optional<std::uint64_t>(ev.seq) : combined->previous;
    } else if (out.status == Status::executed || out.status == Status::duplicate) {
      const AdvanceResult a = store_->advance(ev.entity, ev.seq);
      out.advanced = a.advanced;
      out.last_applied = a.advanced ? std::optional<std::uint64_t>(ev.seq) : a.previous;
    }
    return out;
  }

  /// Positional form of run(guard, SequencedEvent{key, entity, seq}, handler).
  template <StateStore Store, class F>
  auto run(IdempotencyGuard<Store>& guard, std::string_view key, std::string_view entity, std::uint64_t seq,
           F&& handler) {
    return run(guard, SequencedEvent{key, entity, seq, {}}, std::forward<F>(handler));
  }

  /// The last applied sequence of `entity` (nullopt = none).
  std::optional<std::uint64_t> last_applied(std::string_view entity) const {
    detail::check_entity(entity, options_.max_entity_bytes);
    return store_->last_applied(entity);
  }

  /// The options in force.
  [[nodiscard]] const SequenceGateOptions& options() const noexcept { return options_; }
  /// The sequence store this gate runs on.
  [[nodiscard]] Seq& store() const noexcept { return *store_; }

private:
  template <class O>
  struct outcome_traits;
  template <class T>
  struct outcome_traits<Outcome<T>> {
    using type = T;
  };

  // Outcomes decided by the gate itself reach the guard's observer too, so one CountingObserver
  // sees every delivery (the guard reports the ones it decides).
  template <class Store>
  static void report(IdempotencyGuard<Store>& guard, std::string_view key, Status s,
                     std::chrono::steady_clock::time_point started) {
    if (const auto& obs = guard.options().observer)
      obs->on_outcome(OutcomeEvent{key, s, std::chrono::steady_clock::now() - started, 0, false, false});
  }

  Seq* store_;
  SequenceGateOptions options_;
};

}  // namespace idem
