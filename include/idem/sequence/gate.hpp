#pragma once
/// @file sequence/gate.hpp SequenceGate: skips an event as Status::stale when a newer one of its
/// entity was already applied, on top of an IdempotencyGuard. Semantics: docs/ordering.md.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>
#include <string_view>
#include <type_traits>
#include <utility>

#include <fmt/core.h>

#include "idem/core/observer.hpp"
#include "idem/core/outcome.hpp"
#include "idem/core/store.hpp"
#include "idem/core/hex.hpp"
#include "idem/guard/batch.hpp"
#include "idem/guard/guard.hpp"
#include "idem/guard/sequence_phase.hpp"
#include "idem/sequence/sequence_store.hpp"

namespace idem {

namespace detail {
/// What a gate handler returns: called with the guard's context, or with nothing.
template <class Ctx, class F>
struct gate_handler {
  static constexpr bool takes_ctx = std::is_invocable_v<F&, const Ctx&>;
  static_assert(takes_ctx || std::is_invocable_v<F&>,
                "idem: the handler must be callable with () or with (const idem::Context&)");
  using type = std::decay_t<
      typename std::conditional_t<takes_ctx, std::invoke_result<F&, const Ctx&>, std::invoke_result<F&>>::type>;
};
}  // namespace detail

/// What SequenceGate::run_batch did to one event's entity (the batch's own outcome is per item).
struct SequenceNote {
  std::optional<std::uint64_t> last_applied;  ///< as SequencedOutcome::last_applied
  bool advanced = false;                      ///< this call advanced the entity to the event's seq
  bool gap = false;                           ///< contiguous: the event is ahead of its entity
};

/// The result of SequenceGate::run_batch: the guard's batch outcome and, per item, its sequence.
template <class T>
struct SequencedBatchOutcome : BatchOutcome<T> {
  std::vector<SequenceNote> sequence;  ///< one per item, in input order
};

/**
 * Applies events in entity order on top of an IdempotencyGuard: an event whose sequence is not
 * newer than its entity's last applied one is skipped as Status::stale (handler not run, ack it);
 * otherwise it runs through the guard and the sequence advances (compare-and-set). How the advance
 * joins the run depends on the stores, with one gate for all of them:
 *
 * - the sequence store CompletesWithAdvance on the guard's store (Redis): a lease-mode run
 *   completes and advances in one atomic step, so no crash can separate the two;
 * - the sequence store AdvancesInTransaction and the guard's store is in transactional mode
 *   (PostgreSQL): the advance runs first inside the claiming transaction and commits with the
 *   handler's writes; an advance that loses (a newer event committed meanwhile) rolls back and
 *   answers stale without running the handler;
 * - otherwise: the advance follows a run that reports executed — or duplicate, which repairs a
 *   crash between the completion and the advance.
 *
 * Thread-safe when the sequence store is; share one gate between workers. The store must outlive it.
 *
 * Concurrent events of one entity (lease mode): the check before the handler and the advance after
 * it are two atomic steps, so two newer events can run at once. The one that finishes last with
 * the lower sequence still reports executed (its result is recorded under its key) with
 * `advanced == false`, and the sequence keeps the higher value: it never goes backwards. When an
 * effect must never be applied after a newer one, make it conditional on the sequence itself, or
 * use the in-transaction advance (docs/ordering.md).
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
    using Ctx = typename IdempotencyGuard<Store>::context_type;
    using R = typename detail::gate_handler<Ctx, F>::type;
    check(guard, ev);
    const auto started = std::chrono::steady_clock::now();
    detail::SequencePhase phase(rule(), ev.seq, way(guard));
    if constexpr (ChecksCompleteAdvance<Seq, Store>) {
      // Refused before the claim, not after the handler ran (its effect would run again on
      // every redelivery, and be refused again).
      if (phase.way() == detail::AdvanceWay::with_completion) store_->check_complete_advance(guard.store(), ev.key, ev.entity);
    }
    if (const auto early = decided(phase.on_last_applied(store_->last_applied(ev.entity)))) {
      report(guard, ev.key, *early, started);
      return sequenced<R>(phase, Outcome<R>{}, *early);
    }
    switch (phase.way()) {
      case detail::AdvanceWay::in_transaction:
        if constexpr (AdvancesInTransaction<Seq, Store>) {
          auto inner = in_transaction<Ctx>(phase, ev, handler);
          return finish_tx<R>(phase, guard.run_with_completion(ev.key, ev.payload, inner, nullptr));
        }
        break;
      case detail::AdvanceWay::with_completion:
        if constexpr (CompletesWithAdvance<Seq, Store>) {
          bool combined = false;
          auto complete = [&](const Holder& h, std::string_view encoded, millis retention) {
            CompleteAdvanceResult r =
                store_->complete_advance(guard.store(), ev.key, h, encoded, retention, ev.entity, ev.seq);
            if (r.status == WriteStatus::ok) {
              combined = true;
              phase.on_advanced(r.advance.advanced, r.advance.previous);
            }
            return r.status;
          };
          auto out = guard.run_with_completion(ev.key, ev.payload, handler, complete);
          return after<R>(phase, ev, std::move(out), combined);
        }
        break;
      case detail::AdvanceWay::after: break;
    }
    return after<R>(phase, ev, guard.run_with_completion(ev.key, ev.payload, handler, nullptr), false);
  }

  /// Runs a polled batch of events through `guard`'s run_batch: `handler(event, ctx)` (or
  /// `handler(event)`) once for each event that is neither stale nor, contiguous, ahead of its
  /// entity, in input order. An event behind an earlier event of its entity in the same batch (an
  /// equal or lower sequence, or any later one in contiguous mode) is not run now: in_flight with
  /// retry_after 0, decided again on its redelivery, after the earlier one is applied or not. The
  /// advance follows each executed or duplicate run (the completion and the advance are two
  /// steps here, as in SequenceGate::run without CompletesWithAdvance), or runs inside each item's
  /// transaction on a transactional store. Errors as IdempotencyGuard::run_batch, per item.
  template <StateStore Store, class F>
  auto run_batch(IdempotencyGuard<Store>& guard, std::span<const SequencedEvent> events, F&& handler,
                 BatchOptions batch = {});

  /// run() for event loops: a `boost::asio::awaitable<SequencedOutcome<R>>`, defined in
  /// idem/asio/sequence.hpp (include it), with the decisions of run(). On an
  /// AsyncRedisSequenceStore with an AsyncRedisStore no thread blocks and the completion advances
  /// in the same script; other stores are called inline. The event's key, entity and payload are
  /// copied. A transactional store is refused (usage_error): use run_sequenced on a worker thread.
  template <StateStore Store, class F>
  auto run_async(IdempotencyGuard<Store>& guard, SequencedEvent ev, F handler);

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
  // Bad input is refused before any store call.
  template <class Store>
  void check(const IdempotencyGuard<Store>& guard, const SequencedEvent& ev) const {
    detail::check_entity(ev.entity, options_.max_entity_bytes);
    detail::check_key(ev.key, guard.options().max_key_bytes);
  }

  [[nodiscard]] detail::SequenceRule rule() const noexcept {
    return {options_.contiguous, options_.first, options_.gap_retry_after};
  }

  // How an event's advance joins its run on this guard's store.
  template <class Store>
  static detail::AdvanceWay way(const IdempotencyGuard<Store>& guard) {
    if constexpr (AdvancesInTransaction<Seq, Store>)
      if (guard.store().transactional()) return detail::AdvanceWay::in_transaction;
    if constexpr (CompletesWithAdvance<Seq, Store>) return detail::AdvanceWay::with_completion;
    return detail::AdvanceWay::after;
  }

  // The status an event ends with before any claim (stale, a gap, behind an earlier one), or none.
  static std::optional<Status> decided(detail::SeqNext n) noexcept {
    switch (n) {
      case detail::SeqNext::claim: return std::nullopt;
      case detail::SeqNext::stale: return Status::stale;
      case detail::SeqNext::gap:
      case detail::SeqNext::later: return Status::in_flight;
    }
    return std::nullopt;
  }

  // The outcome with what the phase knows of the entity; `early` is a status decided before the claim.
  template <class R>
  static SequencedOutcome<R> sequenced(const detail::SequencePhase& phase, Outcome<R> base,
                                       std::optional<Status> early = std::nullopt) {
    SequencedOutcome<R> out(std::move(base));
    if (early) {
      out.status = *early;
      if (phase.gap()) out.retry_after = phase.gap_retry_after();
    }
    out.gap = phase.gap();
    out.advanced = phase.advanced();
    out.last_applied = phase.last_applied();
    return out;
  }

  // After a lease-mode run: advance when the phase asks for it (not combined with the completion).
  template <class R>
  SequencedOutcome<R> after(detail::SequencePhase& phase, const SequencedEvent& ev, Outcome<R> out, bool combined) {
    if (phase.advance_after(out.status, combined)) {
      const AdvanceResult a = store_->advance(ev.entity, ev.seq);
      phase.on_advanced(a.advanced, a.previous);
    }
    return sequenced<R>(phase, std::move(out));
  }

  // The handler inside the claiming transaction, the advance first: it commits with the
  // handler's writes, or a lost advance rolls the claim back (stale_signal) before the handler runs.
  template <class Ctx, class F>
  auto in_transaction(detail::SequencePhase& phase, const SequencedEvent& ev, F& handler) {
    return [this, &phase, &ev, &handler](const Ctx& ctx) -> decltype(auto) {
      const AdvanceResult a = store_->advance(*ctx.tx, ev.entity, ev.seq);
      switch (phase.on_tx_advance(a.advanced, a.previous)) {
        case detail::TxNext::run_handler: break;
        case detail::TxNext::stale: throw detail::stale_signal{};
        case detail::TxNext::raise: throw phase.changed_error(ev.entity);
      }
      if constexpr (std::is_invocable_v<F&, const Ctx&>)
        return handler(ctx);
      else
        return handler();
    };
  }

  template <class R>
  static SequencedOutcome<R> finish_tx(detail::SequencePhase& phase, Outcome<R> out) {
    phase.on_tx_run(out.status);
    return sequenced<R>(phase, std::move(out));
  }

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

template <SequenceStore Seq>
template <StateStore Store, class F>
auto SequenceGate<Seq>::run_batch(IdempotencyGuard<Store>& guard, std::span<const SequencedEvent> events,
                                  F&& handler, BatchOptions batch) {
  using Ctx = typename IdempotencyGuard<Store>::context_type;
  constexpr bool takes_ctx = std::is_invocable_v<F&, const SequencedEvent&, const Ctx&>;
  static_assert(takes_ctx || std::is_invocable_v<F&, const SequencedEvent&>,
                "idem: the batch handler must be callable with (const idem::SequencedEvent&) or with (const "
                "idem::SequencedEvent&, const idem::Context&)");
  using Inv = std::conditional_t<takes_ctx, std::invoke_result<F&, const SequencedEvent&, const Ctx&>,
                                 std::invoke_result<F&, const SequencedEvent&>>;
  using R = std::decay_t<typename Inv::type>;
  for (const SequencedEvent& ev : events) check(guard, ev);
  const auto started = std::chrono::steady_clock::now();
  // The advance of a batch never joins a store's batched completion: it follows the run, or
  // runs inside each item's transaction.
  const detail::AdvanceWay w =
      way(guard) == detail::AdvanceWay::in_transaction ? detail::AdvanceWay::in_transaction : detail::AdvanceWay::after;
  std::vector<detail::SequencePhase> phases;
  phases.reserve(events.size());
  SequencedBatchOutcome<R> res;
  res.outcomes.resize(events.size());
  res.errors.resize(events.size());
  res.sequence.resize(events.size());
  std::vector<BatchItem> items;             // the events that claim, in input order
  std::vector<std::size_t> claimed;         // items[j] is events[claimed[j]]
  struct Seen {
    std::string_view entity;
    std::optional<std::uint64_t> last;     // read once per entity and batch
    std::optional<std::uint64_t> claimed;  // the highest seq an earlier item of the batch claimed
  };
  std::vector<Seen> seen;
  for (std::size_t i = 0; i < events.size(); ++i) {
    const SequencedEvent& ev = events[i];
    phases.emplace_back(rule(), ev.seq, w);
    detail::SequencePhase& phase = phases.back();
    auto it = std::find_if(seen.begin(), seen.end(), [&](const Seen& e) { return e.entity == ev.entity; });
    if (it == seen.end()) it = seen.insert(seen.end(), Seen{ev.entity, store_->last_applied(ev.entity), std::nullopt});
    detail::SeqNext n = phase.on_last_applied(it->last);
    if (n != detail::SeqNext::stale && it->claimed) n = phase.behind_earlier(*it->claimed);
    if (const auto early = decided(n)) {
      report(guard, ev.key, *early, started);
      res.outcomes[i] = sequenced<R>(phase, Outcome<R>{}, *early);
      continue;
    }
    it->claimed = ev.seq;
    items.push_back({.key = ev.key, .payload = ev.payload});
    claimed.push_back(i);
  }
  auto each = [&](const BatchItem& item, const Ctx& ctx) -> decltype(auto) {
    const std::size_t i = claimed[static_cast<std::size_t>(&item - items.data())];
    const SequencedEvent& ev = events[i];
    auto call = [&](const Ctx& c) -> decltype(auto) {
      if constexpr (takes_ctx)
        return handler(ev, c);
      else
        return handler(ev);
    };
    if constexpr (AdvancesInTransaction<Seq, Store>) {
      if (w == detail::AdvanceWay::in_transaction) return in_transaction<Ctx>(phases[i], ev, call)(ctx);
    }
    return call(ctx);
  };
  BatchOutcome<R> ran = guard.run_batch(std::span<const BatchItem>(items), each, batch);
  for (std::size_t j = 0; j < claimed.size(); ++j) {
    const std::size_t i = claimed[j];
    detail::SequencePhase& phase = phases[i];
    res.errors[i] = ran.errors[j];
    if (ran.errors[j]) {
      phase.on_tx_run(Status::in_flight);  // nothing committed for it
      continue;
    }
    if (w == detail::AdvanceWay::in_transaction) {
      res.outcomes[i] = finish_tx<R>(phase, std::move(ran.outcomes[j]));
    } else {
      try {
        res.outcomes[i] = after<R>(phase, events[i], std::move(ran.outcomes[j]), false);
      } catch (...) {
        res.errors[i] = std::current_exception();  // recorded, not advanced: its redelivery repairs it
      }
    }
  }
  for (std::size_t i = 0; i < events.size(); ++i)
    res.sequence[i] = {phases[i].last_applied(), phases[i].advanced(), phases[i].gap()};
  return res;
}

}  // namespace idem
