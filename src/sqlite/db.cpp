// The shared file of the SQLite backend (db.hpp): connections opened in WAL mode, SQLite's codes
// mapped to idem's errors (each saying what to fix), and the versioned schema.

#include "db.hpp"

#include <sys/statfs.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <utility>

#include <fmt/format.h>

namespace idem::detail {

namespace {

// SQLite's locks live in the local kernel: on these file systems two hosts (or even two processes)
// can both believe they hold the write lock, and a store would decide twice.
bool network_file_system(const std::string& path) {
  const auto slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  struct statfs st {};
  if (statfs(dir.c_str(), &st) != 0) return false;  // a missing directory fails at open, with its own message
  const auto magic = static_cast<unsigned long>(st.f_type);
  return magic == 0x6969UL /* NFS */ || magic == 0x517BUL /* SMB */ || magic == 0xFF534D42UL /* CIFS */ ||
         magic == 0xFE534D42UL /* SMB2 */;
}

int commit_hook(void* p) { return static_cast<SqliteConn*>(p)->in_handler ? 1 : 0; }

}  // namespace

std::string_view sqlite_code_name(int rc) {
  switch (rc & 0xff) {
    case SQLITE_BUSY: return "SQLITE_BUSY";
    case SQLITE_LOCKED: return "SQLITE_LOCKED";
    case SQLITE_READONLY: return "SQLITE_READONLY";
    case SQLITE_FULL: return "SQLITE_FULL";
    case SQLITE_CORRUPT: return "SQLITE_CORRUPT";
    case SQLITE_NOTADB: return "SQLITE_NOTADB";
    case SQLITE_CANTOPEN: return "SQLITE_CANTOPEN";
    case SQLITE_IOERR: return "SQLITE_IOERR";
    case SQLITE_NOMEM: return "SQLITE_NOMEM";
    case SQLITE_PERM: return "SQLITE_PERM";
    case SQLITE_AUTH: return "SQLITE_AUTH";
    case SQLITE_SCHEMA: return "SQLITE_SCHEMA";
    case SQLITE_TOOBIG: return "SQLITE_TOOBIG";
    case SQLITE_CONSTRAINT: return "SQLITE_CONSTRAINT";
    case SQLITE_MISMATCH: return "SQLITE_MISMATCH";
    case SQLITE_PROTOCOL: return "SQLITE_PROTOCOL";
    default: return "SQLITE_ERROR";
  }
}

std::string sqlite_quote(std::string_view name) { return fmt::format("\"{}\"", name); }

void check_sqlite_table(std::string_view name, std::string_view option) {
  const bool plain = !name.empty() && name.size() <= 40 && (name[0] == '_' || (name[0] >= 'a' && name[0] <= 'z')) &&
                     std::all_of(name.begin(), name.end(), [](char c) {
                       return c == '_' || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9');
                     });
  if (!plain || name.rfind("sqlite_", 0) == 0 || name == "idem_schema")
    throw invalid_options_error(fmt::format("idem: {} '{}' is not a plain table name; use [a-z_][a-z0-9_]* (max 40, "
                                            "not sqlite_*, not idem_schema)",
                                            option, name.substr(0, 80)));
}

SqliteConn::~SqliteConn() {
  for (auto& [sql, s] : stmts) sqlite3_finalize(s);
  if (db) sqlite3_close_v2(db);
}

sqlite3_stmt* SqliteConn::prepare(const std::string& sql) {
  auto it = stmts.find(sql);
  if (it != stmts.end()) return it->second;
  sqlite3_stmt* s = nullptr;
  const int rc = sqlite3_prepare_v3(db, sql.c_str(), static_cast<int>(sql.size()), SQLITE_PREPARE_PERSISTENT, &s, nullptr);
  if (rc != SQLITE_OK) {
    sqlite3_finalize(s);
    return nullptr;
  }
  stmts.emplace(sql, s);
  return s;
}

// ---- Stmt -----------------------------------------------------------------------------------

Stmt::Stmt(const SqliteDb& db, SqliteConn& c, const std::string& sql, std::string_view what)
    : db_(&db), c_(&c), s_(c.prepare(sql)), what_(what) {
  if (!s_) db.raise(c.db, sqlite3_errcode(c.db), what);
}

Stmt::~Stmt() {
  sqlite3_reset(s_);
  sqlite3_clear_bindings(s_);
}

Stmt& Stmt::bind(int i, std::int64_t v) {
  sqlite3_bind_int64(s_, i, v);
  return *this;
}

Stmt& Stmt::bind_blob(int i, std::string_view v) {
  // A zero-length blob, not NULL, for an empty value (the columns are NOT NULL).
  sqlite3_bind_blob64(s_, i, v.empty() ? "" : v.data(), v.size(), SQLITE_STATIC);
  return *this;
}

Stmt& Stmt::bind_text(int i, std::string_view v) {
  sqlite3_bind_text64(s_, i, v.empty() ? "" : v.data(), v.size(), SQLITE_STATIC, SQLITE_UTF8);
  return *this;
}

bool Stmt::step() {
  errno = 0;
  const int rc = sqlite3_step(s_);
  if (rc == SQLITE_ROW) return true;
  if (rc == SQLITE_DONE) return false;
  db_->raise(c_->db, rc, what_, errno);
}

std::int64_t Stmt::run() {
  while (step()) {
  }
  return sqlite3_changes64(c_->db);
}

std::int64_t Stmt::col_int(int i) const { return sqlite3_column_int64(s_, i); }

bool Stmt::col_is_int(int i) const { return sqlite3_column_type(s_, i) == SQLITE_INTEGER; }

std::string Stmt::col_blob(int i) const {
  const void* p = sqlite3_column_blob(s_, i);
  const int n = sqlite3_column_bytes(s_, i);
  return p && n > 0 ? std::string(static_cast<const char*>(p), static_cast<std::size_t>(n)) : std::string();
}

// ---- SqliteDb -------------------------------------------------------------------------------

SqliteDb::SqliteDb(const SqliteOptions& o)
    : path_(o.path), sync_(o.synchronous), busy_(o.busy_timeout), max_idle_(o.max_idle_connections), clock_(o.clock) {
  if (network_file_system(path_))
    throw invalid_options_error(fmt::format("idem: SqliteOptions::path '{}' is on a network file system (NFS, SMB): "
                                            "SQLite's locks do not hold there and a key could run twice; use a "
                                            "local disk, or RedisStore / PostgresStore",
                                            path_));
  // Opened now, so a missing directory, a read-only or foreign file fails at construction.
  idle_.push_back(open());
}

SqliteDb::~SqliteDb() = default;

std::unique_ptr<SqliteConn> SqliteDb::open() {
  auto conn = std::make_unique<SqliteConn>();
  const int rc = sqlite3_open_v2(path_.c_str(), &conn->db,
                                 SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr);
  if (rc != SQLITE_OK) raise(conn->db, rc, "open");
  sqlite3_extended_result_codes(conn->db, 1);
  sqlite3_busy_timeout(conn->db, static_cast<int>(std::min<std::int64_t>(busy_.count(), INT_MAX)));
  // SQLite opens a file it may not write read-only without a word: say so now, not at the first write.
  if (sqlite3_db_readonly(conn->db, "main") == 1)
    raise(nullptr, SQLITE_READONLY, "open (the file is not writable by this process)");
  sqlite3_commit_hook(conn->db, &commit_hook, conn.get());
  {
    Stmt wal(*this, *conn, "PRAGMA journal_mode=WAL", "open (journal_mode=WAL)");
    std::string mode = wal.step() ? wal.col_blob(0) : std::string();
    if (mode != "wal")
      throw store_error(fmt::format("idem: sqlite {} stays in journal_mode '{}' instead of WAL; another program keeps "
                                    "it in another mode (or it is on a file system without shared memory): "
                                    "close it or use another file",
                                    path_, mode),
                        "SQLITE_WAL", false);
  }
  exec(*conn, sync_ == SqliteSync::full ? "PRAGMA synchronous=FULL" : "PRAGMA synchronous=NORMAL", "open (synchronous)");
  return conn;
}

void SqliteDb::Returner::operator()(SqliteConn* c) const noexcept {
  std::unique_ptr<SqliteConn> owned(c);
  if (!c || !c->db) return;
  c->in_handler = false;
  rollback_quietly(*c);
  std::lock_guard lk(db->pool_mu_);
  if (db->idle_.size() < db->max_idle_) db->idle_.push_back(std::move(owned));
}

SqliteDb::ConnPtr SqliteDb::checkout() {
  {
    std::lock_guard lk(pool_mu_);
    if (!idle_.empty()) {
      ConnPtr c(idle_.back().release(), Returner{this});
      idle_.pop_back();
      return c;
    }
  }
  return ConnPtr(open().release(), Returner{this});
}

WriterLock SqliteDb::lock_writer(std::string_view what) {
  if (writer_.load() == std::this_thread::get_id())
    throw usage_error(fmt::format("idem: sqlite {} on {}: this thread already holds the store's write transaction (a "
                                  "transactional-mode handler calling a write of its own store); write through "
                                  "ctx.tx instead, or use another file",
                                  what, path_));
  if (!write_mu_.try_lock_for(busy_))
    throw timeout_error(fmt::format("idem: sqlite {} on {}: another thread of this process held the store's write "
                                    "lock for the whole busy_timeout ({} ms); nothing was decided, retry (a long "
                                    "transactional-mode handler holds it until it returns)",
                                    what, path_, busy_.count()),
                        "SQLITE_BUSY", true);
  return WriterLock(write_mu_, writer_);
}

std::int64_t SqliteDb::now_ms() const {
  if (clock_) return clock_->now_ms();
  return std::chrono::duration_cast<millis>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void SqliteDb::raise(sqlite3* c, int rc, std::string_view what, int sys) const {
  raise_sqlite(c, rc, what, path_, busy_, sys);
}

void raise_sqlite(sqlite3* c, int rc, std::string_view what, const std::string& path, millis busy, int sys) {
  const std::string msg = c ? sqlite3_errmsg(c) : sqlite3_errstr(rc);
  // SQLite keeps the OS error of some failures only; errno right after the call has the others.
  if (c && sqlite3_system_errno(c) != 0) sys = sqlite3_system_errno(c);
  const std::string code(sqlite_code_name(rc));
  const std::string base = fmt::format("idem: sqlite {} on {} failed: {} [{}, extended code {}{}]", what, path, msg,
                                       code, rc, sys != 0 ? fmt::format(", errno {}", sys) : std::string());
  // A write the OS refused for space (ENOSPC, a quota, the file-size limit) is a full disk, however
  // SQLite reports it (SQLITE_FULL for a short write, SQLITE_IOERR_WRITE when a retry of the rest fails).
  const bool no_space = (rc & 0xff) == SQLITE_FULL ||
                        (rc == SQLITE_IOERR_WRITE && (sys == ENOSPC || sys == EFBIG || sys == EDQUOT));
  if (no_space)
    throw capacity_error(fmt::format("{}; the disk (or this process's file-size limit) is full: free space or purge "
                                     "expired records (purge_expired); nothing was decided",
                                     base),
                         code, true);
  switch (rc & 0xff) {
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
      throw timeout_error(fmt::format("{}; another connection held the file's write lock for the whole busytimeout "
                                      "({} ms): nothing was decided, retry (a long transactional-mode handler, a "
                                      "backup or a manual sqlite3 session can hold it)",
                                      base, busy.count()),
                          code, true);
    case SQLITE_READONLY:
      throw store_error(fmt::format("{}; the database is read-only for this process: make the file, the -wal and "
                                    "-shm files beside it and their directory writable by this user (a read-only "
                                    "mount cannot hold a store); nothing was decided",
                                    base),
                        code, false);
    case SQLITE_CORRUPT:
    case SQLITE_NOTADB:
      throw store_error(fmt::format("{}; the file is not an SQLite database or is damaged: restore it from a backup "
                                    "or point SqliteOptions::path at another file; nothing was decided",
                                    base),
                        code, false);
    case SQLITE_CANTOPEN:
      throw store_error(fmt::format("{}; check that the directory exists and this user may create files in it", base),
                        code, false);
    case SQLITE_PERM:
    case SQLITE_AUTH:
      throw store_error(fmt::format("{}; access was refused: check the file's permissions", base), code, false);
    case SQLITE_IOERR:
      throw store_error(fmt::format("{}; an I/O error: check the disk; nothing was decided", base), code, true);
    case SQLITE_NOMEM:
    case SQLITE_SCHEMA:
    case SQLITE_PROTOCOL:
      throw store_error(base, code, true);
    default: throw store_error(base, code, false);
  }
}

void SqliteDb::exec(SqliteConn& c, const char* sql, std::string_view what) const {
  errno = 0;
  const int rc = sqlite3_exec(c.db, sql, nullptr, nullptr, nullptr);
  if (rc != SQLITE_OK) raise(c.db, rc, what, errno);
}

void SqliteDb::begin_immediate(SqliteConn& c, std::string_view what) const {
  const int rc = sqlite3_exec(c.db, "BEGIN IMMEDIATE", nullptr, nullptr, nullptr);
  if (rc != SQLITE_OK) raise(c.db, rc, fmt::format("{} (BEGIN IMMEDIATE)", what));
}

void SqliteDb::commit(SqliteConn& c, CommitKind kind, std::string_view what) const {
  c.in_handler = false;
  errno = 0;
  const int rc = sqlite3_exec(c.db, "COMMIT", nullptr, nullptr, nullptr);
  if (rc == SQLITE_OK) return;
  const int sys = sqlite3_system_errno(c.db) != 0 ? sqlite3_system_errno(c.db) : errno;
  const std::string msg = sqlite3_errmsg(c.db);
  rollback_quietly(c);
  // A failed write of the WAL frames cuts the commit frame short (its checksum fails at recovery),
  // and a failed read comes before any: uncommitted. Any other I/O error (a sync, a lock, the
  // shared memory) may strike after the commit frame reached the file, which the next recovery
  // would replay: in doubt.
  const bool in_doubt = (rc & 0xff) == SQLITE_IOERR && rc != SQLITE_IOERR_WRITE && rc != SQLITE_IOERR_READ &&
                        rc != SQLITE_IOERR_SHORT_READ && rc != SQLITE_IOERR_NOMEM;
  if (in_doubt && kind != CommitKind::plain)
    throw outcome_unknown_error(
        fmt::format("idem: sqlite {} on {}: COMMIT failed with an I/O error ({} [{}]): it may or may not be on disk; "
                    "{}",
                    what, path_, msg, rc,
                    kind == CommitKind::decision ? "no handler ran, the key frees itself after the lease"
                                                 : "inspect the key before acting on it again"),
        std::string(sqlite_code_name(rc)), kind == CommitKind::decision);
  // The message was read before ROLLBACK replaced it on the connection.
  raise(nullptr, rc, fmt::format("{} (COMMIT: {})", what, msg), sys);
}

void SqliteDb::rollback_quietly(SqliteConn& c) noexcept {
  c.in_handler = false;
  if (c.db && sqlite3_get_autocommit(c.db) == 0) sqlite3_exec(c.db, "ROLLBACK", nullptr, nullptr, nullptr);
}

int SqliteDb::installed_version(SqliteConn& c, const std::string& table, std::string_view kind) {
  {
    Stmt has(*this, c, "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'idem_schema'", "schema version");
    if (!has.step()) return 0;
  }
  try {
    Stmt v(*this, c, "SELECT kind, version FROM idem_schema WHERE table_name = ?", "schema version");
    v.bind_text(1, table);
    if (!v.step()) return 0;
    const std::string have_kind = v.col_blob(0);
    if (have_kind != kind)
      throw store_error(fmt::format("idem: table '{}' in {} is idem's {} table, not a {} table: give this store "
                                    "another table name",
                                    table, path_, have_kind, kind),
                        "SCHEMA", false);
    return static_cast<int>(v.col_int(1));
  } catch (const store_error& e) {
    if (e.code() != "SQLITE_ERROR") throw;
    throw store_error(fmt::format("idem: {} has a table idem_schema that idem did not create ({}): point "
                                  "SqliteOptions::path at another file",
                                  path_, e.what()),
                      "SCHEMA", false);
  }
}

void SqliteDb::ensure_schema(const std::string& table, std::string_view kind, int version,
                             const std::vector<std::string>& scripts) {
  {
    // Every process starts here: a current schema is read without taking the write lock.
    ConnPtr c = checkout();
    const int have = installed_version(*c, table, kind);
    if (have == version) return;
  }
  write("migrate", CommitKind::plain, [&](SqliteConn& c) {
    exec(c,
         "CREATE TABLE IF NOT EXISTS idem_schema (table_name TEXT PRIMARY KEY, kind TEXT NOT NULL, "
         "version INTEGER NOT NULL, installed_at INTEGER NOT NULL)",
         "migrate (idem_schema)");
    const int have = installed_version(c, table, kind);
    if (have > version)
      throw store_error(fmt::format("idem: table '{}' in {} has schema version {}, newer than this library's {}; "
                                    "upgrade idem (a newer process migrated it)",
                                    table, path_, have, version),
                        "SCHEMA", false);
    if (have == 0) {
      Stmt taken(*this, c, "SELECT type FROM sqlite_master WHERE name = ?", "migrate (name check)");
      taken.bind_text(1, table);
      if (taken.step())
        throw store_error(fmt::format("idem: {} already has a {} named '{}' that idem did not create (no row in "
                                      "idem_schema); idem never alters what it does not own: choose another table "
                                      "name or another file",
                                      path_, taken.col_blob(0), table),
                          "SCHEMA", false);
    }
    for (int v = have + 1; v <= version; ++v)
      exec(c, scripts[static_cast<std::size_t>(v - 1)].c_str(), fmt::format("migrate ({} v{})", table, v));
    if (have < version) {
      Stmt row(*this, c, "INSERT OR REPLACE INTO idem_schema (table_name, kind, version, installed_at) VALUES (?, ?, ?, ?)",
               "migrate (version row)");
      row.bind_text(1, table).bind_text(2, kind).bind(3, version).bind(4, now_ms());
      row.run();
    }
  });
}

}  // namespace idem::detail
