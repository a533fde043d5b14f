// AsyncRedisStore's connection (connection.hpp): one socket on a strand. Requests queue while a
// write is under way and then go out together; replies are read as they come, parsed by hiredis's
// reader and matched in order to the requests in flight.

#include "connection.hpp"

#include <array>
#include <atomic>
#include <charconv>
#include <cstdint>
#include <vector>
#include <deque>
#include <string>

#include <boost/asio/generic/stream_protocol.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>

#include <fmt/format.h>
#include <hiredis/hiredis.h>

#include "idem/core/error.hpp"

namespace idem::detail::asio_redis {

namespace net = boost::asio;

namespace {
struct ReaderFree {
  void operator()(redisReader* r) const noexcept { redisReaderFree(r); }
};
using ReaderPtr = std::unique_ptr<redisReader, ReaderFree>;
}  // namespace

// The connection's own requests (AUTH, SELECT, SCRIPT LOAD).
struct Internal final : Op {
  void finish(std::exception_ptr, ReplyPtr) noexcept override {}
};

namespace {
// Parses the decimal in `text`; -1 when it is not one.
long long decimal(std::string_view text) {
  long long v = -1;
  const auto res = std::from_chars(text.data(), text.data() + text.size(), v);
  return res.ec == std::errc() && res.ptr == text.data() + text.size() ? v : -1;
}
// The end of the RESP bulk string at `at` in `b`, or npos.
std::size_t bulk_end(std::string_view b, std::size_t at) {
  if (at >= b.size() || b[at] != '$') return std::string_view::npos;
  const std::size_t eol = b.find("\r\n", at);
  if (eol == std::string_view::npos) return eol;
  const long long len = decimal(b.substr(at + 1, eol - at - 1));
  if (len < 0 || eol + 4 + static_cast<std::size_t>(len) > b.size()) return std::string_view::npos;
  return eol + 4 + static_cast<std::size_t>(len);
}
}  // namespace

void locate_step(Op& op, Script s) {
  const std::string_view b = op.bytes;
  const std::size_t eol = b.find("\r\n");
  if (b.empty() || b[0] != '*' || eol == std::string_view::npos) return;
  const long long argc = decimal(b.substr(1, eol - 1));
  std::size_t at = eol + 2;
  for (int i = 0; i < 3 && at != std::string_view::npos; ++i) at = bulk_end(b, at);  // EVALSHA sha 1
  const std::size_t args = at == std::string_view::npos ? at : bulk_end(b, at);
  if (args == std::string_view::npos || b.size() > UINT32_MAX) return;
  const long long nargs = argc - 4;
  const char* step = nullptr;
  switch (s) {
    case Script::acquire: step = nargs == 5 ? "a5" : nullptr; break;
    case Script::complete: step = nargs == 4 ? "c4" : nargs == 5 ? "c5" : nullptr; break;
    case Script::fail: step = nargs == 7 ? "f7" : nullptr; break;
    case Script::extend: step = nargs == 3 ? "e3" : nullptr; break;
    default: break;
  }
  if (step == nullptr) return;
  op.step = step;
  op.key_at = static_cast<std::uint32_t>(at);
  op.args_at = static_cast<std::uint32_t>(args);
  op.script_end = static_cast<std::uint32_t>(b.size());
}

// Several callers' one-key steps sent as one `many` call (auto-batching). Each member gets the
// reply element its own call would have had: the same answer, the same error (a damaged record,
// OOM), the same durability check (a WAIT after the call counts for the members whose step wrote),
// and, when the call had to be sent again after a lost reply, the same in-doubt error.
struct Group final : Op {
  std::vector<std::unique_ptr<Op>> members;
  const RedisOptions* opt = nullptr;
  const std::string* where = nullptr;
  ReplyPtr wait;  // with `waits`: the WAIT's reply

