// libFuzzer: the RedisStore reply decoders (src/redis/store_requests.hpp) and the error-reply
// mapping (src/redis/errors.cpp) on any bytes a server could send. hiredis's own reader turns the
// bytes into replies, as it does off the socket. Byte 0 picks the decoder; the rest is RESP.
// Oracle: every input either decodes or throws an idem::error (invariant 5: a typed error, never
// a crash, a std::out_of_range or a sanitizer report).

#include <hiredis/hiredis.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "client.hpp"
#include "idem/core/error.hpp"
#include "store_requests.hpp"

namespace r = idem::detail::redis;

namespace {

void decode(std::uint8_t pick, const redisReply* reply) {
  try {
    switch (pick % 5) {
      case 0: (void)r::parse_acquire(reply, "k", 0x0102030405060708ULL); break;
      case 1: (void)r::parse_write(reply, "complete", "k"); break;
      case 2: (void)r::parse_inspect(reply, "k"); break;
      case 3: r::throw_if_error(reply, r::store_hints, [] { return std::string("acquire of key 'k'"); }); break;
      case 4: r::throw_if_error(reply, r::sequence_hints, [] { return std::string("advance"); }); break;
    }
  } catch (const idem::error&) {
    // The typed failure every bad reply must become.
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  redisReader* reader = redisReaderCreate();
  r::limit_aggregates(reader);  // as every idem connection's reader (an array header allocates its table)
  if (redisReaderFeed(reader, reinterpret_cast<const char*>(data + 1), size - 1) == REDIS_OK) {
    for (int i = 0; i < 8; ++i) {
      void* reply = nullptr;
      if (redisReaderGetReply(reader, &reply) != REDIS_OK || reply == nullptr) break;
      decode(data[0], static_cast<const redisReply*>(reply));
      freeReplyObject(reply);
    }
  }
  redisReaderFree(reader);
  return 0;
}
