// AsyncRedisStore's connection (connection.hpp, the class in connection_impl.hpp), its strand's
// side: one socket, opened on the strand as every Redis connection is (opening.hpp: TCP or Unix,
// TLS, AUTH, SELECT, Sentinel). Requests queue while a write is
// under way and then go out together, one-key steps coalesced; replies are read as they come,
// parsed by hiredis's reader and matched in order. An idle connection is parked for a blocked
// caller (handover.cpp).

#include "connection_impl.hpp"

#include <algorithm>
#include <cerrno>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/write.hpp>

#include <fmt/format.h>

#include "cluster.hpp"
#include "idem/core/error.hpp"
#include "idem/core/hex.hpp"
#include "tls.hpp"

namespace idem::detail::asio_redis {

std::string Op::describe() const {
  if (!label.empty()) return label;
  return fmt::format("{} of key '{}'", idem::detail::redis::script(script).name, detail::printable(key));
}

namespace {
// The connection's own requests (SCRIPT LOAD after NOSCRIPT, the idle PING).
struct Internal final : Op {
  void finish(std::exception_ptr, ReplyPtr) noexcept override {}
};
}  // namespace

void Connection::submit(std::unique_ptr<Op> op) {
  net::post(strand_, [self = shared_from_this(), op = std::move(op)]() mutable { self->enqueue(std::move(op)); });
}

void Connection::submit(std::vector<std::unique_ptr<Op>> ops) {
  net::post(strand_, [self = shared_from_this(), ops = std::move(ops)]() mutable {
    for (auto& op : ops) self->enqueue(std::move(op));
  });
}

void Connection::shutdown() {
  net::post(strand_, [self = shared_from_this()] { self->close(); });
}

AsyncRedisStats Connection::stats() const noexcept {
  return {requests_.load(),  writes_.load(),    connects_.load(),      resent_.load(),
          reloads_.load(),   coalesced_.load(), health_checks_.load(), health_failures_.load()};
}

void Connection::close() {
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

void Connection::enqueue(std::unique_ptr<Op> op) {
  if (closed_) {
    op->finish(capture([] { throw usage_error("idem: this AsyncRedisStore is being destroyed"); }), nullptr);
    return;
  }
  queued_.push_back(std::move(op));
  if (state_ == State::idle) connect();
  else if (state_ == State::ready && take()) schedule_write();
}

void Connection::schedule_write() {
  if (opt_.auto_batch <= 1) return write();
  if (write_posted_ || writing_) return;  // a finishing write writes what queued meanwhile
  write_posted_ = true;
  net::post(strand_, [self = shared_from_this()] {
    self->write_posted_ = false;
    self->write();
  });
}

void Connection::connect() {
  state_ = State::connecting;
  ++generation_;
  ++connects_;
  net::co_spawn(
      strand_,
      [self = shared_from_this(), gen = generation_]() -> net::awaitable<void> {
        std::optional<Opened> opened;
        std::exception_ptr e;
        try {
          Opened o = co_await open_ready(*self->factory_);
          opened.emplace(std::move(o));
        } catch (...) {
          e = std::current_exception();
        }
        self->connected(gen, std::move(opened), e);
      },
      net::detached);
}

void Connection::connected(std::uint64_t gen, std::optional<Opened> opened, std::exception_ptr e) {
  if (gen != generation_) return;
  if (e) return connect_failed(e);
  where_ = factory_->where();
  socket_ = std::move(opened->socket);
  fd_ = socket_.native_handle();
  boost::system::error_code ignored;
  protocol_.emplace(socket_.local_endpoint(ignored).protocol());
  tls_ = std::move(opened->tls);
  reader_.emplace();
  state_ = State::ready;
  touch();
  write();  // it reads once it has written, and parks the connection when nothing is queued
  arm_idle_check();
}

void Connection::connect_failed(const std::exception_ptr& e) {
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

void Connection::write() {
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

void Connection::send_bytes(std::string bytes, std::size_t n) {
  touch();
  requests_ += n;
  ++writes_;
  writing_ = true;
  wbuf_ = std::move(bytes);
  wdone_ = 0;
  if (!timer_armed_) arm_timer();
  if (!reading_) read();
  if (tls_) return write_tls(generation_);
  net::async_write(socket_, net::buffer(wbuf_),
                   [self = shared_from_this(), gen = generation_](boost::system::error_code ec, std::size_t) {
                     if (gen != self->generation_) return;
                     if (ec) return self->send_failed(ec.message());
                     self->written();
                   });
}

void Connection::write_tls(std::uint64_t gen) {
  const IoStep step = write_step(socket_.native_handle(), tls_.get(), wbuf_, wdone_);
  if (step == IoStep::done) return written();
  if (step == IoStep::failed) return send_failed(io_reason(tls_.get(), errno));
  socket_.async_wait(net::socket_base::wait_write, [self = shared_from_this(), gen](boost::system::error_code ec) {
    if (gen != self->generation_) return;
    if (ec) return self->send_failed(ec.message());
    self->write_tls(gen);
  });
}

void Connection::written() {
  writing_ = false;
  write();
}

void Connection::send_failed(const std::string& why) { broken(io_broke(where_, why, "while sending")); }

void Connection::read() {
  reading_ = true;
  if (tls_) {
    socket_.async_wait(net::socket_base::wait_read, [self = shared_from_this(), gen = generation_](
                                                        boost::system::error_code ec) {
      if (gen != self->generation_) return;
      self->reading_ = false;
      if (ec) return self->broken(io_broke(self->where_, ec.message()));
      self->read_tls();
    });
    return;
  }
  socket_.async_read_some(net::buffer(rbuf_), [self = shared_from_this(), gen = generation_](
                                                   boost::system::error_code ec, std::size_t n) {
    if (gen != self->generation_) return;
    self->reading_ = false;
    if (ec) return self->broken(io_broke(self->where_, ec == net::error::eof ? io_reason(nullptr, 0) : ec.message()));
    self->reader_->feed(self->rbuf_.data(), n);
    if (!self->received()) return;
    self->next();
  });
}

void Connection::next() {
  write();
  if (!inflight_.empty() && !reading_) read();
}

void Connection::read_tls() {
  for (;;) {
    const IoStep step = read_step(socket_.native_handle(), tls_.get(), *reader_, rbuf_.data(), rbuf_.size());
    if (step == IoStep::wait) break;
    if (step == IoStep::failed) return broken(io_broke(where_, io_reason(tls_.get(), errno)));
    if (!received()) return;
  }
  next();
}

bool Connection::received() {
  const auto gen = generation_;
  touch();
  for (;;) {
    ReplyPtr reply = reader_->next();
    if (reader_->failed()) {
      broken({reader_->error(where_), false});
      return false;
    }
    if (!reply) return true;
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

void Connection::deliver(std::unique_ptr<Op> op, ReplyPtr reply) {
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

std::exception_ptr Connection::acks_failed(Op& op, const ReplyPtr& reply, ReplyPtr& wait) const {
  const redisReply* r = reply.get();
  if (op.keeps_wait(wait) || is_error(r) || !wrote(op.script, r)) return nullptr;  // nothing a failover could lose
  return capture([&] { check_wait(wait.get(), op.script, op.describe(), opt_, where_); });
}

void Connection::arm_idle_check() {
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

void Connection::arm_timer() {
  if (inflight_.empty()) return;
  timer_armed_ = true;
  timer_.expires_at(inflight_.front()->deadline);
  timer_.async_wait([self = shared_from_this(), gen = generation_](boost::system::error_code ec) {
    if (ec || gen != self->generation_) return;
    self->timer_armed_ = false;
    if (self->inflight_.empty()) return;
    if (self->inflight_.front()->deadline <= Clock::now())
      return self->broken(io_timed_out(self->where_, self->opt_.command_timeout));
    self->arm_timer();
  });
}

void Connection::broken(IoFailure f) {
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

void Connection::doubt() noexcept {
  factory_->doubt_master();
  if (auto r = routing_.lock()) r->doubt();
}

void Connection::drop_socket() {
  ++generation_;  // every callback of the old socket now returns at once
  boost::system::error_code ignored;
  if (taken_out())
    ::close(fd_);
  else
    socket_.close(ignored);
  fd_ = -1;
  timer_.cancel();
  timer_armed_ = false;
  writing_ = false;
  reading_ = false;
  reader_.reset();
  tls_.reset();
}

void Connection::fail_all(std::deque<std::unique_ptr<Op>>& ops, const std::exception_ptr& e) {
  auto all = std::move(ops);
  ops.clear();
  for (auto& op : all)
    if (!op->internal) op->finish(e, nullptr);
}

std::shared_ptr<Connection> make_connection(net::any_io_executor ex, const RedisOptions& o,
                                            std::shared_ptr<const Client> factory, std::weak_ptr<Routing> routing) {
  return std::make_shared<Connection>(std::move(ex), o, std::move(factory), std::move(routing));
}
void submit(Connection& c, std::unique_ptr<Op> op) { c.submit(std::move(op)); }
bool try_call(Connection& c, std::unique_ptr<Op>& op) { return c.try_call(op); }
bool try_call(Connection& c, std::vector<std::unique_ptr<Op>>& ops) { return c.try_call(ops); }
bool fits_one_call(const std::vector<std::unique_ptr<Op>>& ops, const RedisOptions& o) noexcept {
  return Connection::fits_one_call(ops, o);
}
void submit(Connection& c, std::vector<std::unique_ptr<Op>> ops) { c.submit(std::move(ops)); }
void shutdown(Connection& c) { c.shutdown(); }
AsyncRedisStats stats(const Connection& c) noexcept { return c.stats(); }

}  // namespace idem::detail::asio_redis
