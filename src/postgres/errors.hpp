#pragma once
// Internal to idem_postgres: identifiers, and the one mapping of libpq results and SQLSTATEs to idem's typed
// errors, so that every call of every PostgreSQL store fails the same way.

#include <libpq-fe.h>

#include <cstddef>
#include <string>
#include <string_view>

#include "idem/core/error.hpp"

namespace idem::detail {

// [a-z_][a-z0-9_]*, 1..max bytes: safe to splice into SQL between double quotes.
bool valid_identifier(std::string_view s, std::size_t max);

// A valid identifier between double quotes.
inline std::string quote_ident(std::string_view s) { return "\"" + std::string(s) + "\""; }

// The key of the advisory lock every migration of `schema` takes (store and sequence store alike):
// two of them starting on a fresh database would otherwise race on CREATE SCHEMA IF NOT EXISTS,
// which is not safe against itself.
inline std::string schema_lock_key(std::string_view schema) { return "idem:" + std::string(schema); }

// A libpq message without its trailing newline (libpq ends every message with one).
std::string first_line(const char* msg);

/// The error of a connection libpq could not open: retryable unless no retry can fix it (a TLS
/// check, an authentication refusal), which says what to fix.
connection_error connect_failure(const char* libpq_message);

// The SQLSTATE of a failed result, or "" (no result, or none reported).
std::string sqlstate_of(const PGresult* r);

bool result_ok(const PGresult* r);

// A statement refused because the session is read-only (SQLSTATE 25006): a standby, or a primary
// made read-only. Such a session is dropped, never given back to the pool: ConnectionTraits
// sees only what the server reports (PostgreSQL 14+), the answer is there on every version.
inline bool read_only_answer(const PGresult* r) { return sqlstate_of(r) == "25006"; }

// What a missing schema object means to the store whose statement failed.
struct MissingSchemaHint {
  std::string_view advice;          // appended to the message
  bool undefined_function = false;  // 42883 (the store's SQL functions) counts as missing too
};

// Throws the typed error for a failed statement `what`: the result's message (else the
// connection's), mapped by SQLSTATE; a missing SQLSTATE on a broken connection is connection_error.
[[noreturn]] void throw_result(std::string_view what, const PGresult* r, PGconn* c,
                               const MissingSchemaHint& missing = {});

}  // namespace idem::detail
