#pragma once
// Replicated Redis for the failover tests: a master and one replica, either watched by three
// sentinels that fail over by themselves (SentinelTopology), or replicating through a TcpProxy
// that the test stops when it wants (ProxiedPair), so "the replica never got that write" is the
// test's decision and not a race it hopes to win.
//
// The data nodes are RedisServers (redis_server.hpp: free port, temp dir, no persistence, admin
// user, PR_SET_PDEATHSIG). Their role lives in a file their redis.conf includes, because a
// RedisServer restarts with the configuration it was built with: rewriting that file is what lets
// the killed master come back on its port as a replica of the new one, never as a master (an empty
// master on the old address is a failover bug of its own, not the one under test). Sentinels are
// separate processes, each with its own writable config file (Sentinel rewrites it as it learns).
// Every wait is bounded and throws with what the servers said; nothing here skips.

#include <algorithm>
#include <array>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <hiredis/hiredis.h>
#include <sys/wait.h>
#include <unistd.h>

#include "redis_server.hpp"
#include "support/tcp_proxy.hpp"

namespace idem::test {

// One reply kept whole: SENTINEL REPLICAS answers a list of field lists, which RedisServer's
// flattened text cannot tell apart.
struct Reply {
  int type = 0;  // REDIS_REPLY_*
  std::string str;  // string, status, error; an integer as text
  std::vector<Reply> elements;

  // The fields of a flat [name, value, ...] array (one entry of SENTINEL REPLICAS / SENTINELS).
  [[nodiscard]] std::map<std::string, std::string> fields() const {
    std::map<std::string, std::string> f;
    for (std::size_t i = 0; i + 1 < elements.size(); i += 2) f[elements[i].str] = elements[i + 1].str;
    return f;
  }
  [[nodiscard]] std::string text() const {
    if (type != REDIS_REPLY_ARRAY) return type == REDIS_REPLY_NIL ? "(nil)" : str;
    std::string out = "[";
    for (std::size_t i = 0; i < elements.size(); ++i) out += (i ? " " : "") + elements[i].text();
    return out + "]";
  }

  static Reply from(const redisReply* r) {
    Reply out;
    out.type = r->type;
    if (r->type == REDIS_REPLY_INTEGER) out.str = std::to_string(r->integer);
    else if (r->str != nullptr) out.str.assign(r->str, r->len);
    for (std::size_t i = 0; r->type == REDIS_REPLY_ARRAY && i < r->elements; ++i) out.elements.push_back(from(r->element[i]));
    return out;
  }
};

// Runs `args` on 127.0.0.1:port as the harness's admin user; throws when the server cannot be
// reached or answers nothing within 2 s.
inline Reply admin_query(int port, const std::string& password, const std::vector<std::string>& args) {
  const timeval tv{2, 0};
  std::unique_ptr<redisContext, void (*)(redisContext*)> c(redisConnectWithTimeout("127.0.0.1", port, tv), redisFree);
  if (!c || c->err) throw std::runtime_error("test: cannot connect to 127.0.0.1:" + std::to_string(port));
  redisSetTimeout(c.get(), tv);
  auto run = [&](const std::vector<std::string>& a) {
    auto r = command_argv(c.get(), a);
    if (!r) throw std::runtime_error("test: command failed on port " + std::to_string(port) + ": " + c->errstr);
    return Reply::from(r.get());
  };
  const Reply auth = run({"AUTH", admin_user, password});
  if (auth.str != "OK") throw std::runtime_error("test: admin AUTH failed on port " + std::to_string(port) + ": " + auth.str);
  return run(args);
}

inline std::string file_tail(const std::string& path, std::size_t n = 1500) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string s = ss.str();
  return s.size() > n ? s.substr(s.size() - n) : s;
}

// One sentinel process on a free port, watching the master named Sentinel::monitored at
// 127.0.0.1:master_port, with an admin user like the data nodes' (harness commands only).
class Sentinel {
public:
  static constexpr const char* monitored = "m";

