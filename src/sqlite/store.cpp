// SqliteStore: the record contract of docs/design.md in one SQLite file. Every decision that
// writes is made inside one BEGIN IMMEDIATE transaction (the file's single write lock), re-reading
// the row there; answers that write nothing (duplicate, in_flight, previously_failed, mismatch) may
// come from a plain snapshot read first, since each of them only ever stops a handler.

#include <atomic>
#include <limits>
#include <mutex>
#include <optional>
#include <utility>

#include <fmt/format.h>

#include "db.hpp"
#include "idem/core/validate.hpp"
#include "idem/sqlite/store.hpp"
#include "store_impl.hpp"

namespace idem {
namespace detail {

namespace {

constexpr const char* kind_records = "records";

// A key for messages: printable and short.
std::string shown(std::string_view key) {
  std::string s;
  for (char ch : key.substr(0, 64)) s += (ch >= 0x20 && ch < 0x7f) ? ch : '?';
  return key.size() > 64 ? s + "..." : s;
}

// What acquire answers for the live `row` (nullopt: absent or expired) at `now`. `acquired`
// means the caller must write the claim: fence + 1 (1 for a new record).
AcquireResult decide(const std::optional<Row>& row, const AcquireParams& p, std::int64_t now) {
  AcquireResult r;
  if (!row) {
    r.status = AcquireStatus::acquired;
    r.holder = {1, p.token};
    r.attempts = 1;
    return r;
  }
  r.attempts = row->attempts;
  if (!p.fingerprint.empty() && !row->fingerprint.empty() && row->fingerprint != p.fingerprint) {
    r.status = AcquireStatus::mismatch;
    return r;
  }
  switch (row->state) {
    case State::completed:
      r.status = AcquireStatus::duplicate;
      r.result_unavailable = row->permanent;
      r.payload = row->permanent ? row->error : row->result;
      return r;
    case State::in_progress:
      if (row->lease_until > now) {
        r.status = AcquireStatus::in_flight;
        r.retry_after = millis{row->lease_until - now};
        return r;
      }
      r.takeover = true;
      break;
    case State::failed:
      if (row->permanent) {
        r.status = AcquireStatus::previously_failed;
        r.payload = row->error;
        return r;
      }
      if (row->retry_at > now) {
        r.status = AcquireStatus::in_flight;
        r.retry_after = millis{row->retry_at - now};
        return r;
      }
      break;
  }
  r.status = AcquireStatus::acquired;
  r.holder = {row->fence + 1, p.token};
  r.attempts = row->attempts + 1;
  return r;
}

void check_key_size(std::string_view key) {
  check_key(key, SqliteStore::max_key_bytes);
}

}  // namespace

std::vector<std::string> record_schema_scripts(const std::string& table) {
  const std::string t = sqlite_quote(table);
  const std::string idx = sqlite_quote(table + "_expires");
  return {
      // v1: the record of docs/design.md §1, one row per key. Strings are blobs: keys, results and
      // owners are bytes, never re-encoded.
      "CREATE TABLE " + t +
          " (key BLOB NOT NULL PRIMARY KEY, state INTEGER NOT NULL, fence INTEGER NOT NULL, token INTEGER NOT NULL, "
          "owner BLOB NOT NULL, lease_until INTEGER NOT NULL, retry_at INTEGER NOT NULL, attempts INTEGER NOT NULL, "
          "permanent INTEGER NOT NULL, fingerprint BLOB NOT NULL, result BLOB NOT NULL, error BLOB NOT NULL, "
          "expires_at INTEGER NOT NULL)",
      // v2: purge_expired finds expired rows through an index instead of a full scan.
      "CREATE INDEX IF NOT EXISTS " + idx + " ON " + t + " (expires_at)",
  };
}

SqliteStoreImpl::SqliteStoreImpl(SqliteOptions o) : opt(std::move(o)) {
  if (opt.path.empty())
    throw invalid_options_error("idem: SqliteOptions::path is empty; give the database file's path");
  if (opt.path == ":memory:" || opt.path.rfind("file:", 0) == 0)
    throw invalid_options_error(fmt::format("idem: SqliteOptions::path '{}' is not a plain file path; an in-memory "
                                            "database lives in one connection only (use MemoryStore), and URIs are "
                                            "not taken",
                                            opt.path));
  check_sqlite_table(opt.table, "SqliteOptions::table");
  if (opt.busy_timeout < millis{0})
    throw invalid_options_error("idem: SqliteOptions::busy_timeout is negative; use 0 to answer at once when locked");
  if (opt.max_result_bytes == 0 || opt.max_result_bytes > (std::size_t{512} << 20))
    throw invalid_options_error(fmt::format("idem: SqliteOptions::max_result_bytes is {}; use 1 byte to 512 MiB",
                                            opt.max_result_bytes));
  if (opt.max_idle_connections == 0)
    throw invalid_options_error("idem: SqliteOptions::max_idle_connections is 0; keep at least one connection");
  const std::string t = sqlite_quote(opt.table);
  scripts = record_schema_scripts(opt.table);
  sel_sql = "SELECT state, fence, token, owner, lease_until, retry_at, attempts, permanent, fingerprint, result, error, "
            "expires_at FROM " + t + " WHERE key = ?1";
  insert_sql = "INSERT OR REPLACE INTO " + t +
               " (key, state, fence, token, owner, lease_until, retry_at, attempts, permanent, fingerprint, result, "
               "error, expires_at) VALUES (?1, 1, 1, ?2, ?3, ?4, 0, 1, 0, ?5, x'', x'', ?6)";
  reclaim_sql = "UPDATE " + t +
                " SET state = 1, fence = ?2, token = ?3, owner = ?4, lease_until = ?5, retry_at = 0, attempts = ?6, "
                "error = x'', expires_at = max(expires_at, ?7) WHERE key = ?1";
  const std::string held = " WHERE key = ?5 AND state = 1 AND fence = ?6 AND token = ?7 AND expires_at > ?8";
  complete_sql = "UPDATE " + t +
                 " SET state = 2, permanent = ?1, result = ?2, error = ?3, lease_until = 0, expires_at = ?4" + held;
  fail_sql = "UPDATE " + t +
             " SET state = 3, permanent = ?1, error = ?2, retry_at = ?3, lease_until = 0, expires_at = ?4" + held;
  extend_sql = "UPDATE " + t + " SET lease_until = ?1, expires_at = max(expires_at, ?1)" + held;
  purge_sql = "DELETE FROM " + t + " WHERE rowid IN (SELECT rowid FROM " + t + " WHERE expires_at <= ?1 LIMIT ?2)";
  db = std::make_shared<SqliteDb>(opt);
}

void SqliteStoreImpl::ensure_ready() {
  if (ready.load(std::memory_order_acquire)) return;
  std::lock_guard lk(ready_mu);
  if (ready.load(std::memory_order_relaxed)) return;
  if (opt.auto_migrate) {
    db->ensure_schema(opt.table, kind_records, SqliteStore::schema_version, scripts);
  } else {
    auto c = db->checkout();
    const int have = db->installed_version(*c, opt.table, kind_records);
    if (have != SqliteStore::schema_version)
      throw store_error(fmt::format("idem: table '{}' in {} is at schema version {}, this library needs {}: {}", opt.table,
                                    opt.path, have, SqliteStore::schema_version,
                                    have > SqliteStore::schema_version ? "upgrade idem"
                                                                       : "run SqliteStore::migrate() (or set auto_migrate)"),
                        "SCHEMA", false);
  }
  ready.store(true, std::memory_order_release);
}

void SqliteStoreImpl::migrate() {
  std::lock_guard lk(ready_mu);
  db->ensure_schema(opt.table, kind_records, SqliteStore::schema_version, scripts);
  ready.store(true, std::memory_order_release);
}

std::optional<Row> SqliteStoreImpl::read_row(SqliteConn& c, std::string_view key, std::int64_t now) const {
  Stmt s(*db, c, sel_sql, "read record");
  s.bind_blob(1, key);
  if (!s.step()) return std::nullopt;
  Row r;
  const std::int64_t state = s.col_int(0);
  bool readable = state >= 1 && state <= 3 && s.col_int(1) >= 0 && s.col_int(6) >= 0;
  for (int i : {0, 1, 2, 4, 5, 6, 7, 11}) readable = readable && s.col_is_int(i);
  // Never guessed at: a record idem cannot read is neither a duplicate nor free to claim.
  if (!readable)
    throw corrupt_record_error(fmt::format("idem: the record of key '{}' in table '{}' of {} cannot be read (state {}, "
                                           "or a column of another type); inspect it with sqlite3 and delete the row",
                                           shown(key), opt.table, opt.path, state));
  r.expires_at = s.col_int(11);
  if (r.expires_at <= now) return std::nullopt;  // expired: as if absent, until a purge or a new claim replaces it
  r.state = static_cast<State>(state);
  r.fence = static_cast<std::uint64_t>(s.col_int(1));
  r.token = static_cast<std::uint64_t>(s.col_int(2));
  r.owner = s.col_blob(3);
  r.lease_until = s.col_int(4);
  r.retry_at = s.col_int(5);
  r.attempts = static_cast<std::uint32_t>(std::min<std::int64_t>(s.col_int(6), std::numeric_limits<std::uint32_t>::max()));
  r.permanent = s.col_int(7) != 0;
  r.fingerprint = s.col_blob(8);
  r.result = s.col_blob(9);
  r.error = s.col_blob(10);
  return r;
}

std::optional<AcquireResult> SqliteStoreImpl::snapshot_decision(std::string_view key, const AcquireParams& p) {
  auto c = db->checkout();
  const std::int64_t now = db->now_ms();
  AcquireResult d = decide(read_row(*c, key, now), p, now);
  if (d.status == AcquireStatus::acquired) return std::nullopt;
  return d;
}

AcquireResult SqliteStoreImpl::claim(SqliteConn& c, std::string_view key, const AcquireParams& p) {
  const std::int64_t now = db->now_ms();
  const std::optional<Row> row = read_row(c, key, now);
  AcquireResult d = decide(row, p, now);
  if (d.status != AcquireStatus::acquired) return d;
  const std::int64_t lease_until = now + p.lease.count();
  if (!row) {
    Stmt s(*db, c, insert_sql, "acquire (new record)");
    s.bind_blob(1, key).bind(2, static_cast<std::int64_t>(p.token)).bind_blob(3, p.owner).bind(4, lease_until);
    s.bind_blob(5, p.fingerprint).bind(6, now + p.retention.count());
    s.run();
  } else {
    Stmt s(*db, c, reclaim_sql, "acquire (claim)");
    s.bind_blob(1, key).bind(2, static_cast<std::int64_t>(d.holder.fence)).bind(3, static_cast<std::int64_t>(p.token));
    s.bind_blob(4, p.owner).bind(5, lease_until).bind(6, d.attempts).bind(7, now + p.retention.count());
    s.run();
  }
  return d;
}

WriteStatus SqliteStoreImpl::held_write(SqliteConn& c, const HeldWrite& w) {
  const std::int64_t now = db->now_ms();
  const std::string* sql = &complete_sql;
  std::string_view what = "complete";
  if (w.kind == HeldWrite::fail) {
    sql = &fail_sql;
    what = "fail";
  } else if (w.kind == HeldWrite::extend) {
    sql = &extend_sql;
    what = "extend";
  }
  Stmt s(*db, c, *sql, what);
  switch (w.kind) {
    case HeldWrite::complete:
    case HeldWrite::complete_unavailable: {
      const bool unavailable = w.kind == HeldWrite::complete_unavailable;
      s.bind(1, unavailable ? 1 : 0).bind_blob(2, unavailable ? std::string_view() : w.text);
      s.bind_blob(3, unavailable ? w.text : std::string_view()).bind(4, now + w.duration.count());
      break;
    }
    case HeldWrite::fail:
      s.bind(1, (!w.release && w.permanent) ? 1 : 0).bind_blob(2, w.text);
      s.bind(3, w.release ? now : now + std::max<std::int64_t>(0, w.backoff.count()));
      s.bind(4, now + w.duration.count());
      break;
    case HeldWrite::extend: s.bind(1, now + w.duration.count()); break;
  }
  s.bind_blob(5, w.key).bind(6, static_cast<std::int64_t>(w.holder.fence));
  s.bind(7, static_cast<std::int64_t>(w.holder.token)).bind(8, now);
  return s.run() == 1 ? WriteStatus::ok : WriteStatus::lease_lost;
}

void SqliteStoreImpl::check_write(const HeldWrite& w) const {
  check_holder(w.key, w.holder);
  switch (w.kind) {
    case HeldWrite::complete:
      check_lease(w.duration, "retention");
      if (w.text.size() > opt.max_result_bytes)
        throw usage_error(fmt::format("idem: the result is {} bytes, over SqliteOptions::max_result_bytes ({}); the "
                                      "guard completes such a key without its result",
                                      w.text.size(), opt.max_result_bytes));
      break;
    case HeldWrite::complete_unavailable:
    case HeldWrite::fail: check_lease(w.duration, "retention"); break;
    case HeldWrite::extend: check_lease(w.duration); break;
  }
}

WriteStatus SqliteStoreImpl::write_one(const HeldWrite& w) {
  check_write(w);
  ensure_ready();
  static constexpr std::string_view names[] = {"complete", "complete_unavailable", "fail", "extend"};
  return db->write(names[w.kind], CommitKind::completion,
                   [&](SqliteConn& c) { return held_write(c, w); });
}

}  // namespace detail

// ---- SqliteStore ----------------------------------------------------------------------------

SqliteStore::SqliteStore(SqliteOptions options) : impl_(std::make_unique<detail::SqliteStoreImpl>(std::move(options))) {}
SqliteStore::~SqliteStore() = default;
SqliteStore::SqliteStore(SqliteStore&&) noexcept = default;
SqliteStore& SqliteStore::operator=(SqliteStore&&) noexcept = default;

AcquireResult SqliteStore::acquire(std::string_view key, const AcquireParams& params) {
  detail::check_acquire(key, params);
  detail::check_key_size(key);
  impl_->ensure_ready();
  if (auto early = impl_->snapshot_decision(key, params)) return std::move(*early);
  return impl_->db->write("acquire", detail::CommitKind::decision,
                          [&](detail::SqliteConn& c) { return impl_->claim(c, key, params); });
}

WriteStatus SqliteStore::complete(std::string_view key, const Holder& holder, std::string_view result, millis retention) {
  return impl_->write_one({detail::HeldWrite::complete, key, holder, result, retention});
}

WriteStatus SqliteStore::complete_unavailable(std::string_view key, const Holder& holder, std::string_view reason,
                                              millis retention) {
  return impl_->write_one({detail::HeldWrite::complete_unavailable, key, holder, reason, retention});
}

WriteStatus SqliteStore::fail(std::string_view key, const Holder& holder, const FailParams& params) {
  return impl_->write_one({detail::HeldWrite::fail, key, holder, params.error, params.retention, params.release,
                           params.permanent, params.backoff});
}

WriteStatus SqliteStore::extend(std::string_view key, const Holder& holder, millis lease) {
  return impl_->write_one({detail::HeldWrite::extend, key, holder, {}, lease});
}

std::optional<Record> SqliteStore::inspect(std::string_view key) {
  detail::check_key(key, static_cast<std::size_t>(-1));
  impl_->ensure_ready();
  auto c = impl_->db->checkout();
  auto row = impl_->read_row(*c, key, impl_->db->now_ms());
  if (!row) return std::nullopt;
  Record r;
  r.state = row->state;
  r.holder = {row->fence, row->token};
  r.owner = std::move(row->owner);
  r.lease_until_ms = row->lease_until;
  r.retry_at_ms = row->retry_at;
  r.attempts = row->attempts;
  r.permanent = row->permanent;
  r.fingerprint = std::move(row->fingerprint);
  r.result = std::move(row->result);
  r.error = std::move(row->error);
  return r;
}

std::vector<AcquireResult> SqliteStore::acquire_many(std::span<const AcquireRequest> requests) {
  // A bad request refuses the batch before any key is taken, as the other stores do.
  for (const AcquireRequest& r : requests) {
    detail::check_acquire(r.key, r.params);
    detail::check_key_size(r.key);
  }
  if (requests.empty()) return {};
  impl_->ensure_ready();
  // One transaction, in request order: a key asked twice sees its first claim and answers in_flight.
  return impl_->db->write("acquire_many", detail::CommitKind::decision, [&](detail::SqliteConn& c) {
    std::vector<AcquireResult> out;
    out.reserve(requests.size());
    for (const AcquireRequest& r : requests) out.push_back(impl_->claim(c, r.key, r.params));
    return out;
  });
}

std::size_t SqliteStore::purge_expired(std::size_t batch, std::size_t max_batches) {
  if (batch == 0) throw invalid_options_error("idem: purge_expired batch is 0; delete at least one row per batch");
  impl_->ensure_ready();
  std::size_t total = 0;
  for (std::size_t b = 0; b < max_batches; ++b) {
    // One short transaction per batch: the write lock is free for claims between them.
    const std::int64_t n = impl_->db->write("purge_expired", detail::CommitKind::plain, [&](detail::SqliteConn& c) {
      detail::Stmt s(*impl_->db, c, impl_->purge_sql, "purge_expired");
      s.bind(1, impl_->db->now_ms()).bind(2, static_cast<std::int64_t>(std::min<std::size_t>(batch, INT64_MAX)));
      return s.run();
    });
    total += static_cast<std::size_t>(n);
    if (static_cast<std::size_t>(n) < batch) break;
  }
  return total;
}

void SqliteStore::migrate() { impl_->migrate(); }

bool SqliteStore::transactional() const noexcept { return impl_->opt.mode == SqliteMode::transactional; }

const SqliteOptions& SqliteStore::options() const noexcept { return impl_->opt; }

StoreLimits SqliteStore::limits() const noexcept { return {max_key_bytes, impl_->opt.max_result_bytes}; }

// ---- BatchWriter ----------------------------------------------------------------------------

struct SqliteStore::BatchWriter::Impl {
  detail::SqliteStoreImpl* store;
  // Owned copies: the guard's views need not outlive the call that kept them.
  struct Op {
    detail::HeldWrite::Kind kind;
    std::string key, text;
    Holder holder;
    millis duration;
    bool release, permanent;
    millis backoff;
  };
  std::vector<Op> ops;

