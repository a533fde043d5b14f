// Opening a connection (opening.hpp) as coroutines, and Client::session, which runs one on a
// private loop. Every wait is bounded: a watchdog timer cancels the socket's operation at its
// deadline (Boost 1.74's Asio has no awaitable operators to race a timer against it).

#include "opening.hpp"

#include <algorithm>
#include <array>
#include <cerrno>
#include <exception>
#include <iterator>
#include <optional>
#include <utility>
#include <vector>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <fmt/format.h>

#include "idem/core/error.hpp"

namespace idem::detail::redis {

namespace net = boost::asio;
using Clock = std::chrono::steady_clock;
using ErrorCode = boost::system::error_code;

namespace {

auto with(ErrorCode& ec) { return net::redirect_error(net::use_awaitable, ec); }

millis left_until(Clock::time_point deadline) {
  return std::max(millis{0}, std::chrono::duration_cast<millis>(deadline - Clock::now()));
}

// Cancels the socket's pending operation at `deadline` (judged() reports that as timed_out). The
// timer's handler may run after the watchdog is gone (fired and queued at once with the
// operation's completion), so what it touches lives in a shared state the watchdog detaches from.
class Watchdog {
public:
  Watchdog(Socket& s, Clock::time_point deadline) : timer_(s.get_executor(), deadline), st_(std::make_shared<State>()) {
    st_->socket = &s;
    timer_.async_wait([st = st_](const ErrorCode& ec) {
      if (ec || st->socket == nullptr) return;
      st->fired = true;
      ErrorCode ignored;
      st->socket->cancel(ignored);
    });
  }
  ~Watchdog() { st_->socket = nullptr; }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  // `ec`, or timed_out when the watchdog cut the operation short.
  [[nodiscard]] ErrorCode judged(ErrorCode ec) const noexcept {
    return ec == net::error::operation_aborted && st_->fired ? ErrorCode(net::error::timed_out) : ec;
  }

private:
  struct State {
    Socket* socket = nullptr;
    bool fired = false;
  };
  net::steady_timer timer_;
  std::shared_ptr<State> st_;
};

// A socket connected to `to` within `timeout` (every address a host name resolves to, in turn).
net::awaitable<Socket> dial(const Endpoint& to, millis timeout, const char* role) {
  auto ex = co_await net::this_coro::executor;
  Socket s(ex);
  const auto deadline = Clock::now() + timeout;
  ErrorCode ec = net::error::host_not_found;
  if (to.port == 0) {
    Watchdog w(s, deadline);
    co_await s.async_connect(Socket::endpoint_type(net::local::stream_protocol::endpoint(to.host)), with(ec));
    ec = w.judged(ec);
  } else {
    std::vector<net::ip::tcp::endpoint> addresses;
    ErrorCode not_ip;
    const net::ip::address ip = net::ip::make_address(to.host, not_ip);
    if (!not_ip) {
      addresses.emplace_back(ip, static_cast<unsigned short>(to.port));
    } else {
      net::ip::tcp::resolver resolver(ex);
      const auto found = co_await resolver.async_resolve(to.host, std::to_string(to.port), with(ec));
      for (const auto& e : found) addresses.push_back(e.endpoint());
      if (!ec && addresses.empty()) ec = net::error::host_not_found;
    }
    for (const auto& a : addresses) {
      ErrorCode ignored;
      s.close(ignored);
      Watchdog w(s, deadline);
      co_await s.async_connect(Socket::endpoint_type(a), with(ec));
      ec = w.judged(ec);
      if (!ec || ec == net::error::timed_out) break;
    }
    if (!ec) s.set_option(net::ip::tcp::no_delay(true), ec);
  }
  if (ec)
    throw connection_error(fmt::format("idem: cannot connect to {} at {} within connect_timeout ({}): {}; is it "
                                       "running there? retry later",
                                       role, describe(to), ms(timeout), ec.message()),
                           "", true);
  co_return s;
}

// Requests written and replies read while a connection opens (and in a session): whole writes,
// replies parsed by hiredis's reader, each wait bounded by the deadline given.
class Wire {
public:
  Wire(Socket& s, TlsSession* tls) : s_(s), tls_(tls) {}

  // False when the connection failed (failure() says how).
  net::awaitable<bool> send(std::string_view data, Clock::time_point deadline) {
    std::size_t done = 0;
    for (;;) {
      const IoStep step = write_step(s_.native_handle(), tls_, data, done);
      if (step == IoStep::done) co_return true;
      if (step == IoStep::failed) co_return failed(errno);
      if (!co_await wait(net::socket_base::wait_write, deadline)) co_return false;
    }
  }

