// SqliteAdmin (include/idem/sqlite/admin.hpp): one plain sqlite3 connection of its own, opened
// without SQLITE_OPEN_CREATE and without touching the journal mode, so the operator's tool never
// creates a file, migrates a table or hides a misconfiguration doctor should report.

#include "idem/sqlite/admin.hpp"

#include <sqlite3.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <utility>

#include <fmt/format.h>

#include "db.hpp"
#include "idem/core/error.hpp"
#include "store_impl.hpp"

namespace idem {

namespace {

std::int64_t wall_ms() {
  return std::chrono::duration_cast<millis>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string dir_of(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

// statfs magic numbers (linux/magic.h) of the file systems an operator is likely to meet; the
// network ones are those on which SQLite's locks do not hold (the store refuses them).
struct FsType {
  unsigned long magic;
  const char* name;
  bool network;
};
constexpr FsType fs_types[] = {
    {0xEF53UL, "ext4", false},       {0x58465342UL, "xfs", false},     {0x9123683EUL, "btrfs", false},
    {0x01021994UL, "tmpfs", false},  {0x794C7630UL, "overlayfs", false}, {0x2FC12FC1UL, "zfs", false},
    {0xF2F52010UL, "f2fs", false},   {0x6969UL, "nfs", true},            {0x517BUL, "smb", true},
    {0xFF534D42UL, "cifs", true},    {0xFE534D42UL, "smb2", true},       {0x65735546UL, "fuse", false},
    {0x4D44UL, "vfat", false},       {0x5346544EUL, "ntfs", false},      {0x01021997UL, "9p", false},
};

}  // namespace

std::string sqlite_migration_sql(const std::string& table) {
  detail::check_sqlite_table(table, "table");
  const auto scripts = detail::record_schema_scripts(table);
  std::string out = fmt::format(
      "-- idem SqliteStore schema version {} for table {}: what SqliteStore::migrate() runs on a new file.\n"
      "-- Apply with: sqlite3 FILE < this.sql (stores then need no auto_migrate).\n"
      "PRAGMA journal_mode=WAL;\nBEGIN IMMEDIATE;\n"
      "CREATE TABLE IF NOT EXISTS idem_schema (table_name TEXT PRIMARY KEY, kind TEXT NOT NULL, version INTEGER NOT "
      "NULL, installed_at INTEGER NOT NULL);\n",
      SqliteStore::schema_version, detail::sqlite_quote(table));
  for (const auto& s : scripts) out += s + ";\n";
  out += fmt::format("INSERT INTO idem_schema (table_name, kind, version, installed_at) VALUES ('{}', 'records', {}, "
                     "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER));\nCOMMIT;\n",
                     table, SqliteStore::schema_version);
  return out;
}

struct SqliteAdmin::Impl {
  std::string path, table, qt;
  millis busy{5000};
  sqlite3* db = nullptr;

  explicit Impl(const SqliteOptions& o) : path(o.path), table(o.table), qt(detail::sqlite_quote(o.table)), busy(o.busy_timeout) {
    detail::check_sqlite_table(table, "table");
    if (path.empty()) throw invalid_options_error("idem: no SQLite file given (sqlite:///path/to/file.db)");
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0)
      throw store_error(fmt::format("idem: sqlite {}: no such file; check the path (the tool never creates a store's "
                                    "file: a SqliteStore does, or `idem migrate --apply`)",
                                    path),
                        "SQLITE_CANTOPEN", false);
    const int rc = sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX, nullptr);
    if (rc != SQLITE_OK) fail(rc, "open");
    sqlite3_extended_result_codes(db, 1);
    sqlite3_busy_timeout(db, static_cast<int>(std::min<std::int64_t>(busy.count(), INT_MAX)));
    // Touches the header: a file that is not a database fails here, not half-way through a command.
    exec("SELECT count(*) FROM sqlite_master", "open");
  }
  ~Impl() {
    if (db) sqlite3_close_v2(db);
  }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  // The store's classification (db.cpp): the same types, codes and retry advice as its own calls.
  [[noreturn]] void fail(int rc, std::string_view what) const { detail::raise_sqlite(db, rc, what, path, busy); }

