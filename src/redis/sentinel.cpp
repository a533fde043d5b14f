// Sentinel mode of the Redis client (client.hpp): the master the sentinels named, asked again
// whenever the client doubts it (suspect()), so the next connection goes to the new one; what a
// sentinel is asked and its answer read. The asking is opening.cpp's.

#include <charconv>
#include <chrono>
#include <iterator>
#include <optional>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "client.hpp"
#include "idem/core/error.hpp"

namespace idem::detail::redis {

// Sentinels are asked at most this often: during a failover every call fails and suspects the
// master, and many consumers asking the same sentinels on every failure is load, not information.
constexpr auto min_discovery_interval = std::chrono::milliseconds(100);

std::optional<Endpoint> Client::known_master() const {
  std::lock_guard lock(master_mu_);
  const auto now = std::chrono::steady_clock::now();
  if (!master_.host.empty() && (!rediscover_.load() || now - last_discovery_ < min_discovery_interval))
    return master_;
  // Cleared before asking, so a failure that happens meanwhile sets it again.
  rediscover_.store(false);
  last_discovery_ = now;
  return std::nullopt;
}

void Client::learned_master(const Endpoint& m, std::size_t sentinel) const {
  std::lock_guard lock(master_mu_);
  master_ = m;
  first_sentinel_ = sentinel;
  discoveries_.fetch_add(1);
}

std::size_t Client::first_sentinel() const {
  std::lock_guard lock(master_mu_);
  return first_sentinel_;
}

Hello sentinel_hello(const RedisOptions& o) {
  Hello h;
  add_auth(h.requests, o.sentinel_user, o.sentinel_password);
  h.requests.add(Command().arg("SENTINEL").arg("get-master-addr-by-name").arg(o.sentinel_master).format());
  return h;
}

std::optional<Endpoint> parse_master_addr(const redisReply* r) {
  if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 || r->element[0]->type != REDIS_REPLY_STRING ||
      r->element[1]->type != REDIS_REPLY_STRING)
    return std::nullopt;
  int port = 0;
  const std::string_view ps = reply_text(r->element[1]);
  const auto [end, ec] = std::from_chars(ps.data(), ps.data() + ps.size(), port);
  if (ec != std::errc{} || end != ps.data() + ps.size() || port <= 0 || port >= 65536) return std::nullopt;
  return Endpoint{std::string(reply_text(r->element[0])), port};
}

}  // namespace idem::detail::redis
