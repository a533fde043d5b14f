#pragma once
/// @file error.hpp The exception family: every error idem's libraries throw derives from idem::error
/// (std::bad_alloc aside); an exception a handler throws reaches the caller as it was thrown.

#include <stdexcept>
#include <string>
#include <utility>

namespace idem {

class error;
namespace detail {
inline void mark_from_handler(error& e) noexcept;
}  // namespace detail

/// Root of every exception idem throws; retryable() says whether trying again later can help.
class error : public std::runtime_error {
public:
  /// Builds an error with a message and whether a later retry can succeed.
  error(const std::string& what, bool retryable) : std::runtime_error(what), retryable_(retryable) {}
  /// True when the same call may succeed later (store down, timeout); false for caller bugs.
  [[nodiscard]] bool retryable() const noexcept { return retryable_; }
  /// True when the guard's handler threw this error itself (say a store_error from ctx.tx->exec):
  /// it is the handler's error, the guard's own store calls did not fail.
  [[nodiscard]] bool from_handler() const noexcept { return from_handler_; }

private:
  friend void detail::mark_from_handler(error& e) noexcept;
  bool retryable_;
  bool from_handler_ = false;
};

namespace detail {
/// The guard marks an idem error its handler threw before rethrowing that same object.
inline void mark_from_handler(error& e) noexcept { e.from_handler_ = true; }
}  // namespace detail

/// Caller mistake (bad key, bad option, bad URL, unsafe identifier): fix the call, do not retry.
class usage_error : public error {
public:
  /// Builds a usage error whose message says what to change.
  explicit usage_error(const std::string& what) : error(what, false) {}
};

/// The idempotency key is empty or longer than the configured limit.
class invalid_key_error : public usage_error {
public:
  using usage_error::usage_error;
};

/// An options struct holds a value that cannot work (zero lease, retention below lease, ...).
class invalid_options_error : public usage_error {
public:
  using usage_error::usage_error;
};

/// The store failed or could not be reached; the handler did not run and nothing was changed
/// blindly. code() carries the store's own code (SQLSTATE, Redis error prefix) when there is one.
class store_error : public error {
public:
  /// Builds a store error; code is the store's own error code or empty.
  store_error(const std::string& what, std::string code = {}, bool retryable = true)
      : error(what, retryable), code_(std::move(code)) {}
  /// The store's own error code (SQLSTATE such as "40001", Redis prefix such as "OOM"), or "".
  [[nodiscard]] const std::string& code() const noexcept { return code_; }

private:
  std::string code_;
};

/// The store could not be reached or the connection broke; retry later.
class connection_error : public store_error {
public:
  using store_error::store_error;
};

/// A store call exceeded its timeout; its effect is unknown, so the guard never treats it as done.
class timeout_error : public store_error {
public:
  using store_error::store_error;
};

/// The store is full (MemoryStore record bound, Redis OOM under noeviction); retry after purge.
class capacity_error : public store_error {
public:
  using store_error::store_error;
};

/// A write's reply was lost and asking again as the same holder could not settle it (or the
/// connection was lost during COMMIT): it may or may not have happened. Never retried blindly (the
/// model is libpqxx's in_doubt_error). retryable() is true only where a redelivery is safe
/// whatever happened: an in-doubt acquire (the handler did not run; the key frees itself after
/// the lease); a completion or commit in doubt is not retryable: reconcile (inspect) first.
class outcome_unknown_error : public store_error {
public:
  /// Builds an in-doubt error, not retryable unless said so.
  explicit outcome_unknown_error(const std::string& what, std::string code = {}, bool retryable = false)
      : store_error(what, std::move(code), retryable) {}
};

/// A write the primary made was acknowledged by fewer replicas than asked (min_replica_acks)
/// within the wait: a failover now could lose it. Retryable: an acquire not acknowledged ran no
/// handler (its claim lapses after the lease); a completion not acknowledged is reported so the
/// message is not acked, and its redelivery finds the record (a duplicate) or, if the failover
/// lost it, runs again after the lease (docs/guarantees.md).
class durability_error : public store_error {
public:
  /// Builds the error; `acks` replicas answered of the `wanted`.
  durability_error(const std::string& what, int acks, int wanted)
      : store_error(what, "WAIT", true), acks_(acks), wanted_(wanted) {}
  /// Replicas that acknowledged the write within the wait.
  [[nodiscard]] int acks() const noexcept { return acks_; }
  /// Replicas that were asked for (min_replica_acks).
  [[nodiscard]] int wanted() const noexcept { return wanted_; }

private:
  int acks_;
  int wanted_;
};

/// A stored record (or stored result) cannot be decoded; never reported as a duplicate.
class corrupt_record_error : public error {
public:
  /// Builds a corrupt-record error naming what could not be read.
  explicit corrupt_record_error(const std::string& what) : error(what, false) {}
};

/// The handler ran but its result could not be stored (over the store's limit, or the codec
/// could not encode it): the key was completed without it, so the effect never runs again, and
/// later deliveries answer duplicate with result_unavailable. Not retryable: ack the message.
class result_not_stored_error : public error {
public:
  /// Builds the error; the message says why the result was not stored.
  explicit result_not_stored_error(const std::string& what) : error(what, false) {}
};

/// A result codec failed to encode or decode a value.
class codec_error : public error {
public:
  /// Builds a codec error; the message names the type and the reason.
  explicit codec_error(const std::string& what) : error(what, false) {}
};

}  // namespace idem
