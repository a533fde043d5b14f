#pragma once
// A real Redis Cluster for one test process: 6 `redis-server --cluster-enabled yes` nodes on free
// 127.0.0.1 ports (3 masters, 1 replica each, formed with `redis-cli --cluster create`), each in
// its own temp dir, no persistence, a small cluster-node-timeout so a failover takes seconds. The
// harness drives the cluster as an `idem-admin` ACL user with a random password (hiredis), so it
// never drives another test's server; the default user stays open for the client under test and
// for the nodes themselves (replication, MIGRATE).
//
// Starting fails the test (throws) when the cluster cannot be formed; it never skips. Nodes are
// fork+exec'ed with PR_SET_PDEATHSIG (redis_server.hpp's spawn), stopped by PID in the destructor.
//
// Faults a test can inject: kill_master (SIGKILL) + wait_failover, restart_node (a killed node
// rejoins as a replica), and a slot migration done step by step (SlotMigration: IMPORTING /
// MIGRATING, GETKEYSINSLOT + MIGRATE in chunks, SETSLOT NODE on every master) so a test can pause
// between the steps while its clients run.

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <sys/wait.h>
#include <unistd.h>

#include "idem/redis.hpp"
#include "idem/redis/hash_slot.hpp"
#include "redis_server.hpp"  // spawn, free_port, admin_user

#ifndef IDEM_REDIS_CLI
#define IDEM_REDIS_CLI "redis-cli"
#endif

namespace idem::test {

/// A reply of the admin connection, as a tree (type is hiredis's REDIS_REPLY_*).
struct ClusterReply {
  int type = REDIS_REPLY_NIL;
  std::string str;
  long long integer = 0;
  std::vector<ClusterReply> elements;
  [[nodiscard]] bool is_error() const { return type == REDIS_REPLY_ERROR; }
  /// Flattened to text as RedisServer::command does ("(nil)", "ERR ...", array items one a line).
  [[nodiscard]] std::string text() const {
    switch (type) {
      case REDIS_REPLY_STRING:
      case REDIS_REPLY_STATUS:
      case REDIS_REPLY_ERROR: return str;
      case REDIS_REPLY_INTEGER: return std::to_string(integer);
      case REDIS_REPLY_NIL: return "(nil)";
      case REDIS_REPLY_ARRAY: {
        std::string out;
        for (std::size_t i = 0; i < elements.size(); ++i) out += (i ? "\n" : "") + elements[i].text();
        return out;
      }
      default: return "?";
    }
  }
};

class RedisCluster {
public:
  struct Options {
    int masters = 3;
    int replicas_per_master = 1;
    /// cluster-node-timeout: a dead master is failed over about 1.5-3 x this later.
    int node_timeout_ms = 2000;
    /// Extra redis.conf lines for every node.
    std::vector<std::string> config;
    /// Bound on forming the cluster.
    std::chrono::seconds start_timeout{90};
  };

  /// One node as the cluster sees it (CLUSTER NODES of a live node).
  struct NodeView {
    std::string id;
    int port = 0;
    std::size_t index = SIZE_MAX;  // the harness's node index, SIZE_MAX if unknown
    bool master = false;
    bool failed = false;  // "fail" or "fail?"
    std::string master_id;
    std::vector<std::pair<int, int>> slots;  // owned ranges (migration markers left out)
  };

  struct SlotRange {
    int first = 0;
    int last = 0;
    std::size_t node = 0;  // master's node index
  };

  RedisCluster() : RedisCluster(Options{}) {}
  explicit RedisCluster(Options o) : opts_(std::move(o)) {
    char tmpl[] = "/tmp/idem-cluster-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) throw std::runtime_error("test: mkdtemp failed");
    base_ = tmpl;
    try {
      const int total = opts_.masters * (1 + opts_.replicas_per_master);
      nodes_.resize(static_cast<std::size_t>(total));
      for (std::size_t i = 0; i < nodes_.size(); ++i) {
        nodes_[i].dir = base_ + "/n" + std::to_string(i);
        std::filesystem::create_directories(nodes_[i].dir);
        start_fresh(i);
      }
      create();
    } catch (...) {
      stop_all();
      keep_or_remove_dir(true);
      throw;
    }
  }

