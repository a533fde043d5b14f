// The Redis stores' engine (connection.hpp): connections to the server (plain, TLS, Sentinel), or
// in cluster mode to each node, every request sent to the master of its key's slot. The server
// has pool.size connections (lanes, opened on first use; one per master on a cluster): the first
// carries the async callers' requests, and each serves a blocked caller on its own thread while
// idle. A request answered MOVED, ASK or TRYAGAIN ran nothing: its connection hands it back here
// and it goes where the answer says (MOVED also fixes the slot map), at most max_redirects times.
//
// The slot map is the store's blocking client's (src/redis/cluster.cpp), read at construction.
// The engine never blocks on it afterwards: a route looks the slot up as the map is, and when the
// map is in doubt (a MOVED, a broken connection) the engine reads it again with CLUSTER SLOTS as a
// request of its own on a node's connection, the nodes asked in turn, at most every 50 ms. Each
// node's connections are opened with a client of the node's, which connects nothing until a
// connection asks.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <boost/asio/steady_timer.hpp>
#include <fmt/format.h>

#include "cluster.hpp"
#include "connection.hpp"
#include "idem/core/error.hpp"

namespace idem::detail::asio_redis {

namespace net = boost::asio;

class Engine final : public Routing, public std::enable_shared_from_this<Engine> {
public:
  Engine(net::any_io_executor ex, const RedisOptions& o, std::shared_ptr<Client> client)
      : ex_(std::move(ex)), opt_(o), client_(std::move(client)) {
    if (client_->clustered()) return;
    server_ = make_lanes(client_, {});
    single_ = server_->lanes.front();
  }

  void submit(std::unique_ptr<Op> op) {
    if (single_) return asio_redis::submit(*single_, std::move(op));
    route(std::move(op), nullptr);
  }
  void call(std::unique_ptr<Op> op) {
    if (single_) return call_lane(*server_, op);
    route(std::move(op), nullptr, true);
  }
  void call(std::vector<std::unique_ptr<Op>> ops) {
    if (single_ && fits_one_call(ops, opt_)) return call_lane(*server_, ops);
    submit(std::move(ops));
  }
  // Per server. On a cluster one connection per master: measured on 2 cores with 3 masters
  // (bench-topologies, 1 and 16 in flight), pool.size lanes per master were up to 20 % slower.
  int lanes() const noexcept {
    return client_->clustered() ? 1 : static_cast<int>(std::max<std::size_t>(1, opt_.pool.size));
  }
  // Cluster mode: one post per master, so each master's share leaves coalesced (per slot).
  void submit(std::vector<std::unique_ptr<Op>> ops) {
    if (single_) return asio_redis::submit(*single_, std::move(ops));
    std::vector<std::pair<std::shared_ptr<Connection>, std::vector<std::unique_ptr<Op>>>> per_master;
    for (auto& op : ops) {
      std::shared_ptr<Connection> conn;
      if (auto e = capture([&] { conn = node_to(target(*op))->lanes.front(); })) {
        fail(std::move(op), e);
        continue;
      }
      auto it = std::find_if(per_master.begin(), per_master.end(), [&](const auto& p) { return p.first == conn; });
      if (it == per_master.end()) {
        per_master.emplace_back(std::move(conn), std::vector<std::unique_ptr<Op>>{});
        it = std::prev(per_master.end());
      }
      it->second.push_back(std::move(op));
    }
    refresh_if_due();
    for (auto& [conn, share] : per_master) asio_redis::submit(*conn, std::move(share));
  }

  void shutdown() {
    if (single_) {
      for (auto& lane : server_->lanes) asio_redis::shutdown(*lane);
      return;
    }
    std::unordered_map<std::string, std::shared_ptr<Lanes>> nodes;
    {
      std::lock_guard lk(mu_);
      closed_ = true;
      nodes.swap(nodes_);
    }
    for (auto& [_, node] : nodes)
      for (auto& lane : node->lanes) asio_redis::shutdown(*lane);
  }

