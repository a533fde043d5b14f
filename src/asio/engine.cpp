// AsyncRedisStore's engine (connection.hpp): the one connection to a server (plain, TLS,
// Sentinel), or in cluster mode one connection per master, each request sent to the master of its
// key's slot. A request answered MOVED, ASK or TRYAGAIN ran nothing: its connection hands it back
// here and it goes where the answer says (MOVED also fixes the slot map the blocking client keeps),
// at most max_redirects times.
//
// The slot map is the blocking client's (src/redis/cluster.cpp): reading it again after a MOVED
// or a broken connection is a blocking CLUSTER SLOTS on the thread that routes next (a caller, or
// the io thread for a redirected request), at most every 50 ms.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

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
    if (!client_->clustered()) single_ = make_connection(ex_, opt_, client_);
  }

  void submit(std::unique_ptr<Op> op) {
    if (single_) return asio_redis::submit(*single_, std::move(op));
    route(std::move(op), nullptr);
  }
  void call(std::unique_ptr<Op> op) {
    if (single_) return asio_redis::call(*single_, std::move(op));
    route(std::move(op), nullptr, true);
  }
  // Cluster mode: one post per master, so each master's share leaves coalesced (per slot).
  void submit(std::vector<std::unique_ptr<Op>> ops) {
    if (single_) return asio_redis::submit(*single_, std::move(ops));
    std::vector<std::pair<std::shared_ptr<Connection>, std::vector<std::unique_ptr<Op>>>> per_master;
    for (auto& op : ops) {
      std::shared_ptr<Connection> conn;
      if (auto e = capture([&] { conn = connection_to(client_->cluster_owner(op->slot)); })) {
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
    for (auto& [conn, share] : per_master) asio_redis::submit(*conn, std::move(share));
  }

  void shutdown() {
    if (single_) return asio_redis::shutdown(*single_);
    std::unordered_map<const Client*, Node> nodes;
    {
      std::lock_guard lk(mu_);
      closed_ = true;
      nodes.swap(nodes_);
    }
    for (auto& [_, n] : nodes) asio_redis::shutdown(*n.conn);
  }

  AsyncRedisStats stats() const noexcept {
    if (single_) return asio_redis::stats(*single_);
    AsyncRedisStats sum;
    std::lock_guard lk(mu_);
    for (const auto& [_, n] : nodes_) {
      const AsyncRedisStats s = asio_redis::stats(*n.conn);
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
      client_->cluster_redirected(d.to);
      return route(std::move(op), op->asking ? &d.to.to : nullptr);
    }
    // TRYAGAIN: a slot in migration holds some of a coalesced call's keys and not the others.
    // The callers did not ask for one call: each step goes alone (served by the source, or ASK).
    if (auto steps = op->dissolve(); !steps.empty()) {
      for (auto& m : steps) route(std::move(m), nullptr);
      return;
    }
    // One key's own call (a resharding tool's multi-step move): later, then, not at once.
    auto timer = std::make_shared<net::steady_timer>(ex_, d.delay);
    timer->async_wait([timer, weak = weak_from_this(), op = std::move(op)](boost::system::error_code) mutable {
      if (auto self = weak.lock()) return self->route(std::move(op), nullptr);
      op->finish(capture([] { throw usage_error("idem: this AsyncRedisStore is being destroyed"); }), nullptr);
    });
  }

  void doubt() noexcept override { client_->cluster_doubt(); }

  const std::shared_ptr<std::atomic<int>>& blocked() const noexcept { return blocked_; }

private:
  struct Node {
    std::shared_ptr<Client> client;  // the node's blocking client: its connection factory
    std::shared_ptr<Connection> conn;
  };

  // To the master of op->slot, or to `ask_to` (ASK); `here`: a blocked caller's (call). A routing
  // failure (no master for the slot, a node that cannot be reached for the map) is the call's
  // error, in doubt if it was a resend.
  void route(std::unique_ptr<Op> op, const Endpoint* ask_to, bool here = false) {
    std::shared_ptr<Connection> conn;
    if (auto e = capture([&] {
          std::shared_ptr<Client> node = ask_to ? client_->cluster_node(*ask_to) : client_->cluster_owner(op->slot);
          conn = connection_to(std::move(node));
        }))
      return fail(std::move(op), e);
    if (here) return asio_redis::call(*conn, std::move(op));
    asio_redis::submit(*conn, std::move(op));
  }

  std::shared_ptr<Connection> connection_to(std::shared_ptr<Client> node) {
    std::lock_guard lk(mu_);
    if (closed_) throw usage_error("idem: this AsyncRedisStore is being destroyed");
    const Client* id = node.get();
    auto it = nodes_.find(id);
    if (it == nodes_.end()) {
      auto conn = make_connection(ex_, opt_, node, weak_from_this());
      it = nodes_.emplace(id, Node{std::move(node), std::move(conn)}).first;
    }
    return it->second.conn;
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
  std::shared_ptr<Connection> single_;  // not in cluster mode: the one connection
  mutable std::mutex mu_;               // cluster mode: guards nodes_ and closed_
  std::unordered_map<const Client*, Node> nodes_;
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
std::shared_ptr<std::atomic<int>> blocked_callers(Engine& e) { return e.blocked(); }
void shutdown(Engine& e) { e.shutdown(); }
AsyncRedisStats stats(const Engine& e) noexcept { return e.stats(); }

}  // namespace idem::detail::asio_redis
