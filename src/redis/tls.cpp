// TLS for the Redis client on OpenSSL (tls.hpp).

#include "tls.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>

#include <arpa/inet.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include <fmt/format.h>

#include "idem/core/error.hpp"
#include "idem/core/hex.hpp"

namespace idem::detail::redis {

namespace {

// The reason of the first error on this thread's OpenSSL queue ("" when none), and the queue cleared.
std::string openssl_reason() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return {};
  const char* reason = ERR_reason_error_string(e);
  return reason != nullptr ? reason : fmt::format("OpenSSL error {}", ERR_GET_REASON(e));
}

// The socket BIO of every session: send(2) with MSG_NOSIGNAL, as the plain path writes (OpenSSL's
// own socket BIO uses write(2), which raises SIGPIPE on a socket the server closed), and recv(2);
// neither waits (MSG_DONTWAIT): the caller waits for the socket, so every wait is bounded.
int bio_write(BIO* b, const char* data, int len) {
  auto* s = static_cast<TlsSession*>(BIO_get_data(b));
  BIO_clear_retry_flags(b);
  ssize_t n;
  do n = ::send(s->fd_, data, static_cast<std::size_t>(len), MSG_NOSIGNAL | MSG_DONTWAIT);
  while (n < 0 && errno == EINTR);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) BIO_set_retry_write(b);
  return static_cast<int>(n);
}

int bio_read(BIO* b, char* buf, int len) {
  auto* s = static_cast<TlsSession*>(BIO_get_data(b));
  BIO_clear_retry_flags(b);
  ssize_t n;
  do n = ::recv(s->fd_, buf, static_cast<std::size_t>(len), MSG_DONTWAIT);
  while (n < 0 && errno == EINTR);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) BIO_set_retry_read(b);
  if (n > 0) s->heard_ = true;
  return static_cast<int>(n);
}

long bio_ctrl(BIO*, int cmd, long, void*) { return cmd == BIO_CTRL_FLUSH ? 1 : 0; }

int bio_create(BIO* b) {
  BIO_set_init(b, 1);
  return 1;
}

const BIO_METHOD* socket_method() {
  static BIO_METHOD* const m = [] {
    BIO_METHOD* bm = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "idem redis socket");
    BIO_meth_set_write(bm, bio_write);
    BIO_meth_set_read(bm, bio_read);
    BIO_meth_set_ctrl(bm, bio_ctrl);
    BIO_meth_set_create(bm, bio_create);
    return bm;
  }();
  return m;
}

bool is_ip_address(const std::string& host) {
  unsigned char buf[sizeof(in6_addr)];
  return inet_pton(AF_INET, host.c_str(), buf) == 1 || inet_pton(AF_INET6, host.c_str(), buf) == 1;
}

// A missing or unreadable file is refused here, naming the field, rather than as OpenSSL's
// "system lib" at the first connection.
void check_readable(const std::string& path, const char* field, bool directory = false) {
  if (path.empty()) return;
  if (::access(path.c_str(), directory ? (R_OK | X_OK) : R_OK) != 0)
    throw invalid_options_error(fmt::format("idem: RedisOptions: {} '{}' cannot be read: {}", field,
                                            printable(path, 200), std::strerror(errno)));
}

// Password-protected keys are refused rather than prompted for on the terminal.
int no_password(char*, int, int, void*) { return 0; }

// Called when the server asks for a client certificate and none is configured.
int no_client_certificate(SSL* ssl, X509**, EVP_PKEY**) {
  // Only noted: the server may go on without one (tls-auth-clients optional).
  if (auto* s = static_cast<TlsSession*>(SSL_get_app_data(ssl))) s->certificate_asked_ = true;
  return 0;
}