  ~RedisCluster() {
    stop_all();
    keep_or_remove_dir(false);
  }
  RedisCluster(const RedisCluster&) = delete;
  RedisCluster& operator=(const RedisCluster&) = delete;

  // ---- addresses -----------------------------------------------------------------------------

  [[nodiscard]] std::size_t size() const { return nodes_.size(); }
  [[nodiscard]] int port(std::size_t i) const { return nodes_.at(i).port; }
  [[nodiscard]] pid_t pid(std::size_t i) const { return nodes_.at(i).pid; }
  [[nodiscard]] bool alive(std::size_t i) const { return nodes_.at(i).pid > 0; }
  [[nodiscard]] const std::string& id(std::size_t i) const { return nodes_.at(i).id; }
  [[nodiscard]] std::string addr(std::size_t i) const { return "127.0.0.1:" + std::to_string(port(i)); }
  [[nodiscard]] const std::string& admin_password() const { return admin_password_; }
  [[nodiscard]] const std::string& dir() const { return base_; }

  /// `redis-cluster://127.0.0.1:p1,127.0.0.1:p2`: two seeds (the first two live nodes).
  [[nodiscard]] std::string url(std::size_t seeds = 2) const {
    std::string u = "redis-cluster://";
    std::size_t n = 0;
    for (std::size_t i = 0; i < nodes_.size() && n < seeds; ++i) {
      if (!alive(i)) continue;
      u += (n++ ? "," : "") + addr(i);
    }
    return u;
  }
  /// Every live node as a seed.
  [[nodiscard]] std::string url_all() const { return url(nodes_.size()); }

  /// Options of a store on this cluster (URL with two seeds, test-friendly timeouts).
  [[nodiscard]] RedisOptions options() const {
    RedisOptions o;
    o.url = url();
    o.connect_timeout = millis{2000};
    o.command_timeout = millis{5000};
    return o;
  }

  // ---- admin commands ------------------------------------------------------------------------

