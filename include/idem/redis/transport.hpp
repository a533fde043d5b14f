#pragma once
/// @file redis/transport.hpp What the Redis stores' one transport reports (AsyncRedisStats), and
/// the completion a request carries through it, compiled once for every caller's handler.

#include <cstdint>
#include <exception>

namespace idem {

/// What a Redis store's connections have done so far (each counter only grows).
struct AsyncRedisStats {
  std::uint64_t requests = 0;    ///< requests sent (scripts, and the handshake's)
  std::uint64_t writes = 0;      ///< socket writes that carried them: requests / writes is the pipelining
  std::uint64_t connects = 0;    ///< connections opened (the first, then one per reconnect)
  std::uint64_t resent = 0;      ///< requests whose reply was lost, sent again as the same holder
  std::uint64_t reloads = 0;     ///< NOSCRIPT answers that reloaded a script
  std::uint64_t coalesced = 0;   ///< steps sent inside one script call with other callers' (auto-batching)
  std::uint64_t health_checks = 0;    ///< PINGs sent on a connection idle for health_check_interval
  std::uint64_t health_failures = 0;  ///< of them, unanswered within command_timeout: the connection was dropped
};

namespace detail::asio_redis {

/// One request's completion, type-erased so the connection is compiled once (the .cpp) while the
/// handler stays whatever the caller's completion token made (callback, coroutine, future).
template <class T>
struct Done {
  virtual ~Done() = default;
  virtual void complete(std::exception_ptr e, T value) = 0;
  /// True for a caller blocked on the answer: its request may be written and read on its own thread.
  [[nodiscard]] virtual bool waits_here() const noexcept { return false; }
};

}  // namespace detail::asio_redis
}  // namespace idem
