// AsyncRedisStore's connection (connection.hpp): one socket on a strand, opened by the connection
// factory every Redis entry point shares (Client::open_ready: TCP or Unix, TLS, AUTH, SELECT,
// Sentinel). Requests queue while a write is under way and then go out together, one-key steps
// coalesced; replies are read as they come, parsed by hiredis's reader and matched in order.
//
// A blocked caller that finds the connection idle writes its request and reads the reply on its
// own thread (call): one request in flight costs no hop to the loop and back. The connection is
// handed between the strand and such a caller through one atomic (Owner): the strand parks it when
// nothing is queued, in flight or being read, a caller claims a parked one, and the strand takes it
// back before it writes again; a caller whose request goes wrong hands it back with the request.

#include "connection.hpp"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <climits>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/generic/stream_protocol.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/execution/outstanding_work.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/prefer.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>

#include <fmt/format.h>
#include <hiredis/hiredis.h>

#include "cluster.hpp"
#include "idem/core/error.hpp"
#include "idem/core/hex.hpp"
#include "tls.hpp"

namespace idem::detail::asio_redis {

namespace net = boost::asio;

namespace {
struct ReaderFree {
  void operator()(redisReader* r) const noexcept { redisReaderFree(r); }
};
using ReaderPtr = std::unique_ptr<redisReader, ReaderFree>;
}  // namespace

std::string Op::describe() const {
  if (!label.empty()) return label;
  return fmt::format("{} of key '{}'", idem::detail::redis::script(script).name, detail::printable(key));
}

// The connection's own requests (SCRIPT LOAD after NOSCRIPT, the idle PING).
struct Internal final : Op {
  void finish(std::exception_ptr, ReplyPtr) noexcept override {}
};

namespace {
// Waits until `fd` is ready for `events` (or has an error to report); false at the deadline.
bool wait_fd(int fd, short events, Clock::time_point deadline) noexcept {
  for (;;) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, INT_MAX)));
    if (rc > 0 || (rc < 0 && errno != EINTR)) return true;  // the I/O call that follows says what it is
  }
}
}  // namespace

class Connection : public std::enable_shared_from_this<Connection> {
public:
  Connection(net::any_io_executor ex, const RedisOptions& o, std::shared_ptr<const Client> factory,
             std::weak_ptr<Routing> routing)
      : opt_(o), factory_(std::move(factory)), routing_(std::move(routing)),
        work_(net::prefer(ex, net::execution::outstanding_work.tracked)), strand_(net::make_strand(ex)),
        socket_(strand_), timer_(strand_), idle_timer_(strand_), where_(factory_->where()) {}
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;
  ~Connection() {
    // The last reference can be dropped by the opening thread itself (its handler never ran).
    if (opener_.joinable()) {
      if (opener_.get_id() == std::this_thread::get_id()) opener_.detach();
      else opener_.join();
    }
  }

  // A blocked caller's request, on its own thread when the connection is parked, else queued.
  void call(std::unique_ptr<Op> op) {
    Owner parked = Owner::parked;
    if (!owner_.compare_exchange_strong(parked, Owner::caller, std::memory_order_acq_rel)) return submit(std::move(op));
    run_here(std::move(op));
  }

  // Any thread: the op joins the queue on the strand.
  void submit(std::unique_ptr<Op> op) {
    net::post(strand_, [self = shared_from_this(), op = std::move(op)]() mutable { self->enqueue(std::move(op)); });
  }
  // One post for all: the write they schedule finds them all queued.
  void submit(std::vector<std::unique_ptr<Op>> ops) {
    net::post(strand_, [self = shared_from_this(), ops = std::move(ops)]() mutable {
      for (auto& op : ops) self->enqueue(std::move(op));
    });
  }

  // The store is going away: a connection being opened is waited for (it posts to the strand),
  // then every pending call fails and the socket closes.
  void shutdown() {
    {
      std::lock_guard lk(opener_mu_);
      stopping_ = true;  // no opening starts after this one: its post could outlive the executor
      if (opener_.joinable()) opener_.join();
    }
    net::post(strand_, [self = shared_from_this()] { self->close(); });
  }