  void finish(std::exception_ptr e, ReplyPtr reply) noexcept override {
    if (!e && (reply->type != REDIS_REPLY_ARRAY || reply->elements != members.size()))
      e = capture([&] {
        throw_if_error(reply.get(), store_hints, [&] { return what; });
        throw_bad_reply(what);
      });
    if (e) {
      for (auto& m : members) m->finish(e, nullptr);
      return;
    }
    for (std::size_t i = 0; i < members.size(); ++i) {
      ReplyPtr one(reply->element[i]);
      reply->element[i] = nullptr;  // now owned by `one` (freeReplyObject skips null elements)
      Op& m = *members[i];
      if (resent && is_error(one.get())) {
        const std::string text(reply_text(one.get()));
        m.finish(capture([&] { throw_outcome_unknown(first, m.what, text, std::string(error_code(text))); }), nullptr);
        continue;
      }
      if (wait && !is_error(one.get()) && wrote(m.script, one.get()))
        if (auto we = capture([&] { check_wait(wait.get(), m.script, m.what, *opt, *where); })) {
          m.finish(we, nullptr);
          continue;
        }
      m.finish(nullptr, std::move(one));
    }
  }
};

class Connection : public std::enable_shared_from_this<Connection> {
public:
  Connection(net::any_io_executor ex, const RedisOptions& o)
      : opt_(o),
        strand_(net::make_strand(ex)),
        socket_(strand_),
        resolver_(strand_),
        timer_(strand_),
        where_(o.unix_socket.empty() ? describe({o.host, o.port}) : o.unix_socket) {}

  // Any thread: the op joins the queue on the strand.
  void submit(std::unique_ptr<Op> op) {
    net::post(strand_, [self = shared_from_this(), op = std::move(op)]() mutable { self->enqueue(std::move(op)); });
  }

  // The store is going away: every pending call fails, the socket closes.
  void shutdown() {
    net::post(strand_, [self = shared_from_this()] {
      self->closed_ = true;
      auto e = capture([] { throw connection_error("idem: the AsyncRedisStore was destroyed with this call pending; "
                                                   "the call may or may not have run", "", true); });
      self->drop_socket();
      self->fail_all(self->inflight_, e);
      self->fail_all(self->queued_, e);
    });
  }

  AsyncRedisStats stats() const noexcept {
    return {requests_.load(), writes_.load(), connects_.load(), resent_.load(), reloads_.load(), coalesced_.load()};
  }

private:
  enum class State { idle, connecting, handshaking, ready };

  void enqueue(std::unique_ptr<Op> op) {
    if (closed_) {
      op->finish(capture([] { throw usage_error("idem: this AsyncRedisStore is being destroyed"); }), nullptr);
      return;
    }
    queued_.push_back(std::move(op));
    if (state_ == State::idle) connect();
    else if (state_ == State::ready) schedule_write();
  }

  // With auto-batching, the write waits for the requests already posted to the strand (the other
  // callers woken by the same read) instead of leaving with the first of them: one post, never a
  // timer, so a lone call still goes out in this turn of the loop.
  void schedule_write() {
    if (opt_.auto_batch <= 1) return write();
    if (write_posted_ || writing_) return;  // a finishing write writes what queued meanwhile
    write_posted_ = true;
    net::post(strand_, [self = shared_from_this()] {
      self->write_posted_ = false;
      self->write();
    });
  }

  // --- connecting ---------------------------------------------------------------------------

