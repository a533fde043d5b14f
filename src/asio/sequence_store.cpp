// AsyncRedisSequenceStore: the sequence requests of an AsyncRedisStore's engine (engine_store.hpp,
// as RedisSequenceStore's); blocking members wait for the async ones.

#include "idem/asio/sequence_store.hpp"

#include <string>

#include "engine_store.hpp"
#include "sequence_requests.hpp"

namespace idem::detail::asio_redis {

namespace {

// Why complete_advance refuses `store` (nullptr: it may run on `seqs`' connection).
const char* unpaired(const AsyncRedisStore& seqs, const AsyncRedisStore& store) {
  return &seqs == &store ? nullptr
                         : "idem: this AsyncRedisSequenceStore and the AsyncRedisStore it completes for are on "
                           "different connections; build the sequence store from the store "
                           "(AsyncRedisSequenceStore{store})";
}

}  // namespace

void SequenceRequests::last_applied(AsyncRedisStore& s, std::string_view entity,
                                    std::unique_ptr<Done<std::optional<std::uint64_t>>> done) {
  s.core_->submit_last_applied(entity, std::move(done));
}

void SequenceRequests::advance(AsyncRedisStore& s, std::string_view entity, std::uint64_t seq,
                               std::unique_ptr<Done<AdvanceResult>> done) {
  s.core_->submit_advance(entity, seq, std::move(done));
}

void SequenceRequests::complete_advance(AsyncRedisStore& s, const AsyncRedisStore& record_store, std::string_view key,
                                        const Holder& h, std::string_view result, millis retention,
                                        std::string_view entity, std::uint64_t seq,
                                        std::unique_ptr<Done<CompleteAdvanceResult>> done) {
  s.core_->submit_complete_advance(key, h, result, retention, entity, seq, unpaired(s, record_store), std::move(done));
}

void SequenceRequests::erase(AsyncRedisStore& s, std::string_view entity, std::unique_ptr<Done<bool>> done) {
  s.core_->submit_erase(entity, std::move(done));
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
  store_->core_->check_complete_advance(key, entity, detail::asio_redis::unpaired(*store_, store));
}

bool AsyncRedisSequenceStore::erase(std::string_view entity) {
  return wait_for<bool>([&](auto w) { SequenceRequests::erase(*store_, entity, std::move(w)); });
}

std::string AsyncRedisSequenceStore::sequence_key(std::string_view entity) const {
  return detail::redis::sequence_key(store_->options(), entity);
}

}  // namespace idem
