// Redis Cluster routing (cluster.hpp).

#include "cluster.hpp"

#include <algorithm>
#include <charconv>
#include <exception>
#include <future>
#include <iterator>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "idem/core/error.hpp"
#include "reply_machine.hpp"

namespace idem::detail::redis {

namespace {

bool parse_number(std::string_view s, int lo, int hi, int& out) {
  int v = 0;
  const auto res = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || res.ec != std::errc{} || res.ptr != s.data() + s.size() || v < lo || v > hi) return false;
  out = v;
  return true;
}

[[noreturn]] void bad_slots(const std::string& asked, std::string_view why) {
  throw store_error(
      fmt::format("idem: unexpected CLUSTER SLOTS reply from {}: {}; is it a Redis Cluster node (cluster-enabled yes)?",
                  asked, why),
      "", false);
}

}  // namespace

std::optional<Redirect> parse_redirect(std::string_view text, std::string_view fallback_host) {
  Redirect r;
  if (text.substr(0, 6) == "MOVED ") {
    text.remove_prefix(6);
  } else if (text.substr(0, 4) == "ASK ") {
    r.ask = true;
    text.remove_prefix(4);
  } else {
    return std::nullopt;
  }
  const auto space = text.find(' ');
  if (space == std::string_view::npos || !parse_number(text.substr(0, space), 0, slot_count - 1, r.slot))
    return std::nullopt;
  std::string_view addr = text.substr(space + 1);
  if (const auto end = addr.find_first_of(" \r\n"); end != std::string_view::npos) addr = addr.substr(0, end);
  const auto colon = addr.rfind(':');
  if (colon == std::string_view::npos || !parse_number(addr.substr(colon + 1), 1, 65535, r.to.port))
    return std::nullopt;
  std::string_view host = addr.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  r.to.host = std::string(host.empty() ? fallback_host : host);
  return r;
}

std::vector<SlotRange> parse_slots(const redisReply* r, const std::string& asked_host) {
  if (r->type != REDIS_REPLY_ARRAY) bad_slots(asked_host, "not an array");
  std::vector<SlotRange> out;
  for (std::size_t i = 0; i < r->elements; ++i) {
    const redisReply* e = r->element[i];
    if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 || e->element[0]->type != REDIS_REPLY_INTEGER ||
        e->element[1]->type != REDIS_REPLY_INTEGER || e->element[2]->type != REDIS_REPLY_ARRAY ||
        e->element[2]->elements < 2 || e->element[2]->element[0]->type != REDIS_REPLY_STRING ||
        e->element[2]->element[1]->type != REDIS_REPLY_INTEGER)
      bad_slots(asked_host, "a range is not [first, last, [host, port, ...], ...]");
    SlotRange range;
    range.first = static_cast<int>(e->element[0]->integer);
    range.last = static_cast<int>(e->element[1]->integer);
    if (range.first < 0 || range.last >= slot_count || range.first > range.last)
      bad_slots(asked_host, "a range outside 0..16383");
    const redisReply* node = e->element[2];
    std::string host = std::string(reply_text(node->element[0]));
    // A node that does not know its own address announces "" (or "?" with cluster-preferred-endpoint-type unknown).
    if (host.empty() || host == "?") host = asked_host;
    const long long port = node->element[1]->integer;
    if (port < 1 || port > 65535) bad_slots(asked_host, "a port outside 1..65535");
    range.master = {std::move(host), static_cast<int>(port)};
    out.push_back(std::move(range));
  }
  return out;
}

Cluster::Cluster(const RedisOptions& o, bool check)
    : node_options_(o), seeds_(endpoints(o.cluster_nodes, 6379, "cluster node")), check_(check) {
  node_options_.cluster_nodes.clear();
  node_options_.url.clear();
  node_options_.unix_socket.clear();
  owner_.fill(-1);
  read_map(candidates());
  if (!check_) return;
  std::vector<Endpoint> masters;
  int uncovered = 0, first_uncovered = -1;
  {
    std::lock_guard lock(mu_);
    masters = masters_;
    for (int s = 0; s < slot_count; ++s)
      if (owner_[static_cast<std::size_t>(s)] < 0 && uncovered++ == 0) first_uncovered = s;
  }
  if (uncovered > 0)
    throw store_error(fmt::format("idem: {} of the 16384 slots of the Redis Cluster have no master (slot {} the "
                                  "first); is the cluster formed and ok (CLUSTER INFO: cluster_state)? retry later",
                                  uncovered, first_uncovered),
                      "CLUSTERDOWN", true);
  for (const Endpoint& m : masters) (void)node_at(m);  // every master reachable, its scripts loaded
}

std::vector<Endpoint> Cluster::candidates() const {
  std::vector<Endpoint> out;
  {
    std::lock_guard lock(mu_);
    out = masters_;
  }
  for (const Endpoint& s : seeds_)  // a seed that is a known master is asked once
    if (std::none_of(out.begin(), out.end(), [&](const Endpoint& m) { return m.host == s.host && m.port == s.port; }))
      out.push_back(s);
  return out;
}

void Cluster::read_map(const std::vector<Endpoint>& nodes) {
  std::string why;
  const Request ask = Command().arg("CLUSTER").arg("SLOTS").format();
  for (const Endpoint& at : nodes) {
    try {
      if (accept_slots(at, node_at(at)->call(ask.view(), "to CLUSTER SLOTS").get(), why)) return;
    } catch (const error& e) {
      fmt::format_to(std::back_inserter(why), "; {}: {}", describe(at), e.what());
    }
  }
  throw connection_error(
      fmt::format("idem: no Redis Cluster node answered CLUSTER SLOTS{}; are the nodes in cluster_nodes running? retry "
                  "later",
                  why),
      "CLUSTER", true);
}

