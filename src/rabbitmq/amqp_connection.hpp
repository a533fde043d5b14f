#pragma once
// What RabbitConsumer (idem::rabbitmq) and RabbitMqPublisher (idem::outbox_rabbitmq) share, header
// only and private to both libraries: the amqp:// / amqps:// URL, the TLS settings' checks at
// construction, and opening the socket (plain TCP or rabbitmq-c's OpenSSL socket) with the
// failures sorted into retryable (the broker down, a handshake cut) and not (a certificate refused).
//
// Both option structs carry the same fields (url, host, port, vhost, user, password, tls, ca_file,
// cert_file, key_file, verify_peer, verify_hostname); the functions here are templates over them.

#include <amqp.h>
#include <amqp_ssl_socket.h>
#include <amqp_tcp_socket.h>
#include <openssl/x509.h>
#include <sys/time.h>
#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "idem/core/error.hpp"

namespace idem::detail::amqp {

/// What an amqp:// or amqps:// URL says; the parts it leaves out are nullopt.
struct Url {
  bool tls = false;
  std::string host;
  int port = 5672;
  std::optional<std::string> user, password, vhost;
};

[[noreturn]] inline void bad_url(std::string_view who, const std::string& why) {
  throw invalid_options_error(fmt::format("idem: {}::url {}", who, why));
}

// %XX decoding; `part` names the URL part in the error (its value is not quoted: it may be a password).
inline std::string percent_decode(std::string_view s, std::string_view who, const char* part) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      out += s[i];
      continue;
    }
    if (i + 2 >= s.size()) bad_url(who, fmt::format("has a '%' without two hex digits in the {}", part));
    const int hi = hex(s[i + 1]), lo = hex(s[i + 2]);
    if (hi < 0 || lo < 0) bad_url(who, fmt::format("has a '%' without two hex digits in the {}", part));
    if (hi == 0 && lo == 0) bad_url(who, fmt::format("has %00 in the {}: a NUL cannot be sent", part));
    out += static_cast<char>(hi * 16 + lo);
    i += 2;
  }
  return out;
}

/// Parses `amqp[s]://[user[:password]@]host[:port][/vhost]` (RabbitMQ's URI spec): user, password
/// and vhost percent-decoded ("%2f" is "/"), the port 5672 (amqp) or 5671 (amqps) when absent, an
/// IPv6 address in brackets. Query parameters are refused (set the fields instead).
inline Url parse_url(std::string_view url, std::string_view who) {
  Url u;
  auto starts = [&](std::string_view scheme) {
    if (url.size() < scheme.size()) return false;
    for (std::size_t i = 0; i < scheme.size(); ++i)
      if (std::tolower(static_cast<unsigned char>(url[i])) != scheme[i]) return false;
    return true;
  };
  std::string_view rest;
  if (starts("amqps://")) {
    u.tls = true;
    u.port = 5671;
    rest = url.substr(8);
  } else if (starts("amqp://")) {
    rest = url.substr(7);
  } else {
    bad_url(who, "must start with amqp:// or amqps://");
  }
  if (rest.find_first_of("?#") != std::string_view::npos)
    bad_url(who, "has a query or fragment ('?', '#'): set the options' fields instead (heartbeat, TLS files, ...)");
  for (char c : rest)
    if (std::isspace(static_cast<unsigned char>(c)) || std::iscntrl(static_cast<unsigned char>(c)))
      bad_url(who, "has a space or control character: percent-encode it");
  const auto slash = rest.find('/');
  std::string_view authority = rest.substr(0, slash);
  if (slash != std::string_view::npos) {
    const std::string_view path = rest.substr(slash + 1);
    if (path.find('/') != std::string_view::npos)
      bad_url(who, "has a '/' in its vhost: write a vhost's '/' as %2f (\"amqp://host/%2f\" is the vhost \"/\")");
    if (!path.empty()) u.vhost = percent_decode(path, who, "vhost");
  }
  if (const auto at = authority.rfind('@'); at != std::string_view::npos) {
    const std::string_view userinfo = authority.substr(0, at);
    authority = authority.substr(at + 1);
    const auto colon = userinfo.find(':');
    u.user = percent_decode(userinfo.substr(0, colon), who, "user");
    if (u.user->empty()) bad_url(who, "has an empty user before '@'");
    if (colon != std::string_view::npos) u.password = percent_decode(userinfo.substr(colon + 1), who, "password");
  }
  std::string_view port;
  bool has_port = false;
  if (!authority.empty() && authority.front() == '[') {  // [IPv6]
    const auto close = authority.find(']');
    if (close == std::string_view::npos) bad_url(who, "has a '[' without its ']' around an IPv6 address");
    u.host = std::string(authority.substr(1, close - 1));
    const std::string_view after = authority.substr(close + 1);
    if (!after.empty()) {
      if (after.front() != ':') bad_url(who, "has something other than ':port' after the IPv6 address");
      port = after.substr(1);
      has_port = true;
    }
  } else {
    const auto colon = authority.find(':');
    u.host = std::string(authority.substr(0, colon));
    if (colon != std::string_view::npos) {
      port = authority.substr(colon + 1);
      has_port = true;
      if (port.find(':') != std::string_view::npos)
        bad_url(who, "has more than one ':' in host:port (put an IPv6 address in brackets)");
    }
  }
  if (u.host.empty()) bad_url(who, "has no host");
  if (has_port) {
    if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string_view::npos)
      bad_url(who, fmt::format("has port '{}': use 1..65535", port));
    u.port = std::stoi(std::string(port));
    if (u.port < 1 || u.port > 65535) bad_url(who, fmt::format("has port {}: use 1..65535", u.port));
  }
  return u;
}

