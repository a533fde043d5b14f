#pragma once
/// @file redis/hash_slot.hpp redis_hash_slot: the Redis Cluster slot of a Redis key.

#include <cstdint>
#include <string_view>

namespace idem {

/// Redis Cluster slot of a Redis key: CRC16/XMODEM of its first non-empty `{hash tag}` if any,
/// else of the whole key, mod 16384 (the cluster specification's rule).
[[nodiscard]] std::uint16_t redis_hash_slot(std::string_view redis_key) noexcept;

}  // namespace idem