// What the refused certificate failed: the check, in words.
std::string verify_failure(long code, const std::string& name) {
  const std::string text = X509_verify_cert_error_string(code);
  switch (code) {
    case X509_V_ERR_HOSTNAME_MISMATCH:
    case X509_V_ERR_IP_ADDRESS_MISMATCH:
      return fmt::format(
          "host name check: {}, the certificate does not name '{}' (set tls.server_name to a name it "
          "carries, or connect by that name)",
          text, printable(name, 200));
    case X509_V_ERR_CERT_HAS_EXPIRED:
    case X509_V_ERR_CERT_NOT_YET_VALID:
    case X509_V_ERR_CRL_HAS_EXPIRED:
      return fmt::format("validity period check: {} (renew the server's certificate, or check this host's clock)",
                         text);
    case X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT_LOCALLY:
    case X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT:
    case X509_V_ERR_DEPTH_ZERO_SELF_SIGNED_CERT:
    case X509_V_ERR_SELF_SIGNED_CERT_IN_CHAIN:
    case X509_V_ERR_CERT_UNTRUSTED:
      return fmt::format(
          "chain of trust check: {} (is tls.ca_file / tls.ca_dir the CA that signed the server's certificate?)", text);
    default: return fmt::format("certificate check: {}", text);
  }
}

[[noreturn]] void refuse(const std::string& at, const char* role, const std::string& why) {
  throw connection_error(fmt::format("idem: TLS with {} at {} failed: {}", role, at, why), "TLS", false);
}

}  // namespace

void throw_plain_text_port(const std::string& at, const char* role, std::string_view evidence, bool certain) {
  throw connection_error(fmt::format("idem: TLS with {} failed: the server at {} does not speak TLS ({}): {} use "
                                     "redis:// for it, or the server's tls-port for rediss://",
                                     role, at, evidence,
                                     certain ? "it is a plain-text port;" : "is it a plain-text port?"),
                         "TLS", false);
}

Tls::Tls(const RedisTlsOptions& o) : server_name_(o.server_name), verify_hostname_(o.verify_hostname) {
  check_readable(o.ca_file, "tls.ca_file");
  check_readable(o.ca_dir, "tls.ca_dir", true);
  check_readable(o.cert_file, "tls.cert_file");
  check_readable(o.key_file, "tls.key_file");
  ERR_clear_error();
  ctx_ = SSL_CTX_new(TLS_client_method());
  if (ctx_ == nullptr)
    throw connection_error(fmt::format("idem: cannot create a TLS context: {}", openssl_reason()), "TLS", false);
  auto bad = [&](const std::string& field, const std::string& path) {
    const std::string why = openssl_reason();
    SSL_CTX_free(ctx_);
    ctx_ = nullptr;
    throw invalid_options_error(fmt::format("idem: RedisOptions: {} '{}' cannot be used: {}", field,
                                            printable(path, 200),
                                            why.empty() ? "not a PEM file of the right kind" : why));
  };
  SSL_CTX_set_min_proto_version(ctx_, o.min_version == TlsVersion::tls1_3 ? TLS1_3_VERSION : TLS1_2_VERSION);
  SSL_CTX_set_verify(ctx_, SSL_VERIFY_PEER, nullptr);
  SSL_CTX_set_mode(ctx_, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_AUTO_RETRY);
  SSL_CTX_set_default_passwd_cb(ctx_, no_password);
  SSL_CTX_set_client_cert_cb(ctx_, no_client_certificate);
  if (o.ca_file.empty() && o.ca_dir.empty()) {
    if (SSL_CTX_set_default_verify_paths(ctx_) != 1) bad("tls.ca_file", "(the system's trust store)");
  } else if (SSL_CTX_load_verify_locations(ctx_, o.ca_file.empty() ? nullptr : o.ca_file.c_str(),
                                           o.ca_dir.empty() ? nullptr : o.ca_dir.c_str()) != 1) {
    bad(o.ca_file.empty() ? "tls.ca_dir" : "tls.ca_file", o.ca_file.empty() ? o.ca_dir : o.ca_file);
  }
  if (!o.cert_file.empty()) {
    if (SSL_CTX_use_certificate_chain_file(ctx_, o.cert_file.c_str()) != 1) bad("tls.cert_file", o.cert_file);
    if (SSL_CTX_use_PrivateKey_file(ctx_, o.key_file.c_str(), SSL_FILETYPE_PEM) != 1)
      bad("tls.key_file", o.key_file);
    if (SSL_CTX_check_private_key(ctx_) != 1) bad("tls.key_file (does it match tls.cert_file?)", o.key_file);
    has_cert_ = true;
  }
}

