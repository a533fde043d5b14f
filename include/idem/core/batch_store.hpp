#pragma once
/// @file batch_store.hpp The batch extension of a StateStore: many acquisitions in one call, and
/// the writes of a batch sent as each handler ends, answered together.

#include <concepts>
#include <span>
#include <string_view>
#include <vector>

#include "idem/core/record.hpp"

namespace idem {

/// One key of a batch acquisition, with its own parameters (token, fingerprint, lease, ...).
struct AcquireRequest {
  std::string_view key;  ///< the idempotency key
  AcquireParams params;  ///< as for acquire(key, params)
};

/// One item of complete_batch (RedisStore, AsyncRedisStore): the key, the holder acquire returned, and the result.
struct CompleteItem {
  std::string_view key;    ///< the idempotency key
  Holder holder;           ///< the holder returned by acquire or acquire_batch
  std::string_view result; ///< encoded result to store
};

/**
 * The writes of one batch (IdempotencyGuard::run_batch): `complete` and `fail` return at once —
 * the request is on its way (or, for an in-process store, done) — and `finish()` waits for every
 * answer and returns them in the order the writes were made. A write whose answer is lost is
 * asked again once as the same holder, as the single calls do; what cannot be settled throws
 * from finish() (store_error, outcome_unknown_error). A writer may also say `broken()` (a write
 * could not be sent): run_batch then runs no more handlers, whose effects could not be recorded.
 * One batch, one thread: not thread-safe.
 */
template <class W>
concept BatchWriter = requires(W& w, std::string_view key, const Holder& h, std::string_view result,
                               const FailParams& fp, millis d) {
  w.complete(key, h, result, d);
  w.fail(key, h, fp);
  { w.finish() } -> std::same_as<std::vector<WriteStatus>>;
};

/// A store with a batch path: `acquire_many` decides every request (each exactly as acquire
/// would) in as few round trips as the store allows, answers in request order; `batch_writer()`
/// returns a BatchWriter. A store without it runs batches one call per item.
template <class S>
concept BatchStore = requires(S& s, std::span<const AcquireRequest> requests) {
  { s.acquire_many(requests) } -> std::same_as<std::vector<AcquireResult>>;
  { s.batch_writer() } -> BatchWriter;
};

}  // namespace idem