  std::vector<WriteStatus> flush() {
    if (ops.empty()) return {};
    store->ensure_ready();
    auto statuses = store->db->write("batch write", detail::CommitKind::completion, [&](detail::SqliteConn& c) {
      std::vector<WriteStatus> out;
      out.reserve(ops.size());
      for (const Op& o : ops)
        out.push_back(store->held_write(c, {o.kind, o.key, o.holder, o.text, o.duration, o.release, o.permanent, o.backoff}));
      return out;
    });
    ops.clear();
    return statuses;
  }
};

SqliteStore::BatchWriter::BatchWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SqliteStore::BatchWriter::BatchWriter(BatchWriter&&) noexcept = default;
SqliteStore::BatchWriter& SqliteStore::BatchWriter::operator=(BatchWriter&&) noexcept = default;

SqliteStore::BatchWriter::~BatchWriter() {
  if (!impl_ || impl_->ops.empty()) return;
  try {
    impl_->flush();
  } catch (...) {  // NOLINT(bugprone-empty-catch): not recorded, the claims lapse after their lease
  }
}

void SqliteStore::BatchWriter::complete(std::string_view key, const Holder& h, std::string_view result, millis retention) {
  const detail::HeldWrite w{detail::HeldWrite::complete, key, h, result, retention};
  impl_->store->check_write(w);
  impl_->ops.push_back({w.kind, std::string(key), std::string(result), h, retention, false, false, millis{0}});
}

void SqliteStore::BatchWriter::fail(std::string_view key, const Holder& h, const FailParams& f) {
  const detail::HeldWrite w{detail::HeldWrite::fail, key, h, f.error, f.retention, f.release, f.permanent, f.backoff};
  impl_->store->check_write(w);
  impl_->ops.push_back({w.kind, std::string(key), std::string(f.error), h, f.retention, f.release, f.permanent, f.backoff});
}

std::vector<WriteStatus> SqliteStore::BatchWriter::finish() { return impl_->flush(); }

SqliteStore::BatchWriter SqliteStore::batch_writer() {
  auto impl = std::make_unique<BatchWriter::Impl>();
  impl->store = impl_.get();
  return BatchWriter(std::move(impl));
}

}  // namespace idem
