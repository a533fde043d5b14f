// SqliteSequenceStore: the last applied sequence per entity, in the SqliteStore's file. A compare-
// and-set is a read and a write in one BEGIN IMMEDIATE transaction (or in the guard's open
// transaction): the file's single write lock makes it atomic across threads and processes.

#include <mutex>
#include <utility>

#include <fmt/format.h>

#include "db.hpp"
#include "idem/sqlite/sequence_store.hpp"
#include "store_impl.hpp"

namespace idem {

namespace {

constexpr const char* kind_sequences = "sequences";
constexpr std::uint64_t top_bit = std::uint64_t{1} << 63;

// SQLite integers are signed: flipping the top bit maps 0..2^64-1 onto INT64_MIN..INT64_MAX in order.
std::int64_t stored(std::uint64_t seq) { return static_cast<std::int64_t>(seq ^ top_bit); }
std::uint64_t loaded(std::int64_t v) { return static_cast<std::uint64_t>(v) ^ top_bit; }

}  // namespace

struct SqliteSequenceStore::Impl {
  SqliteSequenceStoreOptions opt;
  std::shared_ptr<detail::SqliteDb> db;
  std::string select_sql, upsert_sql, erase_sql;
  std::vector<std::string> scripts;
  bool ready = false;
  std::mutex ready_mu;

  void ensure_ready() {
    std::lock_guard lk(ready_mu);
    if (ready) return;
    if (opt.auto_migrate) {
      db->ensure_schema(opt.table, kind_sequences, 1, scripts);
    } else {
      auto c = db->checkout();
      if (db->installed_version(*c, opt.table, kind_sequences) != 1)
        throw store_error(fmt::format("idem: sequence table '{}' in {} is missing: run SqliteSequenceStore::migrate() "
                                      "(or set auto_migrate)",
                                      opt.table, db->path()),
                          "SCHEMA", false);
    }
    ready = true;
  }

  std::optional<std::uint64_t> read(detail::SqliteConn& c, std::string_view entity) const {
    detail::Stmt s(*db, c, select_sql, "last_applied");
    s.bind_blob(1, entity);
    if (!s.step()) return std::nullopt;
    if (!s.col_is_int(0))
      throw corrupt_record_error(fmt::format("idem: the sequence of an entity in table '{}' of {} is not an integer; "
                                             "inspect it with sqlite3",
                                             opt.table, db->path()));
    return loaded(s.col_int(0));
  }

  AdvanceResult advance_on(detail::SqliteConn& c, std::string_view entity, std::uint64_t seq) const {
    AdvanceResult r;
    r.previous = read(c, entity);
    if (r.previous && *r.previous >= seq) return r;
    detail::Stmt s(*db, c, upsert_sql, "advance");
    s.bind_blob(1, entity).bind(2, stored(seq));
    s.run();
    r.advanced = true;
    return r;
  }
};

SqliteSequenceStore::SqliteSequenceStore(SqliteStore& store, SqliteSequenceStoreOptions options)
    : impl_(std::make_unique<Impl>()) {
  detail::check_sqlite_table(options.table, "SqliteSequenceStoreOptions::table");
  if (options.table == store.options().table)
    throw invalid_options_error(fmt::format("idem: SqliteSequenceStoreOptions::table '{}' is the records' table; give "
                                            "the sequences a table of their own",
                                            options.table));
  impl_->opt = std::move(options);
  impl_->db = store.impl_->db;
  const std::string t = detail::sqlite_quote(impl_->opt.table);
  impl_->scripts = {"CREATE TABLE " + t + " (entity BLOB NOT NULL PRIMARY KEY, last_seq INTEGER NOT NULL)"};
  impl_->select_sql = "SELECT last_seq FROM " + t + " WHERE entity = ?1";
  impl_->upsert_sql = "INSERT OR REPLACE INTO " + t + " (entity, last_seq) VALUES (?1, ?2)";
  impl_->erase_sql = "DELETE FROM " + t + " WHERE entity = ?1";
  // Now, not on first use: advance(tx, ...) runs under the write lock its transaction holds, where
  // creating the table would wait for that same lock.
  if (impl_->opt.auto_migrate) impl_->ensure_ready();
}

SqliteSequenceStore::~SqliteSequenceStore() = default;
SqliteSequenceStore::SqliteSequenceStore(SqliteSequenceStore&&) noexcept = default;
SqliteSequenceStore& SqliteSequenceStore::operator=(SqliteSequenceStore&&) noexcept = default;

std::optional<std::uint64_t> SqliteSequenceStore::last_applied(std::string_view entity) {
  detail::check_entity(entity, static_cast<std::size_t>(-1));
  impl_->ensure_ready();
  auto c = impl_->db->checkout();
  return impl_->read(*c, entity);
}

AdvanceResult SqliteSequenceStore::advance(std::string_view entity, std::uint64_t seq) {
  detail::check_entity(entity, static_cast<std::size_t>(-1));
  impl_->ensure_ready();
  return impl_->db->write("advance", detail::CommitKind::plain,
                          [&](detail::SqliteConn& c) { return impl_->advance_on(c, entity, seq); });
}

AdvanceResult SqliteSequenceStore::advance(SqliteStore::Transaction& tx, std::string_view entity, std::uint64_t seq) {
  detail::check_entity(entity, static_cast<std::size_t>(-1));
  if (!tx.is_open()) throw usage_error("idem: SqliteSequenceStore::advance(tx, ...) needs an open transaction");
  if (tx.state_->db != impl_->db)
    throw usage_error("idem: SqliteSequenceStore::advance(tx, ...): the transaction belongs to another SqliteStore's "
                      "file; build the sequence store on the guard's store");
  impl_->ensure_ready();
  return impl_->advance_on(*tx.state_->conn, entity, seq);
}

bool SqliteSequenceStore::erase(std::string_view entity) {
  detail::check_entity(entity, static_cast<std::size_t>(-1));
  impl_->ensure_ready();
  return impl_->db->write("erase", detail::CommitKind::plain, [&](detail::SqliteConn& c) {
    detail::Stmt s(*impl_->db, c, impl_->erase_sql, "erase");
    s.bind_blob(1, entity);
    return s.run() == 1;
  });
}

void SqliteSequenceStore::migrate() {
  std::lock_guard lk(impl_->ready_mu);
  impl_->db->ensure_schema(impl_->opt.table, kind_sequences, 1, impl_->scripts);
  impl_->ready = true;
}

const SqliteSequenceStoreOptions& SqliteSequenceStore::options() const noexcept { return impl_->opt; }

}  // namespace idem
