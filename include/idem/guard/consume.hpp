#pragma once
/// @file guard/consume.hpp One consumer loop for every broker: a `Source` (poll a batch, settle each
/// message with its verdict, release on shutdown) and `idem::consume`, which runs each polled batch
/// through IdempotencyGuard::run_batch and settles it with idem::verdict. docs/consuming.md.

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <ranges>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/detail/consume_loop.hpp"
#include "idem/guard/batch.hpp"
#include "idem/guard/guard.hpp"
#include "idem/guard/verdict.hpp"

namespace idem {

/// The header the outbox relay puts its message id in, on every broker: by default idem::consume
/// keys a message that carries it on its value.
inline constexpr std::string_view outbox_id_header = "idem-outbox-id";

/// One polled message as idem::consume and a handler see it, whatever the broker. Views into the
/// source's own message: valid while the batch is being handled.
struct Delivery {
  std::string id;            ///< the broker's position, for logs: offset, stream entry id, sequence
  std::string_view key;      ///< the message's own id (AMQP message-id, Kafka key, ...): the default key
  std::string_view payload;  ///< the body, binary-safe
  std::vector<std::pair<std::string_view, std::string_view>> headers;  ///< name, value; a repeated name repeats
  std::optional<std::chrono::system_clock::time_point> timestamp;     ///< when the broker has one
  std::uint32_t attempt = 1;  ///< which delivery this is (1 = the first), where the broker counts them

