#pragma once
// A temp dir of a test, removed at the end with everything in it.

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <system_error>

#include <stdlib.h>  // mkdtemp

namespace idem::test {

struct TempDir {
  std::string path;
  // Under the system's temp directory, named `prefix` plus a random suffix.
  explicit TempDir(const std::string& prefix = "idem-test-") {
    std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "XXXXXX")).string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("test: mkdtemp failed");
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  // Writes `text` to the file `name` in the dir; its path.
  std::string file(const std::string& name, const std::string& text) const {
    const std::string p = path + "/" + name;
    std::ofstream(p) << text;
    return p;
  }
};

}  // namespace idem::test
