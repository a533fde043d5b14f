#pragma once
// Contract-suite factories over TLS: one TLS-only redis-server per test process (started on first
// use), a fresh store per case, keys under a random per-case namespace (redis_factory.hpp).

#include <string>

#include "idem/redis.hpp"
#include "redis/redis_factory.hpp"
#include "tls_support.hpp"

namespace idem::tlstest {

// rediss:// with the least-privilege ACL user and its password in the URL, the CA as a URL parameter.
struct RedisTlsFactory : test::RedisFactoryBase {
  using store_type = RedisStore;
  static TlsRedisServer& server() {
    static TlsRedisServer s{TlsServerConfig{"server", "no", test::acl_config()}};
    return s;
  }
  RedisStore s{[] {
    RedisOptions o;
    o.url = "rediss://idem-app:app%20secret%21@localhost:" + std::to_string(server().port()) +
            "/0?tls_ca_file=" + cert("ca.crt");
    o.pool.size = 16;
    o.command_timeout = millis{5000};
    return o;
  }()};
  store_type& store() { return s; }
};

// Mutual TLS: the server takes only clients with a certificate its CA signed (tls-auth-clients yes).
struct RedisMtlsFactory : test::RedisFactoryBase {
  using store_type = RedisStore;
  static TlsRedisServer& server() {
    static TlsRedisServer s{TlsServerConfig{"server", "yes", {}}};
    return s;
  }
  RedisStore s{[] {
    RedisOptions o = server().mtls_options();
    o.pool.size = 16;
    return o;
  }()};
  store_type& store() { return s; }
};

}  // namespace idem::tlstest
