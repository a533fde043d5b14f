#pragma once
// A test's observer that keeps what a store or client advised (Observer::on_warning), from any
// thread, for the test to read back.

#include <algorithm>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "idem/core/observer.hpp"

namespace idem::test {

struct Warnings : idem::Observer {
  std::mutex mu;
  std::vector<std::string> seen;
  void on_warning(std::string_view m) noexcept override {
    std::lock_guard lk(mu);
    seen.emplace_back(m);
  }
  // Every advisory so far, one per line.
  std::string all() {
    std::lock_guard lk(mu);
    std::string s;
    for (const auto& m : seen) s += m + "\n";
    return s;
  }
  // How many advisories so far contain `text`.
  std::size_t count(std::string_view text) {
    std::lock_guard lk(mu);
    return static_cast<std::size_t>(
        std::count_if(seen.begin(), seen.end(), [&](const std::string& m) { return m.find(text) != m.npos; }));
  }
};

}  // namespace idem::test
