// RedisAdmin (include/idem/redis/admin.hpp): connections of its own, opened by the stores' own
// connection factory (open_connection: TCP or a Unix socket, TLS and mutual TLS with hostname
// checks; Sentinel finds the master), so every URL a store takes reaches the operator's tool too.
// No pool, no scripts loaded at connect: doctor must work for a user who may not load them.

#include "idem/redis/admin.hpp"

#include <algorithm>
#include <charconv>
#include <map>
#include <memory>

#include <fmt/format.h>
#include <hiredis/hiredis.h>

#include "admin/idem_redis_scripts.hpp"
#include "client.hpp"
#include "command.hpp"
#include "tls.hpp"
#include "idem/core/error.hpp"
#include "idem/redis/hash_slot.hpp"

namespace idem {

namespace {

using ReplyPtr = std::unique_ptr<redisReply, void (*)(void*)>;

struct Node {
  std::string host;
  int port = 0;
  std::string socket;
  detail::redis::Link link;
  std::string inspect_sha, release_sha;

  [[nodiscard]] std::string name() const { return socket.empty() ? fmt::format("{}:{}", host, port) : socket; }
};

std::string reply_text(const redisReply* r) {
  if (!r) return {};
  if (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS || r->type == REDIS_REPLY_ERROR)
    return std::string(r->str, r->len);
  if (r->type == REDIS_REPLY_INTEGER) return std::to_string(r->integer);
  return {};
}

std::int64_t reply_int(const redisReply* r) {
  if (r->type == REDIS_REPLY_INTEGER) return r->integer;
  std::int64_t v = 0;
  const std::string s = reply_text(r);
  std::from_chars(s.data(), s.data() + s.size(), v);
  return v;
}

// An error reply as idem's error: NOPERM says which permission is missing, IDEMCORRUPT is a record
// the stores' codec refuses; everything else keeps the Redis prefix as code().
[[noreturn]] void throw_reply(const Node& n, std::string_view what, const redisReply* r) {
  const std::string text = reply_text(r);
  const std::string code = text.substr(0, text.find(' '));
  if (code == "IDEMCORRUPT") throw corrupt_record_error(fmt::format("idem: {}", text));
  if (code == "NOPERM")
    throw store_error(fmt::format("idem: {} on {} was refused by ACL ({}); run as a user with the permissions "
                                  "docs/operations.md lists",
                                  what, n.name(), text),
                      code, false);
  throw store_error(fmt::format("idem: {} on {} failed: {}", what, n.name(), text), code, false);
}

// Every request sent before any reply is read: one round trip per page, however many keys.
std::vector<ReplyPtr> pipeline(Node& n, const std::vector<std::vector<std::string>>& cmds) {
  std::string out;
  for (const auto& args : cmds) {
    detail::redis::Command c;
    for (const auto& a : args) c.arg(std::string_view(a));
    out += c.format().view();
  }
  if (n.link.write(out) != out.size())
    throw connection_error(fmt::format("idem: cannot send to {}: {}", n.name(),
                                       detail::redis::reader_error(n.link->err, n.link->errstr)));
  std::vector<ReplyPtr> replies;
  replies.reserve(cmds.size());
  for (std::size_t i = 0; i < cmds.size(); ++i) {
    detail::redis::ReplyPtr r = n.link.read();
    if (!r)
      throw connection_error(fmt::format("idem: the connection to {} failed: {}", n.name(),
                                         detail::redis::reader_error(n.link->err, n.link->errstr)));
    replies.emplace_back(r.release(), freeReplyObject);
  }
  return replies;
}

ReplyPtr command(Node& n, const std::vector<std::string>& args) { return std::move(pipeline(n, {args}).front()); }

// A command whose error reply is an exception.
ReplyPtr checked(Node& n, const std::vector<std::string>& args) {
  auto r = command(n, args);
  if (r->type == REDIS_REPLY_ERROR) throw_reply(n, args.front(), r.get());
  return r;
}

// SCAN MATCH `match` over node `n`, `count` keys a page: `page` gets each page's key array and
// returns false to stop (then so does this).
template <class Page>
bool scan_pages(Node& n, const std::string& match, std::size_t count, Page&& page) {
  std::string cursor = "0";
  do {
    auto r = checked(n, {"SCAN", cursor, "MATCH", match, "COUNT", std::to_string(count)});
    if (r->type != REDIS_REPLY_ARRAY || r->elements != 2)
      throw store_error(fmt::format("idem: unexpected SCAN reply from {}", n.name()), "", false);
    cursor = reply_text(r->element[0]);
    if (!page(r->element[1])) return false;
  } while (cursor != "0");
  return true;
}

std::string glob_escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '*' || c == '?' || c == '[' || c == ']' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

// "name:value" lines of INFO.
std::map<std::string, std::string> parse_info(const std::string& text) {
  std::map<std::string, std::string> out;
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(pos, end - pos);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (const auto c = line.find(':'); c != std::string::npos && line[0] != '#')
      out[line.substr(0, c)] = line.substr(c + 1);
    pos = end + 1;
  }
  return out;
}

int version_number(const std::string& v) {
  int major = 0, minor = 0;
  const auto dot = v.find('.');
  std::from_chars(v.data(), v.data() + v.size(), major);
  if (dot != std::string::npos) std::from_chars(v.data() + dot + 1, v.data() + v.size(), minor);
  return major * 100 + minor;
}

}  // namespace