  Sentinel(const std::string& dir, int master_port) : dir_(dir) {
    std::filesystem::create_directories(dir_);
    std::string last_error;
    for (int attempt = 0; attempt < 5; ++attempt) {
      port_ = free_port();
      try {
        start(master_port);
        return;
      } catch (const std::exception& e) {
        last_error = e.what();
      }
    }
    throw std::runtime_error("test: redis sentinel could not be started: " + last_error);
  }
  ~Sentinel() { stop(); }
  Sentinel(const Sentinel&) = delete;
  Sentinel& operator=(const Sentinel&) = delete;

  [[nodiscard]] int port() const { return port_; }
  [[nodiscard]] Reply command(const std::vector<std::string>& args) const { return admin_query(port_, password_, args); }
  [[nodiscard]] std::string log_path() const { return dir_ + "/sentinel.log"; }
  [[nodiscard]] std::string log_tail(std::size_t n = 1500) const { return file_tail(log_path(), n); }
  // The master it names now, as "host:port", or why it names none.
  [[nodiscard]] std::string named_master() const {
    try {
      const Reply r = command({"SENTINEL", "get-master-addr-by-name", monitored});
      if (r.elements.size() == 2) return r.elements[0].str + ":" + r.elements[1].str;
      return "answered " + r.text();
    } catch (const std::exception& e) {
      return e.what();
    }
  }

  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
  }

private:
  void start(int master_port) {
    {
      // down-after 1000 ms: a dead master is seen within a second or so, with room for a live one
      // on a loaded machine to answer (see tune()); failover-timeout 1500 ms is the shortest that
      // still lets a promotion be seen (Sentinel reads a promoted replica's INFO once a second)
      // while keeping the pause Sentinel imposes between two attempts on one master
      // (2 x failover-timeout) near the time one failover round of the tests takes anyway.
      std::ofstream conf(dir_ + "/sentinel.conf");
      conf << "port " << port_ << "\nbind 127.0.0.1\ndaemonize no\ndir " << dir_ << "\nlogfile " << dir_
           << "/sentinel.log\nuser " << admin_user << " on >" << password_ << " ~* &* +@all\n"
           << "sentinel resolve-hostnames no\nsentinel announce-hostnames no\n"
           << "sentinel monitor " << monitored << " 127.0.0.1 " << master_port << " 2\n"
           << "sentinel down-after-milliseconds " << monitored << " 1000\n"
           << "sentinel failover-timeout " << monitored << " 1500\n"
           << "sentinel parallel-syncs " << monitored << " 1\n";
    }
    pid_ = spawn({IDEM_REDIS_SERVER, dir_ + "/sentinel.conf", "--sentinel"});
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        throw std::runtime_error("redis sentinel exited at start: " + log_tail());
      }
      try {
        // Ours (the pid), not a process that took the port a moment earlier.
        if (command({"INFO", "server"}).str.find("process_id:" + std::to_string(pid_) + "\r") != std::string::npos) {
          tune();
          return;
        }
      } catch (const std::exception&) {
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    stop();
    throw std::runtime_error("redis sentinel did not answer within 10 s: " + log_tail());
  }

  // Sentinel's periods are made for failovers minutes apart; these make each of ten in a row take
  // two or three seconds. Two constraints tie ping-period to down-after (in the config above):
  // - a sentinel pings a new link (every master it switches to is one) only after
  //   min(ping-period, down-after), and counts it down once down-after has passed since the link
  //   was made: with the two equal (500/500 was tried), all three sentinels find the master they
  //   just promoted "down" and fail it over again — a healthy master demoted, two writable masters
  //   for seconds. ping-period must be well below down-after.
  // - while the master is down, a replica is a candidate only if its last INFO is younger than
  //   5 x ping-period, and replicas are asked INFO once a second then: at ping-period 100 most
  //   attempts ended in -failover-abort-no-good-slave. 5 x 400 ms leaves two INFOs of margin.
  // tilt-trigger is raised so that a loaded machine (a 2-core box running a sanitizer build) does
  // not put a sentinel in TILT mode, where it does not fail over at all.
  void tune() const {
    const Reply r = command({"SENTINEL", "DEBUG", "ping-period", "400", "info-period", "1000", "publish-period", "500",
                             "ask-period", "250", "tilt-trigger", "10000", "tilt-period", "2000"});
    if (r.str != "OK") throw std::runtime_error("test: SENTINEL DEBUG refused: " + r.text());
  }

  std::string dir_;
  std::string password_ = "admin-sentinel-" + std::to_string(std::random_device{}());
  int port_ = 0;
  pid_t pid_ = -1;
};

