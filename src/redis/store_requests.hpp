#pragma once
// Internal to idem's Redis stores: one key's request for each transition (checked and formatted)
// and the parsing of its reply, shared by RedisStore (blocking, through Client) and
// AsyncRedisStore (Boost.Asio, through its own multiplexed connection), so both send the same
// scripts the same arguments and read the same answers the same way.

#include <algorithm>
#include <atomic>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "command.hpp"
#include "idem/core/batch_store.hpp"
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

// acquire_batch: a key twice in one batch shares the batch's token, so the script takes the second
// for this acquisition asked again (as after a lost reply) and answers acquired twice. It is one
// holder: the second is reported in_flight behind the first.
void one_holder_per_key(std::span<const std::string_view> keys, std::vector<AcquireResult>& out, millis lease);

// A batch's duplicates answered before any script (both stores' acquire_many): a completed record
// is final, so reading it decides its acquire. Keys per MGET (and per batch script run).
inline constexpr std::size_t batch_chunk = 256;
// MGET of the requests' keys (prefixed): at most batch_chunk of them, of one slot on a cluster.
Command mget_command(const RedisOptions& o, std::span<const AcquireRequest> requests);
// Sets known[i] for each usual completed record the MGET read; leaves the others (the script
// decides them); bad_reply on a reply of another shape.
void read_mget(const redisReply* r, std::span<const AcquireRequest> requests, std::optional<AcquireResult>* known);
// Whether a batch reads its keys with MGET before any script. Never once the server refused MGET
// (NOPERM: an ACL without +mget). Redeliveries come in bursts (after a crash, a rebalance) and
// fresh traffic has none, so an MGET that found no completed record cost a serial round trip for
// nothing (one batch in 8 paying it cost new-key batches 12 %): the next batches skip it, the gap
// doubling with each empty read in a row (8, 16, 32, 64). A burst is still met at once: a batch
// that skipped the read and whose script answered a duplicate makes the next batch read first.
// Thread-safe; the counts are hints (a race moves a probe, never an answer).
class DuplicatesFirst {
public:
  static constexpr unsigned first_gap = 8;  // batches from an empty read to the next read
  static constexpr unsigned max_gap = 64;   // after empty reads in a row
  // Whether this batch reads first; counts a skipped one.
  bool wanted() noexcept {
    if (refused_.load(std::memory_order_relaxed)) return false;
    unsigned s = skip_.load(std::memory_order_relaxed);
    while (s > 0 && !skip_.compare_exchange_weak(s, s - 1, std::memory_order_relaxed)) {
    }
    return s == 0;
  }
  // What the read found: any completed record (the next batch reads too), or none (the next
  // gap - 1 batches skip it).
  void read(bool found) noexcept {
    if (found) return met_duplicate();
    const unsigned g = gap_.load(std::memory_order_relaxed);
    const unsigned next = g == 0 ? first_gap : std::min(2 * g, max_gap);
    gap_.store(next, std::memory_order_relaxed);
    skip_.store(next - 1, std::memory_order_relaxed);
  }
  // A batch's script answered a duplicate: the next batch reads first.
  void met_duplicate() noexcept {
    gap_.store(0, std::memory_order_relaxed);
    skip_.store(0, std::memory_order_relaxed);
  }
  // The server refused MGET: true the first time (the caller warns once).
  bool refuse() noexcept { return !refused_.exchange(true); }

private:
  std::atomic<bool> refused_{false};
  std::atomic<unsigned> skip_{0};
  std::atomic<unsigned> gap_{0};  // the last gap set; 0 after a read that found records
};
// Tells the observer, once per store, that the server refused MGET (NOPERM: an ACL without +mget):
// its batches now answer duplicates through the script.
void warn_mget_refused(const RedisOptions& o, std::string_view error_text);

}  // namespace idem::detail::redis

namespace idem::detail::redis {

class Client;
// Reads the server's settings once (one round trip on `client`): refuses an evicting
// configuration (store_error EVICTION) unless unsafe_allow_eviction, warns through the observer
// when they cannot be read, and returns what one call can carry.
StoreLimits check_server(Client& client);

}  // namespace idem::detail::redis
