#pragma once
// Internal to idem_redis: opening a connection to Redis, as coroutines on an event loop, so no
// connect needs a thread of its own: the socket (TCP or Unix, bounded by connect_timeout), TLS
// (TlsHandshake stepped by the loop, with the plain-text probe), the hello (hello_for,
// hello_accepted) and, in Sentinel mode, the sentinels asked for the master first (sentinel_hello,
// hello_refusal, parse_master_addr). The engine's
// connections open on their strand with it; a blocking caller (the construction's checks, a
// cluster node's CLUSTER SLOTS, Client::session) runs the same on a private loop.

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <utility>  // before Asio: Boost 1.74's awaitable.hpp uses std::exchange without it

#include <boost/asio/awaitable.hpp>
#include <boost/asio/generic/stream_protocol.hpp>

#include "client.hpp"

namespace idem::detail::redis {

using Socket = boost::asio::generic::stream_protocol::socket;

// A connection that may carry requests: the socket and, over TLS, its session (non-blocking: the
// loop waits for the socket, a blocked caller polls it).
struct Opened {
  Socket socket;
  std::unique_ptr<TlsSession> tls;
};

// A connection to `c`'s server (in Sentinel mode to the master the sentinels name now, its ROLE
// checked), TLS and the hello done. Throws what a failed connect is: connection_error (code "TLS",
// not retryable, for a TLS check; "ROLE" for a demoted master), timeout_error, or the hello's
// error reply mapped (AUTH refused). `c` outlives the coroutine.
boost::asio::awaitable<Opened> open_ready(const Client& c);

}  // namespace idem::detail::redis
