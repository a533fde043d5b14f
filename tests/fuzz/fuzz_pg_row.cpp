// libFuzzer: the PostgresStore row decoders (src/postgres/store_impl.hpp: decode_acquire_lease,
// decode_acquire_row, decode_inspect) on any result a server, a proxy or a changed schema could
// hand back. libpq builds the result in memory (PQmakeEmptyPGresult, PQsetResultAttrs,
// PQsetvalue): no server. Input: byte 0 the decoder, byte 1 the columns (0..15), byte 2 the rows
// (0..3), then per cell a length byte (255 = NULL) and that many bytes.
// Oracle: a record / decision, or corrupt_record_error; never a crash or a sanitizer report.

#include <libpq-fe.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "idem/core/error.hpp"
#include "store_impl.hpp"

namespace d = idem::detail;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 3) return 0;
  const int pick = data[0] % 4;
  const int cols = data[1] % 16;
  const int rows = data[2] % 4;
  std::size_t at = 3;
  PGresult* res = PQmakeEmptyPGresult(nullptr, PGRES_TUPLES_OK);
  if (!res) return 0;
  std::vector<std::string> names(static_cast<std::size_t>(cols));
  std::vector<PGresAttDesc> attrs(static_cast<std::size_t>(cols));
  for (int c = 0; c < cols; ++c) {
    names[c] = "c" + std::to_string(c);
    attrs[c] = PGresAttDesc{const_cast<char*>(names[c].c_str()), 0, 0, 1, 0, -1, 0};
  }
  if (cols == 0 || PQsetResultAttrs(res, cols, attrs.data())) {
    for (int row = 0; row < rows && cols > 0; ++row)
      for (int c = 0; c < cols; ++c) {
        int len = at < size ? data[at++] : 0;
        if (len == 255) {
          PQsetvalue(res, row, c, nullptr, -1);
          continue;
        }
        len = static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(len), size - at));
        PQsetvalue(res, row, c, const_cast<char*>(reinterpret_cast<const char*>(data + at)), len);
        at += static_cast<std::size_t>(len);
      }
    try {
      switch (pick) {
        case 0: (void)d::decode_acquire_lease(res, 7); break;
        case 1: (void)d::decode_acquire(res, 7); break;
        case 2: (void)d::decode_inspect(res, "k"); break;
        case 3:  // acquire_many's rows: the request index, then a decision from column 1 (batch.cpp
                 // checks the shape first, as here)
          if (PQnfields(res) != 7) break;
          for (int row = 0; row < PQntuples(res); ++row) {
            (void)d::be_int(res, row, 0, 8);
            (void)d::decode_acquire_row(res, row, 1, 7);
          }
          break;
      }
    } catch (const idem::corrupt_record_error&) {
    }
  }
  PQclear(res);
  return 0;
}