  void exec(const char* sql, std::string_view what) {
    const int rc = sqlite3_exec(db, sql, nullptr, nullptr, nullptr);
    if (rc != SQLITE_OK) fail(rc, what);
  }

  // A statement finalized when it goes out of scope.
  struct Stmt {
    Impl* a;
    sqlite3_stmt* s = nullptr;
    std::string_view what;
    Stmt(Impl* admin, const std::string& sql, std::string_view w) : a(admin), what(w) {
      const int rc = sqlite3_prepare_v2(a->db, sql.c_str(), static_cast<int>(sql.size()), &s, nullptr);
      if (rc != SQLITE_OK) {
        // The one error an operator meets first: a file no store has used with this table.
        if ((rc & 0xff) == SQLITE_ERROR && std::string_view(sqlite3_errmsg(a->db)).find("no such table") != std::string_view::npos)
          throw store_error(fmt::format("idem: sqlite {}: no idem table {} ({}): check --table, or let a store create "
                                        "it (auto_migrate) or run `idem migrate --apply`",
                                        a->path, a->table, sqlite3_errmsg(a->db)),
                            "SCHEMA", false);
        a->fail(rc, w);
      }
    }
    ~Stmt() { sqlite3_finalize(s); }
    Stmt(const Stmt&) = delete;
    Stmt& operator=(const Stmt&) = delete;
    Stmt& bind(int i, std::int64_t v) {
      sqlite3_bind_int64(s, i, v);
      return *this;
    }
    Stmt& blob(int i, std::string_view v) {
      sqlite3_bind_blob64(s, i, v.empty() ? "" : v.data(), v.size(), SQLITE_TRANSIENT);
      return *this;
    }
    Stmt& text(int i, std::string_view v) {
      sqlite3_bind_text64(s, i, v.data(), v.size(), SQLITE_TRANSIENT, SQLITE_UTF8);
      return *this;
    }
    bool step() {
      const int rc = sqlite3_step(s);
      if (rc == SQLITE_ROW) return true;
      if (rc == SQLITE_DONE) return false;
      a->fail(rc, what);
    }
    std::int64_t i64(int c) const { return sqlite3_column_int64(s, c); }
    bool null(int c) const { return sqlite3_column_type(s, c) == SQLITE_NULL; }
    std::string str(int c) const {
      const void* p = sqlite3_column_blob(s, c);
      const int n = sqlite3_column_bytes(s, c);
      return p && n > 0 ? std::string(static_cast<const char*>(p), static_cast<std::size_t>(n)) : std::string();
    }
  };

  // The columns of an AdminRecord; ?1 is now. The row's size is the sum of its values' (plus the
  // eight integers): SQLite keeps no per-row size short of the dbstat table.
  [[nodiscard]] std::string select() const {
    return "SELECT key, state, fence, owner, lease_until, retry_at, attempts, permanent, fingerprint, length(result), "
           "error, expires_at, length(key) + length(owner) + length(fingerprint) + length(result) + length(error) + 64 "
           "FROM " + qt;
  }

  AdminRecord row(const Stmt& s, std::int64_t now) const {
    AdminRecord a;
    a.key = s.str(0);
    const auto st = s.i64(1);
    if (st < 1 || st > 3)
      throw corrupt_record_error(fmt::format("idem: record '{}' in {} has state {}; delete the row", a.key, path, st));
    a.record.state = static_cast<State>(st);
    a.record.holder.fence = static_cast<std::uint64_t>(s.i64(2));
    a.record.owner = s.str(3);
    a.record.lease_until_ms = s.i64(4);
    a.record.retry_at_ms = s.i64(5);
    a.record.attempts = static_cast<std::uint32_t>(std::clamp<std::int64_t>(s.i64(6), 0, UINT32_MAX));
    a.record.permanent = s.i64(7) != 0;
    a.record.fingerprint = s.str(8);
    a.record.result.assign(static_cast<std::size_t>(s.i64(9)), '\0');  // its size is what an operator needs
    a.record.error = s.str(10);
    a.now_ms = now;
    a.expires_in_ms = s.i64(11) - now;
    a.bytes = static_cast<std::size_t>(s.i64(12));
    return a;
  }