  // The next reply, or null when the connection failed (failure() says how).
  net::awaitable<ReplyPtr> next(Clock::time_point deadline) {
    for (;;) {
      ReplyPtr reply = reader_.next();
      if (reader_.failed()) co_return nullptr;
      if (reply) {
        answered_ = true;
        co_return reply;
      }
      const IoStep step = read_step(s_.native_handle(), tls_, reader_, buf_.data(), buf_.size());
      if (step == IoStep::done) continue;
      if (step == IoStep::failed) {
        failed(errno);
        co_return nullptr;
      }
      if (!co_await wait(net::socket_base::wait_read, deadline)) co_return nullptr;
    }
  }

  // What failed, as the typed error for a request that ran nothing (the hello, a session's
  // reads): `where` and `during` name it. TLS ending the session before its first reply (an
  // alert; a client certificate asked for and none configured) is connection_error "TLS", not
  // retryable: retrying cannot help.
  [[noreturn]] void throw_failure(const std::string& where, const char* during, millis command_timeout,
                                  bool tcp) const {
    if (tls_ && !answered_ && !timed_out_ && (tls_->refused() || tls_->certificate_missing())) {
      const std::string what = tls_->refused() ? tls_->failure() : why_;
      if (tls_->certificate_missing())
        throw connection_error(fmt::format("idem: TLS with Redis at {} failed: the server asked for a client "
                                           "certificate, none is configured, and it ended the session ({}); with "
                                           "tls-auth-clients yes set tls.cert_file and tls.key_file",
                                           where, what),
                               "TLS", false);
      throw connection_error(
          fmt::format("idem: TLS with Redis at {} failed: the server refused the session ({})", where, what), "TLS",
          false);
    }
    IoFailure f = failure(where, during, command_timeout);
    // A TLS-only port ends a plain-text connection at its first bytes.
    if (!tls_ && !answered_ && !timed_out_ && tcp)
      f.text += " before its first reply (if this is a TLS port, connect with rediss:// or RedisOptions::tls)";
    throw_io_error(f, false);
  }

  [[nodiscard]] IoFailure failure(const std::string& where, const char* during, millis command_timeout) const {
    if (timed_out_) return io_timed_out(where, command_timeout, during);
    if (reader_.failed()) return {reader_.error(where), false};
    return io_broke(where, why_, during);
  }

private:
  bool failed(int err) {
    why_ = io_reason(tls_, err);
    return false;
  }

  net::awaitable<bool> wait(net::socket_base::wait_type what, Clock::time_point deadline) {
    ErrorCode ec;
    {
      Watchdog w(s_, deadline);
      co_await s_.async_wait(what, with(ec));
      ec = w.judged(ec);
    }
    if (ec == net::error::timed_out) {
      timed_out_ = true;
      why_ = "timed out";
      co_return false;
    }
    if (ec) {
      why_ = ec.message();
      co_return false;
    }
    co_return true;
  }