/// When `o.url` is set: its host and port (5672/5671 by the scheme when absent), and its user,
/// password and vhost when it has them, replace the fields; amqps:// sets tls. amqp:// with tls
/// on is refused (a URL never turns TLS off by accident).
template <class Options>
void apply_url(Options& o, std::string_view who) {
  if (o.url.empty()) return;
  Url u = parse_url(o.url, who);
  if (!u.tls && o.tls) bad_url(who, "is amqp:// (plain text) but tls is on: use amqps://");
  o.tls = u.tls;
  o.host = std::move(u.host);
  o.port = u.port;
  if (u.user) o.user = std::move(*u.user);
  if (u.password) o.password = std::move(*u.password);
  if (u.vhost) o.vhost = std::move(*u.vhost);
}

/// The CA bundle an empty ca_file means: OpenSSL's default (SSL_CERT_FILE, else its cert.pem).
inline std::string default_ca_file() {
  if (const char* env = std::getenv(X509_get_default_cert_file_env()); env && *env) return env;
  return X509_get_default_cert_file();
}

/// Loads the TLS files into a fresh OpenSSL socket; "" when they load, else what is wrong.
template <class Options>
std::string configure_tls(amqp_socket_t* sock, const Options& o) {
  const std::string ca = o.ca_file.empty() ? default_ca_file() : o.ca_file;
  if (o.verify_peer && amqp_ssl_socket_set_cacert(sock, ca.c_str()) != AMQP_STATUS_OK)
    return o.ca_file.empty()
               ? fmt::format("ca_file is empty and the system's default CA bundle {} could not be loaded: set ca_file", ca)
               : fmt::format("ca_file {} could not be loaded: not PEM CA certificates", ca);
  if (!o.cert_file.empty() && amqp_ssl_socket_set_key(sock, o.cert_file.c_str(), o.key_file.c_str()) != AMQP_STATUS_OK)
    return fmt::format("cert_file {} and key_file {} could not be loaded: PEM certificate (chain) and its unencrypted "
                       "private key expected",
                       o.cert_file, o.key_file);
  amqp_ssl_socket_set_verify_peer(sock, o.verify_peer ? 1 : 0);
  amqp_ssl_socket_set_verify_hostname(sock, o.verify_hostname ? 1 : 0);
  return {};
}

