// AsyncRedisStore under lost replies: the suite RedisStore runs too (support/lost_reply_suite.hpp).
// The fixture first makes one call so the store's one connection (and its handshake) is up: the
// proxy's next reply is then the call under test.
#include <catch2/catch.hpp>

#include <string>

#include "asio_factory.hpp"
#include "support/lost_reply_suite.hpp"
#include "support/tcp_proxy.hpp"

using namespace std::chrono_literals;
using idem::test::IoThread;
using idem::test::RedisServer;
using idem::test::TcpProxy;

namespace {

struct Proxied {
  RedisServer server;
  TcpProxy proxy{server.port()};
  IoThread io;
  idem::AsyncRedisStore store{io.io.get_executor(), [this] {
                                idem::RedisOptions o = server.options();
                                o.port = proxy.port();
                                o.command_timeout = 1s;
                                return o;
                              }()};
  std::string key = "lost-" + idem::test::random_hex();
  Proxied() { (void)store.inspect(key + "-warm"); }  // the connection and its handshake, before any plan
};

}  // namespace

IDEM_LOST_REPLY_SUITE(Proxied, "async", "[asio]")
