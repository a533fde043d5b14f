// RedisOptions: parse_redis_url, and the checks every client makes before it connects.

#include <sys/un.h>

#include <charconv>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "client.hpp"
#include "pool.hpp"  // check_pool_options: the PoolOptions rules every client shares
#include "idem/core/error.hpp"
#include "idem/detail/warning_relay.hpp"
#include "idem/core/hex.hpp"
#include "idem/redis/options.hpp"

namespace idem {

namespace {

using detail::printable;

std::string percent_decode(std::string_view s, const std::string& url_shown) {
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      out += s[i];
      continue;
    }
    auto hexval = [](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    const int hi = i + 2 < s.size() ? hexval(s[i + 1]) : -1;
    const int lo = i + 2 < s.size() ? hexval(s[i + 2]) : -1;
    if (hi < 0 || lo < 0)
      throw invalid_options_error(
          fmt::format("idem: bad Redis URL '{}': a '%' escape needs two hex digits", url_shown));
    out += static_cast<char>(hi * 16 + lo);
    i += 2;
  }
  return out;
}

int parse_int(std::string_view s, int lo, int hi, const std::string& what, const std::string& url_shown) {
  int v = 0;
  auto res = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || res.ec != std::errc{} || res.ptr != s.data() + s.size() || v < lo || v > hi)
    throw invalid_options_error(
        fmt::format("idem: bad Redis URL '{}': {} '{}' is not an integer in {}..{}", url_shown, what, s, lo, hi));
  return v;
}

// The URL as it may appear in a message: the password replaced by *** (a sentinel_password in
// the query is cut off with the whole query).
std::string redact(std::string_view url) {
  if (const auto q = url.find("sentinel_password="); q != std::string_view::npos) url = url.substr(0, url.find('?'));
  const auto scheme_end = url.find("://");
  if (scheme_end == std::string_view::npos) return printable(url, 200);
  const auto at = url.rfind('@');
  const auto colon = url.find(':', scheme_end + 3);
  if (at == std::string_view::npos || colon == std::string_view::npos || colon > at) return printable(url, 200);
  return printable(fmt::format("{}***{}", url.substr(0, colon + 1), url.substr(at)), 200);
}

// "host[:port]" or "[v6]:port" of a URL; `default_port` when none is given.
struct HostPort {
  std::string host;
  int port;
};
HostPort parse_host_port(std::string_view hostport, int default_port, const std::string& shown) {
  auto bad = [&](const std::string& why) {
    throw invalid_options_error(fmt::format("idem: bad Redis URL '{}': {}", shown, why));
  };
  if (hostport.empty()) bad("no host");
  std::string_view host = hostport, port;
  if (hostport.front() == '[') {
    const auto close = hostport.find(']');
    if (close == std::string_view::npos) bad("unterminated [IPv6] host");
    host = hostport.substr(1, close - 1);
    const std::string_view after = hostport.substr(close + 1);
    if (!after.empty()) {
      if (after.front() != ':') bad("expected ':' after the [IPv6] host");
      port = after.substr(1);
    }
  } else if (const auto colon = hostport.rfind(':'); colon != std::string_view::npos) {
    host = hostport.substr(0, colon);
    port = hostport.substr(colon + 1);
  }
  if (host.empty()) bad("no host");
  return {std::string(host), port.empty() ? default_port : parse_int(port, 1, 65535, "port", shown)};
}

// "h:p,h:p,...": each as "host:port" ("[v6]:port"), at least one.
std::vector<std::string> host_list(std::string_view list, int default_port, const std::string& shown) {
  std::vector<std::string> out;
  while (!list.empty()) {
    const auto comma = list.find(',');
    const HostPort hp = parse_host_port(list.substr(0, comma), default_port, shown);
    out.push_back(hp.host.find(':') != std::string::npos ? fmt::format("[{}]:{}", hp.host, hp.port)
                                                         : fmt::format("{}:{}", hp.host, hp.port));
    list = comma == std::string_view::npos ? std::string_view{} : list.substr(comma + 1);
    if (comma != std::string_view::npos && list.empty())
      throw invalid_options_error(fmt::format("idem: bad Redis URL '{}': a ',' with no host after it", shown));
  }
  if (out.empty()) throw invalid_options_error(fmt::format("idem: bad Redis URL '{}': no host", shown));
  return out;
}

}  // namespace

