#pragma once
/// @file sequence/gate.hpp SequenceGate: skips an event as Status::stale when a newer one of its
/// entity was already applied, on top of an IdempotencyGuard. Semantics: docs/ordering.md.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string_view>
#include <type_traits>
#include <utility>

#include <fmt/core.h>

#include "idem/core/observer.hpp"
#include "idem/core/outcome.hpp"
#include "idem/core/store.hpp"
#include "idem/core/hex.hpp"
#include "idem/guard/guard.hpp"
#include "idem/sequence/sequence_store.hpp"

namespace idem {

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
    constexpr bool takes_ctx = std::is_invocable_v<F&, const Ctx&>;
    static_assert(takes_ctx || std::is_invocable_v<F&>,
                  "idem: the handler must be callable with () or with (const idem::Context&)");
    using Inv = std::conditional_t<takes_ctx, std::invoke_result<F&, const Ctx&>, std::invoke_result<F&>>;
    using R = std::decay_t<typename Inv::type>;
    SequencedOutcome<R> out;
    detail::check_entity(ev.entity, options_.max_entity_bytes);
    detail::check_key(ev.key, guard.options().max_key_bytes);
    const auto started = std::chrono::steady_clock::now();

    const std::optional<std::uint64_t> last = store_->last_applied(ev.entity);
    out.last_applied = last;
    if (const auto early = precheck(last, ev.seq)) {
      out.status = *early;
      out.gap = *early == Status::in_flight;
      if (out.gap) out.retry_after = options_.gap_retry_after;
      report(guard, ev.key, *early, started);
      return out;
    }
    if constexpr (AdvancesInTransaction<Seq, Store>) {
      if (guard.store().transactional()) return run_in_transaction<R>(guard, ev, last, handler);
    }
    std::optional<AdvanceResult> combined;  // set when the completion advanced in the same step
    if constexpr (CompletesWithAdvance<Seq, Store>) {
      // Refused before the claim, not after the handler ran (its effect would run again on
      // every redelivery, and be refused again).
      if constexpr (ChecksCompleteAdvance<Seq, Store>) store_->check_complete_advance(guard.store(), ev.key, ev.entity);
      auto complete = [&](const Holder& h, std::string_view encoded, millis retention) {
        CompleteAdvanceResult r =
            store_->complete_advance(guard.store(), ev.key, h, encoded, retention, ev.entity, ev.seq);
        if (r.status == WriteStatus::ok) combined = r.advance;
        return r.status;
      };
      out = SequencedOutcome<R>(guard.run_with_completion(ev.key, ev.payload, handler, complete));
    } else {
      out = SequencedOutcome<R>(guard.run_with_completion(ev.key, ev.payload, handler, nullptr));
    }
    out.last_applied = last;
    if (!combined && (out.status == Status::executed || out.status == Status::duplicate))
      combined = store_->advance(ev.entity, ev.seq);
    if (combined) {
      out.advanced = combined->advanced;
      out.last_applied = combined->advanced ? std::optional<std::uint64_t>(ev.seq) : combined->previous;
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
  // The decision taken before any claim: stale (not newer than the entity, or below `first` with
  // nothing applied), in_flight for a contiguous event whose predecessor is missing, or none.
  // Sequences never go down, so an event that is next here is next or stale later too.
  std::optional<Status> precheck(const std::optional<std::uint64_t>& last, std::uint64_t seq) const {
    if (last && seq <= *last) return Status::stale;
    if (!options_.contiguous) return std::nullopt;
    const std::uint64_t want = last ? *last + 1 : options_.first;
    if (seq == want) return std::nullopt;
    if (!last && seq < options_.first) return Status::stale;  // a bad event, not a gap: it can never run
    return Status::in_flight;
  }

  // The advance runs first inside the claiming transaction: it commits with the handler's writes,
  // or a lost advance rolls the claim back (stale_signal) before the handler runs.
  template <class R, class Store, class F>
  SequencedOutcome<R> run_in_transaction(IdempotencyGuard<Store>& guard, const SequencedEvent& ev,
                                         const std::optional<std::uint64_t>& last, F& handler) {
    using Ctx = typename IdempotencyGuard<Store>::context_type;
    std::optional<std::uint64_t> stale_at;
    auto inner = [&](const Ctx& ctx) -> R {
      const AdvanceResult a = store_->advance(*ctx.tx, ev.entity, ev.seq);
      if (!a.advanced) {
        stale_at = a.previous;
        throw detail::stale_signal{};
      }
      // Only an erase() racing this event can open a gap after the precheck: roll back, retry.
      if (options_.contiguous && a.previous != last)
        throw store_error(fmt::format("idem: the sequence of entity '{}' changed under a contiguous event (erased "
                                      "meanwhile?); retry it",
                                      detail::printable(ev.entity)),
                          "", true);
      if constexpr (std::is_invocable_v<F&, const Ctx&>)
        return handler(ctx);
      else
        return handler();
    };
    SequencedOutcome<R> out(guard.run_with_completion(ev.key, ev.payload, inner, nullptr));
    out.last_applied = last;
    if (out.status == Status::stale) {
      out.last_applied = stale_at;
    } else if (out.status == Status::executed) {
      out.advanced = true;
      out.last_applied = ev.seq;
    }
    return out;
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

}  // namespace idem