  void connect() {
    state_ = State::connecting;
    ++generation_;
    ++connects_;
    arm_connect_timer();
    const auto gen = generation_;
    if (!opt_.unix_socket.empty()) {
      socket_.async_connect(net::generic::stream_protocol::endpoint(net::local::stream_protocol::endpoint(opt_.unix_socket)),
                            [self = shared_from_this(), gen](boost::system::error_code ec) { self->connected(gen, ec); });
      return;
    }
    resolver_.async_resolve(opt_.host, std::to_string(opt_.port),
                            [self = shared_from_this(), gen](boost::system::error_code ec,
                                                             net::ip::tcp::resolver::results_type rs) {
                              if (gen != self->generation_) return;
                              if (ec || rs.empty()) return self->connect_failed(ec ? ec.message() : "no address");
                              self->socket_.async_connect(
                                  net::generic::stream_protocol::endpoint(rs.begin()->endpoint()),
                                  [self, gen](boost::system::error_code ec2) { self->connected(gen, ec2); });
                            });
  }

  void arm_connect_timer() {
    timer_.expires_after(opt_.connect_timeout);
    timer_armed_ = true;
    timer_.async_wait([self = shared_from_this(), gen = generation_](boost::system::error_code ec) {
      if (ec || gen != self->generation_) return;
      self->timer_armed_ = false;
      if (self->state_ == State::connecting)
        self->connect_failed(fmt::format("no connection within connect_timeout ({})", ms(self->opt_.connect_timeout)));
      else
        self->arm_timer();
    });
  }

  void connected(std::uint64_t gen, boost::system::error_code ec) {
    if (gen != generation_) return;
    if (ec) return connect_failed(ec.message());
    if (opt_.unix_socket.empty()) {
      boost::system::error_code ignored;
      socket_.set_option(net::ip::tcp::no_delay(true), ignored);
    }
    timer_.cancel();  // the connect timeout; the handshake's command_timeout is armed as it is sent
    timer_armed_ = false;
    reader_.reset(redisReaderCreate());
    limit_aggregates(reader_.get());
    state_ = State::handshaking;
    // The handshake goes first, alone: a refused AUTH must not let any script run. The scripts
    // are not loaded here: the construction check loaded them all, and a server that lost them
    // (restart, SCRIPT FLUSH) answers NOSCRIPT, which loads the one it names and sends the call again.
    Pipeline hello;
    add_auth(hello, opt_.user, opt_.password);
    if (opt_.db != 0) hello.add(Command().arg("SELECT").arg(opt_.db).format());
    if (hello.size() == 0) {
      state_ = State::ready;
      write();
      read();
      return;
    }
    std::string bytes;
    for (std::size_t i = 0; i < hello.size(); ++i) {
      auto op = std::make_unique<Internal>();
      op->internal = op->handshake = true;
      op->what = "the connection handshake (AUTH/SELECT)";
      op->deadline = Clock::now() + opt_.command_timeout;
      bytes += hello[i];
      inflight_.push_back(std::move(op));
    }
    handshake_left_ = hello.size();
    send_bytes(std::move(bytes), hello.size());
    read();
  }

  void connect_failed(const std::string& why) {
    drop_socket();
    state_ = State::idle;
    const std::string text = fmt::format("cannot connect to Redis at {}: {}", where_, why);
    // Nothing queued was written on this connection: a first sending never ran; a resend's first
    // sending may have, so its outcome stays unknown.
    auto queued = std::move(queued_);
    queued_.clear();
    for (auto& op : queued) {
      if (op->resent)
        op->finish(capture([&] { throw_outcome_unknown(op->first, op->what, text, ""); }), nullptr);
      else
        op->finish(capture([&] {
                     throw connection_error(fmt::format("idem: {}; is it running there? retry later", text), "", true);
                   }),
                   nullptr);
    }
  }

  // A handshake reply: the first error fails the connection and everything queued with it.
  void handshake_reply(const redisReply* r, const std::string& what) {
    if (is_error(r) && !handshake_error_)
      handshake_error_ = capture([&] { throw_reply_error(reply_text(r), what, store_hints); });
    if (--handshake_left_ > 0) return;
    if (handshake_error_) {
      auto e = std::exchange(handshake_error_, nullptr);
      drop_socket();
      state_ = State::idle;
      fail_all(queued_, e);
      return;
    }
    state_ = State::ready;
    write();
  }