  Socket& s_;
  TlsSession* tls_;
  RespReader reader_;
  std::array<char, 16 * 1024> buf_{};
  std::string why_;
  bool answered_ = false;
  bool timed_out_ = false;
};

// `requests` (n of them) written at once and their n replies read, by `deadline`: empty when the
// connection failed (w.failure() says how).
net::awaitable<std::vector<ReplyPtr>> exchange(Wire& w, std::string_view requests, std::size_t n,
                                               Clock::time_point deadline) {
  std::vector<ReplyPtr> replies;
  if (!co_await w.send(requests, deadline)) co_return replies;
  replies.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    ReplyPtr r = co_await w.next(deadline);
    if (!r) {
      replies.clear();
      co_return replies;
    }
    replies.push_back(std::move(r));
  }
  co_return replies;
}

// Whether `to` answers a plain-text PING with RESP (a reply or an error reply) within `budget`
// (at least 50 ms, at most 500 ms). A TLS port never does: it drops a connection whose first
// bytes are no TLS record.
net::awaitable<bool> answers_plain_ping(const Endpoint& to, millis budget) {
  budget = std::clamp(budget, millis{50}, millis{500});
  const auto deadline = Clock::now() + budget;
  try {
    Socket s = co_await dial(to, budget, "Redis");
    Wire w(s, nullptr);
    const std::vector<ReplyPtr> answer = co_await exchange(w, "PING\r\n", 1, deadline);
    co_return !answer.empty();
  } catch (const std::exception&) {
    co_return false;
  }
}

// The TLS handshake on `s`, bounded by connect_timeout as a whole. A plain-text Redis given a
// ClientHello answers an error (TlsHandshake sees at once it is not TLS), closes, or waits for a
// newline; the last two are asked about with a plain-text PING on a connection of its own, early
// for a silent server, since a timeout says "retry", which can never help there.
net::awaitable<std::unique_ptr<TlsSession>> handshake(Socket& s, const Tls& tls, const Endpoint& to, const char* role,
                                                      millis timeout) {
  const std::string at = describe(to);
  TlsHandshake h(tls, s.native_handle(), to.host, at, role);
  const auto deadline = Clock::now() + timeout;
  bool probed = false;
  // Once, and only while the server has sent nothing: after any byte of TLS it is no plain port.
  auto plain_text = [&]() -> net::awaitable<bool> {
    if (probed || h.heard()) co_return false;
    probed = true;
    co_return co_await answers_plain_ping(to, left_until(deadline));
  };
  constexpr std::string_view evidence = "it sent no TLS back to the handshake, and answered a PING in plain text";
  for (;;) {
    const TlsHandshake::Step step = h.step();
    if (step == TlsHandshake::Step::done) {
      co_return h.session();
    }
    if (step == TlsHandshake::Step::closed) {
      if (co_await plain_text()) throw_plain_text_port(at, role, evidence, true);
      h.throw_closed();
    }
    const bool want_read = step == TlsHandshake::Step::want_read;
    const bool early = !probed && !h.heard() && want_read && Tls::probe_delay(timeout) < left_until(deadline);
    ErrorCode ec;
    {
      Watchdog w(s, early ? Clock::now() + Tls::probe_delay(timeout) : deadline);
      co_await s.async_wait(want_read ? net::socket_base::wait_read : net::socket_base::wait_write, with(ec));
      ec = w.judged(ec);
    }
    if (ec != net::error::timed_out) continue;  // ready, or a failure the next step reports
    if (co_await plain_text()) throw_plain_text_port(at, role, evidence, true);
    if (early) continue;
    h.throw_timeout(timeout, true);
  }
}

// Sentinel mode: asks the sentinels in turn (from the one that answered last) for the master's
// address. connection_error when none names it (code TLS, not retryable, when every sentinel failed
// a TLS check).
net::awaitable<Endpoint> discover(const Client& c) {
  const RedisOptions& o = c.options();
  const std::vector<Endpoint>& sentinels = c.sentinels();
  const Tls* tls = o.tls.sentinels ? c.tls() : nullptr;
  const std::size_t first = c.first_sentinel();
  const Hello hello = sentinel_hello(o);
  std::string why;
  bool any_answer = false;
  std::size_t tls_refused = 0;  // sentinels whose TLS checks failed
  for (std::size_t n = 0; n < sentinels.size(); ++n) {
    const std::size_t i = (first + n) % sentinels.size();
    const std::string at = describe(sentinels[i]);
    try {
      Socket s = co_await dial(sentinels[i], o.connect_timeout, "the Redis sentinel");
      std::unique_ptr<TlsSession> session;
      if (tls != nullptr) {
        std::unique_ptr<TlsSession> done = co_await handshake(s, *tls, sentinels[i], "the Redis sentinel", o.connect_timeout);
        session = std::move(done);
      }
      Wire w(s, session.get());
      const std::vector<ReplyPtr> answers =
          co_await exchange(w, hello.requests.all(), hello.requests.size(), Clock::now() + o.command_timeout);
      if (answers.empty()) {
        fmt::format_to(std::back_inserter(why), "; {}: {}", at,
                       w.failure(at, "to SENTINEL get-master-addr-by-name", o.command_timeout).text);
        continue;
      }
      if (const std::string_view refused = hello_refusal(answers); !refused.empty()) {
        fmt::format_to(std::back_inserter(why), "; {} refused: {}", at, refused);
        continue;
      }
      any_answer = true;
      if (std::optional<Endpoint> master = parse_master_addr(answers.back().get())) {
        c.learned_master(*master, i);
        co_return std::move(*master);
      }
      fmt::format_to(std::back_inserter(why), "; {} does not know a master named '{}'", at, o.sentinel_master);
    } catch (const error& e) {
      fmt::format_to(std::back_inserter(why), "; {}: {}", at, e.what());
      if (const auto* ce = dynamic_cast<const connection_error*>(&e); ce && ce->code() == "TLS" && !ce->retryable())
        ++tls_refused;
    }
  }
  const std::string msg = fmt::format("idem: no sentinel named the Redis master '{}'{}", o.sentinel_master, why);
  // Every sentinel failed a TLS check: asking again cannot help.
  if (tls_refused > 0 && tls_refused == sentinels.size())
    throw connection_error(fmt::format("{}. Check the TLS settings (RedisOptions::tls, tls.sentinels)", msg), "TLS",
                           false);
  if (any_answer)
    throw connection_error(fmt::format("{}. Check sentinel_master against `sentinel monitor <name> ...` (SENTINEL "
                                       "MASTERS lists the names); retry later if a failover is under way",
                                       msg),
                           "SENTINEL", true);
  throw connection_error(fmt::format("{}. Are the sentinels running at those addresses? retry later", msg), "SENTINEL",
                         true);
}

// The master to connect to: the one known, or the sentinels asked (a failure leaves the next
// opening to ask again).
net::awaitable<Endpoint> master(const Client& c) {
  if (std::optional<Endpoint> known = c.known_master()) co_return std::move(*known);
  std::exception_ptr failed;
  try {
    Endpoint found = co_await discover(c);
    co_return found;
  } catch (...) {
    failed = std::current_exception();
  }
  c.discovery_failed();
  std::rethrow_exception(failed);
}

}  // namespace

