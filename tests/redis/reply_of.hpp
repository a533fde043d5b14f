#pragma once
// The reply hiredis's reader builds from the bytes a server sends, for tests of the pure parts of
// the Redis client (redis_cluster_unit_test, redis_reply_machine_test): no server, the real parser.
#include <catch2/catch.hpp>

#include <hiredis/hiredis.h>

#include <memory>
#include <string>

namespace idem_test {

// The reply hiredis reads from `resp`.
inline std::unique_ptr<redisReply, void (*)(void*)> reply_of(const std::string& resp) {
  std::unique_ptr<redisReader, void (*)(redisReader*)> reader(redisReaderCreate(), redisReaderFree);
  REQUIRE(redisReaderFeed(reader.get(), resp.data(), resp.size()) == REDIS_OK);
  void* r = nullptr;
  REQUIRE(redisReaderGetReply(reader.get(), &r) == REDIS_OK);
  REQUIRE(r != nullptr);
  return {static_cast<redisReply*>(r), freeReplyObject};
}

}  // namespace idem_test