  // --- writing and reading ------------------------------------------------------------------

  // Everything queued goes out in one write; the next write waits for this one to finish. The
  // one-key steps among them (up to auto_batch per call) go as one `many` call: what queued behind
  // one write in flight.
  void write() {
    if (state_ != State::ready || writing_ || queued_.empty()) return;
    std::string bytes;
    std::size_t n = 0;
    const auto deadline = Clock::now() + opt_.command_timeout;
    auto put = [&](std::unique_ptr<Op> op) {
      bytes += op->bytes;
      op->deadline = deadline;
      inflight_.push_back(std::move(op));
      ++n;
    };
    std::vector<std::unique_ptr<Op>> steps;  // in arrival order
    std::size_t step_bytes = 0;
    auto flush = [&] {
      if (steps.size() == 1) put(std::move(steps.front()));
      else if (steps.size() > 1) put(group_of(std::move(steps)));
      steps.clear();
      step_bytes = 0;
    };
    while (!queued_.empty()) {
      std::unique_ptr<Op> op = std::move(queued_.front());
      queued_.pop_front();
      // A resent step stays alone: its in-doubt handling is its own.
      if (op->step == nullptr || op->resent || opt_.auto_batch <= 1) {
        put(std::move(op));
        continue;
      }
      step_bytes += op->script_end - op->key_at;
      steps.push_back(std::move(op));
      if (steps.size() >= opt_.auto_batch || step_bytes >= max_group_bytes) flush();
    }
    flush();
    send_bytes(std::move(bytes), n);
  }

  // A bound on one coalesced call's bytes, so a burst of large results is not one huge request.
  static constexpr std::size_t max_group_bytes = 1 << 20;

  std::unique_ptr<Op> group_of(std::vector<std::unique_ptr<Op>> steps) {
    auto g = std::make_unique<Group>();
    std::size_t argc = 3;  // EVALSHA sha numkeys
    for (const auto& m : steps) argc += 2 + static_cast<std::size_t>(m->step[1] - '0');  // key, step, its arguments
    const ScriptInfo& many = script(Script::many);
    const std::string keys = std::to_string(steps.size());
    g->bytes = fmt::format("*{}\r\n$7\r\nEVALSHA\r\n${}\r\n{}\r\n${}\r\n{}\r\n", argc, many.sha.size(), many.sha,
                           keys.size(), keys);
    for (const auto& m : steps) g->bytes.append(m->bytes, m->key_at, m->args_at - m->key_at);
    for (const auto& m : steps) {
      g->bytes.append("$2\r\n").append(m->step).append("\r\n");
      g->bytes.append(m->bytes, m->args_at, m->script_end - m->args_at);
    }
    const Op& first = *steps.front();
    if (first.waits) {  // every step writes, so every one carries the same WAIT
      g->bytes.append(first.bytes, first.script_end);
      g->waits = true;
    }
    g->script = Script::many;
    g->what = fmt::format("{} steps in one call (auto-batching; the first: {})", steps.size(), first.what);
    g->opt = &opt_;
    g->where = &where_;
    coalesced_ += steps.size();
    g->members = std::move(steps);
    return g;
  }

  void send_bytes(std::string bytes, std::size_t n) {
    requests_ += n;
    ++writes_;
    writing_ = true;
    wbuf_ = std::move(bytes);
    if (!timer_armed_) arm_timer();
    net::async_write(socket_, net::buffer(wbuf_),
                     [self = shared_from_this(), gen = generation_](boost::system::error_code ec, std::size_t) {
                       if (gen != self->generation_) return;
                       self->writing_ = false;
                       if (ec)
                         return self->broken({fmt::format("connection to Redis at {} broke while sending: {}",
                                                          self->where_, ec.message()),
                                              false});
                       self->write();
                     });
  }