struct RedisAdmin::Impl {
  RedisOptions opt;
  std::unique_ptr<const detail::redis::Tls> tls;  // rediss://: the stores' TLS, CA and name checks
  std::vector<Node> nodes;  // the server, or every master of the cluster
  // Cluster: slot ranges of each node, as CLUSTER SLOTS gave them.
  struct Range {
    int first, last;
    std::size_t node;
  };
  std::vector<Range> ranges;
  bool cluster = false;

  void connect(Node& n) const {
    const detail::redis::Endpoint to = n.socket.empty() ? detail::redis::Endpoint{n.host, n.port}
                                                        : detail::redis::Endpoint{n.socket, 0};
    n.link = detail::redis::open_connection(to, opt, "Redis", tls.get());
    if (!opt.password.empty()) {
      auto r = opt.user.empty() ? command(n, {"AUTH", opt.password}) : command(n, {"AUTH", opt.user, opt.password});
      if (r->type == REDIS_REPLY_ERROR)
        throw store_error(fmt::format("idem: authentication to {} failed: {}", n.name(), reply_text(r.get())),
                          "WRONGPASS", false);
    }
    if (opt.db != 0) checked(n, {"SELECT", std::to_string(opt.db)});
  }

  // Loaded on first use, not at connect: doctor must work for a user who may not load scripts.
  void load_scripts(Node& n) const {
    if (!n.inspect_sha.empty()) return;
    n.inspect_sha = reply_text(checked(n, {"SCRIPT", "LOAD", std::string(detail::redis_lua::admin_inspect)}).get());
    n.release_sha = reply_text(checked(n, {"SCRIPT", "LOAD", std::string(detail::redis_lua::admin_release)}).get());
  }

  explicit Impl(RedisOptions o)
      : opt(o.url.empty() ? std::move(o) : parse_redis_url(o.url, o)),
        tls(opt.tls.enabled ? std::make_unique<const detail::redis::Tls>(opt.tls) : nullptr) {
    if (!opt.sentinels.empty()) {
      // The master the sentinels name now: an admin session is short, it does not follow failovers.
      std::size_t first = 0;
      const detail::redis::Endpoint master = detail::redis::discover_master(
          opt, detail::redis::sentinel_endpoints(opt), opt.tls.sentinels ? tls.get() : nullptr, first);
      opt.host = master.host;
      opt.port = master.port;
      opt.unix_socket.clear();
    }
    if (!opt.cluster_nodes.empty()) {
      cluster = true;
      discover_cluster();
    } else {
      Node n;
      n.host = opt.host;
      n.port = opt.port;
      n.socket = opt.unix_socket;
      connect(n);
      nodes.push_back(std::move(n));
    }
  }

