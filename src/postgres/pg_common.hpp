#pragma once
// Internal to idem_postgres: what PostgresStore and PostgresSequenceStore share — identifier
// checks and the mapping of libpq results and SQLSTATEs to idem's typed errors, so both stores
// fail the same way.

#include <cstddef>
#include <string>
#include <string_view>

#include <libpq-fe.h>

namespace idem::detail {

// [a-z_][a-z0-9_]*, 1..max bytes: safe to splice into SQL between double quotes.
bool valid_identifier(std::string_view s, std::size_t max);

// The SQLSTATE of a failed result, or "" (no result, or none reported).
std::string sqlstate_of(const PGresult* r);

bool result_ok(const PGresult* r);

// What a missing schema object means to the store whose statement failed.
struct MissingSchemaHint {
  std::string_view advice;             // appended to the message
  bool undefined_function = false;     // 42883 (the store's SQL functions) counts as missing too
};

// One place decides what each SQLSTATE means to the caller, so every call fails the same way.
[[noreturn]] void throw_mapped(const std::string& what, const std::string& code, PGconn* c,
                               const MissingSchemaHint& missing);

}  // namespace idem::detail
