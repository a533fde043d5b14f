// PostgresResult over a libpq result, kept out of the public header.

#include <charconv>
#include <utility>

#include "client.hpp"

namespace idem {
namespace detail {

PostgresResult ResultAccess::wrap(PGresult* r) noexcept {
  PostgresResult out;
  out.r_ = r;
  return out;
}

}  // namespace detail

namespace {
const PGresult* pg(const void* r) noexcept { return static_cast<const PGresult*>(r); }
}  // namespace

PostgresResult::PostgresResult(PostgresResult&& o) noexcept : r_(std::exchange(o.r_, nullptr)) {}

PostgresResult& PostgresResult::operator=(PostgresResult&& o) noexcept {
  if (this != &o) {
    PQclear(static_cast<PGresult*>(r_));
    r_ = std::exchange(o.r_, nullptr);
  }
  return *this;
}

PostgresResult::~PostgresResult() { PQclear(static_cast<PGresult*>(r_)); }

int PostgresResult::rows() const noexcept { return r_ ? PQntuples(pg(r_)) : 0; }
int PostgresResult::columns() const noexcept { return r_ ? PQnfields(pg(r_)) : 0; }
bool PostgresResult::is_null(int row, int col) const noexcept { return PQgetisnull(pg(r_), row, col) != 0; }

std::string_view PostgresResult::get(int row, int col) const noexcept {
  return {PQgetvalue(pg(r_), row, col), static_cast<std::size_t>(PQgetlength(pg(r_), row, col))};
}

std::uint64_t PostgresResult::affected() const noexcept {
  const char* s = r_ ? PQcmdTuples(static_cast<PGresult*>(r_)) : "";
  std::uint64_t n = 0;
  std::from_chars(s, s + std::char_traits<char>::length(s), n);
  return n;
}

}  // namespace idem