// Two data nodes, one the master and one its replica, whose roles swap on a failover. The
// test-facing half shared by both topologies.
class ReplicatedPair {
public:
  ReplicatedPair(const ReplicatedPair&) = delete;
  ReplicatedPair& operator=(const ReplicatedPair&) = delete;
  // IDEM_TEST_KEEP_TOPOLOGY=1 keeps the directory (sentinel logs and configs, worker files) to read
  // after a run; the data nodes' own directories go with them.
  virtual ~ReplicatedPair() {
    std::error_code ec;
    nodes_[0].reset();
    nodes_[1].reset();
    if (const char* keep = std::getenv("IDEM_TEST_KEEP_TOPOLOGY"); keep != nullptr && std::string(keep) == "1")
      std::fprintf(stderr, "test: kept %s\n", dir_.c_str());
    else
      std::filesystem::remove_all(dir_, ec);
  }

  [[nodiscard]] RedisServer& master() { return *nodes_[master_]; }
  [[nodiscard]] RedisServer& replica() { return *nodes_[1 - master_]; }
  [[nodiscard]] std::string master_address() const { return "127.0.0.1:" + std::to_string(nodes_[master_]->port()); }
  [[nodiscard]] const std::string& dir() const { return dir_; }

  /// SIGKILLs the master (by its pid): a crash, nothing flushed, nothing said to anyone.
  void kill_master() {
    killed_ = master_;
    nodes_[master_]->stop(SIGKILL);
  }

  /// Starts the killed master again on its port, as a replica of the current master (it comes
  /// back empty: no persistence), and waits until it is synced and known to be.
  void restart_old_master_as_replica(std::chrono::milliseconds bound = std::chrono::seconds(30)) {
    if (killed_ < 0 || killed_ == master_) throw std::runtime_error("test: no killed master to restart");
    write_role(killed_, nodes_[master_]->port());
    nodes_[killed_]->start();
    killed_ = -1;
    wait_synced(bound);
  }

  /// Until the replica's link to the master is up and the master counts it online (and, in
  /// subclasses, whatever else must hold before the next failover).
  virtual void wait_synced(std::chrono::milliseconds bound = std::chrono::seconds(30)) {
    poll_until(bound, "the replica did not sync", [&](std::string& why) { return link_up(why); });
  }

protected:
  ReplicatedPair() {
    char tmpl[] = "/tmp/idem-topology-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) throw std::runtime_error("test: mkdtemp failed");
    dir_ = tmpl;
    write_role(0, 0);
    nodes_[0] = std::make_unique<RedisServer>(node_config(0));
  }

  // The replica, replicating from 127.0.0.1:upstream (the master, or a proxy in front of it).
  void start_replica(int upstream) {
    write_role(1, upstream);
    nodes_[1] = std::make_unique<RedisServer>(node_config(1));
  }