  void discover_cluster() {
    std::string last;
    for (const auto& seed : opt.cluster_nodes) {
      Node s;
      const auto colon = seed.rfind(':');
      s.host = seed.substr(0, colon);
      if (!s.host.empty() && s.host.front() == '[') s.host = s.host.substr(1, s.host.size() - 2);
      s.port = std::stoi(seed.substr(colon + 1));
      try {
        connect(s);
        auto r = checked(s, {"CLUSTER", "SLOTS"});
        std::map<std::string, std::size_t> index;
        for (std::size_t i = 0; i < r->elements; ++i) {
          const redisReply* e = r->element[i];
          if (e->type != REDIS_REPLY_ARRAY || e->elements < 3) continue;
          const redisReply* m = e->element[2];
          std::string host = reply_text(m->element[0]);
          if (host.empty()) host = s.host;
          const int port = static_cast<int>(reply_int(m->element[1]));
          const std::string key = host + ":" + std::to_string(port);
          auto [it, fresh] = index.try_emplace(key, nodes.size());
          if (fresh) {
            Node n;
            n.host = host;
            n.port = port;
            connect(n);
            nodes.push_back(std::move(n));
          }
          ranges.push_back({static_cast<int>(reply_int(e->element[0])), static_cast<int>(reply_int(e->element[1])),
                            it->second});
        }
        if (nodes.empty())
          throw store_error(fmt::format("idem: the cluster at {} has no slots assigned", seed), "", false);
        return;
      } catch (const store_error& e) {
        last = e.what();
        nodes.clear();
        ranges.clear();
      }
    }
    throw connection_error(fmt::format("idem: no cluster seed answered CLUSTER SLOTS: {}", last));
  }

  Node& node_of(std::string_view key) {
    if (!cluster) return nodes.front();
    const int slot = redis_hash_slot(opt.key_prefix + std::string(key));
    for (const auto& r : ranges)
      if (slot >= r.first && slot <= r.last) return nodes[r.node];
    throw store_error(fmt::format("idem: slot {} is not served by any master", slot), "CLUSTERDOWN", true);
  }

  // admin_inspect's reply (or nullopt for nil) as an AdminRecord.
  static std::optional<AdminRecord> decode(Node& n, std::string key, const redisReply* r) {
    if (r->type == REDIS_REPLY_NIL) return std::nullopt;
    if (r->type == REDIS_REPLY_ERROR) throw_reply(n, fmt::format("inspect of '{}'", key), r);
    if (r->type != REDIS_REPLY_ARRAY || r->elements < 12)
      throw corrupt_record_error(fmt::format("idem: unexpected admin_inspect reply for '{}'", key));
    AdminRecord a;
    a.key = std::move(key);
    a.record.state = static_cast<State>(reply_int(r->element[0]));
    a.record.holder.fence = static_cast<std::uint64_t>(reply_int(r->element[1]));
    a.record.attempts = static_cast<std::uint32_t>(a.record.holder.fence);  // the fence counts acquisitions
    a.record.owner = reply_text(r->element[2]);
    a.record.lease_until_ms = reply_int(r->element[3]);
    a.record.retry_at_ms = reply_int(r->element[4]);
    a.record.permanent = reply_int(r->element[5]) != 0;
    a.record.fingerprint = reply_text(r->element[6]);
    const auto pay_len = static_cast<std::size_t>(reply_int(r->element[7]));
    const auto pttl = reply_int(r->element[8]);
    a.expires_in_ms = pttl >= 0 ? pttl : -1;
    a.bytes = static_cast<std::size_t>(reply_int(r->element[9]));
    a.now_ms = reply_int(r->element[10]);
    std::string pay = reply_text(r->element[11]);
    if (pay.empty()) pay.assign(pay_len, '\0');  // the length is what a listing needs, not the bytes
    if (a.record.state == State::completed && !a.record.permanent)
      a.record.result = std::move(pay);
    else
      a.record.error = std::move(pay);
    return a;
  }

