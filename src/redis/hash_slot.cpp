// redis_hash_slot (idem/redis/hash_slot.hpp): the key-to-slot rule of the Redis Cluster
// specification, so cluster routing can group keys the way the server will.

#include "idem/redis/hash_slot.hpp"

namespace idem {

namespace {

// CRC16/XMODEM, the variant the cluster specification uses.
std::uint16_t crc16(std::string_view s) noexcept {
  std::uint16_t crc = 0;
  for (char ch : s) {
    crc = static_cast<std::uint16_t>(crc ^ (static_cast<unsigned char>(ch) << 8));
    for (int i = 0; i < 8; ++i)
      crc = static_cast<std::uint16_t>((crc & 0x8000) ? ((crc << 1) ^ 0x1021) : (crc << 1));
  }
  return crc;
}

}  // namespace

std::uint16_t redis_hash_slot(std::string_view k) noexcept {
  if (const auto open = k.find('{'); open != std::string_view::npos) {
    const auto close = k.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) k = k.substr(open + 1, close - open - 1);
  }
  return static_cast<std::uint16_t>(crc16(k) & 16383);
}

}  // namespace idem