Tls::~Tls() { SSL_CTX_free(ctx_); }

TlsHandshake::TlsHandshake(const Tls& tls, int fd, const std::string& host, std::string at, const char* role)
    : s_(new TlsSession()), at_(std::move(at)), role_(role),
      name_(tls.server_name_.empty() ? host : tls.server_name_) {
  s_->fd_ = fd;
  ERR_clear_error();
  s_->ssl_ = SSL_new(tls.ctx_);
  BIO* bio = s_->ssl_ != nullptr ? BIO_new(socket_method()) : nullptr;
  if (bio == nullptr)
    throw connection_error(fmt::format("idem: cannot create a TLS session: {}", openssl_reason()), "TLS", true);
  BIO_set_data(bio, s_.get());
  SSL_set_bio(s_->ssl_, bio, bio);
  SSL_set_app_data(s_->ssl_, s_.get());
  // SNI carries host names only (RFC 6066): an address is checked, not sent.
  if (!is_ip_address(name_)) SSL_set_tlsext_host_name(s_->ssl_, name_.c_str());
  if (tls.verify_hostname_) {
    X509_VERIFY_PARAM* param = SSL_get0_param(s_->ssl_);
    X509_VERIFY_PARAM_set_hostflags(param, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
    const int ok = is_ip_address(name_) ? X509_VERIFY_PARAM_set1_ip_asc(param, name_.c_str())
                                        : X509_VERIFY_PARAM_set1_host(param, name_.c_str(), 0);
    if (ok != 1) refuse(at_, role_, fmt::format("'{}' cannot be checked as a host name", printable(name_, 200)));
  }
}

TlsHandshake::~TlsHandshake() = default;

bool TlsHandshake::heard() const noexcept { return s_->heard_; }

TlsHandshake::Step TlsHandshake::step() {
  ERR_clear_error();
  errno = 0;
  const int rc = SSL_connect(s_->ssl_);
  if (rc == 1) return Step::done;
  const int err = SSL_get_error(s_->ssl_, rc);
  if (err == SSL_ERROR_WANT_READ) return Step::want_read;
  if (err == SSL_ERROR_WANT_WRITE) return Step::want_write;
  const long verify = SSL_get_verify_result(s_->ssl_);
  if (verify != X509_V_OK)
    refuse(at_, role_, fmt::format("the server's certificate was refused by the {}", verify_failure(verify, name_)));
  int sys = errno;
  if (err == SSL_ERROR_SSL) {
    const unsigned long e = ERR_peek_error();
    const int reason = ERR_GET_REASON(e);
    const std::string text = openssl_reason();
    // Bytes that are no TLS record: a plain-text Redis's error reply to the ClientHello's bytes.
    if (reason == SSL_R_WRONG_VERSION_NUMBER || reason == SSL_R_PACKET_LENGTH_TOO_LONG ||
        reason == SSL_R_UNKNOWN_PROTOCOL || reason == SSL_R_HTTP_REQUEST)
      throw_plain_text_port(at_, role_, fmt::format("it answered the handshake with bytes that are not TLS: {}", text),
                            false);
    if (s_->certificate_asked_)
      refuse(at_, role_,
             fmt::format("the server asked for a client certificate and none is configured ({}); with "
                         "tls-auth-clients yes set tls.cert_file and tls.key_file",
                         text));
    // OpenSSL 3 reports a close without close_notify as an error; it is the socket closing.
    if (reason != SSL_R_UNEXPECTED_EOF_WHILE_READING)
      refuse(at_, role_, fmt::format("the handshake was refused: {}", text.empty() ? "unknown TLS error" : text));
    sys = 0;
  }
  closed_errno_ = sys;
  return Step::closed;
}

void TlsHandshake::throw_closed() const {
  const std::string why = closed_errno_ != 0 ? std::strerror(closed_errno_) : "the server closed the connection";
  throw connection_error(fmt::format("idem: TLS handshake with {} at {} failed: {}; retry later", role_, at_, why), "",
                         true);
}

void TlsHandshake::throw_timeout(millis timeout, bool probed) const {
  // With the probe asked, a plain-text port is ruled out: only slowness is left to name.
  throw timeout_error(fmt::format("idem: TLS handshake with {} at {} did not complete within connect_timeout ({} "
                                  "ms): the network or the server is slow{}; retry later",
                                  role_, at_, timeout.count(),
                                  probed ? ""
                                         : ", or it is a plain-text port (a Redis without TLS waits for a "
                                           "newline), which needs redis://"),
                      "TLS", true);
}

std::unique_ptr<TlsSession> TlsHandshake::session() {
  return std::move(s_);
}

TlsSession::~TlsSession() {
  // No close_notify: the socket is closed right after, and a blocking shutdown could stall.
  SSL_free(ssl_);
}

void TlsSession::failed(int ret) noexcept {
  const int saved = errno;
  const int err = SSL_get_error(ssl_, ret);
  refused_ = false;
  failure_.clear();
  switch (err) {
    case SSL_ERROR_WANT_READ:
    case SSL_ERROR_WANT_WRITE:
      // The socket has nothing to read, or no room to write: the caller waits for it.
      ERR_clear_error();
      errno = EAGAIN;
      return;
    case SSL_ERROR_ZERO_RETURN:
      ERR_clear_error();
      errno = 0;
      return;
    case SSL_ERROR_SYSCALL:
      // errno 0: the socket reached EOF without close_notify, read as a close.
      ERR_clear_error();
      errno = saved;
      return;
    default: {
      const int reason = ERR_GET_REASON(ERR_peek_error());
      const std::string text = openssl_reason();
      if (reason == SSL_R_UNEXPECTED_EOF_WHILE_READING) {
        errno = 0;  // read as a close, like a plain socket's EOF
        return;
      }
      try {
        failure_ = fmt::format("TLS: {}", text.empty() ? "unknown TLS error" : text);
      } catch (...) {
      }
      refused_ = true;
      errno = EPROTO;
    }
  }
}

std::size_t TlsSession::write(std::string_view data) noexcept {
  std::size_t done = 0;
  while (done < data.size()) {
    ERR_clear_error();
    const std::size_t chunk = std::min<std::size_t>(data.size() - done, 1 << 30);
    const int n = SSL_write(ssl_, data.data() + done, static_cast<int>(chunk));
    if (n <= 0) {
      failed(n);
      if (errno == 0) errno = EPIPE;
      break;
    }
    done += static_cast<std::size_t>(n);
  }
  return done;
}

long TlsSession::read(char* buf, std::size_t n) noexcept {
  ERR_clear_error();
  const int got = SSL_read(ssl_, buf, static_cast<int>(std::min<std::size_t>(n, 1 << 30)));
  if (got > 0) return got;
  failed(got);
  return refused_ || errno != 0 ? -1 : 0;
}

bool TlsSession::buffered() const noexcept { return SSL_has_pending(ssl_) == 1; }

bool TlsSession::idle() noexcept {
  if (SSL_pending(ssl_) > 0) return false;
  pollfd p{fd_, POLLIN, 0};
  int rc;
  do rc = ::poll(&p, 1, 0);
  while (rc < 0 && errno == EINTR);
  if (rc == 0) return true;
  // Readable: a TLS 1.3 session ticket the server sent after the handshake is no reason to drop
  // the connection; data or a close on an idle connection is.
  ERR_clear_error();
  char b;
  const int n = SSL_peek(ssl_, &b, 1);
  const int err = n > 0 ? SSL_ERROR_NONE : SSL_get_error(ssl_, n);
  ERR_clear_error();
  return n <= 0 && err == SSL_ERROR_WANT_READ;
}

}  // namespace idem::detail::redis
