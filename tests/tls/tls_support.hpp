#pragma once
// The TLS tests' Redis side: the fixture's certificates (tls_fixture.sh made them) and a
// redis-server that speaks TLS only (test::RedisServer with tls_only: `port 0`, `tls-port P`),
// started per test process on a free loopback port; the harness's own admin commands go through
// the server's Unix socket.

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "idem/redis.hpp"
#include "redis/redis_server.hpp"

namespace idem::tlstest {

// The fixture's state directory (compiled in; IDEM_TLS_STATE overrides it).
inline std::string state_dir() {
  const char* s = std::getenv("IDEM_TLS_STATE");
  return s && *s ? s : IDEM_TLS_STATE_DEFAULT;
}
// A file of the fixture's certificates: "ca.crt", "client.key", ...
inline std::string cert(const std::string& name) {
  const std::string path = state_dir() + "/certs/" + name;
  if (!std::filesystem::exists(path))
    throw std::runtime_error("test: no " + path + ": the TLS fixture (tls_fixture.sh start) did not run");
  return path;
}
inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct TlsServerConfig {
  std::string cert = "server";         // server.crt/.key, expired, wronghost
  std::string auth_clients = "no";     // tls-auth-clients: no, yes, optional
  std::vector<std::string> extra;      // more redis.conf lines
};

// A TLS-only redis-server (test::RedisServer with tls_only) and its clients' options.
class TlsRedisServer : public test::RedisServer {
public:
  explicit TlsRedisServer(const TlsServerConfig& cfg = {}) : test::RedisServer(config(cfg), true) {}

  // Options of a client of this server: TLS on, the test CA trusted, no client certificate.
  [[nodiscard]] RedisOptions options() const {
    RedisOptions o = test::RedisServer::options();
    o.tls.enabled = true;
    o.tls.ca_file = cert("ca.crt");
    return o;
  }
  // The same with the client certificate (mutual TLS).
  [[nodiscard]] RedisOptions mtls_options() const {
    RedisOptions o = options();
    o.tls.cert_file = cert("client.crt");
    o.tls.key_file = cert("client.key");
    return o;
  }

private:
  static std::vector<std::string> config(const TlsServerConfig& cfg) {
    std::vector<std::string> lines{"tls-cert-file " + cert(cfg.cert + ".crt"), "tls-key-file " + cert(cfg.cert + ".key"),
                                   "tls-ca-cert-file " + cert("ca.crt"), "tls-auth-clients " + cfg.auth_clients};
    lines.insert(lines.end(), cfg.extra.begin(), cfg.extra.end());
    return lines;
  }
};

}  // namespace idem::tlstest