  AsyncRedisStats stats() const noexcept {
    return {requests_.load(),  writes_.load(),    connects_.load(),      resent_.load(),
            reloads_.load(),   coalesced_.load(), health_checks_.load(), health_failures_.load()};
  }

private:
  enum class State { idle, connecting, ready };
  // Who may use the socket: the strand; nobody (parked: ready and quiet, for the next blocked
  // caller); a blocked caller on its own thread; the same with requests queued behind it (wanted:
  // the caller hands the connection to the strand when done instead of parking it).
  enum class Owner { strand, parked, caller, wanted };

  void close() {
    Owner parked = Owner::parked;
    if (!owner_.compare_exchange_strong(parked, Owner::strand, std::memory_order_acq_rel) && parked != Owner::strand)
      return net::post(strand_, [self = shared_from_this()] { self->close(); });  // a caller is finishing with it
    closed_ = true;
    work_ = {};
    idle_timer_.cancel();
    auto e = capture([] { throw connection_error("idem: the AsyncRedisStore was destroyed with this call pending; "
                                                 "the call may or may not have run", "", true); });
    drop_socket();
    fail_all(inflight_, e);
    fail_all(queued_, e);
  }

  // --- a blocked caller on its own thread -------------------------------------------------------

  // The caller's own write and read, as write() and received() would do them for one request. It
  // finishes the common case itself (any reply but an error one); everything else (a connection
  // found closed, a write or read that failed, an error reply for the machine to decide on) is
  // handed to the strand with the request, in the state the strand would have it in.
  void run_here(std::unique_ptr<Op> op) {
    if (!quiet())
      return hand_back(std::move(op), false,
                       {fmt::format("connection to Redis at {} was closed by the server while idle", where_), false});
    touch();
    ++requests_;
    ++writes_;
    op->deadline = Clock::now() + opt_.command_timeout;
    IoFailure f;
    const std::size_t sent = send_here(op->bytes, op->deadline, f);
    if (sent < op->bytes.size()) return hand_back(std::move(op), sent > 0, std::move(f));
    ReplyPtr reply = read_here(op->deadline, f);
    ReplyPtr wait;
    if (reply && op->waits) wait = read_here(op->deadline, f);
    if (!reply || (op->waits && !wait)) return hand_back(std::move(op), true, std::move(f));
    touch();
    if (op->waits)
      if (auto e = acks_failed(*op, reply, wait)) {
        release();
        return op->finish(e, nullptr);
      }
    if (is_error(reply.get())) return hand_reply(std::move(op), std::move(reply));
    release();
    op->finish(nullptr, std::move(reply));
  }

  // Nothing has come on the idle connection: the server has not closed it (a restart, its timeout).
  bool quiet() noexcept {
    const bool idle = link_.idle();
    if (link_.tls) link_.tls->nonblocking_ = true;  // idle() leaves the session blocking
    return idle;
  }

