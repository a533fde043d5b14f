#pragma once
// What the NATS pipeline's driver (nats_pipeline_test.cpp) and its producer processes
// (pipeline_worker.cpp) agree on without talking: the payment events, each producer's share and
// the order it submits them in (duplicates included), the tables, and the outcome counters every
// worker appends to a stats file of its own.
//
// Everything is computed from (events, duplicate percent, seed), so a producer that was SIGKILLed
// and started again walks the same list and resumes at its progress file.

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

namespace pipeline {

inline constexpr int kAccounts = 50;
inline constexpr int kSubjects = 4;                  // payments.0 .. payments.3
inline constexpr const char* kStream = "PIPE";        // the stream the relays publish into
inline constexpr const char* kStreamSubjects = "payments.>";
inline constexpr const char* kDlqStream = "PIPE_DLQ";  // captures NatsConsumer's dead letters
inline constexpr const char* kDlqSubject = "idem.dlq.PIPE";
inline constexpr const char* kDurable = "pipeline";
inline constexpr const char* kUpTable = "up_records";      // stage 1's store (and its outbox)
inline constexpr const char* kDownTable = "down_records";  // stage 3's store

struct Event {
  std::string id;
  int account = 0;
  long long amount = 0;  // cents
  // The message body the producer sends through the outbox and the consumer records.
  [[nodiscard]] std::string payload() const { return id + ";" + std::to_string(account) + ";" + std::to_string(amount); }
};

// splitmix64: the same numbers on every platform and standard library (std::shuffle's are not
// specified), so the driver and the producers compute the same plan.
struct Rng {
  std::uint64_t s;
  std::uint64_t operator()() {
    std::uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  std::uint64_t below(std::uint64_t n) { return n == 0 ? 0 : (*this)() % n; }
};

inline std::vector<Event> events(int n, std::uint64_t seed) {
  Rng rng{seed};
  std::vector<Event> out;
  out.reserve(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    const long long cents = static_cast<long long>(rng.below(100'000)) + 1;
    out.push_back({"pay-" + std::to_string(seed % 100'000) + "-" + std::to_string(i), static_cast<int>(rng.below(kAccounts)), cents});
  }
  return out;
}

// Producer `p` of `producers`: the events i with i % producers == p, plus `dup_percent` % of them
// submitted a second time, all shuffled (a duplicate always comes after its original, so the guard
// answers it as a duplicate).
inline std::vector<int> plan(int n, int dup_percent, std::uint64_t seed, int p, int producers) {
  Rng rng{seed ^ (0x5bd1e995ULL * static_cast<std::uint64_t>(p + 1))};
  std::vector<int> mine;
  for (int i = p; i < n; i += producers) mine.push_back(i);
  std::vector<int> order = mine;
  for (std::size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[rng.below(i)]);
  const std::size_t dups = mine.size() * static_cast<std::size_t>(dup_percent) / 100;
  for (std::size_t d = 0; d < dups; ++d) {
    // A duplicate of the event at a random position, inserted somewhere after it.
    const std::size_t at = rng.below(order.size());
    const int ev = order[at];
    const std::size_t to = at + 1 + rng.below(order.size() - at);
    order.insert(order.begin() + static_cast<std::ptrdiff_t>(to), ev);
  }
  return order;
}

// The progress file of a producer: the index in its plan of the next submission. Written by rename,
// so a SIGKILL leaves the old value or the new one.
inline std::size_t read_progress(const std::string& path) {
  std::ifstream in(path);
  std::size_t n = 0;
  if (in >> n) return n;
  return 0;
}
inline void write_progress(const std::string& path, std::size_t n) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << n << "\n";
  }
  std::rename(tmp.c_str(), path.c_str());
}

// One outcome per line, appended with a single write(2): a SIGKILL loses nothing written before it.
//   X executed  U duplicate  I in_flight  F previously_failed  L lease_lost  M mismatch  S stale
//   E store / handler error (retried)
class Stats {
public:
  explicit Stats(const std::string& path) : fd_(::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644)) {}
  ~Stats() {
    if (fd_ >= 0) ::close(fd_);
  }
  Stats(const Stats&) = delete;
  Stats& operator=(const Stats&) = delete;
  void note(char c) const noexcept {
    const char line[2] = {c, '\n'};
    if (fd_ >= 0 && ::write(fd_, line, 2) != 2) {
    }
  }

private:
  int fd_;
};

}  // namespace pipeline
