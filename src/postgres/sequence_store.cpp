// PostgresSequenceStore: the table created under the same advisory lock as PostgresStore's
// schema, and the compare-and-set as one INSERT … ON CONFLICT on the client's sessions. Entities
// travel as hex text decoded to bytea on the server, so the same statement runs through
// PostgresStore::Transaction::exec (text parameters) and binary entity ids stay exact.

#include "idem/postgres/sequence_store.hpp"

#include <charconv>
#include <mutex>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "client.hpp"
#include "idem/core/error.hpp"
#include "idem/core/hex.hpp"
#include "idem/core/validate.hpp"

namespace idem {

namespace {

constexpr detail::MissingSchemaHint sequence_missing{
    "; the sequence table is missing: call PostgresSequenceStore::migrate() or set auto_migrate", false};

using detail::printable;
using detail::ResultAccess;

bool valid_ident(std::string_view s) { return s.substr(0, 3) != "pg_" && detail::valid_identifier(s, 63); }

std::string decimal(std::uint64_t v) {
  char tmp[24];
  auto res = std::to_chars(tmp, tmp + sizeof tmp, v);
  return std::string(tmp, res.ptr);
}

std::uint64_t parse_seq(std::string_view s, std::string_view entity) {
  std::uint64_t v = 0;
  auto res = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || res.ec != std::errc{} || res.ptr != s.data() + s.size())
    throw corrupt_record_error(
        fmt::format("idem: the PostgreSQL sequence of entity '{}' holds '{}', not a uint64; inspect and repair the row",
                    printable(entity), printable(s, 32)));
  return v;
}

PostgresSequenceStoreOptions checked(PostgresSequenceStoreOptions o) {
  auto bad = [](const std::string& why) {
    throw invalid_options_error(fmt::format("idem: PostgresSequenceStoreOptions: {}", why));
  };
  if (!valid_ident(o.schema))
    bad(fmt::format("schema '{}' must match [a-z_][a-z0-9_]*, at most 63 bytes, not pg_*", printable(o.schema)));
  if (!valid_ident(o.table))
    bad(fmt::format("table '{}' must match [a-z_][a-z0-9_]*, at most 63 bytes, not pg_*", printable(o.table)));
  return o;
}

// The last applied value from a read of sql_get, or nullopt when the entity has no row.
std::optional<std::uint64_t> read_seq(const PostgresResult& r, std::string_view entity) {
  if (r.rows() == 0) return std::nullopt;
  return parse_seq(r.get(0, 0), entity);
}

// Column 0: advanced (1/0); column 1: snapshot value or NULL. A lost CAS re-reads the value that
// beat it (a fresh snapshot; inside the transaction the row is locked by the failed update).
template <class Reread>
AdvanceResult decode_advance(const PostgresResult& r, std::string_view entity, std::uint64_t seq, Reread&& reread) {
  if (r.rows() != 1 || r.columns() != 2 || r.is_null(0, 0))
    throw store_error("idem: unexpected PostgreSQL reply to the sequence advance", "", false);
  AdvanceResult out;
  out.advanced = r.get(0, 0) == "1";
  if (!r.is_null(0, 1)) out.previous = parse_seq(r.get(0, 1), entity);
  if (!out.advanced && (!out.previous || *out.previous < seq)) {
    out.previous = read_seq(reread(), entity);
    if (!out.previous || *out.previous < seq)
      throw store_error(fmt::format("idem: the PostgreSQL sequence advance of entity '{}' neither advanced nor found a "
                                    "newer value; retry",
                                    printable(entity)),
                        "", true);
  }
  if (out.advanced && out.previous && *out.previous >= seq) out.previous.reset();  // snapshot raced: unknown
  return out;
}

}  // namespace

struct PostgresSequenceStore::Impl {
  std::shared_ptr<PostgresClient> client_ptr;
  detail::ClientImpl& client;
  PostgresSequenceStoreOptions opt;
  std::string qualified;
  std::string sql_advance, sql_get, sql_erase, sql_migrate;

  std::mutex migrate_mu;
  bool migrated = false;

  Impl(std::shared_ptr<PostgresClient> c, PostgresSequenceStoreOptions o)
      : client_ptr(std::move(c)),
        client(detail::ClientAccess::of(client_ptr, "PostgresSequenceStore")),
        opt(checked(std::move(o))),
        qualified(detail::quote_ident(opt.schema) + "." + detail::quote_ident(opt.table)) {
    // $1 entity as hex text, $2 seq as decimal text. Column 0: 1 advanced / 0 not; column 1: the
    // value the statement's snapshot saw (NULL = none).
    sql_advance = "WITH up AS (INSERT INTO " + qualified +
                  " AS s (entity, last_seq) VALUES (decode($1::text, 'hex'), $2::numeric)"
                  " ON CONFLICT (entity) DO UPDATE SET last_seq = EXCLUDED.last_seq"
                  " WHERE s.last_seq < EXCLUDED.last_seq RETURNING 1)"
                  " SELECT (SELECT count(*) FROM up)::int,"
                  " (SELECT last_seq::text FROM " +
                  qualified + " WHERE entity = decode($1::text, 'hex'))";
    sql_get = "SELECT last_seq::text FROM " + qualified + " WHERE entity = decode($1::text, 'hex')";
    sql_erase = "DELETE FROM " + qualified + " WHERE entity = decode($1::text, 'hex')";
    sql_migrate = "BEGIN; SELECT pg_advisory_xact_lock(hashtext('" + detail::schema_lock_key(opt.schema) +
                  "')); "
                  "CREATE SCHEMA IF NOT EXISTS " +
                  detail::quote_ident(opt.schema) +
                  "; "
                  "CREATE TABLE IF NOT EXISTS " +
                  qualified +
                  " (entity bytea PRIMARY KEY, last_seq numeric(20,0) NOT NULL"
                  " CHECK (last_seq >= 0 AND last_seq <= 18446744073709551615)); COMMIT";
  }