  static bool selected(const ListFilter& f, const AdminRecord& a) {
    if (f.state && a.record.state != *f.state) return false;
    if (f.older_than) {
      if (a.record.state == State::completed) return false;
      if (overdue_ms(a) < f.older_than->count()) return false;
    }
    return true;
  }

  // One SCAN pass over every node; `each` sees every record (no payload bytes).
  void scan(std::size_t page, const std::function<bool(AdminRecord&)>& each, std::size_t& corrupt) {
    const std::string match = glob_escape(opt.key_prefix) + "*";
    for (auto& n : nodes) {
      load_scripts(n);
      const bool more = scan_pages(n, match, page, [&](const redisReply* keys) {
        std::vector<std::vector<std::string>> cmds;
        cmds.reserve(keys->elements);
        for (std::size_t i = 0; i < keys->elements; ++i)
          cmds.push_back({"EVALSHA", n.inspect_sha, "1", reply_text(keys->element[i]), "0"});
        auto replies = pipeline(n, cmds);
        for (std::size_t i = 0; i < replies.size(); ++i) {
          const std::string rkey = cmds[i][3];
          if (replies[i]->type == REDIS_REPLY_ERROR) {
            const std::string t = reply_text(replies[i].get());
            // Not idem's (another type under the prefix) or damaged: counted, never fatal to a listing.
            if (t.rfind("IDEMCORRUPT", 0) == 0 || t.rfind("WRONGTYPE", 0) == 0) {
              ++corrupt;
              continue;
            }
            throw_reply(n, "inspect", replies[i].get());
          }
          auto a = decode(n, rkey.substr(opt.key_prefix.size()), replies[i].get());
          if (a && !each(*a)) return false;
        }
        return true;
      });
      if (!more) return;
    }
  }
};

