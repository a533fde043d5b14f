// The SQLSTATE mapping shared by every PostgreSQL store (errors.hpp).

#include "errors.hpp"

#include <algorithm>
#include <string_view>

#include <fmt/format.h>

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

connection_error connect_failure(const char* libpq_message) {
  const std::string why = first_line(libpq_message);
  // What no retry can fix: the TLS checks (CA, host name, certificate files, a server without
  // TLS) and the server refusing the role. These stop a consumer, as the same failures on Redis
  // do; a refused or dropped connection is retryable.
  static constexpr std::string_view tls[] = {"certificate verify failed", "does not match host name",
                                             "root certificate file", "could not read root certificate",
                                             "could not load private key", "could not open certificate",
                                             "certificate present, but not private key",
                                             "server does not support SSL", "no encryption"};
  static constexpr std::string_view auth[] = {"password authentication failed", "no pg_hba.conf entry",
                                              "certificate authentication failed", "does not exist"};
  for (std::string_view t : tls)
    if (why.find(t) != std::string::npos)
      return connection_error(fmt::format("idem: cannot connect to PostgreSQL: {}; fix the TLS settings "
                                          "(sslmode, sslrootcert, the certificates): a retry cannot help", why),
                              "08001", false);
  for (std::string_view a : auth)
    if (why.find(a) != std::string::npos)
      return connection_error(fmt::format("idem: cannot connect to PostgreSQL: {}; fix the role, its credentials "
                                          "or pg_hba.conf: a retry cannot help", why),
                              "28000", false);
  return connection_error(fmt::format("idem: cannot connect to PostgreSQL: {}", why), "08001", true);
}

void throw_result(std::string_view what, const PGresult* r, PGconn* c, const MissingSchemaHint& missing) {
  const char* m = r ? PQresultErrorMessage(r) : nullptr;
  if (!m || !*m) m = c ? PQerrorMessage(c) : "no connection";
  const std::string text = fmt::format("idem: postgres {} failed: {}", what, first_line(m));
  const std::string code = sqlstate_of(r);
  if (code.empty()) {
    if (c == nullptr || PQstatus(c) != CONNECTION_OK)
      throw connection_error(fmt::format("{} (connection lost)", text), "08006", true);
    throw store_error(text, "", true);
  }
  if (code == "XX001" || code == "XX002")
    throw corrupt_record_error(fmt::format("{} [SQLSTATE {}]; inspect and repair or delete the row", text, code));
  const std::string msg = fmt::format("{} [SQLSTATE {}]", text, code);
  if (code == "57014" || code == "55P03") throw timeout_error(msg, code, true);
  // The session reached a standby or a primary made read-only: nothing ran (a read-only
  // transaction refuses the statement before it writes), and the pool drops such sessions
  // (client.cpp), so a retry reaches whichever node is the primary by then.
  if (code == "25006")
    throw connection_error(fmt::format("{}; the server is read-only (a standby, or a primary being demoted): list "
                                       "every node in conninfo with target_session_attrs=read-write and retry",
                                       msg),
                           code, true);
  // One of our statements missing on a session that prepared it: a transaction-mode pooler ran
  // this transaction on another server session.
  if (code == "26000" && std::string_view(m).find("\"idem") != std::string_view::npos)
    throw invalid_options_error(fmt::format("{}: the conninfo reaches a transaction-mode pooler (PgBouncer "
                                            "pool_mode=transaction); set PostgresOptions::transaction_pooler",
                                            msg));
  const std::string cls = code.substr(0, 2);
  if (cls == "08" || code == "57P01" || code == "57P02" || code == "57P03" || code == "25P03")
    throw connection_error(msg, code, true);
  if (cls == "53") throw capacity_error(msg, code, true);
  if (cls == "40" || cls == "55" || cls == "57" || cls == "58") throw store_error(msg, code, true);
  if (code == "42P01" || (missing.undefined_function && code == "42883") || code == "3F000")
    throw store_error(fmt::format("{}{}", msg, missing.advice), code, false);
  throw store_error(msg, code, false);
}

}  // namespace idem::detail
