// libFuzzer: PostgresOptions::conninfo checking (src/postgres/conninfo.cpp: libpq's parser, then
// the values libpq checks only when it connects). Oracle: accepted, or invalid_options_error.

#include <cstddef>
#include <cstdint>
#include <string>

#include "client.hpp"
#include "idem/core/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string conninfo(reinterpret_cast<const char*>(data), size);
  try {
    idem::detail::check_conninfo(conninfo);
  } catch (const idem::invalid_options_error&) {
  }
  return 0;
}