RedisAdmin::RedisAdmin(RedisOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
RedisAdmin::~RedisAdmin() = default;

std::string RedisAdmin::address() const {
  std::string out;
  for (const auto& n : impl_->nodes) out += (out.empty() ? "" : ",") + n.name();
  return out;
}

std::optional<AdminRecord> RedisAdmin::inspect(std::string_view key) {
  Node& n = impl_->node_of(key);
  impl_->load_scripts(n);
  auto r = command(n, {"EVALSHA", n.inspect_sha, "1", impl_->opt.key_prefix + std::string(key), "1"});
  return Impl::decode(n, std::string(key), r.get());
}

// One DEL per key, pipelined a page at a time: a DEL of many keys is refused (CROSSSLOT) when a
// cluster node's page spans slots, and each key's own reply says whether it was there.
std::size_t RedisAdmin::remove_all() {
  const std::string match = glob_escape(impl_->opt.key_prefix) + "*";
  std::size_t deleted = 0;
  for (auto& n : impl_->nodes)
    scan_pages(n, match, 1000, [&](const redisReply* keys) {
      std::vector<std::vector<std::string>> cmds;
      cmds.reserve(keys->elements);
      for (std::size_t i = 0; i < keys->elements; ++i) cmds.push_back({"DEL", reply_text(keys->element[i])});
      for (const auto& d : pipeline(n, cmds)) {
        if (d->type == REDIS_REPLY_ERROR) throw_reply(n, "DEL", d.get());
        deleted += static_cast<std::size_t>(reply_int(d.get()));
      }
      return true;
    });
  return deleted;
}

// Redis 7 says only "The user executing the script can't run this command" when a script is
// refused a command; run outside a script, the same command's NOPERM names it.
std::string RedisAdmin::refused_script_command() {
  const std::string k = impl_->opt.key_prefix + "acl-probe";
  Node& n = impl_->node_of("acl-probe");
  const std::vector<std::vector<std::string>> calls{
      {"TIME"}, {"GET", k}, {"SET", k, "x", "PX", "60000"}, {"PTTL", k}, {"PEXPIRE", k, "60000"}, {"DEL", k}};
  for (const auto& c : calls) {
    auto r = command(n, c);
    if (r->type == REDIS_REPLY_ERROR && reply_text(r.get()).rfind("NOPERM", 0) == 0) return reply_text(r.get());
  }
  return {};
}

std::size_t RedisAdmin::list(const ListFilter& filter, const std::function<bool(const AdminRecord&)>& each) {
  std::size_t passed = 0, corrupt = 0;
  bool stop = false;
  // Stuck keys first: with no state asked, one pass per state, in_progress then failed then completed.
  std::vector<std::optional<State>> passes;
  if (filter.state)
    passes.push_back(filter.state);
  else
    passes = {State::in_progress, State::failed, State::completed};
  for (const auto& st : passes) {
    if (stop) break;
    if (filter.older_than && st == State::completed) continue;  // nothing of a completed record is overdue
    ListFilter f = filter;
    f.state = st;
    impl_->scan(std::max<std::size_t>(filter.page, 1), [&](AdminRecord& a) {
      if (!Impl::selected(f, a)) return true;
      ++passed;
      if (!each(a) || (filter.limit && passed >= filter.limit)) {
        stop = true;
        return false;
      }
      return true;
    }, corrupt);
  }
  return passed;
}

ReleaseResult RedisAdmin::release(std::string_view key, std::uint64_t fence, bool force) {
  Node& n = impl_->node_of(key);
  impl_->load_scripts(n);
  auto r = command(n, {"EVALSHA", n.release_sha, "1", impl_->opt.key_prefix + std::string(key), std::to_string(fence),
                       force ? "1" : "0", fmt::format("released by idem release (fence {})", fence)});
  if (r->type == REDIS_REPLY_ERROR) throw_reply(n, fmt::format("release of '{}'", key), r.get());
  if (r->type != REDIS_REPLY_ARRAY || r->elements != 3) throw store_error("idem: unexpected release reply", "", false);
  ReleaseResult out;
  constexpr ReleaseStatus codes[] = {ReleaseStatus::released, ReleaseStatus::not_found, ReleaseStatus::fence_mismatch,
                                     ReleaseStatus::completed, ReleaseStatus::live};
  const auto code = reply_int(r->element[0]);
  if (code < 0 || code > 4) throw store_error("idem: unexpected release status", "", false);
  out.status = codes[code];
  out.fence = static_cast<std::uint64_t>(reply_int(r->element[1]));
  out.state = static_cast<State>(reply_int(r->element[2]));
  return out;
}

AdminStats RedisAdmin::stats() {
  AdminStats s;
  std::size_t corrupt = 0;
  impl_->scan(1000, [&](AdminRecord& a) {
    const auto st = static_cast<std::size_t>(a.record.state);
    if (st < s.by_state.size()) ++s.by_state[st];
    ++s.records;
    s.bytes += a.bytes + a.key.size() + impl_->opt.key_prefix.size();
    if (a.record.state == State::in_progress) {
      const auto o = overdue_ms(a);
      if (o >= 0) ++s.lapsed;
      if (!s.most_overdue_ms || o > *s.most_overdue_ms) s.most_overdue_ms = o;
    }
    return true;
  }, corrupt);
  return s;
}

std::vector<Finding> RedisAdmin::doctor() {
  std::vector<Finding> out;
  const bool many = impl_->nodes.size() > 1;
  for (auto& n : impl_->nodes) {
    const std::string at = many ? fmt::format("{}: ", n.name()) : "";
    auto add = [&](Severity s, std::string check, std::string message, std::string fix = {}) {
      out.push_back({s, std::move(check), at + std::move(message), std::move(fix)});
    };
    auto info = parse_info(reply_text(checked(n, {"INFO", "server"}).get()));
    for (auto& [k, v] : parse_info(reply_text(checked(n, {"INFO", "replication"}).get()))) info[k] = v;
    for (auto& [k, v] : parse_info(reply_text(checked(n, {"INFO", "persistence"}).get()))) info[k] = v;
    for (auto& [k, v] : parse_info(reply_text(checked(n, {"INFO", "cluster"}).get()))) info[k] = v;
    for (auto& [k, v] : parse_info(reply_text(checked(n, {"INFO", "memory"}).get()))) info[k] = v;

    const std::string version = info["redis_version"];
    const int vn = version_number(version);
    if (vn < 500)
      add(Severity::error, "version", fmt::format("Redis {}: the scripts need Redis >= 5 (writes after TIME)", version),
          "upgrade Redis to 6.2 or later");
    else if (vn < 600)
      add(Severity::warning, "version",
          fmt::format("Redis {}: no ACLs, and older than anything idem is tested with", version), "upgrade Redis to 7");
    else
      add(Severity::ok, "version", fmt::format("Redis {}", version));

    if (info["role"] != "master")
      add(Severity::error, "role", fmt::format("this server is a {}: every idem script writes", info["role"]),
          "point the URL at the master");

    // CONFIG GET may be refused to the application's user: a warning, not a finding about the server.
    std::map<std::string, std::string> cfg;
    auto r = command(n, {"CONFIG", "GET", "*"});
    if (r->type == REDIS_REPLY_ARRAY) {
      for (std::size_t i = 0; i + 1 < r->elements; i += 2) cfg[reply_text(r->element[i])] = reply_text(r->element[i + 1]);
    } else {
      add(Severity::warning, "config",
          fmt::format("CONFIG GET is refused ({}): eviction and persistence could not be checked", reply_text(r.get())),
          "run idem doctor as a user allowed +config|get");
    }
    if (!cfg.empty()) {
      const std::string policy = cfg["maxmemory-policy"];
      const std::string maxmemory = cfg["maxmemory"];
      if (policy != "noeviction") {
        if (maxmemory != "0")
          add(Severity::error, "maxmemory-policy",
              fmt::format("maxmemory-policy is {} with maxmemory {}: Redis evicts idempotency records under memory "
                          "pressure, and their messages run again",
                          policy, maxmemory),
              "CONFIG SET maxmemory-policy noeviction (and CONFIG REWRITE); size maxmemory for the retention");
        else
          add(Severity::warning, "maxmemory-policy",
              fmt::format("maxmemory-policy is {}: nothing is evicted while maxmemory is 0, but setting a limit later "
                          "silently starts evicting records",
                          policy),
              "CONFIG SET maxmemory-policy noeviction (and CONFIG REWRITE)");
      } else {
        add(Severity::ok, "maxmemory-policy", "noeviction (a full server refuses writes: capacity_error, fail closed)");
      }
      if (maxmemory != "0" && policy == "noeviction") {
        const double used = std::stod(info["used_memory"].empty() ? "0" : info["used_memory"]);
        const double limit = std::stod(maxmemory);
        if (limit > 0 && used / limit > 0.9)
          add(Severity::warning, "memory",
              fmt::format("used memory is {}% of maxmemory: acquires will fail (OOM) soon",
                          static_cast<int>(100 * used / limit)),
              "raise maxmemory or shorten the retention");
      }
      const bool aof = cfg["appendonly"] == "yes";
      const bool rdb = !cfg["save"].empty();
      if (!aof) {
        add(Severity::error, "appendonly",
            fmt::format("appendonly is no{}: a restart forgets the records written since the last snapshot, and their "
                        "messages run again",
                        rdb ? fmt::format(" (RDB snapshots only: {})", cfg["save"]) : " and no RDB snapshots"),
            "CONFIG SET appendonly yes (and CONFIG REWRITE)");
      } else {
        const std::string fsync = cfg["appendfsync"];
        if (fsync == "always")
          add(Severity::ok, "appendfsync", "always: every write is on disk before it is acknowledged");
        else if (fsync == "everysec")
          add(Severity::info, "appendfsync",
              "everysec: a machine crash (not a Redis crash) can lose the last second of records",
              "appendfsync always, if a machine crash must not re-run a message");
        else
          add(Severity::warning, "appendfsync",
              fmt::format("appendfsync {}: the OS decides when records reach the disk", fsync),
              "CONFIG SET appendfsync everysec (or always)");
      }
    }

    const int replicas = std::atoi(info["connected_slaves"].c_str());
    const int min_replicas = cfg.empty() ? -1 : std::atoi(cfg["min-replicas-to-write"].c_str());
    if (replicas == 0) {
      add(Severity::info, "replicas", "no replicas: this server's disk is the only copy of the records");
    } else if (min_replicas == 0) {
      add(Severity::warning, "min-replicas-to-write",
          fmt::format("{} replica(s) but min-replicas-to-write 0: replication is asynchronous, a failover can lose "
                      "acknowledged records",
                      replicas),
          "RedisOptions::min_replica_acks = 1 (WAIT per write), or CONFIG SET min-replicas-to-write 1");
    } else {
      add(Severity::ok, "replicas",
          fmt::format("{} replica(s), min-replicas-to-write {}", replicas,
                      min_replicas < 0 ? std::string("unknown") : std::to_string(min_replicas)));
    }

    if (info["cluster_enabled"] == "1") {
      auto ci = parse_info(reply_text(checked(n, {"CLUSTER", "INFO"}).get()));
      if (ci["cluster_state"] != "ok")
        add(Severity::error, "cluster",
            fmt::format("cluster_state is {} ({} slots assigned): keys of unserved slots fail", ci["cluster_state"],
                        ci["cluster_slots_assigned"]),
            "redis-cli --cluster check / fix");
      else
        add(Severity::ok, "cluster", fmt::format("cluster_state ok, {} slots assigned", ci["cluster_slots_assigned"]));
      if (!impl_->cluster)
        add(Severity::warning, "cluster", "a cluster node reached with redis://: keys of other slots answer MOVED",
            "use redis-cluster://host:port");
    }

    // The permissions the stores' scripts need, checked for the connected user without running
    // anything: ACL DRYRUN (Redis 7). A refused DRYRUN is a warning: it says nothing about the user.
    if (vn >= 700) {
      const std::string user = reply_text(command(n, {"ACL", "WHOAMI"}).get());
      const std::string k = impl_->opt.key_prefix + "doctor-probe";
      const std::vector<std::vector<std::string>> needed{
          {"EVALSHA", "0000000000000000000000000000000000000000", "1", k},
          {"SCRIPT", "LOAD", "return 1"},
          {"GET", k},
          {"SET", k, "v", "PX", "1"},
          {"PTTL", k},
          {"PEXPIRE", k, "1"},
          {"TIME"}};
      std::vector<std::string> missing;
      std::string refused;
      for (const auto& c : needed) {
        std::vector<std::string> args{"ACL", "DRYRUN", user};
        args.insert(args.end(), c.begin(), c.end());
        auto d = command(n, args);
        if (d->type == REDIS_REPLY_ERROR) {
          refused = reply_text(d.get());
          break;
        }
        if (reply_text(d.get()) != "OK") missing.push_back(c[0] == "SCRIPT" ? "SCRIPT LOAD" : c[0]);
      }
      if (!refused.empty())
        add(Severity::warning, "acl",
            fmt::format("ACL DRYRUN is refused to user {} ({}): the scripts' permissions could not be checked", user,
                        refused),
            "run idem doctor with the application's URL and a user allowed +acl|dryrun, or check the ACL by hand");
      else if (!missing.empty()) {
        std::string list;
        for (const auto& m : missing) list += (list.empty() ? "" : ", ") + m;
        add(Severity::error, "acl",
            fmt::format("user {} may not run {} on {}*: every store call will fail (NOPERM)", user, list,
                        impl_->opt.key_prefix),
            fmt::format("ACL SETUSER {} ~{}* +evalsha +script|load +get +set +pttl +pexpire +time", user,
                        impl_->opt.key_prefix));
      } else {
        add(Severity::ok, "acl",
            fmt::format("user {} may run every command the scripts use on {}*", user, impl_->opt.key_prefix));
      }
    }
  }
  return out;
}

}  // namespace idem