  // f() inside BEGIN IMMEDIATE: the write lock first, so the rows read are the rows written.
  template <class F>
  auto write(std::string_view what, F&& f) {
    const int rc = sqlite3_exec(db, "BEGIN IMMEDIATE", nullptr, nullptr, nullptr);
    if (rc != SQLITE_OK) fail(rc, fmt::format("{} (BEGIN IMMEDIATE)", what));
    try {
      auto r = f();
      const int c = sqlite3_exec(db, "COMMIT", nullptr, nullptr, nullptr);
      if (c != SQLITE_OK) fail(c, fmt::format("{} (COMMIT)", what));
      return r;
    } catch (...) {
      if (sqlite3_get_autocommit(db) == 0) sqlite3_exec(db, "ROLLBACK", nullptr, nullptr, nullptr);
      throw;
    }
  }

  std::int64_t scalar(const std::string& sql, std::string_view what) {
    Stmt s(this, sql, what);
    return s.step() ? s.i64(0) : 0;
  }

  std::string pragma_text(const char* sql) {
    Stmt s(this, sql, sql);
    return s.step() ? s.str(0) : std::string();
  }

  int installed_version() {
    if (scalar("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'idem_schema'", "schema version") == 0)
      return 0;
    Stmt v(this, "SELECT version, kind FROM idem_schema WHERE table_name = ?1", "schema version");
    v.text(1, table);
    if (!v.step()) return 0;
    if (v.str(1) != "records")
      throw store_error(fmt::format("idem: table '{}' in {} is idem's {} table, not a records table: check --table",
                                    table, path, v.str(1)),
                        "SCHEMA", false);
    return static_cast<int>(v.i64(0));
  }
};

SqliteAdmin::SqliteAdmin(SqliteOptions options) : impl_(std::make_unique<Impl>(options)) {}
SqliteAdmin::~SqliteAdmin() = default;

std::string SqliteAdmin::where() const { return fmt::format("{} (table {})", impl_->path, impl_->table); }

int SqliteAdmin::schema_version() { return impl_->installed_version(); }

std::optional<AdminRecord> SqliteAdmin::inspect(std::string_view key) {
  const std::int64_t now = wall_ms();
  Impl::Stmt s(impl_.get(), impl_->select() + " WHERE key = ?1 AND expires_at > ?2", "inspect");
  s.blob(1, key).bind(2, now);
  if (!s.step()) return std::nullopt;
  return impl_->row(s, now);
}

std::size_t SqliteAdmin::list(const ListFilter& filter, const std::function<bool(const AdminRecord&)>& each) {
  std::size_t passed = 0;
  std::vector<State> passes;
  if (filter.state)
    passes.push_back(*filter.state);
  else
    passes = {State::in_progress, State::failed, State::completed};  // stuck keys first
  const auto page = static_cast<std::int64_t>(filter.page ? filter.page : 1000);
  for (State st : passes) {
    if (filter.older_than && st == State::completed) continue;
    std::string cond = " AND state = " + std::to_string(static_cast<int>(st));
    if (filter.older_than)
      cond += fmt::format(" AND ?2 - {} >= {}", st == State::in_progress ? "lease_until" : "retry_at",
                          filter.older_than->count());
    // Keyset pagination on the primary key: each page is an index range from the last key, and no
    // read transaction stays open between pages (a WAL checkpoint is never held back by a listing).
    std::string last;
    bool first = true;
    for (;;) {
      const std::int64_t now = wall_ms();
      Impl::Stmt s(impl_.get(),
                   impl_->select() + " WHERE expires_at > ?2" + cond + (first ? "" : " AND key > ?3") +
                       " ORDER BY key LIMIT ?1",
                   "list");
      s.bind(1, page).bind(2, now);
      if (!first) s.blob(3, last);
      std::int64_t n = 0;
      while (s.step()) {
        const AdminRecord a = impl_->row(s, now);
        ++n;
        ++passed;
        last = a.key;
        if (!each(a) || (filter.limit && passed >= filter.limit)) return passed;
      }
      if (n < page) break;
      first = false;
    }
  }
  return passed;
}

ReleaseResult SqliteAdmin::release(std::string_view key, std::uint64_t fence, bool force) {
  return impl_->write("release", [&] {
    const std::int64_t now = wall_ms();
    ReleaseResult out;
    Impl::Stmt cur(impl_.get(), "SELECT state, fence, lease_until FROM " + impl_->qt + " WHERE key = ?1 AND expires_at > ?2",
                   "release");
    cur.blob(1, key).bind(2, now);
    if (!cur.step()) return out;  // not_found
    const auto st = cur.i64(0);
    if (st < 1 || st > 3)
      throw corrupt_record_error(fmt::format("idem: record in {} has state {}; delete the row", impl_->path, st));
    out.state = static_cast<State>(st);
    out.fence = static_cast<std::uint64_t>(cur.i64(1));
    const bool lapsed = cur.i64(2) <= now;
    if (out.fence != fence)
      out.status = ReleaseStatus::fence_mismatch;
    else if (out.state == State::completed)
      out.status = ReleaseStatus::completed;
    else if (out.state == State::in_progress && !lapsed && !force)
      out.status = ReleaseStatus::live;
    else
      out.status = ReleaseStatus::released;
    if (out.status != ReleaseStatus::released) return out;
    // Token 0 is no holder's (tokens are never 0): the old holder's complete, fail and extend
    // answer lease_lost from now on; fence + 1 goes to the next delivery's claim.
    Impl::Stmt u(impl_.get(),
                 "UPDATE " + impl_->qt +
                     " SET state = 3, permanent = 0, retry_at = ?2, lease_until = 0, token = 0, owner = x'', error = ?3 "
                     "WHERE key = ?1 AND fence = ?4",
                 "release");
    const std::string why = fmt::format("released by idem release (fence {})", fence);
    u.blob(1, key).bind(2, now).blob(3, why).bind(4, static_cast<std::int64_t>(fence));
    u.step();
    return out;
  });
}

std::size_t SqliteAdmin::purge(std::size_t batch, const std::function<void(std::size_t, std::size_t)>& progress) {
  if (batch == 0) batch = 1000;
  const auto expired = static_cast<std::size_t>(
      impl_->scalar(fmt::format("SELECT count(*) FROM {} WHERE expires_at <= {}", impl_->qt, wall_ms()), "purge"));
  // The store's own statement (purge_expired): the expiry index gives the batch; the write lock is
  // free for claims between batches.
  const std::string del = "DELETE FROM " + impl_->qt + " WHERE rowid IN (SELECT rowid FROM " + impl_->qt +
                          " WHERE expires_at <= ?1 LIMIT ?2)";
  std::size_t total = 0;
  for (;;) {
    const auto n = impl_->write("purge", [&] {
      Impl::Stmt d(impl_.get(), del, "purge");
      d.bind(1, wall_ms()).bind(2, static_cast<std::int64_t>(batch));
      d.step();
      return static_cast<std::size_t>(sqlite3_changes64(impl_->db));
    });
    total += n;
    if (progress) progress(total, expired);
    if (n < batch) break;
  }
  return total;
}

AdminStats SqliteAdmin::stats() {
  AdminStats s;
  const std::int64_t now = wall_ms();
  {
    Impl::Stmt q(impl_.get(),
                 "SELECT state, count(*), sum(length(key) + length(owner) + length(fingerprint) + length(result) + "
                 "length(error) + 64), sum(state = 1 AND lease_until <= ?1), max(CASE WHEN state = 1 THEN ?1 - "
                 "lease_until END) FROM " + impl_->qt + " WHERE expires_at > ?1 GROUP BY state",
                 "stats");
    q.bind(1, now);
    while (q.step()) {
      const auto st = q.i64(0);
      const auto n = static_cast<std::uint64_t>(q.i64(1));
      if (st >= 1 && st <= 3) s.by_state[static_cast<std::size_t>(st)] = n;
      s.records += n;
      s.bytes += static_cast<std::uint64_t>(q.i64(2));
      s.lapsed += static_cast<std::uint64_t>(q.i64(3));
      if (st == 1 && !q.null(4)) s.most_overdue_ms = q.i64(4);
    }
  }
  s.expired_rows = static_cast<std::uint64_t>(
      impl_->scalar(fmt::format("SELECT count(*) FROM {} WHERE expires_at <= {}", impl_->qt, now), "stats"));
  return s;
}

std::vector<Finding> SqliteAdmin::doctor() {
  std::vector<Finding> out;
  auto add = [&](Severity s, std::string check, std::string message, std::string fix = {}) {
    out.push_back({s, std::move(check), std::move(message), std::move(fix)});
  };
  const std::string& path = impl_->path;
  add(Severity::ok, "sqlite", fmt::format("SQLite {} (library linked into this tool)", sqlite3_libversion()));

  // The file system of the directory: the -wal and -shm files live beside the database.
  struct statfs fs {};
  if (statfs(dir_of(path).c_str(), &fs) != 0) {
    add(Severity::warning, "file system", fmt::format("statfs({}) failed: could not tell the file system", dir_of(path)));
  } else {
    const auto magic = static_cast<unsigned long>(fs.f_type);
    const FsType* t = nullptr;
    for (const auto& f : fs_types)
      if (f.magic == magic) t = &f;
    const std::string name = t ? t->name : fmt::format("type 0x{:x}", magic);
    if (t && t->network)
      add(Severity::error, "file system",
          fmt::format("{} is on {}: SQLite's locks do not hold on a network file system, two processes could both "
                      "take the write lock and a key could run twice (SqliteStore refuses it)",
                      dir_of(path), name),
          "move the file to a local disk, or use RedisStore / PostgresStore for several hosts");
    else if (t && magic == 0x01021994UL)
      add(Severity::warning, "file system",
          fmt::format("{} is on tmpfs: the records vanish at a reboot, and every key can run again", dir_of(path)),
          "keep the file on a disk that survives a reboot");
    else
      add(Severity::ok, "file system", fmt::format("{} is on {} (local)", dir_of(path), name));
  }

  const std::string mode = impl_->pragma_text("PRAGMA journal_mode");
  if (mode == "wal")
    add(Severity::ok, "journal_mode", "wal (persistent in the file)");
  else
    add(Severity::error, "journal_mode",
        fmt::format("'{}', not wal: stores set WAL when they open the file, so another program switched it back or "
                    "no store has opened it yet; without WAL readers block the writer and stores refuse the file",
                    mode),
        fmt::format("sqlite3 {} 'PRAGMA journal_mode=WAL' (with no other program holding the file)", path));

  // synchronous and busy_timeout live on each connection, not in the file: what matters is what
  // the stores' options set; this connection shows the library's default for those that set none.
  const auto sync = impl_->scalar("PRAGMA synchronous", "PRAGMA synchronous");
  static constexpr const char* sync_names[] = {"off", "normal", "full", "extra"};
  const std::string sync_name = sync >= 0 && sync <= 3 ? sync_names[sync] : std::to_string(sync);
  add(sync >= 2 ? Severity::ok : Severity::warning, "synchronous",
      fmt::format("a per-connection setting, not kept in the file: SqliteStore sets SqliteOptions::synchronous "
                  "(default full; normal can lose the last commits at a power cut); connections that set none (a "
                  "sqlite3 shell, other programs) get this SQLite's default, {}",
                  sync_name),
      sync >= 2 ? "" : "keep SqliteOptions::synchronous = full for completions that survive a power cut");
  add(Severity::info, "busy_timeout",
      fmt::format("a per-connection setting: stores wait SqliteOptions::busy_timeout (default 5 s) for the write lock, "
                  "then answer a retryable timeout_error; this tool waits {} ms",
                  impl_->busy.count()));

  if (::access(path.c_str(), W_OK) != 0 || ::access(dir_of(path).c_str(), W_OK | X_OK) != 0)
    add(Severity::error, "writable",
        fmt::format("{} or its directory is not writable by this user: stores refuse it (SQLITE_READONLY)", path),
        "make the file, its -wal and -shm files and the directory writable by the stores' user");
  else
    add(Severity::ok, "writable", "the file and its directory are writable by this user");

  // Sizes: pages in use and free, and the WAL beside the file (a reader that never ends holds its
  // checkpoint back, and the WAL grows).
  const auto page_size = impl_->scalar("PRAGMA page_size", "PRAGMA page_size");
  const auto pages = impl_->scalar("PRAGMA page_count", "PRAGMA page_count");
  const auto free_pages = impl_->scalar("PRAGMA freelist_count", "PRAGMA freelist_count");
  struct stat wal {};
  const std::int64_t wal_bytes = ::stat((path + "-wal").c_str(), &wal) == 0 ? static_cast<std::int64_t>(wal.st_size) : 0;
  const std::int64_t bytes = page_size * pages;
  const std::string sizes = fmt::format("file {} KiB ({} of {} pages free), WAL {} KiB", bytes / 1024, free_pages,
                                        pages, wal_bytes / 1024);
  if (wal_bytes > (std::int64_t{256} << 20))
    add(Severity::warning, "file size", sizes + ": the WAL is large, a long-running reader holds checkpoints back",
        fmt::format("end long read transactions; sqlite3 {} 'PRAGMA wal_checkpoint(TRUNCATE)'", path));
  else if (bytes > (std::int64_t{64} << 20) && free_pages * 2 > pages)
    add(Severity::warning, "file size", sizes + ": over half the pages are free (purged rows)",
        fmt::format("sqlite3 {} VACUUM (it holds the write lock for its whole run: at a quiet time)", path));
  else
    add(Severity::ok, "file size", sizes);

  const bool has_table =
      impl_->scalar(fmt::format("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = '{}'", impl_->table),
                    "schema") > 0;
  const int have = impl_->installed_version();
  if (!has_table || have == 0) {
    add(Severity::error, "schema",
        has_table ? fmt::format("a table {} that idem did not create (no row in idem_schema)", impl_->table)
                  : fmt::format("no table {}: no store has run on this file with this table", impl_->table),
        has_table ? "give the stores another table name (--table)"
                  : "check --table, or start a store once (auto_migrate) or run `idem migrate --apply`");
    return out;
  }
  if (have == SqliteStore::schema_version)
    add(Severity::ok, "schema", fmt::format("schema version {}", have));
  else if (have > SqliteStore::schema_version)
    add(Severity::error, "schema",
        fmt::format("schema version {} is newer than this idem's {}: stores of this version refuse it", have,
                    SqliteStore::schema_version),
        "upgrade idem");
  else
    add(Severity::error, "schema",
        fmt::format("schema version {}, this idem expects {}", have, SqliteStore::schema_version),
        "idem migrate --apply (or start a store with auto_migrate)");

  const auto expired = impl_->scalar(
      fmt::format("SELECT count(*) FROM {} WHERE expires_at <= {}", impl_->qt, wall_ms()), "expired rows");
  if (expired > 100000)
    add(Severity::warning, "purge", fmt::format("{} expired rows wait for purge", expired),
        "run `idem purge` from cron, or SqliteStore::purge_expired() on a timer");
  else if (expired > 0)
    add(Severity::info, "purge", fmt::format("{} expired rows wait for purge", expired), "idem purge");
  return out;
}

}  // namespace idem
