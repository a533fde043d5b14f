// The store contract of docs/design.md on SqliteStore (a file per case, on a manual clock): every
// case in lease mode, the guard's and the batch cases again in transactional mode; and the
// sequence store's contract on SqliteSequenceStore (compare-and-set, the race, SequenceGate in
// lease mode, run_sequenced in transactional mode).
#include "contract/contract_suite.hpp"
#include "contract/sequence_race.hpp"

#include <limits>
#include <memory>
#include <stdexcept>

#include "sqlite_support.hpp"

namespace {

using namespace std::chrono_literals;

template <idem::SqliteMode Mode>
struct SqliteFactory {
  using store_type = idem::SqliteStore;
  std::shared_ptr<idem::ManualClock> clock = std::make_shared<idem::ManualClock>(1'700'000'000'000);
  idem::SqliteStore s{idem::SqliteOptions{.path = sqlitetest::fresh_path("contract"), .mode = Mode, .clock = clock}};

  store_type& store() { return s; }
  std::string key(std::string_view name) { return "contract:" + std::string(name); }
  void advance(idem::millis d) { clock->advance(d); }
  [[nodiscard]] idem::millis short_lease() const { return idem::millis{1000}; }
  [[nodiscard]] int race_threads() const { return 8; }
  [[nodiscard]] int race_keys() const { return 40; }
  [[nodiscard]] int race_rounds() const { return 3; }
};

using LeaseFactory = SqliteFactory<idem::SqliteMode::lease>;
using TxFactory = SqliteFactory<idem::SqliteMode::transactional>;

}  // namespace

IDEM_CONTRACT_SUITE(LeaseFactory, "[sqlite]")

// Transactional mode: the guard drives begin / commit / fail; the store-level cases above are the
// same calls in either mode.
IDEM_GUARD_CONTRACT_SUITE(TxFactory, "contract (transactional)", "[sqlite][transactional]")
TEST_CASE("contract (transactional): batch: every kind of item in one call", "[sqlite][transactional][contract]") {
  TxFactory f;
  idem::contract::batch_mixed_items(f);
}
TEST_CASE("contract (transactional): batch: a lapsed lease is taken over, stop at the first error",
          "[sqlite][transactional][contract]") {
  TxFactory f;
  idem::contract::batch_takeover_and_stop(f);
}

// ---- the sequence store ---------------------------------------------------------------------

namespace {

struct SeqFixture {
  idem::SqliteStore store;
  idem::SqliteSequenceStore seqs;
  explicit SeqFixture(idem::SqliteMode mode = idem::SqliteMode::lease)
      : store(idem::SqliteOptions{.path = sqlitetest::fresh_path("seq"), .mode = mode,
                                  .synchronous = idem::SqliteSync::normal}),
        seqs(store) {}
};

}  // namespace

TEST_CASE("sqlite sequence: compare-and-set in order, older, equal, gaps, the whole uint64 range", "[sqlite]") {
  SeqFixture f;
  auto& s = f.seqs;
  const std::string e = "acct";
  CHECK_FALSE(s.last_applied(e).has_value());
  auto a = s.advance(e, 3);
  CHECK(a.advanced);
  CHECK_FALSE(a.previous.has_value());
  a = s.advance(e, 4);
  CHECK(a.advanced);
  CHECK(a.previous == 3u);
  a = s.advance(e, 2);
  CHECK_FALSE(a.advanced);
  CHECK(a.previous == 4u);
  CHECK_FALSE(s.advance(e, 4).advanced);
  CHECK(s.advance(e, 10).advanced);
  CHECK(s.last_applied(e) == 10u);
  // Across the sign boundary of SQLite's integers and up to the top.
  const auto max = std::numeric_limits<std::uint64_t>::max();
  CHECK(s.advance(e, std::uint64_t{1} << 63).advanced);
  CHECK_FALSE(s.advance(e, (std::uint64_t{1} << 63) - 1).advanced);
  CHECK(s.advance(e, max).advanced);
  CHECK_FALSE(s.advance(e, max).advanced);
  CHECK(s.last_applied(e) == max);
  // Zero is a sequence like any other, and entity ids are bytes.
  const std::string bin("e\0\xff", 3);
  CHECK(s.advance(bin, 0).advanced);
  CHECK(s.last_applied(bin) == 0u);
  CHECK_FALSE(s.last_applied(std::string("e\0\xfe", 3)).has_value());
  CHECK(s.erase(bin));
  CHECK_FALSE(s.erase(bin));
  CHECK_THROWS_AS(s.advance("", 1), idem::invalid_entity_error);
  CHECK_THROWS_AS(idem::SqliteSequenceStore(f.store, {.table = "idem_records"}), idem::invalid_options_error);
  CHECK_THROWS_AS(idem::SqliteSequenceStore(f.store, {.table = "Bad-Name"}), idem::invalid_options_error);
}

