// libFuzzer: parse_redis_url and the option checks a client runs on what it returns
// (resolve_options, src/redis/url.cpp). Oracle: a URL parses or is refused with
// invalid_options_error; a parsed URL's options are refused with usage errors only.

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "client.hpp"
#include "idem/core/error.hpp"
#include "idem/redis/options.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view url(reinterpret_cast<const char*>(data), size);
  idem::RedisOptions o;
  try {
    o = idem::parse_redis_url(url);
  } catch (const idem::invalid_options_error&) {
    return 0;
  }
  try {
    (void)idem::detail::redis::resolve_options(o);
  } catch (const idem::usage_error&) {
  }
  return 0;
}
