#pragma once
/// @file guard/sequence_phase.hpp The sequence phase of a run, decided once: stale, gap, how the
/// advance joins the completion, and what the outcome says about the entity. Not part of idem's API.
///
/// SequenceGate's drivers (run, run_batch, run_async, and the transactional run through
/// run_sequenced) read the entity's last applied sequence, feed it here, run the guard's machine
/// when told to, and feed the advance's answer back. Like RunMachine, this never calls a store:
/// the step tests (tests/core/run_machine_test.cpp) drive it with scripted answers.

#include <cstdint>
#include <optional>
#include <string_view>

#include <fmt/core.h>

#include "idem/core/error.hpp"
#include "idem/core/hex.hpp"
#include "idem/core/outcome.hpp"
#include "idem/core/record.hpp"

namespace idem::detail {

/// How an event's advance joins its run.
enum class AdvanceWay : std::uint8_t {
  with_completion,  ///< the sequence store completes and advances in one atomic step (Redis)
  in_transaction,   ///< the advance runs first inside the claiming transaction (PostgreSQL transactional)
  after,            ///< the advance follows an executed or duplicate run (a duplicate repairs a missed one)
};

/// The rule of one gate: SequenceGateOptions without the vocabulary types.
struct SequenceRule {
  bool contiguous = false;
  std::uint64_t first = 1;
  millis gap_retry_after{1'000};
};

/// What to do after the entity's last applied sequence was read.
enum class SeqNext : std::uint8_t {
  claim,  ///< run the event through the guard (its advance per way())
  stale,  ///< done: Status::stale, no claim, no record
  gap,    ///< done: Status::in_flight with gap, retry_after = the rule's gap_retry_after, no record
  later,  ///< done (a batch): Status::in_flight, retry_after 0, no record: decided after an earlier event
};

/// What to do with the in-transaction advance's answer.
enum class TxNext : std::uint8_t {
  run_handler,  ///< advanced: run the handler in the same transaction
  stale,        ///< a newer event committed meanwhile: roll back, answer stale (stale_signal)
  raise,        ///< contiguous and the sequence moved under the event: raise changed_error()
};

/// The sequence decisions of one event. Not thread-safe: one driver steps it.
class SequencePhase {
public:
  /// An event at `seq` under `rule`, whose advance joins its run `way`.
  SequencePhase(const SequenceRule& rule, std::uint64_t seq, AdvanceWay way) noexcept
      : rule_(rule), seq_(seq), way_(way) {}

  /// How the advance joins the run.
  [[nodiscard]] AdvanceWay way() const noexcept { return way_; }

  /// The entity's last applied sequence (nullopt = none). Sequences never go down, so an event
  /// that is next here is next or stale later too.
  SeqNext on_last_applied(std::optional<std::uint64_t> last) noexcept {
    last_ = last;
    seen_ = last;
    if (last && seq_ <= *last) return SeqNext::stale;
    if (!rule_.contiguous) return SeqNext::claim;
    const std::uint64_t want = last ? *last + 1 : rule_.first;
    if (seq_ == want) return SeqNext::claim;
    if (!last && seq_ < rule_.first) return SeqNext::stale;  // a bad event, not a gap: it can never run
    gap_ = true;
    return SeqNext::gap;
  }

  /// A batch: an earlier event of the same entity in this batch claimed `earlier` (its run decides
  /// before this one's), after on_last_applied said anything but stale. This one runs only when it
  /// is newer and gaps are allowed; otherwise it is redelivered (in_flight, no record) and decided
  /// again once that one is applied or not.
  SeqNext behind_earlier(std::uint64_t earlier) noexcept {
    gap_ = false;
    if (seq_ > earlier && !rule_.contiguous) return SeqNext::claim;
    return SeqNext::later;
  }

  /// The in-transaction advance answered.
  TxNext on_tx_advance(bool advanced, std::optional<std::uint64_t> previous) noexcept {
    if (!advanced) {
      seen_ = previous;
      return TxNext::stale;
    }
    // Only an erase racing this event can open a gap after the first read: roll back, retry.
    if (rule_.contiguous && previous != last_) return TxNext::raise;
    advanced_ = true;
    seen_ = seq_;
    return TxNext::run_handler;
  }

  /// The error TxNext::raise stands for.
  [[nodiscard]] store_error changed_error(std::string_view entity) const {
    return store_error(fmt::format("idem: the sequence of entity '{}' changed under a contiguous event (erased "
                                   "meanwhile?); retry it",
                                   printable(entity)),
                       "", true);
  }

  /// The guard's run ended with `s`; `combined` when the completion already advanced (or not).
  /// True: ask the sequence store to advance now (way() == after, executed or duplicate).
  [[nodiscard]] bool advance_after(Status s, bool combined) const noexcept {
    if (way_ == AdvanceWay::in_transaction || combined) return false;
    return s == Status::executed || s == Status::duplicate;
  }

  /// The answer of the advance made with the completion or after the run.
  void on_advanced(bool advanced, std::optional<std::uint64_t> previous) noexcept {
    advanced_ = advanced;
    seen_ = advanced ? std::optional<std::uint64_t>(seq_) : previous;
  }

  /// The in-transaction run ended with `s` (executed commits the advance made in it).
  void on_tx_run(Status s) noexcept {
    if (s != Status::executed && s != Status::stale) {
      advanced_ = false;
      seen_ = last_;
    }
  }

  /// The entity's last applied sequence as this event saw it last (stale: the value that made it).
  [[nodiscard]] std::optional<std::uint64_t> last_applied() const noexcept { return seen_; }
  /// True when this event's advance was made (and, in a transaction, committed).
  [[nodiscard]] bool advanced() const noexcept { return advanced_; }
  /// True when the event is ahead of its entity in contiguous mode.
  [[nodiscard]] bool gap() const noexcept { return gap_; }
  /// The redelivery delay of a gap.
  [[nodiscard]] millis gap_retry_after() const noexcept { return rule_.gap_retry_after; }

private:
  SequenceRule rule_;
  std::uint64_t seq_;
  AdvanceWay way_;
  std::optional<std::uint64_t> last_, seen_;
  bool advanced_ = false, gap_ = false;
};

}  // namespace idem::detail
