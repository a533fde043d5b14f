#pragma once
/// @file asio/sequence_store.hpp AsyncRedisSequenceStore: RedisSequenceStore's sequences on an
/// AsyncRedisStore's connections, blocking and asynchronous.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "idem/asio/redis_store.hpp"
#include "idem/sequence/sequence_store.hpp"

namespace idem {

namespace detail::asio_redis {
/// The sequence requests, compiled once (src/asio/sequence_store.cpp).
struct SequenceRequests {
  static void last_applied(AsyncRedisStore& s, std::string_view entity,
                           std::unique_ptr<Done<std::optional<std::uint64_t>>> done);
  static void advance(AsyncRedisStore& s, std::string_view entity, std::uint64_t seq,
                      std::unique_ptr<Done<AdvanceResult>> done);
  static void complete_advance(AsyncRedisStore& s, const AsyncRedisStore& record_store, std::string_view key,
                               const Holder& h, std::string_view result,
                               millis retention, std::string_view entity, std::uint64_t seq,
                               std::unique_ptr<Done<CompleteAdvanceResult>> done);
  static void erase(AsyncRedisStore& s, std::string_view entity, std::unique_ptr<Done<bool>> done);
};
}  // namespace detail::asio_redis

/**
 * SequenceStore on the connections of an AsyncRedisStore: the same keys (`<key_prefix>seq:{<entity>}`),
 * scripts and answers as RedisSequenceStore, sent through the store's multiplexed connections
 * (per master on a cluster, with its min_replica_acks WAIT). Blocking members for SequenceGate and
 * `async_*` members taking any completion token. complete_advance's lost reply is asked again as
 * the same holder; advance's is in doubt (outcome_unknown_error), never resent. Thread-safe; the
 * store must outlive it. Errors are RedisSequenceStore's.
 *
 * @code
 * idem::AsyncRedisStore store{io.get_executor(), {.url = "redis://127.0.0.1:6379"}};
 * idem::AsyncRedisSequenceStore seqs{store};
 * idem::SequenceGate gate{seqs};
 * auto out = gate.run(guard, {.key = "{acct-7}:evt-9", .entity = "acct-7", .seq = 9}, handler);
 * @endcode
 */
class AsyncRedisSequenceStore {
public:
  /// On the connections of `store`, which complete_advance then requires.
  explicit AsyncRedisSequenceStore(AsyncRedisStore& store) noexcept : store_(&store) {}

  /// The last applied sequence of `entity` (one GET), or nullopt. Blocking.
  std::optional<std::uint64_t> last_applied(std::string_view entity);
  /// Compare-and-set (one EVALSHA): `entity` goes to `seq` iff nothing or less was applied. Blocking.
  AdvanceResult advance(std::string_view entity, std::uint64_t seq);
  /// The store's complete and advance(entity, seq) in one script (SequenceGate calls it). Blocking.
  CompleteAdvanceResult complete_advance(AsyncRedisStore& store, std::string_view key, const Holder& h,
                                         std::string_view result, millis retention, std::string_view entity,
                                         std::uint64_t seq);
  /// What complete_advance would refuse before sending: another store, or on a cluster the key
  /// and the entity's sequence in two slots (usage_error naming the hash tag to use).
  void check_complete_advance(AsyncRedisStore& store, std::string_view key, std::string_view entity) const;
  /// Deletes the entity's sequence; true if it existed. For tests and for retiring an entity.
  bool erase(std::string_view entity);
  /// The Redis key of `entity`'s sequence, for redis-cli.
  [[nodiscard]] std::string sequence_key(std::string_view entity) const;

  /// last_applied(), asynchronously: `void(std::exception_ptr, std::optional<std::uint64_t>)`.
  template <class Token>
  auto async_last_applied(std::string_view entity, Token&& token) {
    return store_->start<std::optional<std::uint64_t>>(std::forward<Token>(token), [=, this](auto done) {
      detail::asio_redis::SequenceRequests::last_applied(*store_, entity, std::move(done));
    });
  }
  /// advance(): `void(std::exception_ptr, AdvanceResult)`.
  template <class Token>
  auto async_advance(std::string_view entity, std::uint64_t seq, Token&& token) {
    return store_->start<AdvanceResult>(std::forward<Token>(token), [=, this](auto done) {
      detail::asio_redis::SequenceRequests::advance(*store_, entity, seq, std::move(done));
    });
  }
  /// complete_advance(): `void(std::exception_ptr, CompleteAdvanceResult)`.
  template <class Token>
  auto async_complete_advance(AsyncRedisStore& store, std::string_view key, const Holder& h, std::string_view result,
                              millis retention, std::string_view entity, std::uint64_t seq, Token&& token) {
    return store_->start<CompleteAdvanceResult>(std::forward<Token>(token), [=, this, &store](auto done) {
      detail::asio_redis::SequenceRequests::complete_advance(*store_, store, key, h, result, retention, entity, seq,
                                                             std::move(done));
    });
  }

private:
  AsyncRedisStore* store_;
};

static_assert(SequenceStore<AsyncRedisSequenceStore>);
static_assert(CompletesWithAdvance<AsyncRedisSequenceStore, AsyncRedisStore>);

}  // namespace idem
