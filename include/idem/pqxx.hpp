#pragma once
/// @file pqxx.hpp idem::pqxx::Connection: PostgresJoined over a libpqxx transaction (link
/// idem::pqxx, built where libpqxx is found; Debian's libpqxx-dev 6.4 and later).

#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <pqxx/pqxx>

#include "idem/postgres/joined.hpp"

namespace idem::pqxx {

/**
 * The application's libpqxx transaction (not owned) as the connection a PostgresJoined runs its
 * claim and completion on: they commit, or roll back, with the application's own writes.
 *
 * @code
 * pqxx::work w{conn};
 * idem::pqxx::Connection app{w};
 * idem::PostgresJoined joined{store, app};
 * idem::IdempotencyGuard guard{joined};
 * guard.run(msg.id, [&] { w.exec_params("UPDATE account SET balance = balance - $1 WHERE id = $2", msg.amount, msg.account); });
 * w.commit();
 * @endcode
 */
class Connection final : public JoinedConnection {
 public:
  /// Wraps `tx` (not owned; it must outlive this object and stay open while the guard runs).
  explicit Connection(::pqxx::transaction_base& tx) noexcept : tx_(&tx) {}

  /// See JoinedConnection::exec. bytea parameters travel as their hex text form (libpqxx ends a
  /// text parameter at a zero byte); libpqxx's errors become idem's, with the SQLSTATE.
  std::vector<Row> exec(const std::string& sql, std::span<const Param> params) override {
    std::vector<std::string> texts(params.size());
    std::vector<const char*> values(params.size(), nullptr);
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (!params[i].value) continue;
      texts[i] = params[i].binary ? hex_bytea(*params[i].value) : std::string(*params[i].value);
      values[i] = texts[i].c_str();
    }
    ::pqxx::result r;
    try {
      r = tx_->exec_params(sql, ::pqxx::prepare::make_dynamic_params(values));
    } catch (const ::pqxx::sql_error& e) {
      const std::string& code = e.sqlstate();
      // The classes a retry can cure: connection (08), transaction rollback (40), resources (53),
      // object state / lock not available (55), operator intervention (57).
      const std::string cls = code.substr(0, 2);
      const bool retryable = cls == "08" || cls == "40" || cls == "53" || cls == "55" || cls == "57";
      throw store_error(fmt::format("idem: postgres statement in the application's transaction failed: {} "
                                    "[SQLSTATE {}]",
                                    first_line(e.what()), code),
                        code, retryable);
    } catch (const ::pqxx::broken_connection& e) {
      throw connection_error(fmt::format("idem: the application's PostgreSQL connection broke: {}", first_line(e.what())),
                             "08006", true);
    } catch (const ::pqxx::usage_error& e) {
      throw usage_error(fmt::format("idem: libpqxx refused the statement: {}", first_line(e.what())));
    }
    std::vector<Row> rows;
    rows.reserve(r.size());
    for (const auto& row : r) {
      Row out(row.size());
      for (::pqxx::row::size_type c = 0; c < row.size(); ++c)
        if (!row[c].is_null()) out[c] = std::string(row[c].c_str(), row[c].size());
      rows.push_back(std::move(out));
    }
    return rows;
  }

 private:
  static std::string hex_bytea(std::string_view bytes) {
    static constexpr char digits[] = "0123456789abcdef";
    std::string out = "\\x";
    out.reserve(2 + bytes.size() * 2);
    for (unsigned char ch : bytes) {
      out.push_back(digits[ch >> 4]);
      out.push_back(digits[ch & 0xf]);
    }
    return out;
  }
  static std::string first_line(const char* m) {
    std::string s(m);
    if (auto nl = s.find('\n'); nl != std::string::npos) s.resize(nl);
    return s;
  }

  ::pqxx::transaction_base* tx_;
};

}  // namespace idem::pqxx
