// AsyncRedisStore's connection (connection_impl.hpp), the hand-over: a blocked caller that finds
// the connection idle writes its request and reads the reply on its own thread (call), so one
// request in flight costs no hop to the loop and back. The connection passes between the strand
// and such a caller through one atomic (Owner): the strand parks it when nothing is queued, in
// flight or being read, a caller claims a parked one, and the strand takes it back before it
// writes again; a caller whose request goes wrong hands it back with the request.

#include "connection_impl.hpp"

#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <utility>

#include <boost/asio/post.hpp>
#include <fmt/format.h>

#include "tls.hpp"

namespace idem::detail::asio_redis {

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

bool Connection::try_call(std::unique_ptr<Op>& op) {
  Owner parked = Owner::parked;
  if (!owner_.compare_exchange_strong(parked, Owner::caller, std::memory_order_acq_rel)) return false;
  run_here(std::move(op));
  return true;
}

bool Connection::fits_one_call(const std::vector<std::unique_ptr<Op>>& ops, const RedisOptions& o) noexcept {
  if (ops.size() == 1) return true;
  bool one_call = ops.size() > 1 && o.auto_batch > 1 && ops.size() <= o.auto_batch;
  std::size_t bytes = 0;
  for (const auto& op : ops) {
    one_call = one_call && op->step != 0 && !op->attempt.resent && !op->asking && !op->solo &&
               op->slot == ops.front()->slot && op->waits == ops.front()->waits;
    bytes += op->script_end - op->key_at;
  }
  return one_call && bytes < max_coalesced_bytes;
}

bool Connection::try_call(std::vector<std::unique_ptr<Op>>& ops) {
  if (ops.size() == 1) return try_call(ops.front());
  if (!fits_one_call(ops, opt_)) return false;
  Owner parked = Owner::parked;
  if (!owner_.compare_exchange_strong(parked, Owner::caller, std::memory_order_acq_rel)) return false;
  run_here(coalesce(std::move(ops), opt_, where_, coalesced_));
  return true;
}

void Connection::run_here(std::unique_ptr<Op> op) {
  if (!quiet())
    return hand_back(std::move(op), false,
                     {fmt::format("connection to Redis at {} was closed by the server while idle", where_), false});
  out_of_reactor();
  touch();
  ++requests_;
  ++writes_;
  op->deadline = Clock::now() + opt_.command_timeout;
  IoFailure f;
  const std::size_t sent = send_here(op->bytes, op->deadline, f);
  if (sent < op->bytes.size()) return hand_back(std::move(op), sent > 0, std::move(f));
  ReplyPtr reply = read_here(op->deadline, f, true);
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

bool Connection::quiet() noexcept {
  if (tls_) return tls_->idle();
  pollfd p{fd_, POLLIN, 0};
  int rc;
  do rc = ::poll(&p, 1, 0);
  while (rc < 0 && errno == EINTR);
  return rc == 0;
}

std::size_t Connection::send_here(std::string_view data, Clock::time_point deadline, IoFailure& f) {
  std::size_t done = 0;
  for (;;) {
    switch (write_step(fd_, tls_.get(), data, done)) {
      case IoStep::done:
        return done;
      case IoStep::failed:
        f = io_broke(where_, io_reason(tls_.get(), errno), "while sending");
        return done;
      case IoStep::wait:
        if (wait_fd(fd_, POLLOUT, deadline)) continue;
        f = io_timed_out(where_, opt_.command_timeout);
        return done;
    }
  }
}

ReplyPtr Connection::read_here(Clock::time_point deadline, IoFailure& f, bool just_sent) {
  for (;;) {
    ReplyPtr reply = reader_->next();
    if (reader_->failed()) {
      f = {reader_->error(where_), false};
      return nullptr;
    }
    if (reply) return reply;
    // Just written, the request has not been run yet: a read now would only say so, a system call
    // for nothing.
    if (std::exchange(just_sent, false) && !(tls_ && tls_->buffered()) && !wait_fd(fd_, POLLIN, deadline)) {
      f = io_timed_out(where_, opt_.command_timeout);
      return nullptr;
    }
    switch (read_step(fd_, tls_.get(), *reader_, rbuf_.data(), rbuf_.size())) {
      case IoStep::done:
        continue;
      case IoStep::failed:
        f = io_broke(where_, io_reason(tls_.get(), errno));
        return nullptr;
      case IoStep::wait:
        if (wait_fd(fd_, POLLIN, deadline)) continue;
        f = io_timed_out(where_, opt_.command_timeout);
        return nullptr;
    }
  }
}

void Connection::release() {
  Owner mine = Owner::caller;
  if (owner_.compare_exchange_strong(mine, Owner::parked, std::memory_order_acq_rel)) return;
  net::post(strand_, [self = shared_from_this()] {
    self->owner_.store(Owner::strand, std::memory_order_release);
    self->in_reactor();
    self->write();
  });
}

void Connection::hand_back(std::unique_ptr<Op> op, bool maybe_ran, IoFailure f) {
  net::post(strand_, [self = shared_from_this(), op = std::move(op), maybe_ran, f = std::move(f)]() mutable {
    self->owner_.store(Owner::strand, std::memory_order_release);
    (maybe_ran ? self->inflight_ : self->queued_).push_front(std::move(op));
    self->broken(std::move(f));
  });
}

void Connection::hand_reply(std::unique_ptr<Op> op, ReplyPtr reply) {
  net::post(strand_, [self = shared_from_this(), op = std::move(op), reply = std::move(reply)]() mutable {
    self->owner_.store(Owner::strand, std::memory_order_release);
    self->in_reactor();
    self->deliver(std::move(op), std::move(reply));
    self->write();
  });
}

bool Connection::take() {
  Owner o = owner_.load(std::memory_order_acquire);
  for (;;) {
    switch (o) {
      case Owner::strand:
        return true;
      case Owner::wanted:
        return false;
      case Owner::parked:
        if (!owner_.compare_exchange_weak(o, Owner::strand, std::memory_order_acq_rel)) continue;
        if (quiet()) {
          in_reactor();
          return true;
        }
        broken({fmt::format("connection to Redis at {} was closed by the server while idle", where_), false});
        return false;
      case Owner::caller:
        if (!owner_.compare_exchange_weak(o, Owner::wanted, std::memory_order_acq_rel)) continue;
        return false;
    }
  }
}

void Connection::out_of_reactor() noexcept {
  if (!socket_.is_open()) return;
  boost::system::error_code ec;
  socket_.release(ec);  // the descriptor stays open, in fd_ (on failure socket_ keeps it)
}

void Connection::in_reactor() {
  if (!taken_out()) return;
  boost::system::error_code ec;
  socket_.assign(*protocol_, fd_, ec);
  if (ec) return broken(io_broke(where_, ec.message()));  // fd_ still taken out: drop_socket closes it
}

void Connection::park() {
  if (state_ == State::ready && !closed_ && queued_.empty() && inflight_.empty() && !writing_ && !reading_ &&
      !write_posted_)
    owner_.store(Owner::parked, std::memory_order_release);
}

}  // namespace idem::detail::asio_redis