RedisOptions parse_redis_url(std::string_view url, RedisOptions o) {
  const std::string shown = redact(url);
  auto bad = [&](const std::string& why) {
    throw invalid_options_error(fmt::format("idem: bad Redis URL '{}': {}", shown, why));
  };
  const auto scheme_end = url.find("://");
  if (scheme_end == std::string_view::npos)
    bad("expected redis://host[:port][/db], unix:///path or redis-sentinel://host:port[,host:port...]/master-name");
  const std::string_view scheme = url.substr(0, scheme_end);
  std::string_view rest = url.substr(scheme_end + 3);
  if (scheme != "redis" && scheme != "rediss" && scheme != "unix" && scheme != "redis-sentinel" &&
      scheme != "redis-cluster")
    bad(
        fmt::format("unknown scheme '{}'; use redis://, rediss:// (TLS), unix://, redis-cluster:// or "
                    "redis-sentinel://",
                    printable(scheme)));
  const bool unix_scheme = scheme == "unix";
  const bool sentinel_scheme = scheme == "redis-sentinel";
  const bool cluster_scheme = scheme == "redis-cluster";

  std::string_view query;
  if (const auto q = rest.find('?'); q != std::string_view::npos) {
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
  }
  std::string_view authority = rest, path;
  if (unix_scheme) {
    // unix://[user[:password]@]/path: the path starts at the first '/' after any userinfo.
    const auto at = rest.rfind('@');
    const auto slash = rest.find('/');
    if (at != std::string_view::npos && (slash == std::string_view::npos || at < slash)) {
      authority = rest.substr(0, at + 1);
      path = rest.substr(at + 1);
    } else {
      authority = {};
      path = rest;
    }
  } else if (const auto slash = rest.find('/'); slash != std::string_view::npos) {
    authority = rest.substr(0, slash);
    path = rest.substr(slash);
  }

  std::string user, password;
  std::string_view hostport = authority;
  if (const auto at = authority.rfind('@'); at != std::string_view::npos) {
    const std::string_view info = authority.substr(0, at);
    hostport = authority.substr(at + 1);
    if (const auto colon = info.find(':'); colon != std::string_view::npos) {
      user = percent_decode(info.substr(0, colon), shown);
      password = percent_decode(info.substr(colon + 1), shown);
    } else {
      // redis://secret@host is read as a password (the default user), as redis-cli does.
      password = percent_decode(info, shown);
    }
    if (password.empty() && !user.empty()) bad(fmt::format("user '{}' has no password", printable(user)));
  }

  int db = 0;
  std::string sentinel_user, sentinel_password;
  RedisTlsOptions tls = o.tls;
  if (scheme == "rediss") tls.enabled = true;
  if (unix_scheme) {
    if (path.empty() || path.front() != '/') bad("a unix:// URL needs an absolute socket path, as unix:///run/redis.sock");
    o.unix_socket = percent_decode(path, shown);
    o.sentinels.clear();
    o.cluster_nodes.clear();
  } else if (cluster_scheme) {
    // redis-cluster://h:p[,h:p...]: seeds; the cluster has one keyspace (db 0) and no path.
    o.cluster_nodes = host_list(hostport, 6379, shown);
    if (!path.empty() && path != "/") bad("a redis-cluster:// URL has no path: a cluster has database 0 only");
    o.unix_socket.clear();
    o.sentinels.clear();
  } else if (sentinel_scheme) {
    // redis-sentinel://h:p[,h:p...]/master-name[/db]: 26379 is Sentinel's own default port.
    o.sentinels = host_list(hostport, 26379, shown);
    o.cluster_nodes.clear();
    const std::string_view names = path.empty() ? path : path.substr(1);
    const auto slash = names.find('/');
    const std::string_view name = names.substr(0, slash);
    if (name.empty()) bad("no master name; expected redis-sentinel://host:port[,host:port...]/master-name[/db]");
    o.sentinel_master = percent_decode(name, shown);
    if (slash != std::string_view::npos && slash + 1 < names.size())
      db = parse_int(names.substr(slash + 1), 0, 1'000'000, "database index", shown);
    o.unix_socket.clear();
  } else {
    const HostPort hp = parse_host_port(hostport, 6379, shown);
    o.host = hp.host;
    o.port = hp.port;
    o.unix_socket.clear();
    o.sentinels.clear();
    o.cluster_nodes.clear();
    if (!path.empty() && path != "/") db = parse_int(path.substr(1), 0, 1'000'000, "database index", shown);
  }
  // yes/true/1 or no/false/0.
  auto flag = [&](std::string_view name, std::string_view v) {
    if (v == "yes" || v == "true" || v == "1") return true;
    if (v == "no" || v == "false" || v == "0") return false;
    bad(fmt::format("{} '{}' is not yes or no", name, printable(v)));
    return false;
  };
  while (!query.empty()) {
    const auto amp = query.find('&');
    const std::string_view kv = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view{} : query.substr(amp + 1);
    const auto eq = kv.find('=');
    const std::string_view key = kv.substr(0, eq);
    const std::string_view value = eq == std::string_view::npos ? std::string_view{} : kv.substr(eq + 1);
    if (key == "tls") {
      // A URL turns TLS on, never off: a `tls.enabled` set in code is not undone by a URL.
      if (flag(key, value)) tls.enabled = true;
    } else if (key == "tls_ca_file") {
      tls.ca_file = percent_decode(value, shown);
    } else if (key == "tls_ca_dir") {
      tls.ca_dir = percent_decode(value, shown);
    } else if (key == "tls_cert_file") {
      tls.cert_file = percent_decode(value, shown);
    } else if (key == "tls_key_file") {
      tls.key_file = percent_decode(value, shown);
    } else if (key == "tls_server_name") {
      tls.server_name = percent_decode(value, shown);
    } else if (key == "tls_min_version") {
      if (value == "1.2")
        tls.min_version = TlsVersion::tls1_2;
      else if (value == "1.3")
        tls.min_version = TlsVersion::tls1_3;
      else
        bad(fmt::format("tls_min_version '{}' is not 1.2 or 1.3", printable(value)));
    } else if (sentinel_scheme && key == "sentinel_tls") {
      tls.sentinels = flag(key, value);
    } else if (kv.substr(0, 3) == "db=")
      db = parse_int(kv.substr(3), 0, 1'000'000, "database index", shown);
    else if (sentinel_scheme && kv.substr(0, 14) == "sentinel_user=")
      sentinel_user = percent_decode(kv.substr(14), shown);
    else if (sentinel_scheme && kv.substr(0, 18) == "sentinel_password=")
      sentinel_password = percent_decode(kv.substr(18), shown);
    else
      bad(fmt::format(
          "unknown parameter '{}'; only db=N, tls=yes, tls_ca_file, tls_ca_dir, tls_cert_file, "
          "tls_key_file, tls_server_name, tls_min_version{} understood",
          printable(key), sentinel_scheme ? ", sentinel_tls, sentinel_user and sentinel_password are" : " are"));
  }
  if (tls.enabled && unix_scheme) bad("TLS over a unix:// socket: Redis speaks TLS on TCP only (tls-port)");
  o.tls = std::move(tls);
  o.user = std::move(user);
  o.password = std::move(password);
  o.db = db;
  if (sentinel_scheme) {
    o.sentinel_user = std::move(sentinel_user);
    o.sentinel_password = std::move(sentinel_password);
  }
  o.url = std::string(url);
  return o;
}


