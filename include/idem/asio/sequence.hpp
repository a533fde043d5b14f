#pragma once
/// @file asio/sequence.hpp SequenceGate::run_async (declared in sequence/gate.hpp): the gate on
/// Boost.Asio coroutines, with run()'s decisions (the sequence phase, guard/sequence_phase.hpp).

#include <utility>  // before Asio: Boost 1.74's awaitable.hpp uses std::exchange without including it

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include <boost/asio/awaitable.hpp>
#include <boost/asio/use_awaitable.hpp>

#include "idem/asio/guard.hpp"
#include "idem/sequence/gate.hpp"

namespace idem {

namespace detail {

// The sequence store's calls as awaitables: awaited on a store with async members
// (AsyncRedisSequenceStore), called inline on any other.
template <class Seq>
boost::asio::awaitable<std::optional<std::uint64_t>> step_last_applied(Seq& q, std::string_view entity) {
  if constexpr (requires { q.async_last_applied(entity, boost::asio::use_awaitable); })
    co_return co_await q.async_last_applied(entity, boost::asio::use_awaitable);
  else
    co_return q.last_applied(entity);
}

template <class Seq>
boost::asio::awaitable<AdvanceResult> step_advance(Seq& q, std::string_view entity, std::uint64_t seq) {
  if constexpr (requires { q.async_advance(entity, seq, boost::asio::use_awaitable); })
    co_return co_await q.async_advance(entity, seq, boost::asio::use_awaitable);
  else
    co_return q.advance(entity, seq);
}

template <class Seq, class Store>
boost::asio::awaitable<CompleteAdvanceResult> step_complete_advance(Seq& q, Store& s, std::string_view key,
                                                                    const Holder& h, std::string_view result,
                                                                    millis retention, std::string_view entity,
                                                                    std::uint64_t seq) {
  if constexpr (requires {
                  q.async_complete_advance(s, key, h, result, retention, entity, seq, boost::asio::use_awaitable);
                })
    co_return co_await q.async_complete_advance(s, key, h, result, retention, entity, seq, boost::asio::use_awaitable);
  else
    co_return q.complete_advance(s, key, h, result, retention, entity, seq);
}

}  // namespace detail

template <SequenceStore Seq>
template <StateStore Store, class F>
auto SequenceGate<Seq>::run_async(IdempotencyGuard<Store>& guard, SequencedEvent ev, F handler) {
  using Returned = typename detail::gate_handler<typename IdempotencyGuard<Store>::context_type, F>::type;
  using R = std::decay_t<typename detail::awaited<Returned>::type>;
  check(guard, ev);
  const detail::AdvanceWay w = way(guard);
  if (w == detail::AdvanceWay::in_transaction)
    throw usage_error("idem: SequenceGate::run_async does not run a store in transactional mode; use run_sequenced "
                      "on a worker thread, or the store's lease mode");
  if constexpr (ChecksCompleteAdvance<Seq, Store>) {
    // Refused before the claim, as run() does.
    if (w == detail::AdvanceWay::with_completion) store_->check_complete_advance(guard.store(), ev.key, ev.entity);
  }
  return [](SequenceGate* self, IdempotencyGuard<Store>* g, std::string key, std::string entity, std::uint64_t seq,
            std::string payload, F h, detail::AdvanceWay how) -> boost::asio::awaitable<SequencedOutcome<R>> {
    const auto started = std::chrono::steady_clock::now();
    detail::SequencePhase phase(self->rule(), seq, how);
    if (const auto early = decided(phase.on_last_applied(co_await detail::step_last_applied(*self->store_, entity)))) {
      report(*g, key, *early, started);
      co_return sequenced<R>(phase, Outcome<R>{}, *early);
    }
    bool combined = false;
    Outcome<R> out;
    if constexpr (CompletesWithAdvance<Seq, Store>) {
      // The completion and the advance in one step (one script on Redis).
      auto complete = [self, g, &key, &entity, seq, &combined, &phase](
                          const Holder& holder, std::string_view encoded,
                          millis retention) -> boost::asio::awaitable<WriteStatus> {
        const CompleteAdvanceResult r = co_await detail::step_complete_advance(*self->store_, g->store(), key, holder,
                                                                               encoded, retention, entity, seq);
        if (r.status == WriteStatus::ok) {
          combined = true;
          phase.on_advanced(r.advance.advanced, r.advance.previous);
        }
        co_return r.status;
      };
      out = co_await g->run_async_with_completion(key, payload, std::move(h), complete);
    } else {
      out = co_await g->run_async_with_completion(key, payload, std::move(h), nullptr);
    }
    if (phase.advance_after(out.status, combined)) {
      const AdvanceResult a = co_await detail::step_advance(*self->store_, entity, seq);
      phase.on_advanced(a.advanced, a.previous);
    }
    co_return sequenced<R>(phase, std::move(out));
  }(this, &guard, std::string(ev.key), std::string(ev.entity), ev.seq, std::string(ev.payload), std::move(handler), w);
}

}  // namespace idem