net::awaitable<Opened> open_ready(const Client& c) {
  const RedisOptions& o = c.options();
  const bool sentinel = !c.sentinels().empty();
  // Each co_await's result is a variable of its own: GCC 12 mishandles the temporaries of a
  // co_await inside a larger expression (a conditional, a braced initializer).
  Endpoint to = c.server();
  if (sentinel) {
    Endpoint m = co_await master(c);
    to = std::move(m);
  }
  const char* role = sentinel ? "the Redis master" : "Redis";
  Socket s = co_await dial(to, o.connect_timeout, role);
  Opened out{std::move(s), nullptr};
  if (c.tls() != nullptr) {
    std::unique_ptr<TlsSession> session = co_await handshake(out.socket, *c.tls(), to, role, o.connect_timeout);
    out.tls = std::move(session);
  }
  const Hello hello = hello_for(o, sentinel, out.tls != nullptr);
  if (hello.requests.size() == 0) co_return out;
  // No request of the caller's was sent yet: a failure here is an ordinary connection error.
  Wire w(out.socket, out.tls.get());
  const std::vector<ReplyPtr> answers =
      co_await exchange(w, hello.requests.all(), hello.requests.size(), Clock::now() + o.command_timeout);
  if (answers.empty()) w.throw_failure(c.where(), "while authenticating", o.command_timeout, to.port != 0);
  // The sentinels' answer can be a moment old: a demoted master answers ROLE slave.
  if (!hello_accepted(hello, answers)) {
    c.doubt_master();
    throw connection_error(fmt::format("idem: the sentinels name {} as the master '{}', but it does not answer ROLE "
                                       "master (a failover under way?); retry later",
                                       describe(to), o.sentinel_master),
                           "ROLE", true);
  }
  co_return out;
}

std::vector<ReplyPtr> Client::session(std::string_view requests, std::size_t replies, const char* during) const {
  net::io_context io;
  std::vector<ReplyPtr> out;
  std::exception_ptr failed;
  net::co_spawn(
      io,
      [&]() -> net::awaitable<void> {
        try {
          Opened c = co_await open_ready(*this);
          Wire w(c.socket, c.tls.get());
          std::vector<ReplyPtr> answers =
              co_await exchange(w, requests, replies, Clock::now() + opt_.command_timeout);
          if (answers.empty() && replies > 0)
            w.throw_failure(where(), during, opt_.command_timeout, !sentinels_.empty() || opt_.unix_socket.empty());
          out = std::move(answers);
        } catch (...) {
          failed = std::current_exception();
        }
      },
      net::detached);
  io.run();
  if (!failed) return out;
  try {
    std::rethrow_exception(failed);
  } catch (const connection_error&) {
    suspect();
    throw;
  } catch (const timeout_error&) {
    suspect();
    throw;
  }
}

}  // namespace idem::detail::redis