TEST_CASE("sqlite sequence: 4 threads on shared entities end at the max, each advance once", "[sqlite]") {
  SeqFixture f;
  idem::contract::advance_race(f.seqs, "race-", 4, 4, 12);
}

TEST_CASE("sqlite sequence: SequenceGate over a lease-mode SqliteStore answers stale", "[sqlite]") {
  SeqFixture f;
  idem::IdempotencyGuard guard(f.store);
  idem::SequenceGate gate(f.seqs);
  int ran = 0;
  auto o2 = gate.run(guard, {.key = "ev-2", .entity = "a", .seq = 2}, [&] { return ++ran; });
  CHECK(o2.status == idem::Status::executed);
  CHECK(o2.advanced);
  auto o1 = gate.run(guard, {.key = "ev-1", .entity = "a", .seq = 1}, [&] { return ++ran; });
  CHECK(o1.status == idem::Status::stale);
  CHECK(o1.last_applied == 2u);
  CHECK(ran == 1);
  CHECK(f.seqs.last_applied("a") == 2u);
}

namespace {

// run_sequenced on a transactional store: the handler sets a balance in the same file.
struct TxSeq : SeqFixture {
  idem::IdempotencyGuard<idem::SqliteStore> guard{store};
  TxSeq() : SeqFixture(idem::SqliteMode::transactional) {
    sqlitetest::Raw(store.options().path).exec("CREATE TABLE balance (id TEXT PRIMARY KEY, amount INTEGER)");
  }
  auto set(const std::string& key, const std::string& id, std::uint64_t seq, long value, bool fail = false) {
    return idem::run_sequenced(guard, seqs, {.key = key, .entity = id, .seq = seq}, [&](const auto& ctx) -> long {
      ctx.tx->exec("INSERT OR REPLACE INTO balance (id, amount) VALUES (?, ?)", id, value);
      if (fail) throw std::runtime_error("handler failed after its write");
      return value;
    });
  }
  std::string amount(const std::string& id) {
    return sqlitetest::Raw(store.options().path).scalar("SELECT amount FROM balance WHERE id = '" + id + "'");
  }
};

}  // namespace

TEST_CASE("sqlite sequence: run_sequenced commits the advance with the business write", "[sqlite][transactional]") {
  TxSeq f;
  auto o1 = f.set("a/1", "a", 1, 100);
  CHECK(o1.status == idem::Status::executed);
  CHECK(o1.advanced);
  CHECK(o1.value == 100L);
  CHECK(f.amount("a") == "100");
  CHECK(f.set("a/3", "a", 3, 300).status == idem::Status::executed);
  auto o2 = f.set("a/2", "a", 2, 200);  // reordered: stale, nothing written
  CHECK(o2.status == idem::Status::stale);
  CHECK(o2.last_applied == 3u);
  CHECK(f.amount("a") == "300");
  auto dup = f.set("a/3", "a", 3, 999);
  CHECK((dup.status == idem::Status::duplicate || dup.status == idem::Status::stale));
  CHECK(f.amount("a") == "300");
  // A handler exception rolls back its write and the advance together.
  CHECK_THROWS_WITH(f.set("a/4", "a", 4, 400, true), "handler failed after its write");
  CHECK(f.amount("a") == "300");
  CHECK(f.seqs.last_applied("a") == 3u);
  auto o4 = f.set("a/4", "a", 4, 400);
  CHECK(o4.status == idem::Status::executed);
  CHECK(f.amount("a") == "400");
  CHECK(f.seqs.last_applied("a") == 4u);
}

TEST_CASE("sqlite sequence: an event that became stale inside the transaction answers stale, the key released",
          "[sqlite][transactional]") {
  TxSeq f;
  REQUIRE(f.set("b/5", "b", 5, 500).status == idem::Status::executed);
  // The gate's first check is passed by a direct advance between the check and the claim: simulate
  // it with the in-transaction advance refusing (a newer seq already stored).
  auto tx = f.store.begin("b/4", sqlitetest::ap(41));
  REQUIRE(tx.is_open());
  auto r = f.seqs.advance(tx, "b", 4);
  CHECK_FALSE(r.advanced);
  CHECK(r.previous == 5u);
  idem::FailParams release;
  release.release = true;
  CHECK(tx.fail(release) == idem::WriteStatus::ok);
  auto rec = f.store.inspect("b/4");
  REQUIRE(rec);
  CHECK(rec->state == idem::State::failed);
  CHECK(f.store.acquire("b/4", sqlitetest::ap(42)).status == idem::AcquireStatus::acquired);
  CHECK(f.seqs.last_applied("b") == 5u);
}