  /// Runs one command on node `i` as the admin user; the reply as a tree. Throws when the node
  /// cannot be reached or the connection breaks (an error reply is returned, not thrown).
  [[nodiscard]] ClusterReply call(std::size_t i, const std::vector<std::string>& args, int timeout_ms = 5000) const {
    timeval tv{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    std::unique_ptr<redisContext, void (*)(redisContext*)> c(redisConnectWithTimeout("127.0.0.1", port(i), tv),
                                                              redisFree);
    if (!c || c->err)
      throw std::runtime_error("test: cannot connect to cluster node " + std::to_string(i) + " (" + addr(i) +
                               "): " + (c ? c->errstr : "alloc"));
    redisSetTimeout(c.get(), tv);
    auto run = [&](const std::vector<std::string>& a) {
      auto r = command_argv(c.get(), a);
      if (!r) throw std::runtime_error("test: command on cluster node " + std::to_string(i) + " failed: " + c->errstr);
      return convert(r.get());
    };
    const ClusterReply auth = run({"AUTH", admin_user, admin_password_});
    if (auth.text() != "OK") throw std::runtime_error("test: admin AUTH failed on node " + addr(i) + ": " + auth.text());
    return run(args);
  }

  /// Runs one command on node `i`; the reply flattened to text ("(nil)", "ERR ...").
  std::string command(std::size_t i, const std::vector<std::string>& args) const { return call(i, args).text(); }

  /// Like command, but an error reply throws (for the harness's own steps).
  std::string checked(std::size_t i, const std::vector<std::string>& args) const {
    ClusterReply r = call(i, args);
    if (r.is_error()) {
      std::string what = "test: on node " + addr(i) + ":";
      for (const auto& a : args) what += " " + a;
      throw std::runtime_error(what + " -> " + r.str);
    }
    return r.text();
  }

  /// A field of `INFO`/`CLUSTER INFO` text ("" if absent).
  static std::string field(const std::string& info, const std::string& name) {
    const std::string k = name + ":";
    std::size_t p = 0;
    while ((p = info.find(k, p)) != std::string::npos) {
      if (p == 0 || info[p - 1] == '\n') {
        const std::size_t e = info.find_first_of("\r\n", p);
        return info.substr(p + k.size(), e == std::string::npos ? std::string::npos : e - p - k.size());
      }
      p += k.size();
    }
    return "";
  }

  // ---- topology ------------------------------------------------------------------------------

  /// The cluster as node `from` sees it (CLUSTER NODES).
  [[nodiscard]] std::vector<NodeView> view(std::size_t from) const {
    const std::string text = checked(from, {"CLUSTER", "NODES"});
    std::vector<NodeView> out;
    std::istringstream in(text);
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      std::istringstream ls(line);
      std::string id, address, flags, master, ping, pong, epoch, link;
      ls >> id >> address >> flags >> master >> ping >> pong >> epoch >> link;
      NodeView v;
      v.id = id;
      const auto colon = address.rfind(':', address.find('@'));
      if (colon != std::string::npos) v.port = std::atoi(address.c_str() + colon + 1);
      for (std::size_t i = 0; i < nodes_.size(); ++i)
        if (nodes_[i].port == v.port) v.index = i;
      v.master = flags.find("master") != std::string::npos;
      v.failed = flags.find("fail") != std::string::npos;
      v.master_id = master == "-" ? "" : master;
      std::string s;
      while (ls >> s) {
        if (s.empty() || s[0] == '[') continue;  // [slot->-id] / [slot-<-id]: migration markers
        const auto dash = s.find('-');
        const int a = std::atoi(s.c_str());
        const int b = dash == std::string::npos ? a : std::atoi(s.c_str() + dash + 1);
        v.slots.emplace_back(a, b);
      }
      out.push_back(std::move(v));
    }
    return out;
  }

  /// The first live node that answers (the viewpoint of the topology queries below).
  [[nodiscard]] std::size_t any_live() const {
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      if (!alive(i)) continue;
      try {
        if (call(i, {"PING"}, 2000).text() == "PONG") return i;
      } catch (const std::exception&) {
      }
    }
    throw std::runtime_error("test: no cluster node answers");
  }

  /// Node indices of the masters that own slots, ordered by their first slot.
  [[nodiscard]] std::vector<std::size_t> masters() const {
    std::vector<std::pair<int, std::size_t>> m;
    for (const auto& v : view(any_live()))
      if (v.master && !v.failed && !v.slots.empty() && v.index != SIZE_MAX) {
        int first = 16384;
        for (auto [a, b] : v.slots) first = std::min(first, a);
        m.emplace_back(first, v.index);
      }
    std::sort(m.begin(), m.end());
    std::vector<std::size_t> out;
    for (auto& [f, i] : m) out.push_back(i);
    return out;
  }

  /// Every owned slot range with its master, ordered by slot.
  [[nodiscard]] std::vector<SlotRange> slot_ranges() const {
    std::vector<SlotRange> out;
    for (const auto& v : view(any_live()))
      if (v.master && !v.failed && v.index != SIZE_MAX)
        for (auto [a, b] : v.slots) out.push_back({a, b, v.index});
    std::sort(out.begin(), out.end(), [](const SlotRange& x, const SlotRange& y) { return x.first < y.first; });
    return out;
  }

  /// The master node index that owns `slot` (as a live node sees it).
  [[nodiscard]] std::size_t master_of(int slot) const {
    for (const auto& r : slot_ranges())
      if (slot >= r.first && slot <= r.last) return r.node;
    throw std::runtime_error("test: no master owns slot " + std::to_string(slot));
  }