  // Calls `done` every 20 ms until it returns true; throws `what` with its last explanation
  // after `bound`.
  template <class F>
  static void poll_until(std::chrono::milliseconds bound, const std::string& what, F&& done) {
    const auto deadline = std::chrono::steady_clock::now() + bound;
    std::string why;
    for (;;) {
      why.clear();
      try {
        if (done(why)) return;
      } catch (const std::exception& e) {
        why += std::string(" (") + e.what() + ")";
      }
      if (std::chrono::steady_clock::now() > deadline)
        throw std::runtime_error("test: " + what + " within " + std::to_string(bound.count()) + " ms: " + why);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  bool link_up(std::string& why) {
    const std::string r = replica().command({"INFO", "replication"});
    const std::string m = master().command({"INFO", "replication"});
    if (r.find("master_link_status:up") == std::string::npos || m.find("connected_slaves:1") == std::string::npos ||
        m.find("state=online") == std::string::npos) {
      why = "replica says: " + r + "\nmaster says: " + m;
      return false;
    }
    // "online" is not yet "acknowledging": after a diskless full sync the master holds the command
    // stream back until the replica's first REPLCONF ACK, which it sends once a second, and a WAIT
    // meanwhile counts no replica. Tests that ask for acks need the stream flowing.
    master().command({"SET", "idem-test:synced", std::to_string(++probes_)});
    if (const std::string acks = master().command({"WAIT", "1", "200"}); acks != "1") {
      why = "the replica is online but does not acknowledge writes yet (WAIT 1 answered " + acks + ")";
      return false;
    }
    return true;
  }

  void write_role(int node, int upstream) {
    std::ofstream role(role_file(node), std::ios::trunc);
    if (upstream > 0) role << "replicaof 127.0.0.1 " << upstream << "\n";
  }

  std::string dir_;
  std::array<std::unique_ptr<RedisServer>, 2> nodes_;
  int master_ = 0;
  int killed_ = -1;
  long probes_ = 0;

private:
  [[nodiscard]] std::string role_file(int node) const { return dir_ + "/node-" + std::to_string(node) + "-role.conf"; }
  // Diskless full syncs start at once (the default waits 5 s for more replicas to come).
  [[nodiscard]] std::vector<std::string> node_config(int node) const {
    return {"include " + role_file(node), "repl-diskless-sync-delay 0"};
  }
};

/// A master, one replica and three sentinels (quorum 2) that fail the master over by themselves.
class SentinelTopology : public ReplicatedPair {
public:
  SentinelTopology() {
    start_replica(nodes_[0]->port());
    for (int i = 0; i < 3; ++i)
      sentinels_.push_back(std::make_unique<Sentinel>(dir_ + "/sentinel-" + std::to_string(i), nodes_[0]->port()));
    wait_synced();
  }
  ~SentinelTopology() override { stop(); }

  /// `redis-sentinel://` URL of the three sentinels and the monitored master.
  [[nodiscard]] std::string url() const {
    std::string u = "redis-sentinel://";
    for (std::size_t i = 0; i < sentinels_.size(); ++i)
      u += (i ? "," : "") + std::string("127.0.0.1:") + std::to_string(sentinels_[i]->port());
    return u + "/" + Sentinel::monitored;
  }
  [[nodiscard]] std::vector<std::unique_ptr<Sentinel>>& sentinels() { return sentinels_; }
  /// Masters switched so far, as the first sentinel logged them: more than the kills means a
  /// sentinel failed over a master that was alive (a false detection).
  [[nodiscard]] int switches() const {
    std::ifstream in(sentinels_[0]->log_path());
    int n = 0;
    for (std::string line; std::getline(in, line);) n += line.find("+switch-master") != std::string::npos;
    return n;
  }

  /// The replica is synced, every sentinel names the master, knows the replica as a healthy one
  /// of it (from a fresh INFO: it reports that master) and knows the two other sentinels. Until
  /// then a failover could not pick the replica, or could not reach a majority.
  void wait_synced(std::chrono::milliseconds bound = std::chrono::seconds(30)) override {
    const std::string want = master_address();
    const std::string replica_port = std::to_string(replica().port());
    const std::string master_port = std::to_string(master().port());
    with_logs([&] { poll_until(bound, "the topology did not settle", [&](std::string& why) {
      if (!link_up(why)) return false;
      for (const auto& s : sentinels_) {
        const std::string at = "sentinel :" + std::to_string(s->port());
        if (const std::string named = s->named_master(); named != want) {
          why = at + " names " + named + ", not " + want;
          return false;
        }
        bool replica_ok = false;
        for (const Reply& e : s->command({"SENTINEL", "REPLICAS", Sentinel::monitored}).elements) {
          auto f = e.fields();
          if (f["port"] != replica_port) continue;
          replica_ok = f["flags"] == "slave" && f["master-link-status"] == "ok" && f["master-port"] == master_port &&
                       f["role-reported"] == "slave";
          if (!replica_ok) why = at + " sees the replica as " + e.text();
        }
        if (!replica_ok) {
          if (why.empty()) why = at + " does not list the replica yet";
          return false;
        }
        const Reply others = s->command({"SENTINEL", "SENTINELS", Sentinel::monitored});
        const auto healthy = std::count_if(others.elements.begin(), others.elements.end(),
                                           [](const Reply& e) { return e.fields()["flags"] == "sentinel"; });
        if (healthy != static_cast<long>(sentinels_.size()) - 1) {
          why = at + " knows the other sentinels as " + others.text();
          return false;
        }
      }
      return true;
    }); });
  }

  /// Until every sentinel names the replica as the master and it answers ROLE master; it is then
  /// master(). Throws after `bound` with what each sentinel says and the end of its log.
  void wait_promoted(std::chrono::milliseconds bound = std::chrono::seconds(30)) {
    if (killed_ != master_) throw std::runtime_error("test: wait_promoted without kill_master");
    const int next = 1 - master_;
    const std::string want = "127.0.0.1:" + std::to_string(nodes_[next]->port());
    with_logs([&] { poll_until(bound, "no promotion", [&](std::string& why) {
        for (const auto& s : sentinels_)
          why += "sentinel :" + std::to_string(s->port()) + " names " + s->named_master() + "; ";
        for (const auto& s : sentinels_)
          if (s->named_master() != want) return false;
        const std::string role = nodes_[next]->command({"ROLE"});
        why += "ROLE of " + want + ": " + role;
        return role.rfind("master", 0) == 0;
      }); });
    master_ = next;
  }

  /// Sentinels first, so none fails over what is being stopped; then the data nodes.
  void stop() {
    for (auto& s : sentinels_) s->stop();
    for (auto& n : nodes_)
      if (n) n->stop(SIGKILL);
  }

private:
  // Runs `wait`; a timeout it throws carries the end of every sentinel's log (why they did what they did).
  template <class F>
  void with_logs(F&& wait) {
    try {
      wait();
    } catch (const std::runtime_error& e) {
      std::string logs;
      for (const auto& s : sentinels_) logs += "\n--- sentinel :" + std::to_string(s->port()) + " log:\n" + s->log_tail(2500);
      throw std::runtime_error(e.what() + logs);
    }
  }

  std::vector<std::unique_ptr<Sentinel>> sentinels_;
};

/// A master and a replica that replicates through a TcpProxy, without sentinels: the test holds
/// replication, kills the master and promotes the replica itself (REPLICAOF NO ONE), so which
/// writes the promoted replica has is exactly what the test decided.
class ProxiedPair : public ReplicatedPair {
public:
  ProxiedPair() {
    proxy_ = std::make_unique<TcpProxy>(nodes_[0]->port());
    start_replica(proxy_->port());
    wait_synced();
  }

  /// From the next byte the master sends on the replication link, nothing more reaches the
  /// replica (its link stays open: no error, no resync; the bytes are gone).
  void hold_replication() { proxy_->plan({{TcpProxy::Action::hold}}); }
  /// Whether the hold has taken effect (the master sent something since hold_replication()).
  [[nodiscard]] bool replication_held() const { return proxy_->fired(); }

  /// After kill_master(): the replica becomes the master (REPLICAOF NO ONE) and answers ROLE master.
  void promote_replica() {
    if (killed_ != master_) throw std::runtime_error("test: promote_replica without kill_master");
    const int next = 1 - master_;
    const std::string ok = nodes_[next]->command({"REPLICAOF", "NO", "ONE"});
    if (ok != "OK") throw std::runtime_error("test: REPLICAOF NO ONE answered " + ok);
    poll_until(std::chrono::seconds(10), "the replica did not become a master",
               [&](std::string& why) { return (why = nodes_[next]->command({"ROLE"})).rfind("master", 0) == 0; });
    master_ = next;
  }

private:
  std::unique_ptr<TcpProxy> proxy_;
};

}  // namespace idem::test