  void read() {
    socket_.async_read_some(net::buffer(rbuf_), [self = shared_from_this(), gen = generation_](
                                                     boost::system::error_code ec, std::size_t n) {
      if (gen != self->generation_) return;
      if (ec) {
        const std::string why = ec == net::error::eof ? "the server closed it" : ec.message();
        return self->broken({fmt::format("connection to Redis at {} broke: {}", self->where_, why), false});
      }
      self->received(n);
    });
  }

  void received(std::size_t n) {
    const auto gen = generation_;
    if (redisReaderFeed(reader_.get(), rbuf_.data(), n) != REDIS_OK)
      return broken({fmt::format("Redis at {} sent bytes that are not RESP", where_), false});
    for (;;) {
      void* raw = nullptr;
      if (redisReaderGetReply(reader_.get(), &raw) != REDIS_OK)
        return broken({fmt::format("Redis at {} sent a reply that is not RESP: {}", where_,
                                   reader_error(reader_->err, reader_->errstr)),
                       false});
      if (raw == nullptr) break;
      ReplyPtr reply(static_cast<redisReply*>(raw));
      if (inflight_.empty()) return broken({fmt::format("Redis at {} sent a reply to no request", where_), false});
      Op& front = *inflight_.front();
      if (front.waits && !front.script_reply) {  // the script's reply; its WAIT's comes next
        front.script_reply = std::move(reply);
        continue;
      }
      std::unique_ptr<Op> op = std::move(inflight_.front());
      inflight_.pop_front();
      if (op->waits) {
        ReplyPtr wait = std::move(reply);
        reply = std::move(op->script_reply);
        if (auto* g = dynamic_cast<Group*>(op.get())) {
          g->wait = std::move(wait);  // checked per member, for the steps that wrote
        } else if (!is_noscript(reply.get()) && !(op->resent && is_error(reply.get()))) {
          if (auto e = check_acks(*op, reply.get(), wait.get())) {
            op->finish(e, nullptr);
            continue;
          }
        }
      }
      deliver(std::move(op), std::move(reply));
      if (gen != generation_) return;  // the delivery broke the connection (a failed handshake)
    }
    write();
    read();
  }

  void deliver(std::unique_ptr<Op> op, ReplyPtr reply) {
    if (op->handshake) return handshake_reply(reply.get(), op->what);
    if (op->internal) return;  // a reload: the request sent after it answers for both
    if (is_noscript(reply.get()) && !op->reloaded) {
      // SCRIPT FLUSH or a restart under us: the call ran nothing. SCRIPT LOAD goes first in the
      // next write and the call right after it; a second NOSCRIPT is an error.
      ++reloads_;
      auto load = std::make_unique<Internal>();
      load->internal = true;
      load->what = fmt::format("SCRIPT LOAD of {}", script(op->script).name);
      load->bytes.assign(Command().arg("SCRIPT").arg("LOAD").arg(script(op->script).source).format().view());
      op->reloaded = true;
      queued_.push_front(std::move(op));
      queued_.push_front(std::move(load));
      return;
    }
    if (op->resent && is_error(reply.get())) {
      const std::string text(reply_text(reply.get()));
      return op->finish(capture([&] { throw_outcome_unknown(op->first, op->what, text, std::string(error_code(text))); }),
                        nullptr);
    }
    op->finish(nullptr, std::move(reply));
  }

  // min_replica_acks: a reply that changed a record counts only once enough replicas have it (the
  // WAIT went in the same write, so it covers this connection's writes up to and including it).
  std::exception_ptr check_acks(const Op& op, const redisReply* r, const redisReply* wait) const {
    if (is_error(r) || !wrote(op.script, r)) return nullptr;  // an error, or nothing a failover could lose
    return capture([&] { check_wait(wait, op.script, op.what, opt_, where_); });
  }

  // --- timeouts and failures ----------------------------------------------------------------

