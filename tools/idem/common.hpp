#pragma once
// What every subcommand of the `idem` tool shares: the global options, the store behind a URL,
// exit codes and the formatting of records, durations and JSON.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "idem/core/admin.hpp"

namespace idem::tool {

// Exit codes, documented in docs/operations.md: scripts branch on them.
inline constexpr int exit_ok = 0;
inline constexpr int exit_refused = 1;  // not found, refused release, error finding
inline constexpr int exit_usage = 2;    // bad arguments or URL
inline constexpr int exit_store = 3;    // store unreachable, permission denied, unexpected store error

// Options before or after the subcommand name.
struct Globals {
  std::string url;           // --url / -u
  std::string url_argument;  // the store URL given as the command's first argument
  std::string prefix = "idem:";
  std::string schema = "idem";
  std::string table = "idem_records";
  int exit_code = exit_ok;
};

// One admin API behind the URL's scheme.
class Backend {
public:
  virtual ~Backend() = default;
  [[nodiscard]] virtual std::string where() const = 0;
  [[nodiscard]] virtual bool is_redis() const = 0;
  virtual std::optional<AdminRecord> inspect(std::string_view key) = 0;
  virtual std::size_t list(const ListFilter& f, const std::function<bool(const AdminRecord&)>& each) = 0;
  virtual ReleaseResult release(std::string_view key, std::uint64_t fence, bool force) = 0;
  // nullopt: the store expires records itself.
  virtual std::optional<std::size_t> purge(std::size_t batch, const std::function<void(std::size_t, std::size_t)>& p) = 0;
  virtual AdminStats stats() = 0;
  virtual std::vector<Finding> doctor() = 0;
};

// Whether `s` begins with a store URL scheme the tool opens (redis://, rediss://, unix://,
// redis-cluster://, redis-sentinel://, postgresql://, postgres://, sqlite://).
bool is_store_url(std::string_view s);
bool is_postgres_url(std::string_view s);
bool is_sqlite_url(std::string_view s);
// The file of a sqlite:// URL: sqlite:///var/lib/app/idem.db is /var/lib/app/idem.db,
// sqlite://idem.db is idem.db in the working directory (usage_error for ?options or no path).
std::string sqlite_path(std::string_view url);

// The one store of this run, named in one of three ways: the command's URL argument, --url / -u,
// or IDEM_URL. The argument and --url may both be given only if they are the same URL (else a
// usage_error naming both); either overrides IDEM_URL. Throws invalid_options_error when none
// is given.
std::string store_url(const Globals& g);

// For commands whose arguments are "[URL] KEY...": takes a leading store URL off `args` into
// g.url_argument.
void take_url_argument(Globals& g, std::vector<std::string>& args);

// The backend for store_url(g) (invalid_options_error for an unknown scheme or a missing URL).
std::unique_ptr<Backend> open(const Globals& g);

// Adds the subcommand with the shared options attached, so they may follow its name.
// url_positional: also take the store URL as an optional positional argument (commands with no
// positional arguments of their own; the ones with keys call take_url_argument).
CLI::App* subcommand(CLI::App& app, Globals& g, const std::string& name, const std::string& help,
                     bool url_positional = true);

// The help line every command shows for the ways to name the store.
inline constexpr const char* store_help =
    "The store: a URL argument, --url/-u or the IDEM_URL environment variable (the argument and --url "
    "must agree when both are given; either overrides IDEM_URL).\n";

// Runs `body` and turns idem's exceptions into a message on stderr and an exit code.
void guarded(Globals& g, const std::function<int()>& body);

bool stdin_is_tty();
bool stderr_is_tty();

// "5m", "90s", "1h30m", "2d", "250ms" -> milliseconds; throws CLI::ValidationError.
millis parse_duration(const std::string& text);
// 272000 -> "4m32s"; negative values keep their sign.
std::string format_duration(std::int64_t ms);
// A key as text: printable ASCII as is, other bytes as \xNN.
std::string printable(std::string_view s);

// The tool's JSON (docs/operations.md): one object per line, fields in the order they are set.
using Json = nlohmann::ordered_json;
// Well-formed UTF-8 (RFC 3629: no overlong forms, surrogates or code points past U+10FFFF), the
// only bytes dump() writes into a JSON string without throwing.
bool is_utf8(std::string_view s);
// Keys, owners and messages are bytes: UTF-8 goes out as the string field `name`; anything else
// as `name_hex` (lowercase hex of the bytes) instead, so that no byte is lost or replaced and a key
// can be given back with --key-hex.
void put_bytes(Json& obj, const std::string& name, std::string_view s);
// One object on one line.
void print_json(const Json& obj);
// Bytes as lowercase hex, and back (usage_error unless an even number of hex digits).
std::string hex(std::string_view s);
std::string from_hex(std::string_view text, std::string_view option);
// The keys given with --key-hex appended to the positional ones.
void append_hex_keys(std::vector<std::string>& keys, const std::vector<std::string>& hex_keys);

// One record as text lines (inspect) or one JSON object (inspect --json, list --json).
std::string record_text(const AdminRecord& r);
Json record_json(const AdminRecord& r);
// "lapsed 4m ago" / "live, 25s left" for an in_progress lease (or a failed backoff).
std::string lease_text(const AdminRecord& r);

std::optional<State> parse_state(const std::string& s);

}  // namespace idem::tool