  void migrate_on(PGconn* c) {
    for (int attempt = 0;; ++attempt) {
      PostgresResult r = ResultAccess::wrap(PQexec(c, sql_migrate.c_str()));
      if (detail::result_ok(ResultAccess::native(r))) return;
      const std::string code = detail::sqlstate_of(ResultAccess::native(r));
      PQclear(PQexec(c, "ROLLBACK"));
      // Another process creating the same schema outside our lock (e.g. an older idem).
      if (attempt == 0 && code == "23505") continue;
      detail::throw_result("sequence table migration", ResultAccess::native(r), c, sequence_missing);
    }
  }

  void migrate() {
    std::lock_guard lk(migrate_mu);
    detail::Session s(client.pool());
    migrate_on(s.pg());
    migrated = true;
  }

  void ensure_migrated() {
    if (!opt.auto_migrate) return;
    std::lock_guard lk(migrate_mu);
    if (migrated) return;
    detail::Session s(client.pool());
    migrate_on(s.pg());
    migrated = true;
  }

  // One statement with text parameters on a pooled session. Never retried: a statement whose
  // connection broke may have run, so the error reaches the caller (fail closed).
  PostgresResult run(const std::string& sql, std::initializer_list<const std::string*> params, std::string_view what) {
    ensure_migrated();
    std::array<const char*, 2> vals{};
    int n = 0;
    for (const std::string* p : params) vals[static_cast<std::size_t>(n++)] = p->c_str();
    detail::Session s(client.pool());
    detail::Connection& conn = *s.get();
    conn.sync_cancelled = false;
    // An advance or erase commits: bounded as the stores' writes are (detail::await_answer).
    PostgresResult r;
    const millis bound = detail::commit_bound(client.options());
    if (PQsendQueryParams(s.pg(), sql.c_str(), n, nullptr, vals.data(), nullptr, nullptr, 0) != 1 ||
        !detail::read_answer(conn, bound, r)) {
      s.healthy(false);
      const std::string why = conn.cancelled_after > millis{0}
                                  ? fmt::format("no answer {} ms after a cancel", bound.count())
                                  : detail::first_line(PQerrorMessage(s.pg()));
      throw connection_error(fmt::format("idem: postgres {} failed: {} (connection lost)", what, why), "08006", true);
    }
    if (conn.sync_cancelled) detail::throw_sync_cancelled(what, conn.cancelled_after);
    if (!detail::result_ok(ResultAccess::native(r)))
      detail::throw_result(what, ResultAccess::native(r), s.pg(), sequence_missing);
    return r;
  }
};

PostgresSequenceStore::PostgresSequenceStore(PostgresStore& store, PostgresSequenceStoreOptions options)
    : PostgresSequenceStore(store.client(), std::move(options)) {}
PostgresSequenceStore::PostgresSequenceStore(std::shared_ptr<PostgresClient> client,
                                             PostgresSequenceStoreOptions options)
    : impl_(std::make_unique<Impl>(std::move(client), std::move(options))) {}
PostgresSequenceStore::~PostgresSequenceStore() = default;
PostgresSequenceStore::PostgresSequenceStore(PostgresSequenceStore&&) noexcept = default;
PostgresSequenceStore& PostgresSequenceStore::operator=(PostgresSequenceStore&&) noexcept = default;

PostgresSequenceStore::Impl& PostgresSequenceStore::impl() const {
  if (!impl_) throw usage_error("idem: this PostgresSequenceStore was moved from; use the store it was moved to");
  return *impl_;
}

std::optional<std::uint64_t> PostgresSequenceStore::last_applied(std::string_view entity) {
  detail::check_entity(entity);
  Impl& im = impl();
  const std::string hex = detail::to_hex(entity);
  return read_seq(im.run(im.sql_get, {&hex}, "sequence read"), entity);
}

AdvanceResult PostgresSequenceStore::advance(std::string_view entity, std::uint64_t seq) {
  detail::check_entity(entity);
  Impl& im = impl();
  const std::string hex = detail::to_hex(entity), dec = decimal(seq);
  PostgresResult r = im.run(im.sql_advance, {&hex, &dec}, "sequence advance");
  return decode_advance(r, entity, seq, [&] { return im.run(im.sql_get, {&hex}, "sequence read"); });
}

AdvanceResult PostgresSequenceStore::advance(PostgresStore::Transaction& tx, std::string_view entity,
                                             std::uint64_t seq) {
  detail::check_entity(entity);
  if (!tx.is_open())
    throw usage_error("idem: PostgresSequenceStore::advance(tx, ...) on a transaction that is not open");
  Impl& im = impl();
  im.ensure_migrated();
  const std::string hex = detail::to_hex(entity);
  PostgresResult r = tx.exec(im.sql_advance, hex, decimal(seq));
  return decode_advance(r, entity, seq, [&] { return tx.exec(im.sql_get, hex); });
}

bool PostgresSequenceStore::erase(std::string_view entity) {
  detail::check_entity(entity);
  Impl& im = impl();
  const std::string hex = detail::to_hex(entity);
  return im.run(im.sql_erase, {&hex}, "sequence erase").affected() > 0;
}

void PostgresSequenceStore::migrate() { impl().migrate(); }

const PostgresSequenceStoreOptions& PostgresSequenceStore::options() const { return impl().opt; }
const std::string& PostgresSequenceStore::qualified_table() const { return impl().qualified; }

}  // namespace idem
