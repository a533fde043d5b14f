// The store contract, instantiated for MemoryStore on a manual clock.
#include "contract/contract_suite.hpp"

#include <atomic>
#include <memory>

namespace {

struct MemoryFactory {
  using store_type = idem::MemoryStore;
  std::shared_ptr<idem::ManualClock> clock = std::make_shared<idem::ManualClock>();
  idem::MemoryStore mem{idem::MemoryStoreOptions{.shards = 64, .max_records = 0, .clock = clock}};

  store_type& store() { return mem; }
  std::string key(std::string_view name) { return "contract:" + std::string(name); }
  void advance(idem::millis d) { clock->advance(d); }
  [[nodiscard]] idem::millis short_lease() const { return idem::millis{1000}; }
  [[nodiscard]] int race_threads() const { return 16; }
  [[nodiscard]] int race_keys() const { return 1000; }
  [[nodiscard]] int race_rounds() const { return 50; }
};

}  // namespace

IDEM_CONTRACT_SUITE(MemoryFactory, "[memory]")
