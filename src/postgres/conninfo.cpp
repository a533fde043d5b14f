// PostgresOptions::conninfo checked at construction with libpq's own parser, so a malformed
// string is an invalid_options_error naming the problem when the client is built, never a
// retryable connection error at the first message.

#include <algorithm>
#include <array>
#include <memory>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "client.hpp"
#include "idem/core/error.hpp"

namespace idem::detail {

namespace {

[[noreturn]] void bad(const std::string& why, std::string_view fix) {
  throw invalid_options_error(fmt::format("idem: PostgresOptions::conninfo: {}; {}", why, fix));
}

// libpq checks these values only when it connects, and then fails as a connection error.
bool valid_port_list(std::string_view v) {
  // A comma-separated list (one per host); an empty entry means the default port.
  std::size_t start = 0;
  while (start <= v.size()) {
    const std::size_t end = std::min(v.find(',', start), v.size());
    const std::string_view p = v.substr(start, end - start);
    if (!p.empty()) {
      if (p.size() > 5 || !std::all_of(p.begin(), p.end(), [](char ch) { return ch >= '0' && ch <= '9'; }))
        return false;
      const int n = std::stoi(std::string(p));
      if (n < 1 || n > 65535) return false;
    }
    start = end + 1;
  }
  return true;
}

bool one_of(std::string_view v, std::initializer_list<std::string_view> allowed) {
  return std::find(allowed.begin(), allowed.end(), v) != allowed.end();
}

void check_value(std::string_view key, std::string_view v) {
  const auto say = [&](std::string_view fix) { bad(fmt::format("'{}' is '{}'", key, v.substr(0, 80)), fix); };
  if (key == "port" && !valid_port_list(v)) say("use a port number 1..65535 (a comma-separated list for several hosts)");
  if (key == "sslmode" && !one_of(v, {"disable", "allow", "prefer", "require", "verify-ca", "verify-full"}))
    say("use disable, allow, prefer, require, verify-ca or verify-full");
  if (key == "target_session_attrs" &&
      !one_of(v, {"any", "read-write", "read-only", "primary", "standby", "prefer-standby"}))
    say("use any, read-write, read-only, primary, standby or prefer-standby");
  if (key == "connect_timeout" &&
      (v.empty() || !std::all_of(v.begin(), v.end(), [](char ch) { return ch >= '0' && ch <= '9'; })))
    say("use a whole number of seconds");
}

}  // namespace

void check_conninfo(const std::string& conninfo) {
  if (conninfo.find('\0') != std::string::npos) bad("contains a NUL byte", "remove it");
  char* err = nullptr;
  std::unique_ptr<PQconninfoOption, void (*)(PQconninfoOption*)> opts(PQconninfoParse(conninfo.c_str(), &err),
                                                                      &PQconninfoFree);
  if (!opts) {
    const std::string why = err ? first_line(err) : std::string("libpq is out of memory");
    PQfreemem(err);
    bad(why,
        "use key=value pairs with libpq's parameter names ('host=db port=5432 dbname=app', values with spaces in "
        "single quotes) or a URI (postgresql://user@host:port/dbname?param=value)");
  }
  for (const PQconninfoOption* o = opts.get(); o->keyword; ++o)
    if (o->val) check_value(o->keyword, o->val);
}

}  // namespace idem::detail
