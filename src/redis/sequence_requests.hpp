#pragma once
// Internal to idem's Redis sequence stores: each request (checked and formatted) and the parsing
// of its reply, shared by RedisSequenceStore (blocking, through Client) and AsyncRedisSequenceStore
// (through the async engine), so both send the same scripts the same arguments and read the same
// answers the same way. Error replies are mapped with sequence_hints before these parsers run.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "command.hpp"
#include "idem/core/record.hpp"
#include "idem/redis/options.hpp"
#include "idem/sequence/sequence_store.hpp"

struct redisReply;

namespace idem::detail::redis {

// `<prefix>seq:{<entity>}`: the entity's key.
std::string sequence_key(const RedisOptions& o, std::string_view entity);
// GET or DEL (`name`) of the entity's key (checks the entity).
Command sequence_key_command(const char* name, const RedisOptions& o, std::string_view entity);
// The last applied sequence from GET's reply (nil: none), or corrupt_record_error.
std::optional<std::uint64_t> parse_sequence_get(const redisReply* r, std::string_view entity);
// Whether DEL removed the key.
bool parse_sequence_del(const redisReply* r, std::string_view entity);

// sequence_advance.lua's EVALSHA (checks the entity) and its answer.
Command sequence_advance_command(const RedisOptions& o, std::string_view entity, std::uint64_t seq);
AdvanceResult parse_sequence_advance(const redisReply* r, std::string_view entity, std::uint64_t seq);

// complete_advance.lua's EVALSHA (checks the entity, holder and retention) and its answer: the
// result recorded then a damaged sequence key is thrown (the message is not acked).
Command complete_advance_command(const RedisOptions& o, std::string_view key, const Holder& h, std::string_view result,
                                 millis retention, std::string_view entity, std::uint64_t seq);
CompleteAdvanceResult parse_complete_advance(const redisReply* r, std::string_view key, std::string_view entity,
                                             std::uint64_t seq);

// On a cluster (`slot_of` of the entity's key >= 0) the key must hash to the entity's slot, as one
// script writes both: usage_error naming the hash tag to use. Returns that slot (-1 off a cluster).
int check_advance_slot(int key_slot, int entity_slot, std::string_view key, std::string_view entity);

}  // namespace idem::detail::redis