  /// The replicas of `master` (node indices).
  [[nodiscard]] std::vector<std::size_t> replicas_of(std::size_t master) const {
    std::vector<std::size_t> out;
    for (const auto& v : view(any_live()))
      if (!v.master && v.master_id == id(master) && v.index != SIZE_MAX) out.push_back(v.index);
    return out;
  }

  /// Keys held by node `i` (DBSIZE).
  [[nodiscard]] long long dbsize(std::size_t i) const { return call(i, {"DBSIZE"}).integer; }

  // ---- keys by slot --------------------------------------------------------------------------

  /// A brace-free string whose slot is `slot`: every key "{tag}..." lands in that slot.
  [[nodiscard]] static std::string tag_for_slot(int slot) {
    for (std::uint64_t n = 0;; ++n) {
      std::string t = "s" + std::to_string(n);
      if (redis_hash_slot(t) == slot) return t;
    }
  }
  /// A key k (stem + number, no braces) with redis_hash_slot(prefix + k) == slot.
  [[nodiscard]] static std::string key_in_slot(int slot, std::string_view prefix = "", std::string_view stem = "k") {
    std::string k;
    for (std::uint64_t n = 0;; ++n) {
      k.assign(prefix);
      k.append(stem);
      k.append(std::to_string(n));
      if (redis_hash_slot(k) == slot) return k.substr(prefix.size());
    }
  }

  // ---- waiting -------------------------------------------------------------------------------

  /// Until every live node says cluster_state:ok with all 16384 slots ok, every live node agrees
  /// on who owns each slot, and every live replica's link to its master is up. Throws on timeout.
  void wait_ok(std::chrono::milliseconds timeout = std::chrono::seconds(60)) const {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::string why;
    while (std::chrono::steady_clock::now() < deadline) {
      why = health();
      if (why.empty()) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    throw std::runtime_error("test: the cluster did not become healthy within " +
                             std::to_string(timeout.count()) + " ms: " + why);
  }

  /// "" when healthy (see wait_ok), else what is not.
  [[nodiscard]] std::string health() const {
    std::string first_sig;
    std::size_t first_from = 0;
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      if (!alive(i)) continue;
      try {
        const std::string info = checked(i, {"CLUSTER", "INFO"});
        if (field(info, "cluster_state") != "ok") return addr(i) + " cluster_state:" + field(info, "cluster_state");
        if (field(info, "cluster_slots_ok") != "16384")
          return addr(i) + " cluster_slots_ok:" + field(info, "cluster_slots_ok");
        // This node's view of every live node: role, master, slots. Every view must agree, list
        // every live node as healthy, and have the configured number of masters.
        std::vector<NodeView> v = view(i);
        std::sort(v.begin(), v.end(), [](const NodeView& a, const NodeView& b) { return a.id < b.id; });
        std::string sig;
        int masters_with_slots = 0;
        bool self_master = false;
        std::set<std::size_t> listed;
        for (const auto& n : v) {
          if (n.index == SIZE_MAX || !alive(n.index)) continue;
          listed.insert(n.index);
          if (n.failed) return addr(i) + " flags live node " + addr(n.index) + " as failing";
          if (n.index == i) self_master = n.master;
          sig += n.id + (n.master ? " master " : " replica-of " + n.master_id + " ");
          for (auto [a, b] : n.slots) sig += std::to_string(a) + "-" + std::to_string(b) + ",";
          sig += "\n";
          if (n.master && !n.slots.empty()) ++masters_with_slots;
        }
        for (std::size_t j = 0; j < nodes_.size(); ++j)
          if (alive(j) && !listed.count(j)) return addr(i) + " does not know " + addr(j);
        if (masters_with_slots != opts_.masters)
          return addr(i) + " sees " + std::to_string(masters_with_slots) + " masters with slots";
        if (first_sig.empty()) {
          first_sig = sig;
          first_from = i;
        } else if (sig != first_sig) {
          return addr(i) + " and " + addr(first_from) + " see different clusters";
        }
        if (!self_master) {
          const std::string rep = checked(i, {"INFO", "replication"});
          if (field(rep, "role") != "slave") return addr(i) + " is listed as a replica but has role " + field(rep, "role");
          if (field(rep, "master_link_status") != "up") return addr(i) + " replica link " + field(rep, "master_link_status");
          if (field(rep, "master_sync_in_progress") == "1") return addr(i) + " replica still syncing";
        }
      } catch (const std::exception& e) {
        return e.what();
      }
    }
    return "";
  }