  AsyncRedisStats stats() const noexcept {
    std::vector<std::shared_ptr<Connection>> conns;
    if (single_) {
      conns = server_->lanes;
    } else {
      std::lock_guard lk(mu_);
      for (const auto& [_, node] : nodes_) conns.insert(conns.end(), node->lanes.begin(), node->lanes.end());
    }
    AsyncRedisStats sum;
    for (const auto& conn : conns) {
      const AsyncRedisStats s = asio_redis::stats(*conn);
      sum.requests += s.requests;
      sum.writes += s.writes;
      sum.connects += s.connects;
      sum.resent += s.resent;
      sum.reloads += s.reloads;
      sum.coalesced += s.coalesced;
      sum.health_checks += s.health_checks;
      sum.health_failures += s.health_failures;
    }
    return sum;
  }

  void reroute(std::unique_ptr<Op> op, const Decision& d) override {
    op->asking = d.next == Next::ask;  // ASK: this sending only, to the node importing the slot
    if (d.next != Next::later) {
      map().redirected(d.to);
      return route(std::move(op), op->asking ? &d.to.to : nullptr);
    }
    // TRYAGAIN: a slot in migration holds some of a coalesced call's keys and not the others.
    // The callers did not ask for one call: each step goes alone (served by the source, or ASK).
    map().retried();
    if (auto steps = op->dissolve(); !steps.empty()) {
      for (auto& m : steps) route(std::move(m), nullptr);
      return;
    }
    // One key's own call (a resharding tool's multi-step move): later, then, not at once.
    auto timer = std::make_shared<net::steady_timer>(ex_, d.delay);
    timer->async_wait([timer, weak = weak_from_this(), op = std::move(op)](boost::system::error_code) mutable {
      if (auto self = weak.lock()) return self->route(std::move(op), nullptr);
      op->finish(capture([] { throw usage_error("idem: this Redis store is being destroyed"); }), nullptr);
    });
  }

  void doubt() noexcept override { map().doubt(); }

  const std::shared_ptr<std::atomic<int>>& blocked() const noexcept { return blocked_; }

private:
  // CLUSTER SLOTS asked of nodes[at]; its answer installs the map, anything else asks the next node.
  struct SlotsRequest final : Op {
    SlotsRequest(std::weak_ptr<Engine> e, std::vector<Endpoint> n, std::size_t i)
        : engine(std::move(e)), nodes(std::move(n)), at(i) {
      bytes = "*2\r\n$7\r\nCLUSTER\r\n$5\r\nSLOTS\r\n";
      label = fmt::format("CLUSTER SLOTS of {}", redis::describe(nodes[at]));
      same_holder = false;  // a read: a lost reply is asked of the next node instead
    }
    void finish(std::exception_ptr e, ReplyPtr reply) noexcept override {
      auto self = engine.lock();
      if (!self) return;
      bool installed = false;
      std::string why;  // the blocking reading's message material; a failed reading here is silent
      if (!e) (void)capture([&] { installed = self->map().accept_slots(nodes[at], reply.get(), why); });
      if (!installed) self->ask_slots(std::move(nodes), at + 1);
    }
    std::weak_ptr<Engine> engine;
    std::vector<Endpoint> nodes;
    std::size_t at;
  };

  Cluster& map() noexcept { return client_->cluster(); }

  // One server's connections: made at once, each opened when it is first given a request.
  struct Lanes {
    std::vector<std::shared_ptr<Connection>> lanes;  // [0] carries the async callers' requests
    std::atomic<std::size_t> opened{0};              // lanes[0, opened) have had blocked callers' requests
  };
  std::shared_ptr<Lanes> make_lanes(const std::shared_ptr<const Client>& factory, std::weak_ptr<Routing> routing) {
    auto out = std::make_shared<Lanes>();
    for (int i = 0; i < lanes(); ++i) out->lanes.push_back(make_connection(ex_, opt_, factory, routing));
    return out;
  }

  // A blocked caller's request(s) to server `s`: on its first idle lane, on the caller's thread;
  // else to a lane not opened yet (it opens, then serves callers as the others do); else queued
  // on the first, multiplexed with the async callers'.
  template <class Ops>
  static void call_lane(Lanes& s, Ops& ops) {
    std::size_t open = s.opened.load(std::memory_order_acquire);
    for (std::size_t i = 0; i < open; ++i)
      if (asio_redis::try_call(*s.lanes[i], ops)) return;
    while (open < s.lanes.size() && !s.opened.compare_exchange_weak(open, open + 1, std::memory_order_acq_rel)) {
    }
    asio_redis::submit(open < s.lanes.size() ? *s.lanes[open] : *s.lanes.front(), std::move(ops));
  }

