#pragma once
/// @file kafka/processor.hpp Processor: what the Kafka consumer loop does with each message, decided through a guard.
// Guide: docs/consuming.md.

#include <fmt/core.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "idem/core/error.hpp"
#include "idem/core/fingerprint.hpp"
#include "idem/core/options.hpp"
#include "idem/core/outcome.hpp"
#include "idem/guard/batch.hpp"
#include "idem/guard/guard.hpp"
#include "idem/guard/verdict.hpp"

namespace idem::kafka {

/// One Kafka header: a name and a binary-safe value, views like the rest of a Message.
struct Header {
  std::string_view name;   ///< The header's name.
  std::string_view value;  ///< Its value, bytes as produced (a null value reads as empty).
};

/// Whose clock a message's timestamp is.
enum class TimestampType {
  create_time,      ///< The producer's (the topic's message.timestamp.type=CreateTime, Kafka's default).
  log_append_time,  ///< The broker's, when it appended the message (LogAppendTime).
};

/// A message's timestamp: milliseconds since the epoch, as Kafka keeps it, and its type.
struct Timestamp {
  std::chrono::system_clock::time_point time;       ///< When, to the millisecond.
  TimestampType type = TimestampType::create_time;  ///< Whose clock.
};

/// The header in which the outbox relay's KafkaPublisher sends the message id (docs/outbox.md).
inline constexpr std::string_view outbox_id_header = "idem-outbox-id";

/// One polled message as a handler sees it: views into the client's message, valid during the call.
struct Message {
  std::string_view topic;              ///< The topic's name.
  std::int32_t partition = 0;          ///< The partition number.
  std::int64_t offset = 0;             ///< The message's offset.
  std::string_view key;                ///< The Kafka message key (not the idempotency key).
  std::string_view value;              ///< The payload.
  std::span<const Header> headers;     ///< Its headers in the order produced; a name may repeat.
  std::optional<Timestamp> timestamp;  ///< Its timestamp; nullopt when the broker gave none.

