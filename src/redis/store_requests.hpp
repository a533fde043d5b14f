#pragma once
// Internal to idem's Redis stores: one key's request for each transition (checked and formatted)
// and the parsing of its reply, shared by RedisStore (blocking, through Client) and
// AsyncRedisStore (Boost.Asio, through its own multiplexed connection), so both send the same
// scripts the same arguments and read the same answers the same way.

#include <optional>
#include <string_view>

#include "command.hpp"
#include "idem/core/record.hpp"
#include "idem/core/store.hpp"
#include "idem/redis/options.hpp"
#include "scripts.hpp"

namespace idem::detail::redis {

// A reply of a shape idem's scripts never send for `what` of `key`: store_error.
[[noreturn]] void bad_reply(std::string_view what, std::string_view key);

// The script's EVALSHA with its one key (prefixed); the caller adds the arguments.
Command eval_one(const RedisOptions& o, Script s, std::string_view key);
// Each checks its inputs (usage_error, invalid_key_error) before formatting anything.
Command acquire_command(const RedisOptions& o, std::string_view key, const AcquireParams& p);
Command complete_command(const RedisOptions& o, std::string_view key, const Holder& h, std::string_view text,
                         millis retention, bool unavailable);
Command fail_command(const RedisOptions& o, std::string_view key, const Holder& h, const FailParams& f);
Command extend_command(const RedisOptions& o, std::string_view key, const Holder& h, millis lease);
Command inspect_command(const RedisOptions& o, std::string_view key);

AcquireResult parse_acquire(const redisReply* r, std::string_view key, std::uint64_t token);
// A usual completed record (header 0xA2 or 0x82) read as the duplicate answer; false for anything else.
bool usual_completed(const redisReply* r, AcquireResult& out);
WriteStatus parse_write(const redisReply* r, std::string_view what, std::string_view key);
std::optional<Record> parse_inspect(const redisReply* r, std::string_view key);

// The record stores the fingerprint's length in 16 bits: invalid_options_error above that.
void check_fingerprint(const AcquireParams& p);

}  // namespace idem::detail::redis

namespace idem::detail::redis {

class Client;
// Reads the server's settings once (one round trip on `client`): refuses an evicting
// configuration (store_error EVICTION) unless unsafe_allow_eviction, warns through the observer
// when they cannot be read, and returns what one call can carry.
StoreLimits check_server(Client& client);

}  // namespace idem::detail::redis
