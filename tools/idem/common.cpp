// The tool's shared parts (common.hpp).

#include "common.hpp"

#include <cctype>
#include <cstdlib>
#include <cstdio>
#include <iostream>
#include <iterator>
#include <sstream>
#include <type_traits>
#include <utility>

#include <fmt/format.h>
#include <unistd.h>

#include "idem/core/error.hpp"
#include "idem/postgres/admin.hpp"
#include "idem/redis/admin.hpp"
#ifdef IDEM_TOOL_SQLITE
#include "idem/sqlite/admin.hpp"
#endif

namespace idem::tool {

namespace {

// The tool's commands over one store's admin: each member is the admin's own. Redis has no purge
// (its records expire by themselves).
template <class Admin>
class AdminBackend final : public Backend {
public:
  template <class... Args>
  explicit AdminBackend(Args&&... args) : admin_(std::forward<Args>(args)...) {}
  std::string where() const override {
    if constexpr (std::is_same_v<Admin, RedisAdmin>) return fmt::format("redis {}", admin_.address());
    else if constexpr (std::is_same_v<Admin, PostgresAdmin>) return fmt::format("postgresql {}", admin_.table());
    else return fmt::format("sqlite {}", admin_.where());
  }
  bool is_redis() const override { return std::is_same_v<Admin, RedisAdmin>; }
  std::optional<AdminRecord> inspect(std::string_view key) override { return admin_.inspect(key); }
  std::size_t list(const ListFilter& f, const std::function<bool(const AdminRecord&)>& each) override {
    return admin_.list(f, each);
  }
  ReleaseResult release(std::string_view key, std::uint64_t fence, bool force) override {
    return admin_.release(key, fence, force);
  }
  std::optional<std::size_t> purge(std::size_t batch, const std::function<void(std::size_t, std::size_t)>& p) override {
    if constexpr (std::is_same_v<Admin, RedisAdmin>) return std::nullopt;
    else return admin_.purge(batch, p);
  }
  AdminStats stats() override { return admin_.stats(); }
  std::vector<Finding> doctor() override { return admin_.doctor(); }

private:
  Admin admin_;
};

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

}  // namespace

bool is_postgres_url(std::string_view s) { return starts_with(s, "postgresql://") || starts_with(s, "postgres://"); }

bool is_sqlite_url(std::string_view s) { return starts_with(s, "sqlite://"); }

std::string sqlite_path(std::string_view url) {
  std::string_view rest = url.substr(std::string_view("sqlite://").size());
  // A query or fragment would silently name another file than the operator meant.
  if (rest.empty() || rest.find_first_of("?#") != std::string_view::npos)
    throw usage_error(fmt::format("idem: '{}' is not a SQLite store URL: use sqlite:///absolute/path.db (or "
                                  "sqlite://relative/path.db), without ?options",
                                  printable(url)));
  return std::string(rest);
}

bool is_store_url(std::string_view s) {
  for (std::string_view scheme : {"redis://", "rediss://", "unix://", "redis-cluster://", "redis-sentinel://"})
    if (starts_with(s, scheme)) return true;
  return is_postgres_url(s) || is_sqlite_url(s);
}

std::string store_url(const Globals& g) {
  if (!g.url_argument.empty() && !g.url.empty() && g.url_argument != g.url)
    throw usage_error(fmt::format("idem: two different stores given: '{}' (argument) and '{}' (--url); give one",
                                  g.url_argument, g.url));
  if (!g.url_argument.empty()) return g.url_argument;
  if (!g.url.empty()) return g.url;
  if (const char* env = std::getenv("IDEM_URL"); env != nullptr && *env != '\0') return env;
  throw invalid_options_error(
      "idem: no store given: pass its URL (redis://, rediss://, redis-cluster://, redis-sentinel://, postgresql://, "
      "sqlite:///path) "
      "as an argument or with --url, or set IDEM_URL");
}

void take_url_argument(Globals& g, std::vector<std::string>& args) {
  if (args.empty() || !is_store_url(args.front())) return;
  g.url_argument = args.front();
  args.erase(args.begin());
}

std::unique_ptr<Backend> open(const Globals& g) {
  const std::string url = store_url(g);
  if (is_postgres_url(url)) {
    PostgresOptions o;
    o.conninfo = url;
    PostgresStoreOptions s;
    s.schema = g.schema;
    s.table = g.table;
    return std::make_unique<AdminBackend<PostgresAdmin>>(std::move(o), std::move(s));
  }
  if (is_sqlite_url(url)) {
#ifdef IDEM_TOOL_SQLITE
    SqliteOptions o;
    o.path = sqlite_path(url);
    o.table = g.table;
    return std::make_unique<AdminBackend<SqliteAdmin>>(std::move(o));
#else
    throw invalid_options_error("idem: this idem tool was built without SQLite (libsqlite3-dev): sqlite:// URLs "
                                "cannot be opened");
#endif
  }
  if (is_store_url(url)) {
    RedisOptions o;
    o.url = url;
    o.key_prefix = g.prefix;
    o.connect_timeout = millis{3000};
    o.command_timeout = millis{30000};
    return std::make_unique<AdminBackend<RedisAdmin>>(std::move(o));
  }
  const auto colon = url.find("://");
  throw invalid_options_error(
      fmt::format("idem: unsupported store URL '{}...': use redis://, rediss://, redis-cluster://, redis-sentinel://, "
                  "postgresql:// or sqlite:///path",
                  colon == std::string::npos ? url : url.substr(0, colon + 3)));
}

CLI::App* subcommand(CLI::App& app, Globals& g, const std::string& name, const std::string& help,
                     bool url_positional) {
  CLI::App* sub = app.add_subcommand(name, help);
  sub->footer(store_help);
  if (url_positional)
    sub->add_option("url", g.url_argument, "the store URL (same as --url; else IDEM_URL)");
  // IDEM_URL is read by store_url(), not by CLI11, so that an explicit URL can be told apart from it.
  sub->add_option("--url,-u", g.url,
                  "the store (else the URL argument or IDEM_URL): redis://[user:pass@]host:port[/db], rediss://..., "
                  "unix:///path, redis-cluster://host:port[,...], redis-sentinel://host:port[,...]/master, "
                  "postgresql://user@host/db, sqlite:///path/to/file.db");
  sub->add_option("--prefix", g.prefix, "Redis key prefix (RedisOptions::key_prefix)")->capture_default_str();
  sub->add_option("--schema", g.schema, "PostgreSQL schema (PostgresStoreOptions::schema)")->capture_default_str();
  sub->add_option("--table", g.table, "PostgreSQL or SQLite table (PostgresStoreOptions::table, SqliteOptions::table)")->capture_default_str();
  return sub;
}

void guarded(Globals& g, const std::function<int()>& body) {
  try {
    g.exit_code = body();
  } catch (const usage_error& e) {
    std::cerr << "idem: " << (starts_with(e.what(), "idem: ") ? e.what() + 6 : e.what()) << "\n";
    g.exit_code = exit_usage;
  } catch (const CLI::Error& e) {
    std::cerr << "idem: " << e.what() << "\n";
    g.exit_code = exit_usage;
  } catch (const std::exception& e) {
    std::cerr << "idem: " << (starts_with(e.what(), "idem: ") ? e.what() + 6 : e.what()) << "\n";
    g.exit_code = exit_store;
  }
}

bool stdin_is_tty() { return ::isatty(0) == 1; }
bool stderr_is_tty() { return ::isatty(2) == 1; }

millis parse_duration(const std::string& text) {
  std::int64_t total = 0;
  std::size_t i = 0;
  if (text.empty()) throw CLI::ValidationError("duration", "empty duration");
  while (i < text.size()) {
    std::size_t j = i;
    while (j < text.size() && std::isdigit(static_cast<unsigned char>(text[j]))) ++j;
    if (j == i)
      throw CLI::ValidationError("duration", fmt::format("'{}' is not a duration like 90s, 5m, 1h30m, 2d", text));
    const std::int64_t n = std::stoll(text.substr(i, j - i));
    std::size_t k = j;
    while (k < text.size() && std::isalpha(static_cast<unsigned char>(text[k]))) ++k;
    const std::string unit = text.substr(j, k - j);
    std::int64_t ms;
    if (unit == "ms") ms = 1;
    else if (unit == "s" || unit.empty()) ms = 1000;
    else if (unit == "m") ms = 60'000;
    else if (unit == "h") ms = 3'600'000;
    else if (unit == "d") ms = 86'400'000;
    else throw CLI::ValidationError("duration", fmt::format("unknown unit '{}' in '{}' (ms, s, m, h, d)", unit, text));
    total += n * ms;
    i = k;
  }
  return millis{total};
}

std::string format_duration(std::int64_t ms) {
  if (ms < 0) return fmt::format("-{}", format_duration(-ms));
  if (ms < 1000) return fmt::format("{}ms", ms);
  std::int64_t s = ms / 1000;
  const std::int64_t d = s / 86400, h = s % 86400 / 3600, m = s % 3600 / 60;
  s %= 60;
  std::string out;
  if (d) fmt::format_to(std::back_inserter(out), "{}d", d);
  if (h) fmt::format_to(std::back_inserter(out), "{}h", h);
  if (m && !d) fmt::format_to(std::back_inserter(out), "{}m", m);
  if ((s || out.empty()) && !d && !h) fmt::format_to(std::back_inserter(out), "{}s", s);
  return out;
}

std::string printable(std::string_view s) {
  std::string out;
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      char buf[5];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  return out;
}

bool is_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  std::size_t i = 0;
  while (i < n) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t len;
    unsigned char lo = 0x80, hi = 0xbf;  // the second byte's range, narrowed against overlongs and surrogates
    if (c >= 0xc2 && c <= 0xdf) len = 2;
    else if (c == 0xe0) len = 3, lo = 0xa0;
    else if (c >= 0xe1 && c <= 0xec) len = 3;
    else if (c == 0xed) len = 3, hi = 0x9f;
    else if (c >= 0xee && c <= 0xef) len = 3;
    else if (c == 0xf0) len = 4, lo = 0x90;
    else if (c >= 0xf1 && c <= 0xf3) len = 4;
    else if (c == 0xf4) len = 4, hi = 0x8f;
    else return false;
    if (n - i < len || p[i + 1] < lo || p[i + 1] > hi) return false;
    for (std::size_t k = 2; k < len; ++k)
      if (p[i + k] < 0x80 || p[i + k] > 0xbf) return false;
    i += len;
  }
  return true;
}

