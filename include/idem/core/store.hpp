#pragma once
/// @file store.hpp The StateStore concept every backend models, and the transactional extension.

#include <concepts>
#include <cstddef>
#include <optional>
#include <string_view>
#include <type_traits>

#include "idem/core/record.hpp"

namespace idem {

/**
 * A store that moves each key through the state machine of docs/guarantees.md atomically.
 *
 * Every member is one atomic step in the store; lease decisions use the store's clock; any
 * failure throws an idem::store_error (or corrupt_record_error) and never reports a decision it
 * did not make. Implementations must be safe to call from many threads at once.
 *
 * @code
 * idem::MemoryStore store;
 * auto r = store.acquire("order-42", {.lease = 5s, .retention = 24h, .token = 7});
 * if (r.status == idem::AcquireStatus::acquired) store.complete("order-42", r.holder, "ok", 24h);
 * @endcode
 */
template <class S>
concept StateStore = requires(S& s, std::string_view key, const AcquireParams& ap, const Holder& h,
                              std::string_view result, const FailParams& fp, millis d) {
  { s.acquire(key, ap) } -> std::same_as<AcquireResult>;
  { s.complete(key, h, result, d) } -> std::same_as<WriteStatus>;
  { s.fail(key, h, fp) } -> std::same_as<WriteStatus>;
  { s.extend(key, h, d) } -> std::same_as<WriteStatus>;
  { s.inspect(key) } -> std::same_as<std::optional<Record>>;
};

/// What a store can hold; SIZE_MAX = no limit of its own. The guard refuses options that exceed
/// it at construction and never hands the store a result over it.
struct StoreLimits {
  std::size_t max_key_bytes = static_cast<std::size_t>(-1);     ///< longest key the store takes
  std::size_t max_result_bytes = static_cast<std::size_t>(-1);  ///< longest encoded result it stores
};

/// A store that states its limits (`s.limits()`); stores without it are taken as unlimited.
template <class S>
concept HasStoreLimits = requires(const S& s) {
  { s.limits() } -> std::same_as<StoreLimits>;
};

/// A store that can complete a key without its result (`complete_unavailable`): holder-checked
/// like complete; the record becomes `completed` with `permanent` set and `error` = reason, and
/// every later acquire answers duplicate with `result_unavailable`. The guard uses it when an
/// effect ran but its result cannot be stored (too large, or the codec failed), so the effect is
/// never run again; a store without it gets a permanent failure instead.
template <class S>
concept CompletesUnavailable = requires(S& s, std::string_view key, const Holder& h, std::string_view reason, millis d) {
  { s.complete_unavailable(key, h, reason, d) } -> std::same_as<WriteStatus>;
};

namespace detail {
template <class S>
struct transaction_of {
  using type = void;
};
template <class S>
  requires requires { typename S::Transaction; }
struct transaction_of<S> {
  using type = typename S::Transaction;
};
}  // namespace detail

/// The transaction type of a TransactionalStore (`S::Transaction`), or void for other stores.
template <class S>
using transaction_t = typename detail::transaction_of<S>::type;

/**
 * A store whose acquire opens a transaction that the handler joins (PostgreSQL transactional
 * mode): the claim, the handler's own writes and the completion commit together or not at all.
 *
 * `s.begin(key, params)` returns a move-only `S::Transaction`; `tx.decision()` is the acquire
 * decision; when it is acquired, the guard runs the handler with `&tx` in the context and then
 * calls exactly one of `tx.commit(result, retention)` (records completed and commits; throws
 * outcome_unknown_error if the commit's fate is unknown) or `tx.fail(params)` (rolls back; under
 * the record policy writes the failure in a fresh transaction). Destroying an open transaction
 * rolls it back.
 */
template <class S>
concept TransactionalStore =
    !std::is_void_v<transaction_t<S>> &&
    requires(S& s, std::string_view key, const AcquireParams& ap, transaction_t<S>& tx, std::string_view result,
             const FailParams& fp, millis d) {
      { s.begin(key, ap) } -> std::same_as<transaction_t<S>>;
      { tx.decision() } -> std::convertible_to<const AcquireResult&>;
      { tx.commit(result, d) } -> std::same_as<WriteStatus>;
      { tx.fail(fp) } -> std::same_as<WriteStatus>;
    };

}  // namespace idem
