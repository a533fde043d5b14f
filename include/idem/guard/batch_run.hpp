#pragma once
/// @file guard/batch_run.hpp IdempotencyGuard::run_batch (declared in guard.hpp, which includes
/// this file at its end): the batch driver over the run machine. docs/batches.md explains the
/// semantics. Not part of idem's API.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <exception>
#include <functional>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

// Not self-contained on purpose: guard.hpp includes this file at its end, after the class it
// defines members of, so the two never include each other.
#ifndef IDEM_GUARD_BODY
#error "include idem/guard/guard.hpp, not idem/guard/batch_run.hpp"
#endif

namespace idem {
namespace detail {

inline constexpr std::size_t no_item = static_cast<std::size_t>(-1);

/// For each item, the position of the first earlier item with the same key, or no_item. By
/// (hash, position), not through a hash map: no allocation per item. Equal keys have equal hashes,
/// and within a hash the lowest position comes first: that is the first occurrence.
inline std::vector<std::size_t> first_occurrences(std::span<const BatchItem> items) {
  const std::size_t n = items.size();
  std::vector<std::size_t> first_of(n, no_item);
  std::vector<std::pair<std::size_t, std::size_t>> by_hash;
  by_hash.reserve(n);
  for (std::size_t i = 0; i < n; ++i) by_hash.emplace_back(std::hash<std::string_view>{}(items[i].key), i);
  std::sort(by_hash.begin(), by_hash.end());
  for (std::size_t b = 0, e = 0; b < by_hash.size(); b = e) {
    for (e = b + 1; e < by_hash.size() && by_hash[e].first == by_hash[b].first;) ++e;
    for (std::size_t k = b + 1; k < e; ++k)
      for (std::size_t j = b; j < k; ++j) {
        const std::size_t at = by_hash[j].second, i = by_hash[k].second;
        if (first_of[at] == no_item && items[at].key == items[i].key) {
          first_of[i] = at;
          break;
        }
      }
  }
  return first_of;
}

/// The repeats of a key in a batch, each answered by the machine from its first item
/// (RunMachine::repeat_of) and reported to `observer` (may be null) with the batch's time `took`.
template <class R>
void settle_repeats(std::span<const BatchItem> items, const std::vector<std::string>& fps,
                    const std::vector<std::size_t>& first_of, BatchOutcome<R>& res, Observer* observer,
                    std::chrono::nanoseconds took) {
  for (std::size_t i = 0; i < items.size(); ++i) {
    const std::size_t f = first_of[i];
    if (f == no_item) continue;
    const bool other_payload = !fps[i].empty() && !fps[f].empty() && fps[i] != fps[f];
    RunMachine<R>::repeat_of(res.outcomes[f], res.errors[f], other_payload, res.outcomes[i], res.errors[i]);
    if (res.errors[i]) continue;
    const Outcome<R>& out = res.outcomes[i];
    if (observer) observer->on_outcome(OutcomeEvent{items[i].key, out.status, took, out.attempt, out.takeover, out.from_cache});
  }
}

/// The batch handler as a run() handler of one item: it gets the item itself (its index is
/// `&item - items.data()`), and the context when it takes one.
template <class Ctx, class F>
auto bind_item(F& handler, const BatchItem& item) {
  return [&handler, &item](const Ctx& ctx) -> decltype(auto) {
    if constexpr (std::is_invocable_v<F&, const BatchItem&, const Ctx&>)
      return std::invoke(handler, item, ctx);
    else
      return std::invoke(handler, item);
  };
}

}  // namespace detail

template <StateStore Store>
template <class F>
auto IdempotencyGuard<Store>::run_batch(std::span<const BatchItem> items, F&& handler, BatchOptions batch) {
  static_assert(batch_takes_context<F> || std::is_invocable_v<F&, const BatchItem&>,
                "idem: a batch handler must be callable with (const idem::BatchItem&) or with "
                "(const idem::BatchItem&, const idem::Context&)");
  using R = std::decay_t<typename batch_result_of<F>::type>;
  static_assert(std::is_void_v<R> || Encodable<R>,
                "idem: the handler's result type needs an idem::codec<T> specialisation (see codec.hpp)");
  using detail::Call;
  using detail::Next;
  const std::size_t n = items.size();
  const auto started = options_.observer ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  if (options_.observer) options_.observer->on_batch(n);
  BatchOutcome<R> res;
  res.outcomes.resize(n);
  res.errors.resize(n);
  std::vector<std::string> fps(n);
  for (std::size_t i = 0; i < n; ++i)
    if (!items[i].payload.empty()) fps[i] = fingerprint(items[i].payload);
  const std::vector<std::size_t> first_of = detail::first_occurrences(items);

  // One machine per first occurrence; reserved up front, so none moves while it is being stepped.
  std::vector<std::size_t> item_of;
  std::vector<machine<R>> ms;
  item_of.reserve(n);
  ms.reserve(n);
  for (std::size_t i = 0; i < n; ++i)
    if (first_of[i] == detail::no_item) {
      item_of.push_back(i);
      ms.emplace_back(machine_config_, items[i].key, fps[i]);
    }
  const auto handler_of = [&handler, items](std::size_t i) { return detail::bind_item<context_type>(handler, items[i]); };
  std::vector<Next> next(ms.size());
  std::nullptr_t store_completes = nullptr;

  if (machine_config_.transactional || !BatchStore<Store>) {
    // One transaction per item (the handler's writes commit with its record), or a store without
    // a batch path: the items one by one, exactly as run() takes them.
    bool stopped = false;
    for (std::size_t k = 0; k < ms.size(); ++k) {
      const std::size_t i = item_of[k];
      if (stopped) {
        res.outcomes[i] = machine<R>::untried();
        continue;
      }
      auto one = handler_of(i);
      try {
        if constexpr (TransactionalStore<Store>)
          res.outcomes[i] = machine_config_.transactional ? drive_tx(ms[k], one, ms[k].start())
                                                          : drive(ms[k], one, store_completes, ms[k].start());
        else
          res.outcomes[i] = drive(ms[k], one, store_completes, ms[k].start());
      } catch (...) {
        res.errors[i] = std::current_exception();
      }
      stopped = batch.stop_at_first_error && res.errors[i] != nullptr;
    }
  } else if constexpr (BatchStore<Store>) {
    // Every acquisition in one call.
    std::vector<AcquireRequest> requests;
    std::vector<std::size_t> asking;
    requests.reserve(ms.size());
    asking.reserve(ms.size());
    for (std::size_t k = 0; k < ms.size(); ++k)
      if ((next[k] = ms[k].start()) == Next::send) {
        requests.push_back(AcquireRequest{ms[k].key(), ms[k].acquire_params()});
        asking.push_back(k);
      }
    std::vector<AcquireResult> acquired;
    try {
      acquired = timed("batch_acquire", [&] { return store_->acquire_many(requests); });
    } catch (...) {
      // No handler ran: the whole batch fails as one acquire would (the first machine decides).
      if (asking.empty()) throw;
      if (ms[asking.front()].on_store_error(std::current_exception()) == Next::raise)
        std::rethrow_exception(ms[asking.front()].error());
      throw;
    }
    for (std::size_t a = 0; a < asking.size(); ++a) next[asking[a]] = ms[asking[a]].on_acquired(std::move(acquired[a]));
    // The claims are kept alive (heartbeat) from now until each one's completion is sent: items
    // wait for the handlers before them.
    std::vector<std::stop_source> stops(ms.size(), std::stop_source{std::nostopstate});
    std::vector<std::optional<typename detail::LeaseKeeper<Store>::Registration>> kept(ms.size());
    for (std::size_t k = 0; k < ms.size(); ++k)
      if (next[k] == Next::run_handler) {
        if (ms[k].heartbeat()) stops[k] = std::stop_source{};
        kept[k].emplace(keeper_.get(), ms[k].key(), ms[k].holder(), stops[k]);
      }
    auto writer = store_->batch_writer();
    std::vector<std::size_t> sent;  // machines whose write awaits finish()
    sent.reserve(ms.size());
    bool stopped = false;
    for (std::size_t k = 0; k < ms.size(); ++k) {
      if (next[k] != Next::run_handler) continue;
      bool broken = false;
      if constexpr (requires { writer.broken(); }) broken = writer.broken();
      if (broken) {
        // The store stopped taking the batch's writes: a handler run now could not be recorded.
        next[k] = ms[k].abandon();
      } else if (stopped) {
        next[k] = ms[k].release_unrun();  // stop at the first error: released, redelivered later
      } else {
        context_type ctx{};
        ms[k].fill(ctx, stops[k].get_token());
        auto one = handler_of(item_of[k]);
        next[k] = run_handler(ms[k], one, ctx);
        stopped = batch.stop_at_first_error && ms[k].handler_threw();
      }
      kept[k].reset();
      if (next[k] != Next::send) continue;
      // Sent now, answered with the others: no completion waits for the rest of the batch.
      if (ms[k].call() == Call::complete) {
        writer.complete(ms[k].key(), ms[k].holder(), ms[k].result(), ms[k].retention());
      } else if (ms[k].call() == Call::fail) {
        writer.fail(ms[k].key(), ms[k].holder(), ms[k].fail_params());
      } else {
        // Rare (a result the store cannot hold): settled at once with the single call.
        next[k] = send(ms[k], store_completes);
        continue;
      }
      sent.push_back(k);
    }
    try {
      const std::vector<WriteStatus> statuses = timed("batch_write", [&] { return writer.finish(); });
      for (std::size_t w = 0; w < sent.size(); ++w)
        next[sent[w]] = ms[sent[w]].on_written(w < statuses.size() ? statuses[w] : WriteStatus::ok);
    } catch (...) {
      // Not one write of the batch is confirmed: each completion is reported (not acked), as
      // run() reports a completion that failed; a failure keeps its handler's exception.
      for (std::size_t k : sent) next[k] = ms[k].on_store_error(std::current_exception());
    }
    // in_flight answers to wait out, as run() does.
    for (std::size_t k = 0; k < ms.size(); ++k) {
      if (next[k] != Next::wait) continue;
      auto one = handler_of(item_of[k]);
      try {
        res.outcomes[item_of[k]] = drive(ms[k], one, store_completes, Next::wait);
      } catch (...) {
        next[k] = Next::raise;
      }
    }
    for (std::size_t k = 0; k < ms.size(); ++k) {
      if (next[k] == Next::done) res.outcomes[item_of[k]] = std::move(ms[k].outcome());
      if (next[k] == Next::raise) res.errors[item_of[k]] = ms[k].error();
    }
  }
  for (std::size_t k = 0; k < ms.size(); ++k)
    if (ms[k].error()) res.errors[item_of[k]] = ms[k].error();  // a bad key raised at start
  detail::settle_repeats(items, fps, first_of, res, options_.observer.get(),
                         options_.observer ? std::chrono::steady_clock::now() - started : std::chrono::nanoseconds{});
  return res;
}

}  // namespace idem