void put_bytes(Json& obj, const std::string& name, std::string_view s) {
  if (is_utf8(s)) obj[name] = std::string(s);
  else obj[name + "_hex"] = hex(s);
}

void print_json(const Json& obj) { std::cout << obj.dump() << "\n"; }

std::string hex(std::string_view s) {
  std::string out;
  char buf[3];
  for (unsigned char c : s) {
    std::snprintf(buf, sizeof buf, "%02x", c);
    out += buf;
  }
  return out;
}

std::string from_hex(std::string_view text, std::string_view option) {
  const auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  bool ok = text.size() % 2 == 0 && !text.empty();
  for (std::size_t i = 0; ok && i < text.size(); i += 2) {
    const int a = digit(text[i]), b = digit(text[i + 1]);
    ok = a >= 0 && b >= 0;
    out += static_cast<char>(a * 16 + b);
  }
  if (!ok)
    throw usage_error(fmt::format("idem: {} '{}' is not a key in hex (an even number of hex digits, as in key_hex)",
                                  option, printable(text)));
  return out;
}

void append_hex_keys(std::vector<std::string>& keys, const std::vector<std::string>& hex_keys) {
  for (const auto& h : hex_keys) keys.push_back(from_hex(h, "--key-hex"));
}

std::string lease_text(const AdminRecord& r) {
  const auto o = overdue_ms(r);
  if (r.record.state == State::in_progress)
    return o >= 0 ? fmt::format("lapsed {} ago (stuck unless redelivered)", format_duration(o))
                  : fmt::format("live, {} left", format_duration(-o));
  if (r.record.state == State::failed) {
    if (r.record.permanent) return "permanent failure (no retry)";
    return o >= 0 ? fmt::format("retryable since {}", format_duration(o))
                  : fmt::format("backing off, retry in {}", format_duration(-o));
  }
  return "-";
}

