#pragma once
// Internal to idem_asio: the Connection class behind connection.hpp's functions. Its strand's side
// (connecting, writing, reading, timeouts, failures) is connection.cpp; the hand-over to a blocked
// caller who writes and reads on its own thread is handover.cpp.

#include <netinet/in.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <boost/asio/execution/outstanding_work.hpp>
#include <boost/asio/generic/stream_protocol.hpp>
#include <boost/asio/prefer.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>

#include <hiredis/hiredis.h>

#include "connection.hpp"
#include "opening.hpp"

namespace idem::detail::asio_redis {

namespace net = boost::asio;

class Connection : public std::enable_shared_from_this<Connection> {
public:
  Connection(net::any_io_executor ex, const RedisOptions& o, std::shared_ptr<const Client> factory,
             std::weak_ptr<Routing> routing)
      : opt_(o), factory_(std::move(factory)), routing_(std::move(routing)),
        work_(net::prefer(ex, net::execution::outstanding_work.tracked)), strand_(net::make_strand(ex)),
        socket_(strand_), timer_(strand_), idle_timer_(strand_), where_(factory_->where()) {}
  // A descriptor a caller took out of the reactor is the connection's to close (socket_ no longer holds it).
  ~Connection() {
    if (taken_out()) ::close(fd_);
  }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // A blocked caller's request (or batch, as one coalesced `many` call when fits_one_call), on its
  // own thread when the connection is parked; else false, the op(s) left with the caller.
  bool try_call(std::unique_ptr<Op>& op);
  bool try_call(std::vector<std::unique_ptr<Op>>& ops);
  // One op, or steps that one `many` call carries: one slot, at most auto_batch of them, each a
  // step many.lua takes, under max_coalesced_bytes.
  static bool fits_one_call(const std::vector<std::unique_ptr<Op>>& ops, const RedisOptions& o) noexcept;

  // Any thread: the op joins the queue on the strand.
  void submit(std::unique_ptr<Op> op);
  // One post for all: the write they schedule finds them all queued.
  void submit(std::vector<std::unique_ptr<Op>> ops);

  // The store is going away: every pending call fails and the socket closes (a connection being
  // opened is dropped when its opening ends).
  void shutdown();

  AsyncRedisStats stats() const noexcept;

private:
  enum class State { idle, connecting, ready };
  // Who may use the socket: the strand; nobody (parked: ready and quiet, for the next blocked
  // caller); a blocked caller on its own thread; the same with requests queued behind it (wanted:
  // the caller hands the connection to the strand when done instead of parking it).
  enum class Owner { strand, parked, caller, wanted };

  void close();

  // --- a blocked caller on its own thread -------------------------------------------------------

  // The caller's own write and read, as write() and received() would do them for one request. It
  // finishes the common case itself (any reply but an error one); everything else (a connection
  // found closed, a write or read that failed, an error reply for the machine to decide on) is
  // handed to the strand with the request, in the state the strand would have it in.
  void run_here(std::unique_ptr<Op> op);

  // Nothing has come on the idle connection: the server has not closed it (a restart, its timeout).
  // Polled before every request written to a parked connection, however recently it was used: a
  // server killed a moment ago must fail the next call cleanly (retryable, nothing written), not
  // leave it in doubt.
  bool quiet() noexcept;

  // A caller's own I/O runs on fd_ with the socket out of the loop's reactor: Asio's epoll is
  // edge-triggered, so each reply read here would otherwise wake the loop thread for nothing (one
  // wake-up per call, CPU the server on the same cores could have used). The strand puts it back
  // (in_reactor) before its next operation on the socket.
  void out_of_reactor() noexcept;
  void in_reactor();
  // fd_ is open and socket_ does not hold it: a caller took it out, and it is ours to close.
  bool taken_out() const noexcept { return fd_ >= 0 && !socket_.is_open(); }

  // Writes `data` until all is written, an error or `deadline`: the bytes written (`f` says why when short).
  std::size_t send_here(std::string_view data, Clock::time_point deadline, IoFailure& f);

  // The next whole reply, or null with `f` saying why; `just_sent`: the request was written just now.
  ReplyPtr read_here(Clock::time_point deadline, IoFailure& f, bool just_sent = false);

  // The caller is done with the connection: parked again, or, with requests queued behind it,
  // handed to the strand to write them.
  void release();

  // The caller's request met a broken connection: the strand takes both and deals with them as
  // with its own (broken): one that may have run is in flight (resent once as the same holder),
  // one that never left is queued first.
  void hand_back(std::unique_ptr<Op> op, bool maybe_ran, IoFailure f);

  // An error reply (NOSCRIPT, MOVED, READONLY, the script's own): the machine's decision is the
  // strand's to carry out (a reload, a reroute, leaving a demoted master, the caller's error).
  void hand_reply(std::unique_ptr<Op> op, ReplyPtr reply);

  // --- the strand's side of the hand-over ---------------------------------------------------------