bool Cluster::accept_slots(const Endpoint& at, const redisReply* r, std::string& why) {
  if (is_error(r)) {
    fmt::format_to(std::back_inserter(why), "; {}: {}", describe(at), reply_text(r));
    return false;
  }
  const std::vector<SlotRange> ranges = parse_slots(r, at.host);
  if (ranges.empty()) {
    fmt::format_to(std::back_inserter(why), "; {}: no slot assigned", describe(at));
    return false;
  }
  install(ranges);
  return true;
}

void Cluster::install(const std::vector<SlotRange>& ranges) {
  std::array<std::int16_t, slot_count> owner;
  owner.fill(-1);
  std::vector<Endpoint> masters;
  for (const SlotRange& range : ranges) {
    auto it = std::find_if(masters.begin(), masters.end(), [&](const Endpoint& m) {
      return m.host == range.master.host && m.port == range.master.port;
    });
    if (it == masters.end()) it = masters.insert(masters.end(), range.master);
    std::fill(owner.begin() + range.first, owner.begin() + range.last + 1,
              static_cast<std::int16_t>(it - masters.begin()));
  }
  std::lock_guard lock(mu_);
  owner_ = owner;
  masters_ = std::move(masters);
  refreshing_ = false;
  refreshes_.fetch_add(1);
}

std::vector<Endpoint> Cluster::begin_refresh() {
  if (!stale_.load()) return {};
  {
    std::lock_guard lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    if (refreshing_ || now - last_begun_ < std::chrono::milliseconds(50)) return {};
    refreshing_ = true;
    last_begun_ = now;
  }
  stale_.store(false);  // before asking: a failure meanwhile marks it again
  return candidates();
}

void Cluster::refresh_failed() noexcept {
  std::lock_guard lock(mu_);
  refreshing_ = false;
  stale_.store(true);
}

RedisOptions Cluster::node_options(const Endpoint& at) const {
  RedisOptions o = node_options_;
  o.host = at.host;
  o.port = at.port;
  return o;
}

std::shared_ptr<Client> Cluster::node_at(const Endpoint& at) {
  const std::string name = describe(at);
  {
    std::lock_guard lock(mu_);
    if (auto it = nodes_.find(name); it != nodes_.end()) return it->second;
  }
  // Built outside the lock: checked, it connects and loads the scripts (a dead node takes
  // connect_timeout); else it connects on its first command.
  auto node = check_ ? std::make_shared<Client>(node_options(at))
                     : std::make_shared<Client>(node_options(at), Client::FactoryOnly{});
  std::lock_guard lock(mu_);
  return nodes_.try_emplace(name, std::move(node)).first->second;
}

namespace {
[[noreturn]] void throw_no_master(int slot) {
  throw store_error(
      fmt::format("idem: no master serves slot {} in the Redis Cluster's map (a failover under way?); retry later", slot),
      "CLUSTERDOWN", true);
}
void check_slot(int slot) {
  if (slot < 0 || slot >= slot_count) throw usage_error("idem: internal: a Redis Cluster call without its key's slot");
}
}  // namespace

Endpoint Cluster::master_of(int slot) {
  check_slot(slot);
  {
    std::lock_guard lock(mu_);
    if (const int i = owner_[static_cast<std::size_t>(slot)]; i >= 0) return masters_[static_cast<std::size_t>(i)];
  }
  suspect();
  throw_no_master(slot);
}

void Cluster::moved(const Redirect& to) {
  moved_.fetch_add(1);
  {
    std::lock_guard lock(mu_);
    auto it = std::find_if(masters_.begin(), masters_.end(),
                           [&](const Endpoint& m) { return m.host == to.to.host && m.port == to.to.port; });
    if (it == masters_.end()) it = masters_.insert(masters_.end(), to.to);
    owner_[static_cast<std::size_t>(to.slot)] = static_cast<std::int16_t>(it - masters_.begin());
  }
  suspect();  // slots move together: read the whole map again (at most every 50 ms)
}

void Cluster::redirected(const Redirect& to) {
  if (to.ask) ask_.fetch_add(1);
  else moved(to);
}

ServerConfig Cluster::server_config() {
  std::vector<Endpoint> masters;
  {
    std::lock_guard lock(mu_);
    masters = masters_;
  }
  ServerConfig worst;
  bool first = true;
  for (const Endpoint& m : masters) {
    ServerConfig c = node_at(m)->server_config();
    if (!c.problem.empty()) return c;
    if (first || (worst.policy == "noeviction" && c.policy != "noeviction") ||
        (c.policy != "noeviction" && c.maxmemory > 0 && worst.maxmemory == 0)) {
      const std::uint64_t bulk = first ? c.max_bulk_len : std::min(worst.max_bulk_len, c.max_bulk_len);
      worst = c;
      worst.max_bulk_len = bulk;
    } else {
      worst.max_bulk_len = std::min(worst.max_bulk_len, c.max_bulk_len);
    }
    first = false;
  }
  return worst;
}

std::vector<Endpoint> Cluster::master_list() const {
  std::lock_guard lock(mu_);
  return masters_;
}

std::string Cluster::masters() const {
  std::lock_guard lock(mu_);
  std::string out;
  for (const Endpoint& m : masters_) out += (out.empty() ? "" : ",") + describe(m);
  return out;
}

void Cluster::add_stats(RedisClientStats& s) const noexcept {
  s.map_refreshes = refreshes_.load();
  s.moved = moved_.load();
  s.ask = ask_.load();
  s.tryagain = tryagain_.load();
}

}  // namespace idem::detail::redis