/// The TLS settings' checks at construction (invalid_options_error naming the field): files that
/// exist and load, cert_file with key_file, no TLS file without tls.
template <class Options>
void check_tls(const Options& o, std::string_view who) {
  auto bad = [&](const char* field, const std::string& why) {
    throw invalid_options_error(fmt::format("idem: {}::{} {}", who, field, why));
  };
  if (!o.tls) {
    if (!o.ca_file.empty() || !o.cert_file.empty() || !o.key_file.empty())
      bad("tls", "is off but ca_file, cert_file or key_file is set: use an amqps:// url or tls = true");
    return;
  }
  auto readable = [&](const char* field, const std::string& path) {
    if (!path.empty() && ::access(path.c_str(), R_OK) != 0)
      bad(field, fmt::format("'{}' does not exist or cannot be read", path));
  };
  readable("ca_file", o.ca_file);
  readable("cert_file", o.cert_file);
  readable("key_file", o.key_file);
  if (o.cert_file.empty() != o.key_file.empty())
    bad(o.cert_file.empty() ? "cert_file" : "key_file", "is empty: the client certificate needs cert_file and key_file");
  // Load them once now, so a file that is not PEM is refused here, not at every connection.
  amqp_connection_state_t conn = amqp_new_connection();
  amqp_socket_t* sock = conn ? amqp_ssl_socket_new(conn) : nullptr;
  std::string why = sock ? configure_tls(sock, o) : "cannot create an OpenSSL socket";
  if (conn) amqp_destroy_connection(conn);
  if (!why.empty()) throw invalid_options_error(fmt::format("idem: {}: {}", who, why));
}

/// How opening a connection's socket went.
struct Opened {
  enum class Failure { none, connect, handshake, verify, setup } failure = Failure::none;
  std::string what;  ///< what happened and what to check ("" when opened)
  /// A broker down or a handshake cut may pass; a refused certificate or unloadable file will not.
  bool retryable() const { return failure == Failure::connect || failure == Failure::handshake; }
  explicit operator bool() const { return failure == Failure::none; }
};

/// Opens `conn`'s socket to the broker: TCP, or TLS with the options' verification.
template <class Options>
Opened open_socket(amqp_connection_state_t conn, const Options& o, timeval* timeout) {
  using F = Opened::Failure;
  if (!o.tls) {
    amqp_socket_t* sock = amqp_tcp_socket_new(conn);
    if (!sock) return {F::connect, "cannot create a socket (out of memory)"};
    if (const int rc = amqp_socket_open_noblock(sock, o.host.c_str(), o.port, timeout); rc != AMQP_STATUS_OK)
      return {F::connect, fmt::format("cannot connect: {}; check that the broker is up and reachable",
                                      amqp_error_string2(rc))};
    return {};
  }
  amqp_socket_t* sock = amqp_ssl_socket_new(conn);
  if (!sock) return {F::setup, "cannot create an OpenSSL socket"};
  if (std::string why = configure_tls(sock, o); !why.empty()) return {F::setup, why};
  const int rc = amqp_socket_open_noblock(sock, o.host.c_str(), o.port, timeout);
  switch (rc) {
    case AMQP_STATUS_OK:
      return {};
    case AMQP_STATUS_SSL_PEER_VERIFY_FAILED:
      return {F::verify,
              fmt::format("TLS certificate verification failed for host {}: the broker's certificate is not signed "
                          "by a CA of {} (or has expired); check ca_file / verify_peer",
                          o.host, o.ca_file.empty() ? "the system's default CA bundle (ca_file is empty)" : o.ca_file)};
    case AMQP_STATUS_SSL_HOSTNAME_VERIFY_FAILED:
      return {F::verify,
              fmt::format("TLS certificate verification failed for host {}: the broker's certificate is not for that "
                          "name (rabbitmq-c matches its DNS names, not IP address entries); check the host, ca_file "
                          "/ verify_hostname",
                          o.host)};
    case AMQP_STATUS_SSL_CONNECTION_FAILED:
      return {F::handshake,
              fmt::format("TLS handshake failed: {}; check that port {} is the broker's TLS listener (5671 by default) "
                          "and, if it asks for one, the client certificate (cert_file, key_file)",
                          amqp_error_string2(rc), o.port)};
    default:
      return {F::connect, fmt::format("cannot connect over TLS: {}; check that the broker is up and reachable",
                                      amqp_error_string2(rc))};
  }
}

}  // namespace idem::detail::amqp