  // Before the strand uses a ready connection: true when it has it (a parked one found closed by
  // the server is dropped instead, as a read would have found it); false when a blocked caller has
  // it, who then hands it over when done (wanted).
  bool take();

  // Nothing queued, in flight or being read: the next blocked caller may use the connection.
  void park();

  void touch() noexcept { last_activity_.store(Clock::now(), std::memory_order_relaxed); }

  void enqueue(std::unique_ptr<Op> op);

  // With auto-batching, the write waits for the requests already posted to the strand (the other
  // callers woken by the same read) instead of leaving with the first of them: one post, never a
  // timer, so a lone call still goes out in this turn of the loop.
  void schedule_write();

  // --- connecting ---------------------------------------------------------------------------

  // The opening every Redis connection goes through (opening.hpp: the socket, TLS and its checks,
  // AUTH, SELECT, Sentinel discovery and the ROLE check), as a coroutine on this strand: the loop
  // never blocks on a connect and no thread is started for one.
  void connect();

  void connected(std::uint64_t gen, std::optional<Opened> opened, std::exception_ptr e);

  // Nothing queued was written on this connection: a first sending never ran and fails with the
  // factory's own error (a TLS check is not retryable, a server down is); a resend's first sending
  // may have run, so its outcome stays unknown.
  void connect_failed(const std::exception_ptr& e);

  // --- writing and reading ------------------------------------------------------------------

  // Everything queued goes out in one write; the next write waits for this one to finish. The
  // one-key steps among them (up to auto_batch per call) go as one `many` call: what queued behind
  // one write in flight.
  void write();

  void send_bytes(std::string bytes, std::size_t n);

  // TLS: the session writes whole records until the socket would block, then waits until it can
  // write again (OpenSSL wants the same remaining bytes at the same address, which wbuf_ keeps).
  void write_tls(std::uint64_t gen);

  void written();

  void send_failed(const std::string& why);

  // A read waits on the socket only while something is in flight: an idle connection is parked
  // for a blocked caller, who reads on its own thread.
  void read();

  // After a read: what queued goes out, the read goes on while anything is in flight, and a
  // connection with nothing left is parked (write()).
  void next();

  // TLS: everything the session has decrypted (it may hold more than the socket shows), then wait.
  void read_tls();

  // Delivers every whole reply the reader holds; false when that broke the connection.
  bool received();

  void deliver(std::unique_ptr<Op> op, ReplyPtr reply);

  // min_replica_acks: a reply that changed a record counts only once enough replicas have it (the
  // WAIT went in the same write, so it covers this connection's writes up to and including it). A
  // coalesced call keeps the WAIT's reply and checks it per member (keeps_wait); an error reply
  // (NOSCRIPT, a resend's) is the machine's to decide.
  std::exception_ptr acks_failed(Op& op, const ReplyPtr& reply, ReplyPtr& wait) const;

  // --- timeouts and failures ----------------------------------------------------------------

  // The idle health check: a ready connection with nothing sent or received for
  // health_check_interval sends PING. Its reply is dropped like a reload's; no reply within
  // command_timeout breaks the connection as any late reply does (arm_timer), and with nothing
  // queued it stays closed until the next call opens a fresh one. One timer per connection,
  // re-armed for the rest of the interval while there is traffic.
  void arm_idle_check();

  // One timer for the oldest request in flight: the deadlines grow along the queue, so when it
  // fires early for a request already answered, it is re-armed for the new oldest.
  void arm_timer();

  // The connection is gone: each request on it may have run. A holder's step is sent once more on
  // a fresh connection (in its place in the queue), other requests fail in doubt.
  void broken(IoFailure f);

  void doubt() noexcept;

  void drop_socket();

  static void fail_all(std::deque<std::unique_ptr<Op>>& ops, const std::exception_ptr& e);

  RedisOptions opt_;
  std::shared_ptr<const Client> factory_;
  std::weak_ptr<Routing> routing_;  // cluster mode: the router (engine.cpp)
  // Keeps the loop's run() from returning while the store lives, as a pending read did before an
  // idle connection was parked without one.
  net::any_io_executor work_;
  net::strand<net::any_io_executor> strand_;
  Socket socket_;
  int fd_ = -1;  // while connected: socket_'s descriptor, kept when it is out of the reactor
  std::optional<Socket::protocol_type> protocol_;  // fd_'s, to put it back
  net::steady_timer timer_;
  net::steady_timer idle_timer_;
  std::atomic<Clock::time_point> last_activity_{};  // the last write or read: the idle check counts from it
  std::atomic<Owner> owner_{Owner::strand};
  bool idle_armed_ = false;
  std::string where_;
  std::unique_ptr<TlsSession> tls_;  // over TLS, the session on socket_
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
  std::optional<RespReader> reader_;  // while connected: the replies read on socket_
  std::atomic<std::uint64_t> requests_{0}, writes_{0}, connects_{0}, resent_{0}, reloads_{0}, coalesced_{0},
      health_checks_{0}, health_failures_{0};
};

}  // namespace idem::detail::asio_redis
