#pragma once
/// @file core/pool_options.hpp PoolOptions: the connection pool every backend client uses, with
/// one meaning per field whatever the backend.

#include <chrono>
#include <cstddef>

#include "idem/core/record.hpp"

namespace idem {

/**
 * How a backend client (Redis, PostgreSQL) pools its connections. The pool opens connections on
 * demand up to `size`, keeps them open between calls, and checks an idle one before reusing it:
 * a connection the server closed while it sat idle (restart, idle timeout, `CLIENT KILL`) is
 * replaced before a request is sent on it, so a server restart costs no failed call.
 *
 * A call that finds every connection busy waits up to `wait` for one, then throws
 * idem::timeout_error with code() "POOL" (retryable: the pool is busy, not broken). Size the pool
 * to the threads that call the store at once (plus the guard's lease keeper when heartbeat is on).
 */
struct PoolOptions {
  /// Most connections open at once; > 0. Each in-flight call (or open transaction) holds one.
  std::size_t size = 8;
  /// How long a call waits for a free connection when all `size` are busy; 0 = do not wait (fail
  /// at once); >= 0.
  millis wait{1'000};
};

}  // namespace idem