std::string record_text(const AdminRecord& r) {
  std::ostringstream out;
  const auto& rec = r.record;
  out << "key          " << printable(r.key) << "\n"
      << "state        " << to_string(rec.state) << "\n"
      << "fence        " << rec.holder.fence << "\n"
      << "attempts     " << rec.attempts << "\n";
  if (rec.state == State::in_progress) out << "owner        " << (rec.owner.empty() ? "-" : printable(rec.owner)) << "\n";
  if (rec.state != State::completed) out << "lease        " << lease_text(r) << " (store clock)\n";
  if (rec.state == State::completed)
    out << "result       "
        << (rec.permanent ? fmt::format("not stored: {}", printable(rec.error))
                          : fmt::format("{} bytes", rec.result.size()))
        << "\n";
  if (rec.state == State::failed) out << "error        " << printable(rec.error.substr(0, 200)) << "\n";
  out << "fingerprint  " << (rec.fingerprint.empty() ? "-" : hex(rec.fingerprint.substr(0, 16))) << "\n"
      << "expires in   " << (r.expires_in_ms < 0 ? std::string("never") : format_duration(r.expires_in_ms)) << "\n"
      << "stored       " << r.bytes << " bytes\n";
  return out.str();
}

namespace {
// At most n bytes of s, cut on a character boundary when s is UTF-8, so a truncated message stays
// text instead of turning into error_hex.
std::string_view utf8_prefix(std::string_view s, std::size_t n) {
  if (s.size() <= n) return s;
  if (is_utf8(s))
    while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xc0) == 0x80) --n;
  return s.substr(0, n);
}
}  // namespace

Json record_json(const AdminRecord& r) {
  const auto& rec = r.record;
  Json j = Json::object();
  put_bytes(j, "key", r.key);
  j["state"] = std::string(to_string(rec.state));
  j["fence"] = rec.holder.fence;
  j["attempts"] = rec.attempts;
  put_bytes(j, "owner", rec.owner);
  j["lease_until_ms"] = rec.lease_until_ms;
  j["retry_at_ms"] = rec.retry_at_ms;
  j["now_ms"] = r.now_ms;
  j["overdue_ms"] = overdue_ms(r);
  j["permanent"] = rec.permanent;
  j["result_bytes"] = rec.result.size();
  put_bytes(j, "error", utf8_prefix(rec.error, 1000));
  j["expires_in_ms"] = r.expires_in_ms;
  j["bytes"] = r.bytes;
  return j;
}

std::optional<State> parse_state(const std::string& s) {
  if (s == "in_progress") return State::in_progress;
  if (s == "completed") return State::completed;
  if (s == "failed") return State::failed;
  return std::nullopt;
}

}  // namespace idem::tool
