#pragma once
// Internal to idem_redis: TLS for the Redis client on OpenSSL, since Debian's hiredis 0.14 has
// none (hiredis only parses the replies). Tls is the context one client builds from
// RedisTlsOptions (every file loaded and checked then, so a bad one fails at construction),
// TlsHandshake the client handshake stepped by the opening's loop (opening.cpp), TlsSession the
// session of one connection on its socket.
// Errors: a check that failed (certificate, host name, protocol, a plain-text server) is a
// connection_error with code "TLS", not retryable; a socket that failed is an ordinary,
// retryable connection_error, and a handshake that ran out of connect_timeout a timeout_error.
// A plain-text Redis given a ClientHello answers an error (seen at once as not TLS), closes, or
// waits for a newline: the handshake asks its caller's probe early rather than wait that out.

#include <algorithm>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "idem/core/record.hpp"
#include "idem/redis/options.hpp"

struct ssl_st;
struct ssl_ctx_st;

namespace idem::detail::redis {

class TlsSession;
class TlsHandshake;

class Tls {
public:
  // Throws invalid_options_error naming the field (tls.ca_file, tls.cert_file, ...) it cannot use.
  explicit Tls(const RedisTlsOptions& o);
  ~Tls();
  Tls(const Tls&) = delete;
  Tls& operator=(const Tls&) = delete;

  // How long a silent handshake waits before the probe: a TLS server answers a ClientHello within
  // a round trip, and the probe costs a connection the TLS server refuses (and may log).
  static millis probe_delay(millis timeout) noexcept { return std::min(timeout / 4, millis{250}); }

private:
  friend class TlsHandshake;
  ssl_ctx_st* ctx_ = nullptr;
  std::string server_name_;
  bool verify_hostname_ = true;
  bool has_cert_ = false;
};

// The refusal of a port that does not speak TLS (connection_error "TLS", not retryable): `evidence`
// says what showed it, the message what to use instead.
[[noreturn]] void throw_plain_text_port(const std::string& at, const char* role, std::string_view evidence,
                                        bool certain);

class TlsSession {
public:
  ~TlsSession();
  TlsSession(const TlsSession&) = delete;
  TlsSession& operator=(const TlsSession&) = delete;

  // Writes until all of `data` went out or an error: the bytes written in whole TLS records (a
  // record cut short cannot be decrypted, so the server never sees its bytes). errno is set as
  // send(2) would set it (EAGAIN: the socket is full, wait until it is writable).
  std::size_t write(std::string_view data) noexcept;
  // Up to n decrypted bytes; 0 when the server closed the session; -1 on an error, with errno
  // (EAGAIN: nothing to read yet, wait until the socket is readable) and failure() saying what happened.
  long read(char* buf, std::size_t n) noexcept;
  // An idle session has no data to read: true when nothing is readable, or only records that
  // are not data (TLS 1.3 session tickets, consumed here); false when data or a close is waiting.
  bool idle() noexcept;
  // Bytes taken off the socket that a read would return (or decrypt) without the socket: waiting
  // on the socket for them would wait in vain.
  [[nodiscard]] bool buffered() const noexcept;
  // Why the last read or write failed ("" for a plain socket error or timeout).
  [[nodiscard]] const std::string& failure() const noexcept { return failure_; }
  // The last failure was TLS refusing the session (an alert, a protocol error), not the socket.
  [[nodiscard]] bool refused() const noexcept { return refused_; }
  // The server asked for a client certificate and none is configured (mutual TLS).
  [[nodiscard]] bool certificate_missing() const noexcept { return certificate_asked_; }

  // Set by tls.cpp's socket BIO and callbacks.
  int fd_ = -1;
  bool certificate_asked_ = false;
  bool heard_ = false;  // the server sent a byte: it is not silent

private:
  friend class TlsHandshake;
  TlsSession() = default;
  void failed(int ret) noexcept;

  ssl_st* ssl_ = nullptr;
  std::string failure_;
  bool refused_ = false;
};

// One client handshake on a connected socket, stepped by its caller without I/O of its own: the
// caller waits for the socket to be ready for what step() asks (opening.cpp, on its event loop)
// and asks the plain-text probe when it fits.
class TlsHandshake {
public:
  enum class Step {
    done,        // session() is ready
    want_read,   // call step() again once the socket is readable
    want_write,  // ... writable
    closed,      // the socket failed or closed under the handshake: probe if wanted, then throw_closed()
  };
  // The session on `fd` for `host` (SNI and the name checked, unless tls.server_name is set);
  // `at` and `role` name the server in messages. A name that cannot be checked throws.
  TlsHandshake(const Tls& tls, int fd, const std::string& host, std::string at, const char* role);
  ~TlsHandshake();
  TlsHandshake(const TlsHandshake&) = delete;
  TlsHandshake& operator=(const TlsHandshake&) = delete;

  // One SSL_connect. A refusal (the certificate, the protocol, bytes that are not TLS, a client
  // certificate asked for and none configured) throws connection_error "TLS", not retryable.
  Step step();
  // The server sent a byte: it speaks TLS, so no plain-text probe is worth asking.
  [[nodiscard]] bool heard() const noexcept;
  // After Step::closed: a retryable connection_error naming the socket's error.
  [[noreturn]] void throw_closed() const;
  // The handshake outlived `timeout` (timeout_error "TLS", retryable); without `probed` the message
  // names a plain-text port as a possible cause.
  [[noreturn]] void throw_timeout(millis timeout, bool probed) const;
  // After Step::done: the session (non-blocking: its reads and writes answer EAGAIN rather than wait).
  std::unique_ptr<TlsSession> session();

private:
  std::unique_ptr<TlsSession> s_;
  std::string at_;
  const char* role_;
  std::string name_;
  int closed_errno_ = 0;
};

}  // namespace idem::detail::redis
