// The SQLSTATE mapping shared by every PostgreSQL store (errors.hpp).

#include "errors.hpp"

#include <algorithm>

#include "idem/core/error.hpp"

namespace idem::detail {

bool valid_identifier(std::string_view s, std::size_t max) {
  if (s.empty() || s.size() > max) return false;
  if (!(s[0] == '_' || (s[0] >= 'a' && s[0] <= 'z'))) return false;
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return c == '_' || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'); });
}

std::string first_line(const char* msg) {
  std::string s = msg ? msg : "";
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

std::string sqlstate_of(const PGresult* r) {
  const char* s = r ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : nullptr;
  return s ? s : "";
}

bool result_ok(const PGresult* r) {
  if (!r) return false;
  const auto st = PQresultStatus(r);
  return st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK;
}

void throw_result(std::string_view what, const PGresult* r, PGconn* c, const MissingSchemaHint& missing) {
  const char* m = r ? PQresultErrorMessage(r) : nullptr;
  if (!m || !*m) m = c ? PQerrorMessage(c) : "no connection";
  const std::string text = "idem: postgres " + std::string(what) + " failed: " + first_line(m);
  const std::string code = sqlstate_of(r);
  if (code.empty()) {
    if (c == nullptr || PQstatus(c) != CONNECTION_OK)
      throw connection_error(text + " (connection lost)", "08006", true);
    throw store_error(text, "", true);
  }
  if (code == "XX001" || code == "XX002")
    throw corrupt_record_error(text + " [SQLSTATE " + code + "]; inspect and repair or delete the row");
  const std::string msg = text + " [SQLSTATE " + code + "]";
  if (code == "57014" || code == "55P03") throw timeout_error(msg, code, true);
  const std::string cls = code.substr(0, 2);
  if (cls == "08" || code == "57P01" || code == "57P02" || code == "57P03" || code == "25P03")
    throw connection_error(msg, code, true);
  if (cls == "53") throw capacity_error(msg, code, true);
  if (cls == "40" || cls == "55" || cls == "57" || cls == "58") throw store_error(msg, code, true);
  if (code == "42P01" || (missing.undefined_function && code == "42883") || code == "3F000")
    throw store_error(msg + std::string(missing.advice), code, false);
  throw store_error(msg, code, false);
}

}  // namespace idem::detail
