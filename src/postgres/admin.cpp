// PostgresAdmin (include/idem/postgres/admin.hpp): one plain libpq session, so the operator's tool
// shares nothing with the stores' pool and never migrates anything.

#include "idem/postgres/admin.hpp"

#include <charconv>
#include <cstdlib>

#include <fmt/format.h>
#include <libpq-fe.h>

#include "client.hpp"
#include "errors.hpp"
#include "idem/core/error.hpp"

namespace idem {

namespace {

using ResultPtr = std::unique_ptr<PGresult, void (*)(PGresult*)>;

bool valid_ident(std::string_view s) {
  if (s.empty() || s.size() > 63 || !(s[0] == '_' || (s[0] >= 'a' && s[0] <= 'z'))) return false;
  for (char c : s)
    if (!(c == '_' || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'))) return false;
  return true;
}

std::int64_t to_i64(std::string_view s) {
  std::int64_t v = 0;
  std::from_chars(s.data(), s.data() + s.size(), v);
  return v;
}

// A bytea in text output ("\x6b6579") as its bytes.
std::string unhex(std::string_view s) {
  if (s.size() < 2 || s[0] != '\\' || s[1] != 'x') return std::string(s);
  std::string out;
  out.reserve((s.size() - 2) / 2);
  auto nib = [](char c) { return c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10; };
  for (std::size_t i = 2; i + 1 < s.size(); i += 2) out += static_cast<char>(nib(s[i]) * 16 + nib(s[i + 1]));
  return out;
}

}  // namespace

struct PostgresAdmin::Impl {
  PGconn* pg = nullptr;
  std::string qt;  // "schema"."table"
  PostgresStoreOptions store;

  Impl(const PostgresOptions& o, PostgresStoreOptions s) : store(std::move(s)) {
    if (!valid_ident(store.schema))
      throw invalid_options_error(fmt::format("idem: schema '{}' is not [a-z_][a-z0-9_]*", store.schema));
    if (!valid_ident(store.table))
      throw invalid_options_error(fmt::format("idem: table '{}' is not [a-z_][a-z0-9_]*", store.table));
    qt = "\"" + store.schema + "\".\"" + store.table + "\"";
    char* err = nullptr;
    PQconninfoOption* parsed = PQconninfoParse(o.conninfo.c_str(), &err);
    if (!parsed) {
      std::string why = err ? err : "unparsable";
      if (err) PQfreemem(err);
      while (!why.empty() && why.back() == '\n') why.pop_back();
      throw invalid_options_error(fmt::format("idem: bad PostgreSQL URL or conninfo: {}", why));
    }
    PQconninfoFree(parsed);
    pg = PQconnectdb(o.conninfo.c_str());
    if (PQstatus(pg) != CONNECTION_OK) {
      const connection_error e = detail::connect_failure(PQerrorMessage(pg));
      PQfinish(pg);
      pg = nullptr;
      throw e;
    }
  }
  ~Impl() {
    if (pg) PQfinish(pg);
  }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  // $n bound as text, except the key parameters given in `binary` (bytea, any bytes).
  ResultPtr exec(const std::string& sql, const std::vector<std::string>& params = {},
                 const std::vector<int>& binary = {}) {
    std::vector<const char*> values;
    std::vector<int> lengths, formats;
    for (std::size_t i = 0; i < params.size(); ++i) {
      values.push_back(params[i].c_str());
      lengths.push_back(static_cast<int>(params[i].size()));
      formats.push_back(0);
    }
    for (int b : binary) formats[static_cast<std::size_t>(b)] = 1;
    ResultPtr r(PQexecParams(pg, sql.c_str(), static_cast<int>(params.size()), nullptr, values.data(), lengths.data(),
                             formats.data(), 0),
                PQclear);
    const auto st = PQresultStatus(r.get());
    if (st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK) return r;
    if (PQstatus(pg) != CONNECTION_OK)
      throw connection_error(fmt::format("idem: PostgreSQL connection lost: {}", PQerrorMessage(pg)));
    const char* code = PQresultErrorField(r.get(), PG_DIAG_SQLSTATE);
    const std::string sqlstate = code ? code : "";
    std::string msg = PQresultErrorMessage(r.get());
    while (!msg.empty() && (msg.back() == '\n' || msg.back() == ' ')) msg.pop_back();
    if (sqlstate == "42P01" || sqlstate == "3F000")
      throw store_error(fmt::format("idem: no idem table {} ({}): check --schema/--table, or let a store create it "
                                    "(auto_migrate)",
                                    qt, msg),
                        sqlstate, false);
    if (sqlstate == "42501")
      throw store_error(fmt::format("idem: permission denied on {} ({}): grant the tool's user the privilege", qt, msg),
                        sqlstate, false);
    throw store_error(fmt::format("idem: {}", msg), sqlstate, false);
  }

  static std::string get(const PGresult* r, int row, int col) {
    return std::string(PQgetvalue(r, row, col), static_cast<std::size_t>(PQgetlength(r, row, col)));
  }

  static constexpr const char* columns =
      "t.key, t.state, t.fence, t.owner, t.lease_until, t.retry_at, t.attempts, t.permanent, t.fingerprint, "
      "octet_length(t.result), t.error, t.expires_at, c.ms, pg_column_size(t.*)";
  static constexpr const char* clock = "(SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint AS ms) c";

  static AdminRecord row(const PGresult* r, int i) {
    AdminRecord a;
    a.key = unhex(get(r, i, 0));
    const auto st = to_i64(get(r, i, 1));
    if (st < 1 || st > 3) throw corrupt_record_error(fmt::format("idem: record '{}' has state {}", a.key, st));
    a.record.state = static_cast<State>(st);
    a.record.holder.fence = static_cast<std::uint64_t>(to_i64(get(r, i, 2)));
    a.record.owner = get(r, i, 3);
    a.record.lease_until_ms = to_i64(get(r, i, 4));
    a.record.retry_at_ms = to_i64(get(r, i, 5));
    a.record.attempts = static_cast<std::uint32_t>(to_i64(get(r, i, 6)));
    a.record.permanent = get(r, i, 7) == "t";
    a.record.fingerprint = unhex(get(r, i, 8));
    const auto result_len = static_cast<std::size_t>(to_i64(get(r, i, 9)));
    a.record.result.assign(result_len, '\0');  // its size is what an operator needs; the bytes may be large
    a.record.error = unhex(get(r, i, 10));
    a.now_ms = to_i64(get(r, i, 12));
    a.expires_in_ms = to_i64(get(r, i, 11)) - a.now_ms;
    a.bytes = static_cast<std::size_t>(to_i64(get(r, i, 13)));
    return a;
  }
};

PostgresAdmin::PostgresAdmin(PostgresOptions options, PostgresStoreOptions store)
    : impl_(std::make_unique<Impl>(options, std::move(store))) {}
PostgresAdmin::~PostgresAdmin() = default;

std::string PostgresAdmin::table() const { return impl_->qt; }

std::optional<AdminRecord> PostgresAdmin::inspect(std::string_view key) {
  auto r = impl_->exec(std::string("SELECT ") + Impl::columns + " FROM " + impl_->qt + " t, " + Impl::clock +
                           " WHERE t.key = $1 AND t.expires_at > c.ms",
                       {std::string(key)}, {0});
  if (PQntuples(r.get()) == 0) return std::nullopt;
  return Impl::row(r.get(), 0);
}

std::size_t PostgresAdmin::list(const ListFilter& filter, const std::function<bool(const AdminRecord&)>& each) {
  std::size_t passed = 0;
  std::vector<State> passes;
  if (filter.state)
    passes.push_back(*filter.state);
  else
    passes = {State::in_progress, State::failed, State::completed};  // stuck keys first
  const std::size_t page = filter.page ? filter.page : 1000;
  for (State st : passes) {
    if (filter.older_than && st == State::completed) continue;
    std::string cond = " AND t.state = " + std::to_string(static_cast<int>(st));
    if (filter.older_than) {
      const std::string col = st == State::in_progress ? "t.lease_until" : "t.retry_at";
      cond += " AND c.ms - " + col + " >= " + std::to_string(filter.older_than->count());
    }
    // Keyset pagination on the primary key: each page is an index range scan from the last key.
    std::string last;
    bool first = true;
    for (;;) {
      std::vector<std::string> params{std::to_string(page)};
      std::string where = "t.expires_at > c.ms" + cond;
      if (!first) {
        params.push_back(last);
        where += " AND t.key > $2";
      }
      auto r = impl_->exec(std::string("SELECT ") + Impl::columns + " FROM " + impl_->qt + " t, " + Impl::clock +
                               " WHERE " + where + " ORDER BY t.key LIMIT $1",
                           params, first ? std::vector<int>{} : std::vector<int>{1});
      const int n = PQntuples(r.get());
      for (int i = 0; i < n; ++i) {
        const AdminRecord a = Impl::row(r.get(), i);
        ++passed;
        if (!each(a) || (filter.limit && passed >= filter.limit)) return passed;
      }
      if (n < static_cast<int>(page)) break;
      last = unhex(Impl::get(r.get(), n - 1, 0));
      first = false;
    }
  }
  return passed;
}

ReleaseResult PostgresAdmin::release(std::string_view key, std::uint64_t fence, bool force) {
  // The WHERE of the UPDATE is the decision (re-checked on the locked row under READ COMMITTED);
  // `cur` only explains a refusal. Token 0 is no holder's (tokens are never 0), so the old
  // holder's complete, fail and extend answer lease_lost from now on.
  const std::string sql =
      "WITH c AS (SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint AS ms), "
      "cur AS (SELECT t.state, t.fence, t.lease_until FROM " + impl_->qt + " t, c WHERE t.key = $1 AND t.expires_at > c.ms), "
      "u AS (UPDATE " + impl_->qt + " t SET state = 3, permanent = false, retry_at = c.ms, lease_until = 0, token = 0, "
      "owner = '', error = convert_to($4, 'UTF8') FROM c WHERE t.key = $1 AND t.fence = $2 AND t.expires_at > c.ms AND "
      "(t.state = 3 OR (t.state = 1 AND ($3 OR t.lease_until <= c.ms))) RETURNING 1) "
      "SELECT (SELECT count(*) FROM u), cur.state, cur.fence, cur.lease_until <= c.ms FROM c LEFT JOIN cur ON true";
  auto r = impl_->exec(sql,
                       {std::string(key), std::to_string(fence), force ? "true" : "false",
                        fmt::format("released by idem release (fence {})", fence)},
                       {0});
  ReleaseResult out;
  const auto done = to_i64(Impl::get(r.get(), 0, 0));
  if (PQgetisnull(r.get(), 0, 1)) {
    out.status = ReleaseStatus::not_found;
    return out;
  }
  out.state = static_cast<State>(to_i64(Impl::get(r.get(), 0, 1)));
  out.fence = static_cast<std::uint64_t>(to_i64(Impl::get(r.get(), 0, 2)));
  if (done == 1)
    out.status = ReleaseStatus::released;
  else if (out.fence != fence)
    out.status = ReleaseStatus::fence_mismatch;
  else if (out.state == State::completed)
    out.status = ReleaseStatus::completed;
  else if (out.state == State::in_progress && Impl::get(r.get(), 0, 3) != "t")
    out.status = ReleaseStatus::live;
  else
    out.status = ReleaseStatus::fence_mismatch;  // changed between the snapshot and the lock
  return out;
}

std::size_t PostgresAdmin::purge(std::size_t batch, const std::function<void(std::size_t, std::size_t)>& progress) {
  const std::string now = "(SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint AS ms) c";
  auto count = impl_->exec("SELECT count(*) FROM " + impl_->qt + " t, " + now + " WHERE t.purge_after <= c.ms");
  const auto expired = static_cast<std::size_t>(to_i64(Impl::get(count.get(), 0, 0)));
  // The same statement as PostgresStore::purge_expired: the retention index gives the batch, and
  // SKIP LOCKED leaves a row a claim holds to the next run.
  const std::string del = "DELETE FROM " + impl_->qt + " d WHERE d.key IN (SELECT t.key FROM " + impl_->qt + " t, " +
                          now + " WHERE t.purge_after <= c.ms LIMIT $1 FOR UPDATE OF t SKIP LOCKED)";
  std::size_t total = 0;
  for (;;) {
    auto r = impl_->exec(del, {std::to_string(batch ? batch : 1000)});
    const auto n = static_cast<std::size_t>(to_i64(PQcmdTuples(r.get())));
    total += n;
    if (progress) progress(total, expired);
    if (n == 0 || n < batch) break;
  }
  return total;
}

AdminStats PostgresAdmin::stats() {
  AdminStats s;
  auto r = impl_->exec("SELECT t.state, count(*), coalesce(sum(pg_column_size(t.*)), 0), "
                       "count(*) FILTER (WHERE t.state = 1 AND t.lease_until <= c.ms), "
                       "max(c.ms - t.lease_until) FILTER (WHERE t.state = 1) FROM " +
                       impl_->qt + " t, " + Impl::clock + " WHERE t.expires_at > c.ms GROUP BY t.state");
  for (int i = 0; i < PQntuples(r.get()); ++i) {
    const auto st = to_i64(Impl::get(r.get(), i, 0));
    const auto n = static_cast<std::uint64_t>(to_i64(Impl::get(r.get(), i, 1)));
    if (st >= 1 && st <= 3) s.by_state[static_cast<std::size_t>(st)] = n;
    s.records += n;
    s.bytes += static_cast<std::uint64_t>(to_i64(Impl::get(r.get(), i, 2)));
    s.lapsed += static_cast<std::uint64_t>(to_i64(Impl::get(r.get(), i, 3)));
    if (st == 1 && !PQgetisnull(r.get(), i, 4)) s.most_overdue_ms = to_i64(Impl::get(r.get(), i, 4));
  }
  auto e = impl_->exec("SELECT count(*) FROM " + impl_->qt + " t, " + Impl::clock + " WHERE t.purge_after <= c.ms");
  s.expired_rows = static_cast<std::uint64_t>(to_i64(Impl::get(e.get(), 0, 0)));
  return s;
}

std::vector<Finding> PostgresAdmin::doctor() {
  std::vector<Finding> out;
  auto add = [&](Severity s, std::string check, std::string message, std::string fix = {}) {
    out.push_back({s, std::move(check), std::move(message), std::move(fix)});
  };
  auto scalar = [&](const std::string& sql, const std::vector<std::string>& p = {}) {
    auto r = impl_->exec(sql, p);
    return PQntuples(r.get()) ? Impl::get(r.get(), 0, 0) : std::string();
  };
  const auto version = to_i64(scalar("SHOW server_version_num"));
  const std::string version_text = scalar("SHOW server_version");
  if (version < 120000)
    add(Severity::error, "version",
        fmt::format("PostgreSQL {}: idem needs 12 or later (MATERIALIZED CTEs)", version_text), "upgrade PostgreSQL");
  else
    add(Severity::ok, "version", fmt::format("PostgreSQL {}", version_text));

  const std::string& schema = impl_->store.schema;
  const std::string& table = impl_->store.table;
  const bool has_table = scalar("SELECT to_regclass($1) IS NOT NULL", {impl_->qt}) == "t";
  if (!has_table) {
    add(Severity::error, "schema", fmt::format("no table {}: no store has run here with these names", impl_->qt),
        "check --schema/--table, or start a store once (auto_migrate) or call PostgresStore::migrate()");
  } else {
    const bool has_versions = scalar("SELECT to_regclass($1) IS NOT NULL", {"\"" + schema + "\".idem_schema_version"}) == "t";
    const std::string v = has_versions ? scalar("SELECT version FROM \"" + schema +
                                                    "\".idem_schema_version WHERE table_name = $1",
                                                {table})
                                       : std::string();
    const auto have = v.empty() ? 0 : to_i64(v);
    if (have == PostgresStore::schema_version)
      add(Severity::ok, "schema", fmt::format("schema version {}", v));
    else if (have > PostgresStore::schema_version)
      add(Severity::error, "schema",
          fmt::format("schema version {} is newer than this idem's {}: stores of this version refuse it", v,
                      PostgresStore::schema_version),
          "upgrade idem");
    else
      add(Severity::error, "schema",
          fmt::format("schema version {}, this idem expects {}", v.empty() ? std::string("unknown") : v,
                      PostgresStore::schema_version),
          "run PostgresStore::migrate() (or start a store with auto_migrate)");
    const bool index = scalar("SELECT count(*) FROM pg_indexes WHERE schemaname = $1 AND tablename = $2 AND indexname = $3",
                              {schema, table, table + "_purge_idx"}) == "1";
    if (index)
      add(Severity::ok, "retention index", fmt::format("{}_purge_idx present", table));
    else
      add(Severity::warning, "retention index",
          fmt::format("no index {}_purge_idx on purge_after: every purge scans the whole table", table),
          fmt::format("CREATE INDEX {}_purge_idx ON {} (purge_after)", table, impl_->qt));
    const std::string privs = scalar("SELECT has_table_privilege(current_user, $1, 'SELECT') AND "
                                     "has_table_privilege(current_user, $1, 'INSERT') AND "
                                     "has_table_privilege(current_user, $1, 'UPDATE') AND "
                                     "has_table_privilege(current_user, $1, 'DELETE')",
                                     {impl_->qt});
    if (privs != "t")
      add(Severity::error, "privileges",
          fmt::format("user {} lacks SELECT, INSERT, UPDATE or DELETE on {}", scalar("SELECT current_user"), impl_->qt),
          fmt::format("GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO <the application's user>", impl_->qt));
    auto b = impl_->exec("SELECT n_live_tup, n_dead_tup, coalesce(greatest(last_autovacuum, last_vacuum)::text, 'never'), "
                         "pg_total_relation_size(relid) FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = $2",
                         {schema, table});
    if (PQntuples(b.get()) == 1) {
      const auto live = to_i64(Impl::get(b.get(), 0, 0)), dead = to_i64(Impl::get(b.get(), 0, 1));
      const std::string size = fmt::format("{} KiB", to_i64(Impl::get(b.get(), 0, 3)) / 1024);
      if (dead > 10000 && dead > live / 5)
        add(Severity::warning, "bloat",
            fmt::format("{} dead rows against {} live ({}, last vacuum {}): acquires slow down", dead, live, size,
                        Impl::get(b.get(), 0, 2)),
            fmt::format("VACUUM {}; lower autovacuum_vacuum_scale_factor for this table", impl_->qt));
      else
        add(Severity::ok, "bloat", fmt::format("{} dead rows, {} live, {}", dead, live, size));
    }
    const auto expired = to_i64(scalar("SELECT count(*) FROM " + impl_->qt +
                                       " WHERE purge_after <= floor(extract(epoch FROM clock_timestamp()) * 1000)"));
    if (expired > 100000)
      add(Severity::warning, "purge", fmt::format("{} expired rows wait for purge", expired),
          "run `idem purge` from cron, or PostgresStore::purge_expired() on a timer");
    else if (expired > 0)
      add(Severity::info, "purge", fmt::format("{} expired rows wait for purge", expired), "idem purge");
  }

  const std::string fsync = scalar("SHOW fsync");
  if (fsync != "on")
    add(Severity::error, "fsync",
        fmt::format("fsync is {}: a server crash can corrupt the table or lose committed records", fsync),
        "fsync = on in postgresql.conf");
  const std::string sc = scalar("SHOW synchronous_commit");
  if (sc == "off")
    add(Severity::error, "synchronous_commit",
        "synchronous_commit is off: a server crash loses recently acknowledged completions, and their messages run again",
        "ALTER ROLE <app> SET synchronous_commit = on (or in postgresql.conf)");
  else
    add(Severity::ok, "synchronous_commit", sc);
  // What survives a failover: the replication settings and what they mean (durability.cpp, the
  // same sentence a store's construction warns with).
  const detail::Durability d = detail::read_durability(impl_->pg);
  if (d.in_recovery)
    add(Severity::error, "role", fmt::format("this server is a standby: every store call writes ({})", d.summary()),
        "point the conninfo at the primary, or list every node with target_session_attrs=read-write");
  else if (d.synchronous() && d.sync_standbys > 0)
    add(Severity::ok, "replication", fmt::format("{}: {}", d.summary(), d.meaning()));
  else if (d.synchronous())
    add(Severity::warning, "replication", fmt::format("{}: {}", d.summary(), d.meaning()),
        "start the synchronous standby, or name two candidates (synchronous_standby_names = 'ANY 1 (s1, s2)')");
  else
    add(Severity::warning, "replication", fmt::format("{}: {}", d.summary(), d.meaning()),
        "for no loss on failover: synchronous_standby_names naming the standbys, synchronous_commit = on");
  return out;
}

}  // namespace idem