  // One timer for the oldest request in flight: the deadlines grow along the queue, so when it
  // fires early for a request already answered, it is re-armed for the new oldest.
  void arm_timer() {
    if (inflight_.empty()) return;
    timer_armed_ = true;
    timer_.expires_at(inflight_.front()->deadline);
    timer_.async_wait([self = shared_from_this(), gen = generation_](boost::system::error_code ec) {
      if (ec || gen != self->generation_) return;
      self->timer_armed_ = false;
      if (self->inflight_.empty()) return;
      if (self->inflight_.front()->deadline <= Clock::now())
        return self->broken({fmt::format("Redis at {} did not answer within command_timeout ({})", self->where_,
                                         ms(self->opt_.command_timeout)),
                             true});
      self->arm_timer();
    });
  }

  // The connection is gone: each request on it may have run. A holder's step is sent once more on
  // a fresh connection (in its place in the queue), other requests fail in doubt.
  void broken(IoFailure f) {
    drop_socket();
    state_ = State::idle;
    auto doubt = std::move(inflight_);
    inflight_.clear();
    const bool handshake = handshake_left_ > 0;
    handshake_left_ = 0;
    handshake_error_ = nullptr;
    for (auto it = doubt.rbegin(); it != doubt.rend(); ++it) {
      std::unique_ptr<Op>& op = *it;
      if (op->internal) continue;
      if (op->resent) {
        op->finish(capture([&] { throw_outcome_unknown(op->first, op->what, f.text, ""); }), nullptr);
      } else if (op->same_holder) {
        op->script_reply.reset();
        op->resent = true;
        op->first = f;
        ++resent_;
        queued_.push_front(std::move(op));
      } else {
        op->finish(capture([&] { throw_io_error(f, true); }), nullptr);
      }
    }
    // A connection lost during its handshake is not retried at once (no loop against a server
    // that accepts and then drops connections): what waits for it fails, retryable.
    if (handshake) return connect_failed(f.text);
    if (!queued_.empty() && !closed_) connect();
  }

  void drop_socket() {
    ++generation_;  // every callback of the old socket now returns at once
    boost::system::error_code ignored;
    socket_.close(ignored);
    resolver_.cancel();
    timer_.cancel();
    timer_armed_ = false;
    writing_ = false;
    reader_.reset();
  }

  static void fail_all(std::deque<std::unique_ptr<Op>>& ops, const std::exception_ptr& e) {
    auto all = std::move(ops);
    ops.clear();
    for (auto& op : all)
      if (!op->internal) op->finish(e, nullptr);
  }

  RedisOptions opt_;
  net::strand<net::any_io_executor> strand_;
  net::generic::stream_protocol::socket socket_;
  net::ip::tcp::resolver resolver_;
  net::steady_timer timer_;
  std::string where_;
  State state_ = State::idle;
  std::uint64_t generation_ = 0;
  bool writing_ = false;
  bool timer_armed_ = false;
  bool closed_ = false;
  bool write_posted_ = false;
  std::size_t handshake_left_ = 0;
  std::exception_ptr handshake_error_;
  std::deque<std::unique_ptr<Op>> queued_;    // not written yet, in order
  std::deque<std::unique_ptr<Op>> inflight_;  // written, waiting for their replies, in order
  std::string wbuf_;
  std::array<char, 64 * 1024> rbuf_{};
  ReaderPtr reader_;
  std::atomic<std::uint64_t> requests_{0}, writes_{0}, connects_{0}, resent_{0}, reloads_{0}, coalesced_{0};
};

std::shared_ptr<Connection> make_connection(net::any_io_executor ex, const RedisOptions& o) {
  return std::make_shared<Connection>(std::move(ex), o);
}
void submit(Connection& c, std::unique_ptr<Op> op) { c.submit(std::move(op)); }
void shutdown(Connection& c) { c.shutdown(); }
AsyncRedisStats stats(const Connection& c) noexcept { return c.stats(); }

}  // namespace idem::detail::asio_redis
