#pragma once
// RedisAdmin's private parts (admin.cpp): the nodes it reads (Node), the raw command helpers and
// RedisAdmin::Impl, shared by admin.cpp (inspect, list, release, stats) and admin_doctor.cpp. Every
// command travels on the Redis engine of a client of the admin's own (the stores' transport and
// handshake: TLS, AUTH, SELECT, Sentinel, the slot map), sent to a node by name.

#include "idem/redis/admin.hpp"

#include <algorithm>
#include <charconv>
#include <map>
#include <memory>

#include <fmt/format.h>
#include <hiredis/hiredis.h>

#include "admin/idem_redis_scripts.hpp"
#include "client.hpp"
#include "cluster.hpp"
#include "command.hpp"
#include "engine_store.hpp"
#include "idem/core/error.hpp"
#include "idem/redis/hash_slot.hpp"

namespace idem {

namespace admin_detail {

using ReplyPtr = std::unique_ptr<redisReply, void (*)(void*)>;

// The server, or one master of the cluster.
struct Node {
  detail::asio_redis::EngineStore* engine = nullptr;
  detail::redis::Endpoint at;  // cluster mode: the master; empty host: the one server
  std::string label;           // its name in messages
  std::string inspect_sha, release_sha;

  [[nodiscard]] const std::string& name() const { return label; }
};

inline std::string reply_text(const redisReply* r) {
  if (!r) return {};
  if (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS || r->type == REDIS_REPLY_ERROR)
    return std::string(r->str, r->len);
  if (r->type == REDIS_REPLY_INTEGER) return std::to_string(r->integer);
  return {};
}

inline std::int64_t reply_int(const redisReply* r) {
  if (r->type == REDIS_REPLY_INTEGER) return r->integer;
  std::int64_t v = 0;
  const std::string s = reply_text(r);
  std::from_chars(s.data(), s.data() + s.size(), v);
  return v;
}

// An error reply as idem's error: NOPERM says which permission is missing, IDEMCORRUPT is a record
// the stores' codec refuses; everything else keeps the Redis prefix as code().
[[noreturn]] inline void throw_reply(const Node& n, std::string_view what, const redisReply* r) {
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

inline detail::asio_redis::EngineStore::PlainCommand plain(const Node& n, const std::vector<std::string>& args) {
  detail::redis::Command c;
  for (const auto& a : args) c.arg(std::string_view(a));
  return {std::string(c.format().view()), args.front(), -1, n.at};
}

// Every request sent before any reply is read: one round trip per page, however many keys.
inline std::vector<ReplyPtr> pipeline(Node& n, const std::vector<std::vector<std::string>>& cmds) {
  std::vector<detail::asio_redis::EngineStore::PlainCommand> out;
  out.reserve(cmds.size());
  for (const auto& args : cmds) out.push_back(plain(n, args));
  std::vector<ReplyPtr> replies;
  replies.reserve(cmds.size());
  for (auto& r : n.engine->commands(std::move(out))) replies.emplace_back(r.release(), freeReplyObject);
  return replies;
}

inline ReplyPtr command(Node& n, const std::vector<std::string>& args) {
  return ReplyPtr(n.engine->command(plain(n, args)).release(), freeReplyObject);
}

// A command whose error reply is an exception.
inline ReplyPtr checked(Node& n, const std::vector<std::string>& args) {
  auto r = command(n, args);
  if (r->type == REDIS_REPLY_ERROR) throw_reply(n, args.front(), r.get());
  return r;
}

// SCAN MATCH `match` over node `n`, `count` keys a page: `page` gets each page's key array and
// returns false to stop (then so does this).
template <class Page>
inline bool scan_pages(Node& n, const std::string& match, std::size_t count, Page&& page) {
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

inline std::string glob_escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '*' || c == '?' || c == '[' || c == ']' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

// "name:value" lines of INFO.
inline std::map<std::string, std::string> parse_info(const std::string& text) {
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

inline int version_number(const std::string& v) {
  int major = 0, minor = 0;
  const auto dot = v.find('.');
  std::from_chars(v.data(), v.data() + v.size(), major);
  if (dot != std::string::npos) std::from_chars(v.data() + dot + 1, v.data() + v.size(), minor);
  return major * 100 + minor;
}

}  // namespace admin_detail

using namespace admin_detail;

struct RedisAdmin::Impl {
  // Its engine: no scripts loaded and no server check, so doctor works for a user who may not
  // load scripts or read CONFIG; on a cluster the slot map is read (a cluster not ok is readable).
  std::unique_ptr<detail::redis::Client> client;
  const RedisOptions& opt;  // the client's (URL applied)
  std::vector<Node> nodes;  // the server, or every master of the cluster
  bool cluster = false;

  // Loaded on first use, not at connect: doctor must work for a user who may not load scripts.
  void load_scripts(Node& n) const {
    if (!n.inspect_sha.empty()) return;
    n.inspect_sha = reply_text(checked(n, {"SCRIPT", "LOAD", std::string(detail::redis_lua::admin_inspect)}).get());
    n.release_sha = reply_text(checked(n, {"SCRIPT", "LOAD", std::string(detail::redis_lua::admin_release)}).get());
  }

  explicit Impl(RedisOptions o)
      : client(std::make_unique<detail::redis::Client>(std::move(o), detail::redis::Client::FactoryOnly{})),
        opt(client->options()),
        cluster(client->clustered()) {
    auto& engine = client->core().store;
    if (cluster) {
      for (auto& m : client->cluster().master_list()) {
        std::string label = detail::redis::describe(m);
        nodes.push_back({&engine, std::move(m), std::move(label), {}, {}});
      }
      if (nodes.empty()) throw store_error("idem: the Redis Cluster has no slots assigned", "", false);
    } else {
      nodes.push_back({&engine, {}, {}, {}, {}});
    }
    // One round trip to each node now: a wrong address or password fails here, not mid-listing.
    for (auto& n : nodes) {
      if (!cluster) n.label = client->where();  // Sentinel: "" until the master is found
      (void)checked(n, {"PING"});
      if (!cluster) n.label = client->where();
    }
  }

  Node& node_of(std::string_view key) {
    if (!cluster) return nodes.front();
    const detail::redis::Endpoint m = client->cluster().master_of(redis_hash_slot(opt.key_prefix + std::string(key)));
    for (auto& n : nodes)
      if (n.at.host == m.host && n.at.port == m.port) return n;
    throw store_error(fmt::format("idem: {} is not among the masters read at start; run the command again",
                                  detail::redis::describe(m)),
                      "CLUSTERDOWN", true);
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

}  // namespace idem