  // Writes `data` until all is written, an error or `deadline`: the bytes written (`f` says why when short).
  std::size_t send_here(std::string_view data, Clock::time_point deadline, IoFailure& f) {
    std::size_t done = 0;
    for (;;) {
      done += link_.write(data.substr(done));
      if (done == data.size()) return done;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        f = {fmt::format("connection to Redis at {} broke while sending: {}", where_,
                         link_.tls ? tls_failure() : std::string(std::strerror(errno))),
             false};
        return done;
      }
      if (!wait_fd(link_->fd, POLLOUT, deadline)) {
        f = {timed_out_text(), true};
        return done;
      }
    }
  }

  // The next whole reply, or null with `f` saying why.
  ReplyPtr read_here(Clock::time_point deadline, IoFailure& f) {
    for (;;) {
      void* raw = nullptr;
      if (redisReaderGetReply(reader_.get(), &raw) != REDIS_OK) {
        f = {fmt::format("Redis at {} sent a reply that is not RESP: {}", where_, reader_error(reader_->err, reader_->errstr)),
             false};
        return nullptr;
      }
      if (raw != nullptr) return ReplyPtr(static_cast<redisReply*>(raw));
      const long n = link_.tls ? link_.tls->read(rbuf_.data(), rbuf_.size())
                               : static_cast<long>(::recv(link_->fd, rbuf_.data(), rbuf_.size(), 0));
      if (n > 0) {
        if (redisReaderFeed(reader_.get(), rbuf_.data(), static_cast<std::size_t>(n)) != REDIS_OK) {
          f = {fmt::format("Redis at {} sent bytes that are not RESP", where_), false};
          return nullptr;
        }
        continue;
      }
      if (n < 0 && errno == EINTR && !link_.tls) continue;
      if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK) || (link_.tls && link_.tls->refused())) {
        const std::string why = n == 0 ? "the server closed it" : link_.tls ? tls_failure() : std::strerror(errno);
        f = {fmt::format("connection to Redis at {} broke: {}", where_, why), false};
        return nullptr;
      }
      if (!wait_fd(link_->fd, POLLIN, deadline)) {
        f = {timed_out_text(), true};
        return nullptr;
      }
    }
  }

  // The caller is done with the connection: parked again, or, with requests queued behind it,
  // handed to the strand to write them.
  void release() {
    Owner mine = Owner::caller;
    if (owner_.compare_exchange_strong(mine, Owner::parked, std::memory_order_acq_rel)) return;
    net::post(strand_, [self = shared_from_this()] {
      self->owner_.store(Owner::strand, std::memory_order_release);
      self->write();
    });
  }

  // The caller's request met a broken connection: the strand takes both and deals with them as
  // with its own (broken): one that may have run is in flight (resent once as the same holder),
  // one that never left is queued first.
  void hand_back(std::unique_ptr<Op> op, bool maybe_ran, IoFailure f) {
    net::post(strand_, [self = shared_from_this(), op = std::move(op), maybe_ran, f = std::move(f)]() mutable {
      self->owner_.store(Owner::strand, std::memory_order_release);
      (maybe_ran ? self->inflight_ : self->queued_).push_front(std::move(op));
      self->broken(std::move(f));
    });
  }

  // An error reply (NOSCRIPT, MOVED, READONLY, the script's own): the machine's decision is the
  // strand's to carry out (a reload, a reroute, leaving a demoted master, the caller's error).
  void hand_reply(std::unique_ptr<Op> op, ReplyPtr reply) {
    net::post(strand_, [self = shared_from_this(), op = std::move(op), reply = std::move(reply)]() mutable {
      self->owner_.store(Owner::strand, std::memory_order_release);
      self->deliver(std::move(op), std::move(reply));
      self->write();
    });
  }

  // --- the strand's side of the hand-over ---------------------------------------------------------

  // Before the strand uses a ready connection: true when it has it (a parked one found closed by
  // the server is dropped instead, as a read would have found it); false when a blocked caller has
  // it, who then hands it over when done (wanted).
  bool take() {
    Owner o = owner_.load(std::memory_order_acquire);
    for (;;) {
      switch (o) {
        case Owner::strand:
          return true;
        case Owner::wanted:
          return false;
        case Owner::parked:
          if (!owner_.compare_exchange_weak(o, Owner::strand, std::memory_order_acq_rel)) continue;
          if (quiet()) return true;
          broken({fmt::format("connection to Redis at {} was closed by the server while idle", where_), false});
          return false;
        case Owner::caller:
          if (!owner_.compare_exchange_weak(o, Owner::wanted, std::memory_order_acq_rel)) continue;
          return false;
      }
    }
  }

  // Nothing queued, in flight or being read: the next blocked caller may use the connection.
  void park() {
    if (state_ == State::ready && !closed_ && queued_.empty() && inflight_.empty() && !writing_ && !reading_ &&
        !write_posted_)
      owner_.store(Owner::parked, std::memory_order_release);
  }

  void touch() noexcept { last_activity_.store(Clock::now(), std::memory_order_relaxed); }
  std::string timed_out_text() const {
    return fmt::format("Redis at {} did not answer within command_timeout ({})", where_, ms(opt_.command_timeout));
  }

  void enqueue(std::unique_ptr<Op> op) {
    if (closed_) {
      op->finish(capture([] { throw usage_error("idem: this AsyncRedisStore is being destroyed"); }), nullptr);
      return;
    }
    queued_.push_back(std::move(op));
    if (state_ == State::idle) connect();
    else if (state_ == State::ready && take()) schedule_write();
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

  // The one connection factory every Redis entry point uses (Client::open_ready: TLS and its
  // checks, AUTH, SELECT, Sentinel discovery and the ROLE check) runs on a thread of its own, so
  // the loop never blocks on a connect; the ready socket is then driven here. Connections are
  // opened rarely (the first call, a reconnect), so a thread per opening costs nothing that counts.
  void connect() {
    state_ = State::connecting;
    ++generation_;
    ++connects_;
    std::lock_guard lk(opener_mu_);
    if (stopping_) {
      state_ = State::idle;
      return fail_all(queued_, capture([] { throw usage_error("idem: this AsyncRedisStore is being destroyed"); }));
    }
    if (opener_.joinable()) opener_.join();  // the previous opening posted its result already
    // The thread touches no member: the store's destruction waits for it (shutdown), but a
    // Connection kept alive by a queued handler must not be reached through `this` from here.
    opener_ = std::thread([factory = factory_, strand = strand_, weak = weak_from_this(), gen = generation_] {
      std::exception_ptr e;
      auto link = std::make_shared<Link>();
      try {
        *link = factory->open_ready();
      } catch (...) {
        e = std::current_exception();
      }
      if (auto self = weak.lock())
        net::post(strand, [self, gen, link, e] { self->connected(gen, std::move(*link), e); });
    });
  }

  void connected(std::uint64_t gen, Link link, std::exception_ptr e) {
    if (gen != generation_) return;
    if (e) return connect_failed(e);
    where_ = factory_->where();
    const int fd = ::dup(link->fd);
    sockaddr_storage addr{};
    socklen_t len = sizeof addr;
    boost::system::error_code ec;
    if (fd < 0 || ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      if (fd >= 0) ::close(fd);
      return connect_failed(capture([&] {
        throw connection_error(fmt::format("idem: cannot take over the connection to Redis at {}: {}", where_,
                                           std::strerror(errno)),
                               "", true);
      }));
    }
    const int family = addr.ss_family;
    socket_.assign(net::generic::stream_protocol(family, family == AF_UNIX ? 0 : IPPROTO_TCP), fd, ec);
    if (ec) {
      ::close(fd);
      return connect_failed(capture([&] {
        throw connection_error(fmt::format("idem: cannot take over the connection to Redis at {}: {}", where_, ec.message()),
                               "", true);
      }));
    }
    if (family != AF_UNIX) socket_.set_option(net::ip::tcp::no_delay(true), ec);
    link_ = std::move(link);
    if (link_.tls) link_.tls->nonblocking_ = true;  // its reads and writes answer EAGAIN instead of waiting
    reader_.reset(redisReaderCreate());
    limit_aggregates(reader_.get());
    state_ = State::ready;
    touch();
    write();  // it reads once it has written, and parks the connection when nothing is queued
    arm_idle_check();
  }

  // Nothing queued was written on this connection: a first sending never ran and fails with the
  // factory's own error (a TLS check is not retryable, a server down is); a resend's first sending
  // may have run, so its outcome stays unknown.
  void connect_failed(const std::exception_ptr& e) {
    drop_socket();
    state_ = State::idle;
    doubt();
    std::string text = "no connection";
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      text = x.what();
    }
    auto queued = std::move(queued_);
    queued_.clear();
    for (auto& op : queued)
      if (!op->internal) op->finish(on_unsent(op->attempt, e, text, op->describe()).error, nullptr);
  }

  // --- writing and reading ------------------------------------------------------------------

  // Everything queued goes out in one write; the next write waits for this one to finish. The
  // one-key steps among them (up to auto_batch per call) go as one `many` call: what queued behind
  // one write in flight.
  void write() {
    if (state_ != State::ready || writing_) return;
    if (queued_.empty()) return park();
    std::string bytes;
    std::size_t n = 0;
    const auto deadline = Clock::now() + opt_.command_timeout;
    auto put = [&](std::unique_ptr<Op> op) {
      op->asking_sent = op->asking;  // this node imports the slot: it serves the key after ASKING
      if (op->asking) bytes += "*1\r\n$6\r\nASKING\r\n";
      bytes += op->bytes;
      op->deadline = deadline;
      inflight_.push_back(std::move(op));
      ++n;
    };
    // The steps to coalesce, per slot (one group when not in cluster mode), each in arrival order.
    struct Steps {
      int slot;
      std::vector<std::unique_ptr<Op>> ops;
      std::size_t bytes = 0;
    };
    std::vector<Steps> groups;
    auto flush = [&](Steps& g) {
      if (g.ops.size() == 1) put(std::move(g.ops.front()));
      else if (g.ops.size() > 1) put(coalesce(std::move(g.ops), opt_, where_, coalesced_));
      g.ops.clear();
      g.bytes = 0;
    };
    while (!queued_.empty()) {
      std::unique_ptr<Op> op = std::move(queued_.front());
      queued_.pop_front();
      // A resent step stays alone: its in-doubt handling is its own; so does one sent after ASKING.
      if (op->step == 0 || op->attempt.resent || op->asking || op->solo || opt_.auto_batch <= 1) {
        put(std::move(op));
        continue;
      }
      auto g = std::find_if(groups.begin(), groups.end(), [&](const Steps& x) { return x.slot == op->slot; });
      if (g == groups.end()) g = groups.insert(groups.end(), Steps{op->slot, {}});
      g->bytes += op->script_end - op->key_at;
      g->ops.push_back(std::move(op));
      if (g->ops.size() >= opt_.auto_batch || g->bytes >= max_coalesced_bytes) flush(*g);
    }
    for (auto& g : groups) flush(g);
    send_bytes(std::move(bytes), n);
  }

  void send_bytes(std::string bytes, std::size_t n) {
    touch();
    requests_ += n;
    ++writes_;
    writing_ = true;
    wbuf_ = std::move(bytes);
    wdone_ = 0;
    if (!timer_armed_) arm_timer();
    if (!reading_) read();
    if (link_.tls) return write_tls(generation_);
    net::async_write(socket_, net::buffer(wbuf_),
                     [self = shared_from_this(), gen = generation_](boost::system::error_code ec, std::size_t) {
                       if (gen != self->generation_) return;
                       if (ec) return self->send_failed(ec.message());
                       self->written();
                     });
  }

  // TLS: the session writes whole records until the socket would block, then waits until it can
  // write again (OpenSSL wants the same remaining bytes at the same address, which wbuf_ keeps).
  void write_tls(std::uint64_t gen) {
    wdone_ += link_.tls->write(std::string_view(wbuf_).substr(wdone_));
    if (wdone_ == wbuf_.size()) return written();
    if (errno != EAGAIN) return send_failed(tls_failure());
    socket_.async_wait(net::socket_base::wait_write, [self = shared_from_this(), gen](boost::system::error_code ec) {
      if (gen != self->generation_) return;
      if (ec) return self->send_failed(ec.message());
      self->write_tls(gen);
    });
  }

  void written() {
    writing_ = false;
    write();
  }

  void send_failed(const std::string& why) {
    broken({fmt::format("connection to Redis at {} broke while sending: {}", where_, why), false});
  }

  std::string tls_failure() const {
    const TlsSession& s = *link_.tls;
    return s.failure().empty() ? std::string(errno == 0 ? "the server closed it" : std::strerror(errno)) : s.failure();
  }

  // A read waits on the socket only while something is in flight: an idle connection is parked
  // for a blocked caller, who reads on its own thread.
  void read() {
    reading_ = true;
    if (link_.tls) {
      socket_.async_wait(net::socket_base::wait_read, [self = shared_from_this(), gen = generation_](
                                                          boost::system::error_code ec) {
        if (gen != self->generation_) return;
        self->reading_ = false;
        if (ec) return self->broken({fmt::format("connection to Redis at {} broke: {}", self->where_, ec.message()), false});
        self->read_tls();
      });
      return;
    }
    socket_.async_read_some(net::buffer(rbuf_), [self = shared_from_this(), gen = generation_](
                                                     boost::system::error_code ec, std::size_t n) {
      if (gen != self->generation_) return;
      self->reading_ = false;
      if (ec) {
        const std::string why = ec == net::error::eof ? "the server closed it" : ec.message();
        return self->broken({fmt::format("connection to Redis at {} broke: {}", self->where_, why), false});
      }
      if (!self->received(n)) return;
      self->next();
    });
  }

  // After a read: what queued goes out, the read goes on while anything is in flight, and a
  // connection with nothing left is parked (write()).
  void next() {
    write();
    if (!inflight_.empty() && !reading_) read();
  }

  // TLS: everything the session has decrypted (it may hold more than the socket shows), then wait.
  void read_tls() {
    for (;;) {
      const long n = link_.tls->read(rbuf_.data(), rbuf_.size());
      if (n > 0) {
        if (!received(static_cast<std::size_t>(n))) return;
        continue;
      }
      if (n < 0 && errno == EAGAIN && !link_.tls->refused()) break;
      return broken({fmt::format("connection to Redis at {} broke: {}", where_, n == 0 ? "the server closed it" : tls_failure()),
                     false});
    }
    next();
  }

  // Feeds n bytes to the reader and delivers every whole reply; false when that broke the connection.
  bool received(std::size_t n) {
    const auto gen = generation_;
    touch();
    if (redisReaderFeed(reader_.get(), rbuf_.data(), n) != REDIS_OK) {
      broken({fmt::format("Redis at {} sent bytes that are not RESP", where_), false});
      return false;
    }
    for (;;) {
      void* raw = nullptr;
      if (redisReaderGetReply(reader_.get(), &raw) != REDIS_OK) {
        broken({fmt::format("Redis at {} sent a reply that is not RESP: {}", where_,
                            reader_error(reader_->err, reader_->errstr)),
                false});
        return false;
      }
      if (raw == nullptr) return true;
      ReplyPtr reply(static_cast<redisReply*>(raw));
      if (inflight_.empty()) {
        broken({fmt::format("Redis at {} sent a reply to no request", where_), false});
        return false;
      }
      Op& front = *inflight_.front();
      if (front.asking_sent) {  // ASKING's +OK; the request's own reply comes next
        front.asking_sent = false;
        continue;
      }
      if (front.waits && !front.script_reply) {  // the script's reply; its WAIT's comes next
        front.script_reply = std::move(reply);
        continue;
      }
      std::unique_ptr<Op> op = std::move(inflight_.front());
      inflight_.pop_front();
      if (op->waits) {
        ReplyPtr wait = std::move(reply);
        reply = std::move(op->script_reply);
        if (auto e = acks_failed(*op, reply, wait)) {
          op->finish(e, nullptr);
          continue;
        }
      }
      deliver(std::move(op), std::move(reply));
      if (gen != generation_) return false;  // the delivery broke the connection (a replica answered)
    }
  }

  void deliver(std::unique_ptr<Op> op, ReplyPtr reply) {
    if (op->internal) return;  // a reload: the request sent after it answers for both
    if (!is_error(reply.get())) return op->finish(nullptr, std::move(reply));
    auto routing = op->slot >= 0 ? routing_.lock() : nullptr;
    const Route route{.cluster = routing != nullptr, .sentinel = !opt_.sentinels.empty(), .max_redirects = opt_.max_redirects};
    Decision d = on_reply(op->attempt, reply.get(), route, op->describe(), op->slot);
    switch (d.next) {
      case Next::moved:
      case Next::ask:
      case Next::later:
        // Cluster: it ran nothing here; the router sends it where it belongs.
        op->script_reply.reset();
        return routing->reroute(std::move(op), d);
      case Next::reload: {
        // SCRIPT LOAD goes first in the next write and the call right after it.
        ++reloads_;
        auto load = std::make_unique<Internal>();
        load->internal = true;
        load->label = fmt::format("SCRIPT LOAD of {}", script(op->script).name);
        load->bytes.assign(Command().arg("SCRIPT").arg("LOAD").arg(script(op->script).source).format().view());
        queued_.push_front(std::move(op));
        queued_.push_front(std::move(load));
        return;
      }
      case Next::leave_master:
        // It goes first on the next connection, which asks the sentinels again; what was behind
        // it is in doubt as on any broken connection.
        op->script_reply.reset();
        queued_.push_front(std::move(op));
        return broken({fmt::format("Redis at {}: {}", where_, d.why), false});
      case Next::fail:
        return op->finish(d.error, nullptr);
      case Next::deliver:
      case Next::resend:
        break;
    }
    op->finish(nullptr, std::move(reply));
  }

  // min_replica_acks: a reply that changed a record counts only once enough replicas have it (the
  // WAIT went in the same write, so it covers this connection's writes up to and including it). A
  // coalesced call keeps the WAIT's reply and checks it per member (keeps_wait); an error reply
  // (NOSCRIPT, a resend's) is the machine's to decide.
  std::exception_ptr acks_failed(Op& op, const ReplyPtr& reply, ReplyPtr& wait) const {
    const redisReply* r = reply.get();
    if (op.keeps_wait(wait) || is_error(r) || !wrote(op.script, r)) return nullptr;  // nothing a failover could lose
    return capture([&] { check_wait(wait.get(), op.script, op.describe(), opt_, where_); });
  }

  // --- timeouts and failures ----------------------------------------------------------------

  // The idle health check: a ready connection with nothing sent or received for
  // health_check_interval sends PING. Its reply is dropped like a reload's; no reply within
  // command_timeout breaks the connection as any late reply does (arm_timer), and with nothing
  // queued it stays closed until the next call opens a fresh one. One timer per connection,
  // re-armed for the rest of the interval while there is traffic.
  void arm_idle_check() {
    if (opt_.health_check_interval <= millis{0} || idle_armed_) return;
    idle_armed_ = true;
    idle_timer_.expires_at(last_activity_.load(std::memory_order_relaxed) + opt_.health_check_interval);
    // A reconnect meanwhile is a connection like any other: its own activity is what counts.
    idle_timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      self->idle_armed_ = false;
      if (ec || self->closed_ || self->state_ != State::ready) return;
      if (!self->inflight_.empty() || !self->queued_.empty() ||
          Clock::now() < self->last_activity_.load(std::memory_order_relaxed) + self->opt_.health_check_interval ||
          !self->take())  // busy, or a blocked caller has it (or it was found closed: dropped)
        return self->arm_idle_check();
      auto ping = std::make_unique<Internal>();
      ping->internal = true;
      ping->probe = true;
      ping->label = "PING (idle health check)";
      ping->bytes = "*1\r\n$4\r\nPING\r\n";
      ++self->health_checks_;
      self->queued_.push_back(std::move(ping));
      self->write();
      self->arm_idle_check();
    });
  }

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
        return self->broken({self->timed_out_text(), true});
      self->arm_timer();
    });
  }

  // The connection is gone: each request on it may have run. A holder's step is sent once more on
  // a fresh connection (in its place in the queue), other requests fail in doubt.
  void broken(IoFailure f) {
    drop_socket();
    state_ = State::idle;
    doubt();
    auto doubt = std::move(inflight_);
    inflight_.clear();
    for (auto it = doubt.rbegin(); it != doubt.rend(); ++it) {
      std::unique_ptr<Op>& op = *it;
      if (op->probe) ++health_failures_;
      if (op->internal) continue;
      const Decision d = on_lost(op->attempt, f, op->same_holder ? Resend::same_holder : Resend::never, op->describe());
      if (d.next == Next::resend) {
        op->script_reply.reset();
        ++resent_;
        queued_.push_front(std::move(op));
      } else {
        op->finish(d.error, nullptr);
      }
    }
    if (!queued_.empty() && !closed_) connect();
  }

  void doubt() noexcept {
    factory_->doubt_master();
    if (auto r = routing_.lock()) r->doubt();
  }

  void drop_socket() {
    ++generation_;  // every callback of the old socket now returns at once
    boost::system::error_code ignored;
    socket_.close(ignored);
    timer_.cancel();
    timer_armed_ = false;
    writing_ = false;
    reading_ = false;
    reader_.reset();
    link_ = Link{};
  }

  static void fail_all(std::deque<std::unique_ptr<Op>>& ops, const std::exception_ptr& e) {
    auto all = std::move(ops);
    ops.clear();
    for (auto& op : all)
      if (!op->internal) op->finish(e, nullptr);
  }

  RedisOptions opt_;
  std::shared_ptr<const Client> factory_;
  std::weak_ptr<Routing> routing_;  // cluster mode: the router (engine.cpp)
  // Keeps the loop's run() from returning while the store lives, as a pending read did before an
  // idle connection was parked without one.
  net::any_io_executor work_;
  net::strand<net::any_io_executor> strand_;
  net::generic::stream_protocol::socket socket_;  // a dup of link_'s socket, for the loop's waits and plain I/O
  net::steady_timer timer_;
  net::steady_timer idle_timer_;
  std::atomic<Clock::time_point> last_activity_{};  // the last write or read: the idle check counts from it
  std::atomic<Owner> owner_{Owner::strand};
  bool idle_armed_ = false;
  std::string where_;
  Link link_;  // the connection the factory opened (its TLS session, if any); owns the socket
  std::mutex opener_mu_;
  std::thread opener_;  // the factory's connect, off the loop
  bool stopping_ = false;  // under opener_mu_: the store is being destroyed
  State state_ = State::idle;
  std::uint64_t generation_ = 0;
  bool writing_ = false;
  bool reading_ = false;  // a read (or TLS's wait to read) is under way on the socket
  bool timer_armed_ = false;
  bool closed_ = false;
  bool write_posted_ = false;
  std::deque<std::unique_ptr<Op>> queued_;    // not written yet, in order
  std::deque<std::unique_ptr<Op>> inflight_;  // written, waiting for their replies, in order
  std::string wbuf_;
  std::size_t wdone_ = 0;  // TLS: bytes of wbuf_ written so far
  std::array<char, 64 * 1024> rbuf_{};
  ReaderPtr reader_;
  std::atomic<std::uint64_t> requests_{0}, writes_{0}, connects_{0}, resent_{0}, reloads_{0}, coalesced_{0},
      health_checks_{0}, health_failures_{0};
};

std::shared_ptr<Connection> make_connection(net::any_io_executor ex, const RedisOptions& o,
                                            std::shared_ptr<const Client> factory, std::weak_ptr<Routing> routing) {
  return std::make_shared<Connection>(std::move(ex), o, std::move(factory), std::move(routing));
}
void submit(Connection& c, std::unique_ptr<Op> op) { c.submit(std::move(op)); }
void call(Connection& c, std::unique_ptr<Op> op) { c.call(std::move(op)); }
void submit(Connection& c, std::vector<std::unique_ptr<Op>> ops) { c.submit(std::move(ops)); }
void shutdown(Connection& c) { c.shutdown(); }
AsyncRedisStats stats(const Connection& c) noexcept { return c.stats(); }

}  // namespace idem::detail::asio_redis