namespace detail::redis {

namespace {

void check_options(const RedisOptions& o) {
  auto bad = [](const std::string& why) { throw invalid_options_error(fmt::format("idem: RedisOptions: {}", why)); };
  if (o.unix_socket.empty()) {
    if (o.host.empty()) bad("host is empty; set host (or unix_socket, or url)");
    if (o.port < 1 || o.port > 65535) bad(fmt::format("port {} is not in 1..65535", o.port));
  }
  if (o.db < 0) bad(fmt::format("db {} is negative", o.db));
  if (o.unix_socket.size() >= sizeof(sockaddr_un::sun_path))
    bad(fmt::format("unix_socket '{}' is {} bytes long: a socket path must be shorter than {} bytes (the kernel's "
                    "limit); use a shorter directory",
                    printable(o.unix_socket), o.unix_socket.size(), sizeof(sockaddr_un::sun_path)));
  if (o.tls.enabled && !o.unix_socket.empty())
    bad(fmt::format("tls with unix_socket '{}': Redis speaks TLS on TCP only (tls-port)", printable(o.unix_socket)));
  if (o.tls.cert_file.empty() != o.tls.key_file.empty())
    bad(o.tls.cert_file.empty() ? "tls.key_file is set without tls.cert_file" : "tls.cert_file is set without tls.key_file");
  if (!o.tls.enabled && (o.tls.sentinels || !o.tls.ca_file.empty() || !o.tls.ca_dir.empty() ||
                         !o.tls.cert_file.empty() || !o.tls.server_name.empty()))
    bad("tls settings are given but tls.enabled is false (use rediss:// or ?tls=yes): idem does not fall back to "
        "plain text");
  if (o.connect_timeout <= millis{0})
    bad(fmt::format("connect_timeout must be positive, got {}", ms(o.connect_timeout)));
  if (o.command_timeout <= millis{0})
    bad(fmt::format("command_timeout must be positive, got {}", ms(o.command_timeout)));
  check_pool_options(o.pool, "RedisOptions");
  if (!o.user.empty() && o.password.empty()) bad(fmt::format("user '{}' is set without a password", printable(o.user)));
  if (o.max_redirects < 1 || o.max_redirects > 100)
    bad(fmt::format("max_redirects {} is not in 1..100", o.max_redirects));
  if (!o.cluster_nodes.empty()) {
    if (!o.sentinels.empty())
      bad("cluster_nodes and sentinels are both set; a Redis Cluster fails over by itself, use cluster_nodes alone");
    if (o.db != 0) bad(fmt::format("db {} with cluster_nodes: a Redis Cluster has database 0 only", o.db));
    (void)endpoints(o.cluster_nodes, 6379, "cluster node");
  }
  if (!o.sentinels.empty()) {
    if (o.sentinel_master.empty())
      bad("sentinels are set but sentinel_master is empty; set it to the name in `sentinel monitor <name> ...`");
    (void)sentinel_endpoints(o);
  } else if (!o.sentinel_master.empty()) {
    bad(fmt::format("sentinel_master '{}' is set without sentinels; list them (host:port)",
                    printable(o.sentinel_master)));
  }
  if (!o.sentinel_user.empty() && o.sentinel_password.empty())
    bad(fmt::format("sentinel_user '{}' is set without sentinel_password", printable(o.sentinel_user)));
  if (o.health_check_interval < millis{0})
    bad(fmt::format("health_check_interval must be >= 0 (0 turns the idle PING off), got {}", ms(o.health_check_interval)));
  if (o.auto_batch < 1 || o.auto_batch > 1024)
    bad(fmt::format("auto_batch {} is not in 1..1024 (1 turns auto-batching off)", o.auto_batch));
  if (o.min_replica_acks < 0) bad(fmt::format("min_replica_acks {} is negative; 0 turns WAIT off", o.min_replica_acks));
  if (o.min_replica_acks > 0 && (o.replica_ack_timeout <= millis{0} || o.replica_ack_timeout >= o.command_timeout))
    bad(
        fmt::format("replica_ack_timeout {} must be positive and below command_timeout ({}): the reply to WAIT "
                    "comes after it, within the same command_timeout",
                    ms(o.replica_ack_timeout), ms(o.command_timeout)));
  const auto open = o.key_prefix.find('{');
  const auto close = o.key_prefix.find('}');
  if (open != std::string::npos || close != std::string::npos) {
    const bool one_tag = open != std::string::npos && close != std::string::npos && close > open + 1 &&
                         o.key_prefix.find('{', open + 1) == std::string::npos &&
                         o.key_prefix.find('}', close + 1) == std::string::npos;
    if (!one_tag)
      bad(
          fmt::format("key_prefix '{}' has stray braces; it may hold one whole {{tag}} (all keys in one cluster "
                      "slot) or none",
                      printable(o.key_prefix)));
  }
}

}  // namespace

std::vector<Endpoint> endpoints(const std::vector<std::string>& list, int default_port, const char* what) {
  std::vector<Endpoint> out;
  for (const std::string& s : list) {
    try {
      const HostPort hp = parse_host_port(s, default_port, s);
      out.push_back({hp.host, hp.port});
    } catch (const invalid_options_error&) {
      throw invalid_options_error(fmt::format(
          "idem: RedisOptions: {} '{}' is not host:port (IPv6 as [addr]:port, port 1..65535)", what, printable(s)));
    }
  }
  return out;
}

std::vector<Endpoint> sentinel_endpoints(const RedisOptions& o) { return endpoints(o.sentinels, 26379, "sentinel"); }

RedisOptions resolve_options(RedisOptions o) {
  if (!o.url.empty()) {
    const std::string url = o.url;
    o = parse_redis_url(url, std::move(o));
  }
  check_options(o);
  // Every store on these options reports through one relay, to which guards attach their observers.
  o.observer = idem::detail::WarningRelay::wrap(std::move(o.observer));
  return o;
}

}  // namespace detail::redis

}  // namespace idem