  // To the master of op->slot, or to `ask_to` (ASK); `here`: a blocked caller's (call). A routing
  // failure (no master for the slot in the map, the store being destroyed) is the call's error,
  // in doubt if it was a resend.
  void route(std::unique_ptr<Op> op, const Endpoint* ask_to, bool here = false) {
    std::shared_ptr<Lanes> node;
    if (auto e = capture([&] { node = node_to(ask_to ? *ask_to : target(*op)); }))
      return fail(std::move(op), e);
    refresh_if_due();
    if (here) return call_lane(*node, op);
    asio_redis::submit(*node->lanes.front(), std::move(op));
  }

  // Where `op` goes: its node when it names one, else its slot's master.
  Endpoint target(const Op& op) { return op.node.host.empty() ? map().master_of(op.slot) : op.node; }

  // The node's connections, made on first use; their factory connects nothing until asked to.
  std::shared_ptr<Lanes> node_to(const Endpoint& at) {
    std::string name = describe(at);
    std::lock_guard lk(mu_);
    if (closed_) throw usage_error("idem: this Redis store is being destroyed");
    auto it = nodes_.find(name);
    if (it == nodes_.end()) {
      auto factory = std::make_shared<const Client>(map().node_options(at), Client::FactoryOnly{});
      it = nodes_.emplace(std::move(name), make_lanes(factory, weak_from_this())).first;
    }
    return it->second;
  }

  void refresh_if_due() {
    if (std::vector<Endpoint> nodes = map().begin_refresh(); !nodes.empty()) ask_slots(std::move(nodes), 0);
  }

  void ask_slots(std::vector<Endpoint> nodes, std::size_t at) {
    std::shared_ptr<Connection> conn;
    if (at >= nodes.size() || capture([&] { conn = node_to(nodes[at])->lanes.front(); })) return map().refresh_failed();
    asio_redis::submit(*conn, std::make_unique<SlotsRequest>(weak_from_this(), std::move(nodes), at));
  }

  static void fail(std::unique_ptr<Op> op, const std::exception_ptr& e) {
    std::string text = "no route";
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      text = x.what();
    }
    op->finish(on_unsent(op->attempt, e, text, op->describe()).error, nullptr);
  }

  net::any_io_executor ex_;
  RedisOptions opt_;
  std::shared_ptr<Client> client_;      // the factory, and in cluster mode the slot map
  std::shared_ptr<Lanes> server_;       // not in cluster mode: the server's lanes
  std::shared_ptr<Connection> single_;  // not in cluster mode: its first lane, the async callers' connection
  mutable std::mutex mu_;               // cluster mode: guards nodes_ and closed_
  std::unordered_map<std::string, std::shared_ptr<Lanes>> nodes_;  // by "host:port"
  bool closed_ = false;
  // Shared with each blocked caller's Waiter: a caller still waiting when the store goes away is
  // answered (in doubt) after the engine is gone.
  std::shared_ptr<std::atomic<int>> blocked_ = std::make_shared<std::atomic<int>>(0);
};

std::shared_ptr<Engine> make_engine(net::any_io_executor ex, const RedisOptions& o, std::shared_ptr<Client> client) {
  return std::make_shared<Engine>(std::move(ex), o, std::move(client));
}
void submit(Engine& e, std::unique_ptr<Op> op) { e.submit(std::move(op)); }
void submit(Engine& e, std::vector<std::unique_ptr<Op>> ops) { e.submit(std::move(ops)); }
void call(Engine& e, std::unique_ptr<Op> op) { e.call(std::move(op)); }
void call(Engine& e, std::vector<std::unique_ptr<Op>> ops) { e.call(std::move(ops)); }
int lanes(const Engine& e) noexcept { return e.lanes(); }
bool count_blocked(Engine& e, std::shared_ptr<std::atomic<int>>& count) {
  count = e.blocked();
  return count->fetch_add(1, std::memory_order_relaxed) < e.lanes();
}
void shutdown(Engine& e) { e.shutdown(); }
AsyncRedisStats stats(const Engine& e) noexcept { return e.stats(); }

}  // namespace idem::detail::asio_redis
