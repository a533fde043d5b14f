#pragma once
// Test support for SqliteStore: a temporary directory per test process, database files in it,
// and a raw sqlite3 connection for poking at the file behind the store's back.

#include <sqlite3.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>

#include "idem/sqlite.hpp"

namespace sqlitetest {

// One directory per test process, removed at exit.
inline const std::filesystem::path& dir() {
  struct Dir {
    std::filesystem::path p;
    Dir() {
      std::string t = (std::filesystem::temp_directory_path() / "idem-sqlite-XXXXXX").string();
      if (!mkdtemp(t.data())) throw std::runtime_error("mkdtemp failed");
      p = t;
    }
    ~Dir() {
      std::error_code ec;
      std::filesystem::remove_all(p, ec);
    }
  };
  static Dir d;
  return d.p;
}

inline std::string random_hex(int n = 12) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  static constexpr char digits[] = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < n; ++i) s += digits[rng() % 16];
  return s;
}

// A fresh database path (the file does not exist yet).
inline std::string fresh_path(std::string_view name = "db") {
  return (dir() / (std::string(name) + "-" + random_hex() + ".sqlite")).string();
}

inline idem::AcquireParams ap(std::uint64_t token, idem::millis lease = std::chrono::seconds(30)) {
  idem::AcquireParams p;
  p.lease = lease;
  p.retention = std::max<idem::millis>(lease * 4, std::chrono::seconds(60));
  p.token = token;
  p.owner = "sqlite-test";
  return p;
}

// A plain sqlite3 connection of the test's own.
class Raw {
public:
  explicit Raw(const std::string& path, int flags = SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE) {
    if (sqlite3_open_v2(path.c_str(), &db_, flags, nullptr) != SQLITE_OK) {
      std::string m = sqlite3_errmsg(db_);
      sqlite3_close(db_);
      throw std::runtime_error("raw open failed: " + m);
    }
  }
  Raw(const Raw&) = delete;
  Raw& operator=(const Raw&) = delete;
  ~Raw() { sqlite3_close_v2(db_); }
  void exec(const std::string& sql) {
    char* err = nullptr;
    if (sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &err) != SQLITE_OK) {
      std::string m = err ? err : "?";
      sqlite3_free(err);
      throw std::runtime_error("raw sql failed: " + sql + ": " + m);
    }
  }
  // The first column of the first row, as text ("" when there is none).
  std::string scalar(const std::string& sql) {
    sqlite3_stmt* s = nullptr;
    if (sqlite3_prepare_v2(db_, sql.c_str(), -1, &s, nullptr) != SQLITE_OK)
      throw std::runtime_error("raw prepare failed: " + sql + ": " + sqlite3_errmsg(db_));
    std::string out;
    const int rc = sqlite3_step(s);
    if (rc == SQLITE_ROW && sqlite3_column_text(s, 0))
      out = reinterpret_cast<const char*>(sqlite3_column_text(s, 0));
    sqlite3_finalize(s);
    if (rc != SQLITE_ROW && rc != SQLITE_DONE) throw std::runtime_error("raw step failed: " + sql);
    return out;
  }
  sqlite3* get() const { return db_; }

private:
  sqlite3* db_ = nullptr;
};

}  // namespace sqlitetest
