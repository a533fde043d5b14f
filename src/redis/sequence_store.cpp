// RedisSequenceStore: one EVALSHA of sequence_advance.lua per advance (complete_advance.lua for a
// RedisStore completion and the advance together), GET and DEL for the rest, on the engine
// (engine_store.cpp, AsyncRedisSequenceStore's code); and the requests both faces send.

#include "idem/redis/sequence_store.hpp"

#include <charconv>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "client.hpp"
#include "engine_store.hpp"
#include "sequence_requests.hpp"
#include "idem/core/error.hpp"
#include "idem/core/hex.hpp"
#include "idem/core/validate.hpp"

namespace idem {

namespace detail::redis {

namespace {

using detail::printable;

// A stored value must be a canonical decimal uint64; anything else fails closed.
std::uint64_t parse_seq(std::string_view s, std::string_view entity) {
  std::uint64_t v = 0;
  const bool canonical = !s.empty() && s.size() <= 20 && (s.size() == 1 || s[0] != '0');
  auto res = std::from_chars(s.data(), s.data() + s.size(), v);
  if (!canonical || res.ec != std::errc{} || res.ptr != s.data() + s.size())
    throw corrupt_record_error(fmt::format(
        "idem: the Redis sequence of entity '{}' holds '{}', not a decimal uint64; delete or repair the key",
        printable(entity), printable(s, 32)));
  return v;
}

// advance_seq's reply (sequence.lua): code 1 advanced / 0 not, and the value it found.
// `what()` names the call in an error message; it is built only when one is thrown.
template <class What>
AdvanceResult advance_result(std::int64_t code, std::string_view prev, std::string_view entity, std::uint64_t seq,
                             const What& what) {
  if (code != 0 && code != 1) throw_bad_reply(what());
  AdvanceResult out;
  out.advanced = code == 1;
  if (!prev.empty()) out.previous = parse_seq(prev, entity);
  // The script only writes when the value grows; a reply saying otherwise is a broken script.
  if (out.previous && out.advanced != (*out.previous < seq))
    throw store_error(fmt::format("idem: inconsistent Redis reply to {}", what()), "", false);
  return out;
}

// The reply is an array of `types` (REDIS_REPLY_*), else a bad reply.
template <class What>
void expect_array(const redisReply* r, std::initializer_list<int> types, const What& what) {
  bool ok = r->type == REDIS_REPLY_ARRAY && r->elements == types.size();
  for (std::size_t i = 0; ok && i < types.size(); ++i) ok = r->element[i]->type == types.begin()[i];
  if (!ok) throw_bad_reply(what());
}

// The entity's key, as one argument of `cmd`.
Command& entity_key(Command& cmd, const RedisOptions& o, std::string_view entity) {
  return cmd.joined({o.key_prefix, "seq:{", entity, "}"});
}

auto key_what(const char* name, std::string_view entity) {
  return [=] { return fmt::format("{} of the sequence of entity '{}'", name, printable(entity)); };
}

}  // namespace

std::string sequence_key(const RedisOptions& o, std::string_view entity) {
  return o.key_prefix + "seq:{" + std::string(entity) + "}";
}

Command sequence_key_command(const char* name, const RedisOptions& o, std::string_view entity) {
  detail::check_entity(entity);
  Command cmd;
  entity_key(cmd.arg(name), o, entity);
  return cmd;
}

std::optional<std::uint64_t> parse_sequence_get(const redisReply* r, std::string_view entity) {
  if (r->type == REDIS_REPLY_NIL) return std::nullopt;
  if (r->type != REDIS_REPLY_STRING) throw_bad_reply(key_what("GET", entity)());
  return parse_seq(reply_text(r), entity);
}

bool parse_sequence_del(const redisReply* r, std::string_view entity) {
  if (r->type != REDIS_REPLY_INTEGER) throw_bad_reply(key_what("DEL", entity)());
  return r->integer > 0;
}

Command sequence_advance_command(const RedisOptions& o, std::string_view entity, std::uint64_t seq) {
  detail::check_entity(entity);
  Command cmd = Client::evalsha(Script::sequence_advance, 1);
  entity_key(cmd, o, entity).arg(seq);
  return cmd;
}

AdvanceResult parse_sequence_advance(const redisReply* r, std::string_view entity, std::uint64_t seq) {
  auto what = [&] { return fmt::format("sequence_advance of entity '{}'", printable(entity)); };
  expect_array(r, {REDIS_REPLY_INTEGER, REDIS_REPLY_STRING}, what);
  return advance_result(r->element[0]->integer, reply_text(r->element[1]), entity, seq, what);
}

Command complete_advance_command(const RedisOptions& o, std::string_view key, const Holder& h, std::string_view result,
                                 millis retention, std::string_view entity, std::uint64_t seq) {
  detail::check_entity(entity);
  detail::check_holder(key, h);
  detail::check_lease(retention, "retention");
  Command cmd = Client::evalsha(Script::complete_advance, 2);
  cmd.joined({o.key_prefix, key});
  entity_key(cmd, o, entity).arg(h.fence).token(h.token).arg(result).arg(retention.count()).arg(seq);
  return cmd;
}

CompleteAdvanceResult parse_complete_advance(const redisReply* r, std::string_view key, std::string_view entity,
                                             std::uint64_t seq) {
  auto what = [&] {
    return fmt::format("complete_advance of key '{}' and entity '{}'", printable(key), printable(entity));
  };
  expect_array(r, {REDIS_REPLY_INTEGER, REDIS_REPLY_INTEGER, REDIS_REPLY_STRING}, what);
  CompleteAdvanceResult out;
  if (r->element[0]->integer != 1) return out;  // lease lost: the script wrote nothing
  out.status = WriteStatus::ok;
  const std::int64_t code = r->element[1]->integer;
  const std::string_view prev = reply_text(r->element[2]);
  // The result is recorded by now; a damaged sequence key is reported, so the message is not acked
  // and its redelivery (a duplicate) stops at the same key until someone repairs it.
  if (code == -1)
    throw corrupt_record_error(
        fmt::format("idem: the result of key '{}' was recorded, but the Redis sequence of "
                    "entity '{}' holds '{}', not a decimal uint64, so it was not advanced; "
                    "repair the key",
                    printable(key), printable(entity), printable(prev)));
  if (code == -2)
    throw_reply_error(prev, fmt::format("{} (the result was recorded; the sequence key is not a string)", what()),
                      sequence_hints);
  out.advance = advance_result(code, prev, entity, seq, what);
  return out;
}

int check_advance_slot(int key_slot, int entity_slot, std::string_view key, std::string_view entity) {
  // Refused here rather than answered CROSSSLOT by the server.
  if (entity_slot >= 0 && key_slot != entity_slot)
    throw usage_error(
        fmt::format("idem: on a Redis Cluster the key '{}' and the sequence of entity '{}' must hash "
                    "to one slot (one script writes both): put the entity's hash tag in the key, as "
                    "'{{{}}}:{}' (a key's first {{...}} decides its slot); or complete and advance in "
                    "two steps",
                    printable(key), printable(entity), printable(entity), printable(key)));
  return entity_slot;
}

}  // namespace detail::redis

using detail::asio_redis::EngineStore;
using detail::asio_redis::RedisCore;
using detail::asio_redis::wait_for;

RedisSequenceStore::RedisSequenceStore(RedisStore& store)
    : ClientHandle(store.client(), "RedisSequenceStore"), core_(store.core_) {
  (void)store.core();  // usage_error for a moved-from store
}
RedisSequenceStore::RedisSequenceStore(std::shared_ptr<RedisClient> client)
    : ClientHandle(std::move(client), "RedisSequenceStore"),
      core_(this->client(), &impl().core()) {}
RedisSequenceStore::RedisSequenceStore(RedisOptions options)
    : RedisSequenceStore(std::make_shared<RedisClient>(std::move(options))) {}

RedisSequenceStore::~RedisSequenceStore() = default;
RedisSequenceStore::RedisSequenceStore(RedisSequenceStore&&) noexcept = default;
RedisSequenceStore& RedisSequenceStore::operator=(RedisSequenceStore&&) noexcept = default;

EngineStore& RedisSequenceStore::core() const {
  (void)impl();  // usage_error on a moved-from store
  return core_->store;
}

// One script writes both keys, so both stores must run on one client (hence one server and db).
const char* RedisSequenceStore::unpaired(const RedisStore& store) const {
  return store.client() == client() ? nullptr
                                    : "idem: this RedisSequenceStore and the RedisStore it completes for run on "
                                      "different RedisClients; build the sequence store from the store "
                                      "(RedisSequenceStore{store})";
}

std::optional<std::uint64_t> RedisSequenceStore::last_applied(std::string_view entity) {
  return wait_for<std::optional<std::uint64_t>>([&](auto w) { core().submit_last_applied(entity, std::move(w)); });
}

AdvanceResult RedisSequenceStore::advance(std::string_view entity, std::uint64_t seq) {
  return wait_for<AdvanceResult>([&](auto w) { core().submit_advance(entity, seq, std::move(w)); });
}

CompleteAdvanceResult RedisSequenceStore::complete_advance(RedisStore& store, std::string_view key, const Holder& h,
                                                          std::string_view result, millis retention,
                                                          std::string_view entity, std::uint64_t seq) {
  return wait_for<CompleteAdvanceResult>([&](auto w) {
    core().submit_complete_advance(key, h, result, retention, entity, seq, unpaired(store), std::move(w));
  });
}

void RedisSequenceStore::check_complete_advance(RedisStore& store, std::string_view key, std::string_view entity) {
  core().check_complete_advance(key, entity, unpaired(store));
}

bool RedisSequenceStore::erase(std::string_view entity) {
  return wait_for<bool>([&](auto w) { core().submit_erase(entity, std::move(w)); });
}

std::string RedisSequenceStore::sequence_key(std::string_view entity) const {
  return detail::redis::sequence_key(impl().options(), entity);
}

}  // namespace idem