  // ---- faults --------------------------------------------------------------------------------

  /// SIGKILLs node `i` and reaps it (the node's dir, with its nodes.conf, stays for restart_node).
  void kill_node(std::size_t i) {
    Node& n = nodes_.at(i);
    if (n.pid <= 0) return;
    ::kill(n.pid, SIGKILL);
    int status = 0;
    while (::waitpid(n.pid, &status, 0) < 0 && errno == EINTR) {
    }
    n.pid = -1;
  }

  /// SIGKILLs master node `i` (throws if it is not a master that owns slots). Returns its replicas
  /// as they were, the candidates wait_failover waits for.
  std::vector<std::size_t> kill_master(std::size_t i) {
    const auto m = masters();
    if (std::find(m.begin(), m.end(), i) == m.end())
      throw std::runtime_error("test: kill_master: node " + addr(i) + " is not a master");
    auto reps = replicas_of(i);
    dead_replicas_[i] = reps;
    kill_node(i);
    return reps;
  }

  /// Until a replica of the killed master `dead` is master, owns the dead master's slots, and
  /// every live node is healthy (wait_ok). Returns the promoted node index.
  std::size_t wait_failover(std::size_t dead, std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    const auto cand = dead_replicas_[dead];
    std::string why = "no replica of " + addr(dead) + " promoted yet";
    while (std::chrono::steady_clock::now() < deadline) {
      try {
        for (std::size_t c : cand) {
          if (!alive(c) || field(checked(c, {"INFO", "replication"}), "role") != "master") continue;
          const std::string h = health();
          if (h.empty()) return c;
          why = "promoted " + addr(c) + ", cluster not healthy yet: " + h;
        }
      } catch (const std::exception& e) {
        why = e.what();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    throw std::runtime_error("test: no failover of " + addr(dead) + " within " + std::to_string(timeout.count()) +
                             " ms: " + why);
  }

  /// Restarts a killed node on its port with its nodes.conf: it rejoins the cluster (as a replica
  /// of whoever took its slots). With `wait`, until the whole cluster is healthy again (its link
  /// to its master up, the full sync done).
  void restart_node(std::size_t i, bool wait = true, std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    if (alive(i)) throw std::runtime_error("test: restart_node: node " + addr(i) + " is running");
    launch(i);
    if (wait) wait_ok(timeout);
  }

  // ---- slot migration, step by step ----------------------------------------------------------

  /// The master that node `from` says owns `slot` ("" if none).
  [[nodiscard]] std::string owner_seen_by(std::size_t from, int slot) const {
    for (const auto& v : view(from))
      if (v.master && !v.failed)
        for (auto [a, b] : v.slots)
          if (slot >= a && slot <= b) return v.id;
    return "";
  }

  /// Until every live node says master `to` owns `slot`. The owner a node believes in comes from
  /// config epochs: a target whose SETSLOT NODE bump was overtaken (the source's epoch grew
  /// meanwhile) loses the slot back to a source that then gives it up, and nobody claims it any
  /// more. Such a split is repaired as an operator would: SETSLOT NODE on `to` again, then
  /// CLUSTER BUMPEPOCH there, so its claim carries the greatest epoch. Throws after `timeout`.
  void wait_slot_owner(int slot, std::size_t to, std::chrono::milliseconds timeout = std::chrono::seconds(30)) const {
    const auto start = std::chrono::steady_clock::now();
    auto last_repair = start;
    std::string why;
    while (std::chrono::steady_clock::now() - start < timeout) {
      why.clear();
      for (std::size_t i = 0; i < nodes_.size() && why.empty(); ++i) {
        if (!alive(i)) continue;
        try {
          const std::string o = owner_seen_by(i, slot);
          if (o != id(to)) why = addr(i) + " says slot " + std::to_string(slot) + " is owned by " + (o.empty() ? "nobody" : o);
        } catch (const std::exception& e) {
          why = e.what();
        }
      }
      if (why.empty()) return;
      if (std::chrono::steady_clock::now() - last_repair > std::chrono::seconds(2)) {
        last_repair = std::chrono::steady_clock::now();
        ++slot_repairs_;
        std::fprintf(stderr, "test: cluster split on slot %d (%s): SETSLOT NODE + BUMPEPOCH on %s\n", slot, why.c_str(),
                     addr(to).c_str());
        checked(to, {"CLUSTER", "SETSLOT", std::to_string(slot), "NODE", id(to)});
        checked(to, {"CLUSTER", "BUMPEPOCH"});
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    throw std::runtime_error("test: slot " + std::to_string(slot) + " not owned by " + addr(to) + " everywhere within " +
                             std::to_string(timeout.count()) + " ms: " + why);
  }
  /// How often wait_slot_owner had to repair a split (0 when migrations do not overlap).
  [[nodiscard]] int slot_repairs() const { return slot_repairs_; }

  /// One slot moved from master `from` to master `to` (node indices), as redis-cli --cluster
  /// reshard does it, one step per call so the test can pause in between:
  ///   begin()       CLUSTER SETSLOT s IMPORTING <from> on `to`, then MIGRATING <to> on `from`
  ///   move_keys(n)  up to n keys: GETKEYSINSLOT on `from`, MIGRATE ... KEYS ... to `to`; returns
  ///                 how many moved (0 = the slot is empty on `from`)
  ///   finish()      CLUSTER SETSLOT s NODE <to> on `to`, `from`, then every other master; then
  ///                 until every live node agrees (wait_slot_owner). One migration at a time:
  ///                 overlapping ones race their config-epoch bumps and can split a slot.
  class SlotMigration {
  public:
    SlotMigration(const RedisCluster& c, int slot, std::size_t from, std::size_t to)
        : c_(c), slot_(slot), from_(from), to_(to) {}
    void begin() {
      c_.checked(to_, {"CLUSTER", "SETSLOT", std::to_string(slot_), "IMPORTING", c_.id(from_)});
      c_.checked(from_, {"CLUSTER", "SETSLOT", std::to_string(slot_), "MIGRATING", c_.id(to_)});
    }
    int move_keys(int n) {
      const ClusterReply keys = c_.call(from_, {"CLUSTER", "GETKEYSINSLOT", std::to_string(slot_), std::to_string(n)});
      if (keys.is_error()) throw std::runtime_error("test: GETKEYSINSLOT: " + keys.str);
      if (keys.elements.empty()) return 0;
      std::vector<std::string> args{"MIGRATE", "127.0.0.1", std::to_string(c_.port(to_)), "", "0", "5000", "KEYS"};
      for (const auto& k : keys.elements) args.push_back(k.str);
      if (before_migrate_) before_migrate_(std::vector<std::string>(args.begin() + 7, args.end()));
      const std::string r = c_.checked(from_, args);
      if (r != "OK" && r != "NOKEY") throw std::runtime_error("test: MIGRATE answered " + r);
      moved_ += static_cast<int>(keys.elements.size());
      return static_cast<int>(keys.elements.size());
    }
    void finish() {
      const std::string s = std::to_string(slot_);
      c_.checked(to_, {"CLUSTER", "SETSLOT", s, "NODE", c_.id(to_)});
      c_.checked(from_, {"CLUSTER", "SETSLOT", s, "NODE", c_.id(to_)});
      for (std::size_t m : c_.masters())
        if (m != to_ && m != from_) c_.checked(m, {"CLUSTER", "SETSLOT", s, "NODE", c_.id(to_)});
      c_.wait_slot_owner(slot_, to_);
    }
    [[nodiscard]] int moved() const { return moved_; }
    [[nodiscard]] int slot() const { return slot_; }
    /// Called with each chunk's Redis keys just before its MIGRATE (e.g. to look at the records).
    void before_migrate(std::function<void(const std::vector<std::string>&)> f) { before_migrate_ = std::move(f); }

  private:
    std::function<void(const std::vector<std::string>&)> before_migrate_;
    const RedisCluster& c_;
    int slot_;
    std::size_t from_, to_;
    int moved_ = 0;
  };

  /// Moves `slot` from master `from` to master `to`: begin, `pause`, the keys `chunk` at a time
  /// with `chunk_pause` between chunks, `pause`, finish. Returns the number of keys moved.
  int migrate_slot(int slot, std::size_t from, std::size_t to, std::chrono::milliseconds pause = {},
                   int chunk = 100, std::chrono::milliseconds chunk_pause = {}) const {
    SlotMigration m(*this, slot, from, to);
    m.begin();
    std::this_thread::sleep_for(pause);
    while (m.move_keys(chunk) > 0) std::this_thread::sleep_for(chunk_pause);
    std::this_thread::sleep_for(pause);
    // Keys written on `from` after the last chunk (a client that found its key there) move too.
    while (m.move_keys(chunk) > 0) {
    }
    m.finish();
    return m.moved();
  }

  [[nodiscard]] std::string log_tail(std::size_t i, std::size_t bytes = 2000) const {
    std::ifstream in(nodes_.at(i).dir + "/redis.log");
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string s = ss.str();
    return s.size() > bytes ? s.substr(s.size() - bytes) : s;
  }

private:
  struct Node {
    int port = 0;
    int bus_port = 0;
    pid_t pid = -1;
    std::string dir;
    std::string id;
  };

  static std::string random_password() {
    std::random_device rd;
    return "admin-" + std::to_string(rd()) + "-" + std::to_string(rd());
  }

  static ClusterReply convert(const redisReply* r) {
    ClusterReply out;
    out.type = r->type;
    switch (r->type) {
      case REDIS_REPLY_STRING:
      case REDIS_REPLY_STATUS:
      case REDIS_REPLY_ERROR: out.str.assign(r->str, r->len); break;
      case REDIS_REPLY_INTEGER: out.integer = r->integer; break;
      case REDIS_REPLY_ARRAY:
        for (std::size_t i = 0; i < r->elements; ++i) out.elements.push_back(convert(r->element[i]));
        break;
      default: break;
    }
    return out;
  }

  void write_conf(std::size_t i) const {
    const Node& n = nodes_[i];
    std::ofstream conf(n.dir + "/redis.conf");
    conf << "bind 127.0.0.1\nport " << n.port << "\ncluster-port " << n.bus_port << "\ndir " << n.dir
         << "\nsave \"\"\nappendonly no\ndaemonize no\nlogfile " << n.dir << "/redis.log\n"
         << "cluster-enabled yes\ncluster-config-file nodes.conf\ncluster-node-timeout " << opts_.node_timeout_ms
         << "\ncluster-replica-validity-factor 0\nrepl-diskless-sync-delay 0\n"
         << "user " << admin_user << " on >" << admin_password_ << " ~* &* +@all\n";
    for (const auto& line : opts_.config) conf << line << "\n";
  }

  // First start of node i: fresh ports (retried on a clash).
  void start_fresh(std::size_t i) {
    std::string last;
    for (int attempt = 0; attempt < 5; ++attempt) {
      nodes_[i].port = free_port();
      do nodes_[i].bus_port = free_port();
      while (nodes_[i].bus_port == nodes_[i].port);
      try {
        launch(i);
        nodes_[i].id = checked(i, {"CLUSTER", "MYID"});
        return;
      } catch (const std::exception& e) {
        last = e.what();
        std::error_code ec;
        std::filesystem::remove(nodes_[i].dir + "/nodes.conf", ec);
      }
    }
    throw std::runtime_error("test: cluster node " + std::to_string(i) + " could not be started: " + last);
  }

  // Spawns node i on its port and waits until it answers as our process.
  void launch(std::size_t i) {
    Node& n = nodes_[i];
    write_conf(i);
    n.pid = spawn({IDEM_REDIS_SERVER, n.dir + "/redis.conf"});
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (::waitpid(n.pid, &status, WNOHANG) == n.pid) {
        n.pid = -1;
        throw std::runtime_error("redis-server (" IDEM_REDIS_SERVER ") exited at start: " + log_tail(i));
      }
      try {
        if (command(i, {"INFO", "server"}).find("process_id:" + std::to_string(n.pid) + "\r") != std::string::npos)
          return;
      } catch (const std::exception&) {
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    kill_node(i);
    throw std::runtime_error("redis-server did not answer within 15 s: " + log_tail(i));
  }

  // redis-cli --cluster create, then wait until healthy.
  void create() {
    std::vector<std::string> args{IDEM_REDIS_CLI, "--user", admin_user, "--pass", admin_password_, "--no-auth-warning",
                                  "--cluster", "create"};
    for (std::size_t i = 0; i < nodes_.size(); ++i) args.push_back(addr(i));
    args.insert(args.end(), {"--cluster-replicas", std::to_string(opts_.replicas_per_master), "--cluster-yes"});
    const std::string log = base_ + "/create.log";
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) throw std::runtime_error("test: cannot write " + log);
    const pid_t cli = spawn(args, fd);
    ::close(fd);
    const auto deadline = std::chrono::steady_clock::now() + opts_.start_timeout;
    int status = 0;
    for (;;) {
      const pid_t r = ::waitpid(cli, &status, WNOHANG);
      if (r == cli) break;
      if (r < 0 && errno != EINTR) throw std::runtime_error("test: waitpid(redis-cli) failed");
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(cli, SIGKILL);
        while (::waitpid(cli, &status, 0) < 0 && errno == EINTR) {
        }
        throw std::runtime_error("test: redis-cli --cluster create timed out: " + file_tail(log));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
      throw std::runtime_error("test: redis-cli (" IDEM_REDIS_CLI ") --cluster create failed: " + file_tail(log));
    wait_ok(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()));
    if (masters().size() != static_cast<std::size_t>(opts_.masters))
      throw std::runtime_error("test: the cluster formed with " + std::to_string(masters().size()) + " masters");
  }

  static std::string file_tail(const std::string& path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string s = ss.str();
    return s.size() > 3000 ? s.substr(s.size() - 3000) : s;
  }

  void stop_all() {
    for (std::size_t i = 0; i < nodes_.size(); ++i) kill_node(i);
  }

  // IDEM_KEEP_CLUSTER=1 keeps the nodes' dirs (logs, nodes.conf) for a post-mortem.
  void keep_or_remove_dir(bool failed) {
    const char* keep = std::getenv("IDEM_KEEP_CLUSTER");
    if (keep != nullptr && *keep == '1') {
      std::fprintf(stderr, "redis cluster dir kept: %s%s\n", base_.c_str(), failed ? " (start failed)" : "");
      return;
    }
    std::error_code ec;
    if (!base_.empty()) std::filesystem::remove_all(base_, ec);
  }

  Options opts_;
  std::string admin_password_ = random_password();
  std::string base_;
  std::vector<Node> nodes_;
  std::map<std::size_t, std::vector<std::size_t>> dead_replicas_;
  mutable std::atomic<int> slot_repairs_{0};
};

}  // namespace idem::test
