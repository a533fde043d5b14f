#pragma once
// A template for a broker idem does not ship: an idem::Source over a spool directory, so that
// idem::consume runs a handler exactly once per message key over it. Copy it and replace the file
// operations with your broker's poll / ack / nack calls.
//
// Layout under `root`: inbox/ holds the messages, one file each ("<key>\n<payload>"); a requeued
// message waits in delayed/ with its due time as its mtime; a dead letter lands in dead/ with a
// "<name>.reason" file beside it; an acked message is deleted. A crash anywhere leaves every
// unsettled message in inbox/ or delayed/: nothing is lost, and the guard makes the redelivery a
// duplicate. One consumer per directory (renames are not claims).

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "idem/guard/consume.hpp"

namespace example {

/// One spooled message: its file name, its key line and the rest.
struct SpoolMessage {
  std::string name;
  std::string key;
  std::string payload;
  std::uint32_t attempt = 1;
};

class DirSource {
public:
  using message_type = SpoolMessage;

  explicit DirSource(std::filesystem::path root, std::size_t batch = 32) : root_(std::move(root)), batch_(batch) {
    for (const char* d : {"inbox", "delayed", "dead"}) std::filesystem::create_directories(root_ / d);
  }

  // Due delayed messages go back to the inbox first; then up to `batch` messages, oldest name first.
  std::vector<SpoolMessage> poll() {
    namespace fs = std::filesystem;
    const auto now = fs::file_time_type::clock::now();
    for (const auto& e : fs::directory_iterator(root_ / "delayed"))
      if (e.last_write_time() <= now) fs::rename(e.path(), root_ / "inbox" / e.path().filename());
    std::vector<fs::path> names;
    for (const auto& e : fs::directory_iterator(root_ / "inbox"))
      if (e.is_regular_file()) names.push_back(e.path());
    std::sort(names.begin(), names.end());
    if (names.size() > batch_) names.resize(batch_);
    polled_.clear();
    for (const fs::path& p : names) {
      std::ifstream in(p, std::ios::binary);
      std::string key;
      std::getline(in, key);
      SpoolMessage m{p.filename().string(), key, std::string(std::istreambuf_iterator<char>(in), {}), 1};
      if (auto a = attempts_.find(m.name); a != attempts_.end()) m.attempt = a->second;
      polled_.push_back(m);
    }
    return polled_;
  }

  static idem::Delivery delivery(const SpoolMessage& m) {
    idem::Delivery d;
    d.id = m.name;
    d.key = m.key;
    d.payload = m.payload;
    d.attempt = m.attempt;
    return d;
  }

  void settle(std::span<const idem::Verdict> verdicts) {
    namespace fs = std::filesystem;
    if (verdicts.size() != polled_.size()) throw std::logic_error("DirSource::settle: one verdict per polled message");
    for (std::size_t i = 0; i < verdicts.size(); ++i) {
      const fs::path file = root_ / "inbox" / polled_[i].name;
      switch (verdicts[i].action) {
        case idem::BrokerAction::ack:
          fs::remove(file);
          attempts_.erase(polled_[i].name);
          break;
        case idem::BrokerAction::dead_letter: {
          std::ofstream(root_ / "dead" / (polled_[i].name + ".reason")) << verdicts[i].reason << '\n';
          fs::rename(file, root_ / "dead" / polled_[i].name);
          attempts_.erase(polled_[i].name);
          break;
        }
        case idem::BrokerAction::requeue: {
          const fs::path later = root_ / "delayed" / polled_[i].name;
          fs::rename(file, later);
          fs::last_write_time(later, fs::file_time_type::clock::now() + verdicts[i].delay);
          attempts_[polled_[i].name] = polled_[i].attempt + 1;
          break;
        }
      }
    }
    polled_.clear();
  }

  // Unsettled messages simply stay in the inbox.
  void release() noexcept { polled_.clear(); }

private:
  std::filesystem::path root_;
  std::size_t batch_;
  std::vector<SpoolMessage> polled_;
  std::map<std::string, std::uint32_t> attempts_;  // in memory: a restart counts from 1 again
};

static_assert(idem::Source<DirSource>);

}  // namespace example