  /// The value of the last header named `name` (Kafka's "last header wins"); nullopt when there is none.
  [[nodiscard]] std::optional<std::string_view> header(std::string_view name) const noexcept {
    for (auto it = headers.rbegin(); it != headers.rend(); ++it)
      if (it->name == name) return it->value;
    return std::nullopt;
  }
};

/// The default idempotency key of guarded(guard, handler): the header `idem-outbox-id`, else none.
// A message without the header gets the empty key: the guard refuses it (invalid_key_error) and it
// is dead-lettered, never run under a guessed key (its coordinates change when it is re-published).
struct OutboxIdKey {
  /// The last `idem-outbox-id` header's value; "" when the message has none.
  std::string operator()(const Message& m) const {
    const auto id = m.header(outbox_id_header);
    return id ? std::string(*id) : std::string();
  }
};

/// A key function: the header `idem-outbox-id` when the message carries one, else `fallback(m)`.
template <class Fallback>
auto outbox_id_or(Fallback fallback) {
  return [fallback = std::move(fallback)](const Message& m) -> std::string {
    if (const auto id = m.header(outbox_id_header)) return std::string(*id);
    return std::string(fallback(m));
  };
}

/// What the consumer loop does with one message.
struct Verdict {
  /// ack: settle it; requeue: seek back to it; dead_letter: write it aside, then settle.
  BrokerAction action = BrokerAction::ack;
  std::optional<Status> status;  ///< The guard's answer, when the run produced one.
  bool handler_failed = false;   ///< The handler threw (the guard recorded it per its failure policy).
  millis retry_after{0};         ///< requeue: how long its partition waits before the seek back.
  std::string reason;            ///< dead_letter: why (sent as a header); requeue: the error, for logs.
  std::string dead_letter_key;   ///< dead_letter: the key its write is made once under.
};

/// The answer of Processor::dead_letter.
struct DeadLetterResult {
  bool written = false;   ///< The dead letter exists: settle the message.
  bool earlier = false;   ///< written: by an earlier delivery, not by this call.
  millis retry_after{0};  ///< Not written: how long before the message is tried again.
  std::string error;      ///< Not written: why, for logs.
};

/// The loop's view of the guard, type-erased so that the loop (librdkafka side) is compiled once.
class Processor {
 public:
  /// Polymorphic base.
  virtual ~Processor() = default;
  /// Runs a batch of one partition's messages in offset order; writes one verdict per message.
  virtual void process(std::span<const Message> batch, std::span<Verdict> verdicts) = 0;
  /// Runs `write` at most once per key across redeliveries; never throws.
  virtual DeadLetterResult dead_letter(const std::string& key, const std::function<void()>& write) = 0;
};

/// Guard options fit for a Kafka consumer: FailureMode::record, so a poison message ends in the dead-letter topic.
inline GuardOptions consumer_guard_options() {
  // release would free the key after every failure: Kafka redelivers the poison message at once,
  // and since nothing after it in its partition may be committed, the partition stops for good.
  GuardOptions o;
  o.lease = std::chrono::seconds{30};
  o.retention = std::chrono::hours{24 * 7};
  o.failure = {.mode = FailureMode::record, .max_attempts = 3, .backoff = millis{1'000}, .max_backoff = millis{60'000}};
  return o;
}

/// How a GuardedProcessor runs messages.
struct GuardedOptions {
  /// A key reused with another payload answers mismatch (dead-lettered) instead of duplicate.
  bool fingerprint = true;
  /// Accept a guard with FailureMode::release, whose poison messages are retried for ever.
  bool allow_release = false;
  /// How long a requeued message's partition waits before the seek back (idem::verdict).
  RetryPolicy retry;
};

/// A Processor over a guard: key_of(message) is the idempotency key, handler(message[, ctx]) the effect.
// guarded(guard, handler) keys on the outbox id (OutboxIdKey); guarded(guard, key_of, handler) on
// key_of alone; outbox_id_or(key_of) on the outbox id when there is one, else on key_of.
template <class Store, class KeyOf, class Handler>
class GuardedProcessor final : public Processor {
 public:
  /// Refuses a guard with FailureMode::release (invalid_options_error) unless options.allow_release.
  GuardedProcessor(IdempotencyGuard<Store>& guard, KeyOf key_of, Handler handler, GuardedOptions options = {})
      : guard_(checked(guard, options)),
        dlq_guard_(guard.store(), dead_letter_options(guard.options())),
        key_of_(std::move(key_of)),
        handler_(std::move(handler)),
        fingerprint_(options.fingerprint),
        retry_((detail::check_retry(options.retry, "kafka::GuardedOptions::retry"), options.retry)) {}

  /// guard.run_batch over the batch; a verdict per message.
  void process(std::span<const Message> batch, std::span<Verdict> verdicts) override {
    std::vector<std::string> keys;
    keys.reserve(batch.size());
    std::vector<BatchItem> items;
    items.reserve(batch.size());
    for (const Message& m : batch) {
      // A message whose key cannot be read gets an empty key: the guard refuses it with
      // invalid_key_error, whose action is dead_letter.
      try {
        keys.push_back(key_of_(m));
      } catch (const std::exception&) {
        keys.emplace_back();
      }
      items.push_back({keys.back(), fingerprint_ ? m.value : std::string_view{}});
    }
    try {
      auto res = guard_.run_batch(items, [&](const BatchItem& item, const auto& ctx) {
        const Message& m = batch[static_cast<std::size_t>(&item - items.data())];
        if constexpr (std::is_invocable_v<Handler&, const Message&, decltype(ctx)>)
          return handler_(m, ctx);
        else
          return handler_(m);
      });
      for (std::size_t i = 0; i < batch.size(); ++i) {
        verdicts[i] =
            res.errors[i] ? from_error(res.errors[i], batch[i]) : from_outcome(res.outcomes[i], batch[i], keys[i]);
      }
    } catch (...) {
      // The batch's acquisition failed: nothing ran, every message is retried.
      const auto e = std::current_exception();
      for (std::size_t i = 0; i < batch.size(); ++i) verdicts[i] = from_error(e, batch[i]);
    }
  }