  /// The last value of header `name`, or nullopt.
  [[nodiscard]] std::optional<std::string_view> header(std::string_view name) const noexcept {
    std::optional<std::string_view> found;
    for (const auto& [k, v] : headers)
      if (k == name) found = v;
    return found;
  }
};

/**
 * A broker as idem::consume drives it: `poll()` returns the next batch (maybe empty after a wait),
 * `delivery(m)` shows one of its messages as a Delivery, `settle(verdicts)` applies verdicts[i] to
 * the batch's message i (ack, requeue after `delay`, dead-letter with `reason`), and `release()`
 * drops the batch unsettled (the broker redelivers it). NatsConsumer, StreamsConsumer and the
 * sources of your own brokers (examples/dir_source.hpp) model it. A source may also count its
 * backlog, `backlog()` returning SourceEvents: idem::consume reports them to the guard's observer.
 */
template <class S>
concept Source = requires(S& s, const typename S::message_type& m, std::span<const Verdict> verdicts) {
  { s.poll() } -> std::same_as<std::vector<typename S::message_type>>;
  { s.delivery(m) } -> std::convertible_to<Delivery>;
  s.settle(verdicts);
  s.release();
};

namespace detail {
// A source that counts its backlog (`backlog()`: SourceEvents, views valid until its next poll)
// reports it to the guard's observer after each round.
template <class S>
void report_backlog(S& source, Observer* observer) {
  if constexpr (requires { { source.backlog() } -> std::ranges::range; }) {
    if (!observer) return;
    for (const SourceEvent& e : source.backlog()) observer->on_source(e);
  }
}
}  // namespace detail

/// How idem::consume keys and answers messages.
struct ConsumeOptions {
  RetryPolicy retry;  ///< the requeue waits and when to give up (idem::verdict)
  /// The idempotency key of a delivery. Empty (default): the `idem-outbox-id` header when present,
  /// else Delivery::key. A message whose key is empty is dead-lettered (invalid_key_error).
  std::function<std::string(const Delivery&)> key_of;
  BatchOptions batch;  ///< run_batch's options (stop_at_first_error)
};

/// The idempotency key idem::consume uses for `d` under `options` (see ConsumeOptions::key_of).
inline std::string key_of(const Delivery& d, const ConsumeOptions& options = {}) {
  if (options.key_of) return options.key_of(d);
  if (const auto id = d.header(outbox_id_header)) return std::string(*id);
  return std::string(d.key);
}

/// What one idem::consume_batch call did.
struct ConsumeReport {
  std::size_t polled = 0;        ///< messages in the batch
  std::size_t executed = 0;      ///< handlers that ran and completed
  std::size_t acked = 0;         ///< verdicts ack
  std::size_t requeued = 0;      ///< verdicts requeue
  std::size_t dead_lettered = 0;  ///< verdicts dead_letter
};

/// One round: poll a batch from `source`, run it through `guard.run_batch` with
/// `handler(const Delivery&, const Context&)` (or `handler(const Delivery&)`), settle every
/// message with its idem::verdict. Throws what poll, run_batch (the acquisition) or settle throw,
/// after releasing the batch; a handler's exception is its message's verdict (requeue), never thrown.
template <Source S, StateStore Store, class F>
ConsumeReport consume_batch(S& source, IdempotencyGuard<Store>& guard, F& handler, const ConsumeOptions& options = {}) {
  using Ctx = typename IdempotencyGuard<Store>::context_type;
  constexpr bool takes_ctx = std::is_invocable_v<F&, const Delivery&, const Ctx&>;
  static_assert(takes_ctx || std::is_invocable_v<F&, const Delivery&>,
                "idem: the consume handler must be callable with (const idem::Delivery&) or with (const "
                "idem::Delivery&, const idem::Context&)");
  ConsumeReport report;
  const auto messages = source.poll();
  report.polled = messages.size();
  if (messages.empty()) {
    detail::report_backlog(source, guard.options().observer.get());
    return report;
  }
  try {
    std::vector<Delivery> deliveries;
    std::vector<std::string> keys;
    std::vector<BatchItem> items;
    deliveries.reserve(messages.size());
    keys.reserve(messages.size());
    items.reserve(messages.size());
    for (const auto& m : messages) {
      deliveries.push_back(source.delivery(m));
      keys.push_back(key_of(deliveries.back(), options));
    }
    for (std::size_t i = 0; i < messages.size(); ++i) items.push_back({.key = keys[i], .payload = deliveries[i].payload});
    auto each = [&](const BatchItem& item, const Ctx& ctx) -> decltype(auto) {
      const Delivery& d = deliveries[static_cast<std::size_t>(&item - items.data())];
      if constexpr (takes_ctx)
        return handler(d, ctx);
      else
        return handler(d);
    };
    auto ran = guard.run_batch(std::span<const BatchItem>(items), each, options.batch);
    std::vector<Verdict> verdicts;
    verdicts.reserve(messages.size());
    for (std::size_t i = 0; i < messages.size(); ++i) {
      const std::uint32_t attempt = deliveries[i].attempt;
      verdicts.push_back(ran.errors[i] ? verdict(ran.errors[i], options.retry, attempt)
                                       : verdict(ran.outcomes[i], options.retry, attempt));
      switch (verdicts.back().action) {
        case BrokerAction::ack: ++report.acked; break;
        case BrokerAction::requeue: ++report.requeued; break;
        case BrokerAction::dead_letter: ++report.dead_lettered; break;
      }
    }
    report.executed = ran.executed();
    source.settle(std::span<const Verdict>(verdicts));
  } catch (...) {
    source.release();  // nothing of the batch is settled: the broker redelivers it
    throw;
  }
  detail::report_backlog(source, guard.options().observer.get());
  return report;
}

/// Until `stop`: consume_batch over and over. A retryable error (the broker or the store down)
/// backs off (50 ms doubling to 1 s, jittered) and polls again; another (bad configuration, a
/// refused request) is thrown. Not thread-safe per source: run one loop per source.
template <Source S, StateStore Store, class F>
void consume(S& source, IdempotencyGuard<Store>& guard, std::stop_token stop, F handler, ConsumeOptions options = {}) {
  detail::check_retry(options.retry, "ConsumeOptions::retry");
  detail::consume_loop(stop, [&] { consume_batch(source, guard, handler, options); }, [] {});
}

}  // namespace idem
