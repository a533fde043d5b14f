#pragma once
/// @file guard/batch.hpp What IdempotencyGuard::run_batch takes and returns.

#include <cstddef>
#include <exception>
#include <string_view>
#include <vector>

#include "idem/core/error.hpp"
#include "idem/core/outcome.hpp"

namespace idem {

/// One message of a polled batch. Views: they must outlive the run_batch call.
struct BatchItem {
  std::string_view key;      ///< its idempotency key
  std::string_view payload;  ///< fingerprinted when not empty (as run(key, payload, handler))
};

/// How run_batch treats the items after a handler throws.
struct BatchOptions {
  /// false (default): the item's failure is recorded per the failure policy and the batch goes on.
  /// true: the items after it that were acquired are released without running (in_flight,
  /// retry_after 0: redeliver them), as a consumer that stops at the first error wants.
  bool stop_at_first_error = false;
};

/// The result of run_batch: one outcome per item, in input order, and what to tell the broker.
template <class T>
struct BatchOutcome {
  /// One per item; meaningful where errors[i] is null.
  std::vector<Outcome<T>> outcomes;
  /// One per item: what its handler threw (after its failure was recorded per the policy), or a
  /// store error for that item (its completion could not be confirmed); null when it has an outcome.
  std::vector<std::exception_ptr> errors;

  /// The broker action for item i: its outcome's, or for an error: requeue, except the errors that
  /// say otherwise (result_not_stored_error: the effect ran and will not run again, ack;
  /// invalid_key_error: no redelivery can help, dead-letter).
  [[nodiscard]] BrokerAction action(std::size_t i) const {
    return errors[i] ? action_of(errors[i]) : outcomes[i].action();
  }
  /// How many leading items are settled (action ack or dead_letter): a consumer with offsets
  /// (Kafka) may commit up to there once it has dead-lettered those that ask for it.
  [[nodiscard]] std::size_t settled_prefix() const {
    std::size_t n = 0;
    while (n < outcomes.size() && action(n) != BrokerAction::requeue) ++n;
    return n;
  }
  /// The items to redeliver (action requeue), in order: SQS's batchItemFailures.
  [[nodiscard]] std::vector<std::size_t> to_retry() const {
    std::vector<std::size_t> out;
    for (std::size_t i = 0; i < outcomes.size(); ++i)
      if (action(i) == BrokerAction::requeue) out.push_back(i);
    return out;
  }
  /// The number of items whose handler ran in this call.
  [[nodiscard]] std::size_t executed() const {
    std::size_t n = 0;
    for (std::size_t i = 0; i < outcomes.size(); ++i) n += !errors[i] && outcomes[i].status == Status::executed;
    return n;
  }
};

}  // namespace idem