  /// `write` run through a second guard under "dlq:" + key, which releases the key when it fails.
  DeadLetterResult dead_letter(const std::string& key, const std::function<void()>& write) override {
    try {
      const auto out = dlq_guard_.run("dlq:" + key, write);
      const idem::Verdict v = idem::verdict(out, retry_);
      switch (v.action) {
        case BrokerAction::ack:
          return {.written = true, .earlier = out.status == Status::duplicate};
        case BrokerAction::requeue:  // another consumer is writing it right now
          return {.retry_after = v.delay, .error = "being written by another consumer"};
        case BrokerAction::dead_letter:
          break;
      }
      // The letter's own key failed for good: to the policy, a store error no retry helps soon.
      const idem::Verdict stuck = idem::verdict(
          std::make_exception_ptr(store_error(
              fmt::format("idem: the dead letter's own key failed for good ({}): {}", to_string(out.status), v.reason),
              "", false)),
          retry_);
      return {.retry_after = stuck.delay, .error = stuck.reason};
    } catch (const std::exception& e) {
      // The write failed (its key was released: see dead_letter_options) or the store did.
      return {.retry_after = verdict(std::current_exception(), retry_).delay, .error = e.what()};
    }
  }

 private:
  // Kafka retries a failed message in place: with release it fails again at once, for ever, and
  // nothing after it in its partition is committed; record ends it in the dead-letter topic.
  static IdempotencyGuard<Store>& checked(IdempotencyGuard<Store>& guard, const GuardedOptions& options) {
    if (guard.options().failure.mode == FailureMode::release && !options.allow_release)
      throw invalid_options_error(
          "kafka::GuardedProcessor: the guard's FailureMode::release retries a poison message for ever and holds "
          "its partition's commits back; use FailureMode::record (consumer_guard_options()), or "
          "GuardedOptions::allow_release (docs/consuming.md)");
    return guard;
  }

  // A failed dead-letter write must free its key at once so that the retry writes it; the
  // consumer's record policy would answer in_flight, then previously_failed: a letter never written.
  static GuardOptions dead_letter_options(GuardOptions o) {
    o.failure = {.mode = FailureMode::release};
    return o;
  }

  static std::string coordinates(const Message& m) { return fmt::format("{}/{}@{}", m.topic, m.partition, m.offset); }

  static Verdict of(idem::Verdict v) {
    return {.action = v.action, .status = v.status, .handler_failed = v.handler_failed, .retry_after = v.delay,
            .reason = std::move(v.reason)};
  }

  template <class Out>
  Verdict from_outcome(const Out& out, const Message& m, const std::string& key) const {
    Verdict v = of(verdict(out, retry_));
    // Keyed on the payload too: each distinct payload reusing a key is its own dead letter.
    if (v.action == BrokerAction::dead_letter) v.dead_letter_key = key + ":" + fingerprint(m.value);
    return v;
  }

  Verdict from_error(const std::exception_ptr& e, const Message& m) const {
    Verdict v = of(verdict(e, retry_));
    // No redelivery can help (a bad key): keyed on where the message is, as it has no usable key.
    if (v.action == BrokerAction::dead_letter) v.dead_letter_key = coordinates(m);
    return v;
  }

  IdempotencyGuard<Store>& guard_;
  IdempotencyGuard<Store> dlq_guard_;  // same store, its own failure policy
  KeyOf key_of_;
  Handler handler_;
  bool fingerprint_;
  RetryPolicy retry_;
};

/// Builds a GuardedProcessor, deducing its types; `key_of` is the whole key (no header is read for it).
template <class Store, class KeyOf, class Handler>
  requires(!std::is_same_v<std::remove_cvref_t<Handler>, GuardedOptions>)
GuardedProcessor<Store, KeyOf, Handler> guarded(IdempotencyGuard<Store>& guard, KeyOf key_of, Handler handler,
                                                GuardedOptions options = {}) {
  return {guard, std::move(key_of), std::move(handler), options};
}

/// Builds a GuardedProcessor keyed by OutboxIdKey: the header `idem-outbox-id` that the outbox
/// relay's KafkaPublisher writes; a message without it is dead-lettered (no usable key).
template <class Store, class Handler>
GuardedProcessor<Store, OutboxIdKey, Handler> guarded(IdempotencyGuard<Store>& guard, Handler handler,
                                                      GuardedOptions options = {}) {
  return {guard, OutboxIdKey{}, std::move(handler), options};
}

}  // namespace idem::kafka
