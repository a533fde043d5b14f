// Sentinel mode of the Redis client (client.hpp): the master asked of the sentinels, and asked
// again whenever the client doubts it (suspect()): the next connection goes to the new one.

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

Endpoint Client::master() const {
  std::lock_guard lock(master_mu_);
  const auto now = std::chrono::steady_clock::now();
  if (rediscover_.load() && (master_.host.empty() || now - last_discovery_ >= min_discovery_interval)) {
    // Cleared before asking, so a failure that happens meanwhile sets it again.
    rediscover_.store(false);
    last_discovery_ = now;
    try {
      master_ = discover();
    } catch (...) {
      rediscover_.store(true);
      throw;
    }
    discoveries_.fetch_add(1);
  }
  return master_;
}

Endpoint Client::discover() const {
  return discover_master(opt_, sentinels_, opt_.tls.sentinels ? tls_.get() : nullptr, first_sentinel_);
}

Pipeline sentinel_query(const RedisOptions& o) {
  Pipeline p;
  add_auth(p, o.sentinel_user, o.sentinel_password);
  p.add(Command().arg("SENTINEL").arg("get-master-addr-by-name").arg(o.sentinel_master).format());
  return p;
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

Endpoint discover_master(const RedisOptions& o, const std::vector<Endpoint>& sentinels, const Tls* tls,
                         std::size_t& first) {
  const Pipeline p = sentinel_query(o);
  std::string why;
  bool any_answer = false;
  int tls_refused = 0;  // sentinels whose TLS checks failed
  for (std::size_t n = 0; n < sentinels.size(); ++n) {
    const std::size_t i = (first + n) % sentinels.size();
    const std::string at = describe(sentinels[i]);
    try {
      Link c = open_connection(sentinels[i], o, "the Redis sentinel", tls);
      // Not read_reply: its messages name the master, whose lock this thread holds.
      auto failed = [&](const char* during) {
        fmt::format_to(std::back_inserter(why), "; {}: {}", at,
                       io_failure(c.context.get(), during, at, o.command_timeout).text);
      };
      if (c.write(p.all()) != p.all().size()) {
        failed("while sending");
        continue;
      }
      std::string refused;
      ReplyPtr last;
      bool broke = false;
      for (std::size_t k = 0; k < p.size() && !broke; ++k) {
        last = c.read();
        if (!last) {
          failed("to SENTINEL get-master-addr-by-name");
          broke = true;
          break;
        }
        if (is_error(last.get()) && refused.empty()) refused = reply_text(last.get());
      }
      if (broke) continue;
      if (!refused.empty()) {
        fmt::format_to(std::back_inserter(why), "; {} refused: {}", at, refused);
        continue;
      }
      any_answer = true;
      if (std::optional<Endpoint> master = parse_master_addr(last.get())) {
        first = i;
        return std::move(*master);
      }
      fmt::format_to(std::back_inserter(why), "; {} does not know a master named '{}'", at, o.sentinel_master);
    } catch (const error& e) {
      fmt::format_to(std::back_inserter(why), "; {}: {}", at, e.what());
      if (const auto* ce = dynamic_cast<const connection_error*>(&e); ce && ce->code() == "TLS" && !ce->retryable())
        ++tls_refused;
    }
  }
  const std::string msg = fmt::format("idem: no sentinel named the Redis master '{}'{}", o.sentinel_master, why);
  // Every sentinel failed a TLS check: asking again cannot help.
  if (tls_refused > 0 && static_cast<std::size_t>(tls_refused) == sentinels.size())
    throw connection_error(fmt::format("{}. Check the TLS settings (RedisOptions::tls, tls.sentinels)", msg), "TLS",
                           false);
  if (any_answer)
    throw connection_error(fmt::format("{}. Check sentinel_master against `sentinel monitor <name> ...` (SENTINEL "
                                       "MASTERS lists the names); retry later if a failover is under way",
                                       msg),
                           "SENTINEL", true);
  throw connection_error(fmt::format("{}. Are the sentinels running at those addresses? retry later", msg), "SENTINEL",
                         true);
}

}  // namespace idem::detail::redis
