// AsyncRedisSequenceStore: RedisSequenceStore's requests and parsing (sequence_requests.hpp) sent
// through an AsyncRedisStore's engine; blocking members wait for the async ones.

#include "idem/asio/sequence_store.hpp"

#include <string>

#include <fmt/format.h>

#include "engine_store.hpp"
#include "idem/core/error.hpp"
#include "idem/core/hex.hpp"
#include "idem/redis/hash_slot.hpp"
#include "sequence_requests.hpp"

namespace idem::detail::asio_redis {

namespace {

// The slot of a key of the store's namespace (-1 off a cluster).
int slot_of(const RedisOptions& o, std::string_view prefixed) {
  return o.cluster_nodes.empty() ? -1 : redis_hash_slot(prefixed);
}

// `resend`: a lost reply is asked again as the same holder (complete_advance), else it is in
// doubt (advance) or plainly retryable (GET, DEL: Script::inspect, which also sends no WAIT).
template <class T, class Parse>
std::unique_ptr<Op> sequence_op(DonePtr<T> done, Parse parse, Command& cmd, Script s, const std::string& wait,
                                int slot, std::string label) {
  auto op = std::make_unique<Call<T, Parse>>(std::move(done), std::move(parse));
  op->bytes.assign(cmd.format().view());
  op->slot = slot;
  op->script = s;
  op->label = std::move(label);
  op->hints = &sequence_hints;
  op->same_holder = s == Script::complete_advance;
  if (!wait.empty() && !reads_only(s)) {
    op->bytes += wait;
    op->waits = true;
  }
  return op;
}

void check_pair(const AsyncRedisStore& seqs, const AsyncRedisStore& store, std::string_view key, std::string_view entity) {
  if (&seqs != &store)
    throw usage_error("idem: this AsyncRedisSequenceStore and the AsyncRedisStore it completes for are on different "
                      "connections; build the sequence store from the store (AsyncRedisSequenceStore{store})");
  const RedisOptions& o = store.options();
  (void)check_advance_slot(slot_of(o, o.key_prefix + std::string(key)), slot_of(o, sequence_key(o, entity)), key,
                           entity);
}

}  // namespace

void SequenceRequests::last_applied(AsyncRedisStore& s, std::string_view entity,
                                    std::unique_ptr<Done<std::optional<std::uint64_t>>> done) {
  send_checked(*s.core_->engine, done, [&] {
    Command cmd = sequence_key_command("GET", s.options_, entity);
    return sequence_op<std::optional<std::uint64_t>>(
        std::move(done), [e = std::string(entity)](const redisReply* r, std::string_view) { return parse_sequence_get(r, e); },
        cmd, Script::inspect, s.core_->wait, slot_of(s.options_, sequence_key(s.options_, entity)),
        fmt::format("GET of the sequence of entity '{}'", detail::printable(entity)));
  });
}

void SequenceRequests::advance(AsyncRedisStore& s, std::string_view entity, std::uint64_t seq,
                               std::unique_ptr<Done<AdvanceResult>> done) {
  send_checked(*s.core_->engine, done, [&] {
    Command cmd = sequence_advance_command(s.options_, entity, seq);
    return sequence_op<AdvanceResult>(
        std::move(done),
        [e = std::string(entity), seq](const redisReply* r, std::string_view) { return parse_sequence_advance(r, e, seq); },
        cmd, Script::sequence_advance, s.core_->wait, slot_of(s.options_, sequence_key(s.options_, entity)),
        fmt::format("sequence_advance of entity '{}'", detail::printable(entity)));
  });
}

void SequenceRequests::complete_advance(AsyncRedisStore& s, const AsyncRedisStore& record_store, std::string_view key,
                                        const Holder& h, std::string_view result, millis retention,
                                        std::string_view entity, std::uint64_t seq,
                                        std::unique_ptr<Done<CompleteAdvanceResult>> done) {
  send_checked(*s.core_->engine, done, [&] {
    Command cmd = complete_advance_command(s.options_, key, h, result, retention, entity, seq);
    check_pair(s, record_store, key, entity);
    return sequence_op<CompleteAdvanceResult>(
        std::move(done),
        [k = std::string(key), e = std::string(entity), seq](const redisReply* r, std::string_view) {
          return parse_complete_advance(r, k, e, seq);
        },
        cmd, Script::complete_advance, s.core_->wait, slot_of(s.options_, sequence_key(s.options_, entity)),
        fmt::format("complete_advance of key '{}' and entity '{}'", detail::printable(key), detail::printable(entity)));
  });
}

void SequenceRequests::erase(AsyncRedisStore& s, std::string_view entity, std::unique_ptr<Done<bool>> done) {
  send_checked(*s.core_->engine, done, [&] {
    Command cmd = sequence_key_command("DEL", s.options_, entity);
    return sequence_op<bool>(
        std::move(done), [e = std::string(entity)](const redisReply* r, std::string_view) { return parse_sequence_del(r, e); },
        cmd, Script::inspect, s.core_->wait, slot_of(s.options_, sequence_key(s.options_, entity)),
        fmt::format("DEL of the sequence of entity '{}'", detail::printable(entity)));
  });
}

}  // namespace idem::detail::asio_redis

namespace idem {

using detail::asio_redis::SequenceRequests;
using detail::asio_redis::wait_for;

std::optional<std::uint64_t> AsyncRedisSequenceStore::last_applied(std::string_view entity) {
  return wait_for<std::optional<std::uint64_t>>([&](auto w) { SequenceRequests::last_applied(*store_, entity, std::move(w)); });
}

AdvanceResult AsyncRedisSequenceStore::advance(std::string_view entity, std::uint64_t seq) {
  return wait_for<AdvanceResult>([&](auto w) { SequenceRequests::advance(*store_, entity, seq, std::move(w)); });
}

CompleteAdvanceResult AsyncRedisSequenceStore::complete_advance(AsyncRedisStore& store, std::string_view key,
                                                               const Holder& h, std::string_view result,
                                                               millis retention, std::string_view entity,
                                                               std::uint64_t seq) {
  return wait_for<CompleteAdvanceResult>([&](auto w) {
    SequenceRequests::complete_advance(*store_, store, key, h, result, retention, entity, seq, std::move(w));
  });
}

void AsyncRedisSequenceStore::check_complete_advance(AsyncRedisStore& store, std::string_view key,
                                                     std::string_view entity) const {
  detail::asio_redis::check_pair(*store_, store, key, entity);
}

bool AsyncRedisSequenceStore::erase(std::string_view entity) {
  return wait_for<bool>([&](auto w) { SequenceRequests::erase(*store_, entity, std::move(w)); });
}

std::string AsyncRedisSequenceStore::sequence_key(std::string_view entity) const {
  return detail::redis::sequence_key(store_->options(), entity);
}

}  // namespace idem
