#pragma once
/// @file guard/batch_run.hpp IdempotencyGuard::run_batch (declared in guard.hpp, which includes
/// this file at its end). docs/batches.md explains the semantics.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "idem/guard/guard.hpp"

namespace idem {

template <StateStore Store>
template <class F>
auto IdempotencyGuard<Store>::run_batch(std::span<const BatchItem> items, F&& handler, BatchOptions batch) {
  static_assert(batch_takes_context<F> || std::is_invocable_v<F&, const BatchItem&>,
                "idem: a batch handler must be callable with (const idem::BatchItem&) or with "
                "(const idem::BatchItem&, const idem::Context&)");
  using R = std::decay_t<typename batch_result_of<F>::type>;
  static_assert(std::is_void_v<R> || Encodable<R>,
                "idem: the handler's result type needs an idem::codec<T> specialisation (see codec.hpp)");
  const std::size_t n = items.size();
  const auto started = std::chrono::steady_clock::now();
  if (options_.observer) options_.observer->on_batch(n);

  BatchOutcome<R> res;
  res.outcomes.resize(n);
  res.errors.resize(n);
  // A bad key is that item's error (dead-letter it), not the batch's: the others still run.
  std::vector<bool> bad(n, false);
  for (std::size_t i = 0; i < n; ++i) try {
      detail::check_key(items[i].key, options_.max_key_bytes);
    } catch (const invalid_key_error&) {
      res.errors[i] = std::current_exception();
      bad[i] = true;
    }
  std::vector<std::string> fps(n);
  for (std::size_t i = 0; i < n; ++i)
    if (!items[i].payload.empty()) fps[i] = fingerprint(items[i].payload);

  // A key seen before in this batch is settled by its first item (below, at the end).
  constexpr std::size_t none = static_cast<std::size_t>(-1);
  std::vector<std::size_t> first_of(n, none);
  {
    // By (hash, position), not through a hash map: no allocation per item. Equal keys have equal
    // hashes, and within a hash the lowest position comes first: that is the first occurrence.
    std::vector<std::pair<std::size_t, std::size_t>> by_hash;
    by_hash.reserve(n);
    for (std::size_t i = 0; i < n; ++i)
      if (!bad[i]) by_hash.emplace_back(std::hash<std::string_view>{}(items[i].key), i);
    std::sort(by_hash.begin(), by_hash.end());
    for (std::size_t b = 0, e = 0; b < by_hash.size(); b = e) {
      for (e = b + 1; e < by_hash.size() && by_hash[e].first == by_hash[b].first;) ++e;
      for (std::size_t k = b + 1; k < e; ++k)
        for (std::size_t j = b; j < k; ++j) {
          const std::size_t at = by_hash[j].second, i = by_hash[k].second;
          if (first_of[at] == none && items[at].key == items[i].key) {
            first_of[i] = at;
            break;
          }
        }
    }
  }
  auto for_item = [&](std::size_t i) {
    return [&handler, &item = items[i]](const context_type& ctx) -> decltype(auto) {
      if constexpr (batch_takes_context<F>)
        return std::invoke(handler, item, ctx);
      else
        return std::invoke(handler, item);
    };
  };
  // The single-run path for one item, every error kept for that item.
  auto run_one = [&](std::size_t i) {
    auto one = for_item(i);
    std::nullptr_t store_completes = nullptr;
    try {
      res.outcomes[i] = decide<R>(items[i].key, fps[i], one, store_completes);
    } catch (...) {
      res.errors[i] = std::current_exception();
    }
  };

  std::vector<std::size_t> todo;  // first occurrences the cache did not answer
  for (std::size_t i = 0; i < n; ++i) {
    if (first_of[i] != none || bad[i]) continue;
    if (cache_) {
      if (auto hit = cache_->get(items[i].key)) {
        Outcome<R>& out = res.outcomes[i];
        if (!fps[i].empty() && !hit->fingerprint.empty() && fps[i] != hit->fingerprint) {
          out.status = Status::mismatch;
        } else {
          out.status = Status::duplicate;
          try {
            out.value = detail::decode_result<R>(items[i].key, hit->result);
            out.from_cache = true;
          } catch (...) {
            res.errors[i] = std::current_exception();
          }
        }
        continue;
      }
    }
    todo.push_back(i);
  }

  bool transactional = false;
  if constexpr (TransactionalStore<Store>) transactional = use_transactions();
  if (transactional || !BatchStore<Store>) {
    // One transaction per item (the handler's writes commit with its record), or a store without
    // a batch path: the items one by one, exactly as run() takes them.
    bool stopped = false;
    for (std::size_t i : todo) {
      if (stopped) {
        res.outcomes[i].status = Status::in_flight;  // not tried: redeliver
        continue;
      }
      run_one(i);
      stopped = batch.stop_at_first_error && res.errors[i] != nullptr;
    }
  } else if constexpr (BatchStore<Store>) {
    // Every acquisition in one call.
    std::vector<AcquireRequest> requests(todo.size());
    for (std::size_t k = 0; k < todo.size(); ++k) {
      AcquireParams& ap = requests[k].params;
      requests[k].key = items[todo[k]].key;
      ap.fingerprint = fps[todo[k]];
      ap.lease = options_.lease;
      ap.retention = options_.retention;
      ap.owner = options_.owner;
      ap.token = detail::random_token();
    }
    std::vector<AcquireResult> acquired;
    try {
      acquired = store_->acquire_many(requests);
    } catch (const outcome_unknown_error& e) {
      if (e.retryable()) throw;
      // As for one acquire: no handler ran, whatever was taken frees itself after the lease.
      throw outcome_unknown_error(std::string(e.what()) + "; no handler ran: redeliver the batch (the keys free "
                                  "themselves after the lease)", e.code(), true);
    }
    // The claims are kept alive (heartbeat) from now until each one's completion is sent: items
    // wait for the handlers before them.
    std::vector<std::stop_source> stops;
    stops.reserve(todo.size());
    std::vector<std::optional<typename detail::LeaseKeeper<Store>::Registration>> kept(todo.size());
    for (std::size_t k = 0; k < todo.size(); ++k) {
      stops.emplace_back(options_.heartbeat ? std::stop_source{} : std::stop_source{std::nostopstate});
      if (acquired[k].status == AcquireStatus::acquired)
        kept[k].emplace(keeper_.get(), items[todo[k]].key, acquired[k].holder, stops[k]);
    }
    auto writer = store_->batch_writer();
    enum class Write { completed, failed };
    struct Sent {
      std::size_t item;
      Write kind;
      std::string encoded;  // completed: for the cache
    };
    std::vector<Sent> sent;
    std::vector<std::size_t> waiting;  // in_flight answers to poll as run() would
    bool stopped = false;
    for (std::size_t k = 0; k < todo.size(); ++k) {
      const std::size_t i = todo[k];
      const AcquireResult& ar = acquired[k];
      const std::string_view key = items[i].key;
      Outcome<R>& out = res.outcomes[i];
      if (ar.status != AcquireStatus::acquired) {
        out = not_acquired<R>(key, fps[i], ar);
        if (ar.status == AcquireStatus::in_flight && options_.wait_for_in_flight > millis{0}) waiting.push_back(i);
        continue;
      }
      // The store stopped taking the batch's writes (the connection broke): a handler run now
      // could not be recorded, and its effect would run again after the lease. The rest are left
      // unrun; their claims lapse after the lease and the redelivery takes them.
      if constexpr (requires { writer.broken(); }) {
        if (writer.broken()) {
          kept[k].reset();
          out.status = Status::in_flight;
          out.retry_after = options_.lease;
          continue;
        }
      }
      if (stopped) {
        // Stop at the first error: released without counting a failure, redelivered later.
        kept[k].reset();
        writer.fail(key, ar.holder, detail::stale_release(options_.retention));
        sent.push_back({i, Write::failed, {}});
        out.status = Status::in_flight;
        continue;
      }
      context_type ctx{};
      begin_run(ctx, out, key, ar, stops[k]);
      auto one = for_item(i);
      try {
        run_handler<R>(one, ctx, out);
      } catch (...) {
        kept[k].reset();
        res.errors[i] = std::current_exception();
        record_failure(key, ar.attempts, res.errors[i], [&](const FailParams& f) {
          writer.fail(key, ar.holder, f);
          sent.push_back({i, Write::failed, {}});
        });
        stopped = batch.stop_at_first_error;
        continue;
      }
      kept[k].reset();
      std::string encoded;
      if (auto why = encode_for_store<R>(out, encoded)) {
        // Rare: settled at once, with the single call (the effect ran; it must not run again).
        try {
          WriteStatus ws;
          if constexpr (CompletesUnavailable<Store>)
            ws = store_->complete_unavailable(key, ar.holder, *why, options_.retention);
          else
            ws = store_->fail(key, ar.holder, unstorable_failure(*why));
          if (ws == WriteStatus::lease_lost) {
            out.status = Status::lease_lost;
            continue;
          }
          throw result_not_stored_error("idem: the result of key '" + detail::printable(key) +
                                        "' was not stored: " + *why +
                                        "; the key is completed without it and will not run again");
        } catch (...) {
          res.errors[i] = std::current_exception();
        }
        continue;
      }
      // Sent now, answered with the others: no completion waits for the rest of the batch.
      writer.complete(key, ar.holder, encoded, options_.retention);
      sent.push_back({i, Write::completed, std::move(encoded)});
    }
    try {
      const std::vector<WriteStatus> statuses = writer.finish();
      for (std::size_t w = 0; w < sent.size() && w < statuses.size(); ++w) {
        if (sent[w].kind != Write::completed) continue;
        finish_run(items[sent[w].item].key, fps[sent[w].item], statuses[w], sent[w].encoded, res.outcomes[sent[w].item]);
      }
    } catch (...) {
      // Not one completion of the batch is confirmed: each is reported (not acked), as run()
      // reports a completion that failed. The failures keep their handler's exception.
      const std::exception_ptr e = std::current_exception();
      for (const Sent& s : sent)
        if (s.kind == Write::completed) res.errors[s.item] = e;
      if (options_.observer) {
        try {
          std::rethrow_exception(e);
        } catch (const std::exception& x) {
          options_.observer->on_store_error(items[sent.empty() ? 0 : sent.front().item].key, x);
        } catch (...) {
        }
      }
    }
    for (std::size_t i : waiting) run_one(i);  // in_flight: polled as run() polls, one by one
  }

  // Repeats of a key: the first item settled it. A run there is a duplicate here; a different
  // payload is a mismatch, as run() would answer; an error there is a redelivery here (the error
  // is reported once, on the first).
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t f = first_of[i];
    if (f == none) continue;
    Outcome<R>& out = res.outcomes[i];
    if (!fps[i].empty() && !fps[f].empty() && fps[i] != fps[f]) {
      out = Outcome<R>{};
      out.status = Status::mismatch;
    } else if (res.errors[f]) {
      out = Outcome<R>{};
      out.status = Status::in_flight;
    } else {
      out = res.outcomes[f];
      if (out.status == Status::executed) out.status = Status::duplicate;
    }
  }
  if (options_.observer) {
    const auto took = std::chrono::steady_clock::now() - started;
    for (std::size_t i = 0; i < n; ++i)
      if (!res.errors[i])
        options_.observer->on_outcome(OutcomeEvent{items[i].key, res.outcomes[i].status, took, res.outcomes[i].attempt,
                                                   res.outcomes[i].takeover, res.outcomes[i].from_cache});
  }
  return res;
}

}  // namespace idem
