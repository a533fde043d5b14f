// The store contract on AsyncRedisStore's blocking members: every case's calls, and the races'
// many threads, share the store's one multiplexed connection. And the async guard's own instance
// of the contract's guard cases: each run is guard.run_async co_spawned on an io thread and
// awaited (the race: 16 threads' runs in flight at once on that one thread), on AsyncRedisStore
// and on MemoryStore.
#include "asio_factory.hpp"
#include "contract/contract_suite.hpp"

#include <memory>
#include <string>
#include <utility>

#include "idem/memory/memory_store.hpp"

namespace {

using idem::test::AsyncRedisFactory;
using idem::test::IoThread;

// run_guard: the handler through run_async (no payload, as run(key, handler)), on the io thread.
template <class Base>
struct AsyncGuard : Base {
  template <class G, class K, class H>
  auto run_guard(G& guard, const K& key, H handler) {
    return this->io.run(guard.run_async(std::string(key), std::string(), std::move(handler)));
  }
};

struct MemoryIoFactory {
  using store_type = idem::MemoryStore;
  IoThread io;
  std::shared_ptr<idem::ManualClock> clock = std::make_shared<idem::ManualClock>();
  idem::MemoryStore mem{idem::MemoryStoreOptions{.shards = 64, .max_records = 0, .clock = clock}};
  store_type& store() { return mem; }
  std::string key(std::string_view name) { return "contract:" + std::string(name); }
  void advance(idem::millis d) { clock->advance(d); }
  [[nodiscard]] int race_threads() const { return 16; }
  [[nodiscard]] int race_keys() const { return 500; }
  [[nodiscard]] int race_rounds() const { return 10; }
};

using AsyncGuardRedis = AsyncGuard<AsyncRedisFactory>;
using AsyncGuardMemory = AsyncGuard<MemoryIoFactory>;

}  // namespace

IDEM_CONTRACT_SUITE(AsyncRedisFactory, "[asio]")
IDEM_GUARD_CONTRACT_SUITE(AsyncGuardRedis, "run_async contract (AsyncRedisStore)", "[asio][run_async]")
IDEM_GUARD_CONTRACT_SUITE(AsyncGuardMemory, "run_async contract (MemoryStore)", "[asio][run_async][memory]")
