#pragma once
/// @file tiered/store.hpp TieredStore: Redis answers duplicates and in-flight keys in one round
/// trip; PostgreSQL (transactional mode) is the truth that decides new keys and commits their
/// completion with the handler's writes. Design and races: docs/tiered.md.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/core.h>

#include "idem/core/error.hpp"
#include "idem/core/observer.hpp"
#include "idem/detail/warning_relay.hpp"
#include "idem/core/record.hpp"
#include "idem/core/store.hpp"
#include "idem/core/hex.hpp"
#include "idem/postgres/result.hpp"
#include "idem/postgres/store.hpp"
#include "idem/redis/options.hpp"
#include "idem/redis/store.hpp"

namespace idem {

/// Options of a TieredStore. Durations are milliseconds.
struct TieredStoreOptions {
  /// After a Redis call fails, decide on PostgreSQL alone for this long before asking Redis again
  /// (a Redis that hangs would otherwise cost a timeout per message); >= 0, 0 = ask every time.
  millis fast_retry_after{1'000};
  /// Where Redis outages are reported: on_warning once when Redis starts failing (acquires, or the
  /// writes that mirror PostgreSQL's decision) and once when it answers again; null = nowhere.
  std::shared_ptr<Observer> observer;
};

/// What a TieredStore decided where since it was built (each counter only grows).
struct TieredStoreStats {
  std::uint64_t fast_duplicates = 0;   ///< duplicates answered by Redis alone (no PostgreSQL round trip)
  std::uint64_t truth_duplicates = 0;  ///< duplicates PostgreSQL answered (Redis had lost the record, or was skipped)
  std::uint64_t fast_other = 0;        ///< in_flight / previously_failed answered by Redis alone
  std::uint64_t truth_decisions = 0;   ///< acquires PostgreSQL decided (every one Redis did not answer)
  std::uint64_t repairs = 0;           ///< Redis records rewritten from PostgreSQL's (duplicate or permanent failure)
  std::uint64_t fast_errors = 0;       ///< Redis calls that failed; the store went on without Redis
  std::uint64_t fast_skipped = 0;      ///< acquires that did not ask Redis (it failed less than fast_retry_after ago)
};

/**
 * A StateStore and TransactionalStore in two tiers: Redis (the fast tier) answers a duplicate or
 * an in-flight key in one round trip without touching PostgreSQL; a new key is claimed in Redis
 * (concurrent deliveries get in_flight at once, with no database transaction opened) and then
 * decided by PostgreSQL (the truth, transactional mode): the handler writes through `ctx.tx`, the
 * completion commits with those writes, and only after the commit is the Redis record completed.
 *
 * Redis only ever says `completed` (or permanently failed) after PostgreSQL did, so whatever Redis
 * loses (a restart without persistence, a failover, eviction, a completion that never reached it)
 * costs a PostgreSQL round trip, never a second run: the redelivery's Redis claim finds PostgreSQL
 * saying duplicate, and the Redis record is repaired from it. Fences come from PostgreSQL. A Redis
 * failure degrades to PostgreSQL alone (reported once per outage through the observer); a
 * PostgreSQL failure fails closed (typed error, no handler run, the Redis claim released).
 *
 * Both stores must outlive this one (and its transactions). Thread-safe; not movable.
 *
 * @code
 * idem::PostgresStore pg{{.conninfo = "postgresql://app@db/app"}, {.mode = idem::PostgresMode::transactional}};
 * idem::TieredStore store{idem::RedisOptions{.url = "redis://cache:6379/0"}, pg};
 * idem::IdempotencyGuard guard{store};
 * guard.run(msg.id, [&](const auto& ctx) {
 *   ctx.tx->exec("UPDATE account SET balance = balance + $1 WHERE id = $2", msg.amount, msg.account);
 * });
 * @endcode
 */
class TieredStore {
public:
  /// A claim decided by the tiers (see TransactionalStore); open only when the decision is
  /// acquired, then it holds the PostgreSQL transaction and the Redis claim. Move-only; destroying
  /// it open rolls PostgreSQL back and releases the Redis claim.
  class Transaction {
  public:
    Transaction(Transaction&& o) noexcept
        : store_(std::exchange(o.store_, nullptr)), pg_(std::move(o.pg_)), decision_(std::move(o.decision_)),
          key_(std::move(o.key_)), fast_holder_(std::exchange(o.fast_holder_, Holder{})) {}  ///< Move-only.
    /// Move-only; an open transaction moved over is ended first, as its destructor would.
    Transaction& operator=(Transaction&& o) noexcept {
      if (this != &o) {
        end_open();
        store_ = std::exchange(o.store_, nullptr);
        pg_ = std::move(o.pg_);
        decision_ = std::move(o.decision_);
        key_ = std::move(o.key_);
        fast_holder_ = std::exchange(o.fast_holder_, Holder{});
      }
      return *this;
    }
    Transaction(const Transaction&) = delete;             ///< Move-only.
    Transaction& operator=(const Transaction&) = delete;  ///< Move-only.
    ~Transaction() { end_open(); }  ///< Rolls back and releases the Redis claim if still open.

    /// The decision: Redis's own for a duplicate / in-flight / failed key, PostgreSQL's otherwise.
    [[nodiscard]] const AcquireResult& decision() const noexcept { return decision_; }
    /// True while the claim is held and neither commit nor fail was called.
    [[nodiscard]] bool is_open() const noexcept { return pg_ && pg_->is_open(); }
    /// True when Redis alone answered (no PostgreSQL round trip was made).
    [[nodiscard]] bool answered_by_fast() const noexcept { return !pg_; }

    /// Commits the result with the handler's writes in PostgreSQL, then completes the Redis record
    /// (a Redis failure there is reported, the outcome stays ok: PostgreSQL answers the next
    /// duplicate). lease_lost if the claim was ended first; outcome_unknown_error if the commit's
    /// fate is unknown (the Redis claim is released: the redelivery asks PostgreSQL).
    WriteStatus commit(std::string_view result, millis retention) {
      auto& tx = postgres();
      WriteStatus ws;
      try {
        ws = tx.commit(result, retention);
      } catch (...) {
        release_fast();
        throw;
      }
      if (ws == WriteStatus::ok)
        store_->fast_write(key_, std::exchange(fast_holder_, Holder{}),
                           [&](RedisStore& f, const Holder& h) { return f.complete(key_, h, result, retention); });
      else
        release_fast();
      return ws;
    }
    /// Rolls back the handler's writes (PostgreSQL records the failure unless params.release) and
    /// mirrors what PostgreSQL recorded onto the Redis record.
    WriteStatus fail(const FailParams& params) {
      auto& tx = postgres();
      WriteStatus ws;
      try {
        ws = tx.fail(params);
      } catch (...) {
        release_fast();
        throw;
      }
      if (ws == WriteStatus::ok)
        store_->fast_write(key_, std::exchange(fast_holder_, Holder{}),
                           [&](RedisStore& f, const Holder& h) { return f.fail(key_, h, params); });
      else
        release_fast();
      return ws;
    }

    /// Runs one statement inside the PostgreSQL transaction (PostgresStore::Transaction::exec).
    template <class... Args>
    PostgresResult exec(std::string_view sql, const Args&... args) {
      return postgres().exec(sql, args...);
    }
    /// The PostgreSQL transaction underneath (for what it offers beyond exec); usage_error when
    /// Redis alone answered and there is none.
    PostgresStore::Transaction& postgres() {
      if (!pg_)
        throw usage_error(fmt::format("idem: this TieredStore transaction has no PostgreSQL transaction: Redis "
                                      "answered its decision ({})",
                                      to_string(decision_.status)));
      return *pg_;
    }
    /// The PostgreSQL transaction, so code written for PostgresStore's (PostgresSequenceStore::advance,
    /// SequenceGate's in-transaction advance) takes this one too.
    operator PostgresStore::Transaction&() { return postgres(); }  // NOLINT(google-explicit-constructor)

  private:
    friend class TieredStore;
    Transaction(TieredStore* store, std::string_view key) : store_(store), key_(key) {}

    void release_fast() noexcept {
      if (store_ && fast_holder_.fence != 0) store_->fast_release(key_, std::exchange(fast_holder_, Holder{}));
    }
    // PostgreSQL first: a rival that claims Redis the moment it is released must find the row unlocked.
    void end_open() noexcept {
      pg_.reset();
      release_fast();
    }

    TieredStore* store_ = nullptr;
    std::optional<PostgresStore::Transaction> pg_;  // absent when Redis alone answered
    AcquireResult decision_;
    std::string key_;
    Holder fast_holder_;  // the Redis claim still held (fence 0 = none)
  };

  /// Tiers over an existing RedisStore (shared, e.g. with a RedisSequenceStore) and PostgresStore;
  /// both must outlive this store. invalid_options_error when the options cannot work.
  TieredStore(RedisStore& fast, PostgresStore& truth, TieredStoreOptions options = {})
      : truth_(&truth), options_(relayed(std::move(options))) {
    check();
    fast_.store(&fast, std::memory_order_release);
  }

  /// Tiers over a RedisStore of its own, built from `fast` with eviction allowed (an evicted
  /// record costs a PostgreSQL round trip, not a re-run). A Redis that is down now is not an
  /// error: the store decides on PostgreSQL alone and builds the Redis store once it answers.
  /// invalid_options_error for options that cannot work (either set).
  TieredStore(RedisOptions fast, PostgresStore& truth, TieredStoreOptions options = {})
      : truth_(&truth), options_(relayed(std::move(options))) {
    check();
    fast.unsafe_allow_eviction = true;
    if (!fast.observer) fast.observer = options_.observer;  // its Redis store's advisories come here too
    fast_options_.emplace(std::move(fast));
    try {
      build_fast();
    } catch (const store_error& e) {
      fast_failed(e);
    }
  }

  TieredStore(const TieredStore&) = delete;             ///< Transactions point at it: not copyable.
  TieredStore& operator=(const TieredStore&) = delete;  ///< Not assignable.
  ~TieredStore() = default;                             ///< Releases the Redis store it built, if any.

  /// Lease-mode acquire: Redis answers duplicate / in_flight / previously_failed; otherwise its
  /// claim is followed by PostgreSQL's acquire, whose decision (and fence) is returned.
  AcquireResult acquire(std::string_view key, const AcquireParams& p) {
    Holder fh;
    if (auto r = fast_acquire(key, p)) {
      if (answered(*r)) return std::move(*r);
      if (r->status == AcquireStatus::acquired) fh = r->holder;
    }
    AcquireResult d;
    try {
      d = truth_->acquire(key, p);
    } catch (...) {
      fast_release(key, fh);
      throw;
    }
    settle(key, fh, d, p.retention);
    return d;
  }

  /// Records the result in PostgreSQL if `h` holds the key there, then completes the Redis claim
  /// of the same token; lease_lost if not held (the Redis claim is released).
  WriteStatus complete(std::string_view key, const Holder& h, std::string_view result, millis retention) {
    return mirrored(key, h, truth_->complete(key, h, result, retention),
                    [&](RedisStore& f, const Holder& fh) { return f.complete(key, fh, result, retention); });
  }
  /// complete() without the result (CompletesUnavailable), in PostgreSQL then in Redis.
  WriteStatus complete_unavailable(std::string_view key, const Holder& h, std::string_view reason, millis retention) {
    return mirrored(key, h, truth_->complete_unavailable(key, h, reason, retention),
                    [&](RedisStore& f, const Holder& fh) { return f.complete_unavailable(key, fh, reason, retention); });
  }
  /// Releases or records a failure in PostgreSQL if `h` holds the key, then the same in Redis.
  WriteStatus fail(std::string_view key, const Holder& h, const FailParams& params) {
    return mirrored(key, h, truth_->fail(key, h, params),
                    [&](RedisStore& f, const Holder& fh) { return f.fail(key, fh, params); });
  }
  /// Extends the PostgreSQL lease (the one that counts) and the Redis claim's, so rivals keep
  /// getting in_flight from Redis; lease_lost if PostgreSQL says so.
  WriteStatus extend(std::string_view key, const Holder& h, millis lease) {
    const WriteStatus ws = truth_->extend(key, h, lease);
    if (ws == WriteStatus::ok)
      if (auto fh = fast_holder_of(key, h.token))
        fast_write(key, *fh, [&](RedisStore& f, const Holder& x) { return f.extend(key, x, lease); });
    return ws;
  }
  /// PostgreSQL's record (the truth: Redis may have lost its copy, or hold another fence); when
  /// PostgreSQL has none — never committed, rolled back by a released run, or a claim still open
  /// in its transaction, which other sessions cannot see — Redis's, if Redis has one and answers.
  std::optional<Record> inspect(std::string_view key) {
    if (auto rec = truth_->inspect(key)) return rec;
    RedisStore* f = fast_now();
    if (!f) return std::nullopt;
    try {
      auto rec = f->inspect(key);
      fast_answered();
      return rec;
    } catch (const store_error& e) {
      fast_failed(e);
    } catch (const corrupt_record_error& e) {
      fast_failed(e);
    }
    return std::nullopt;
  }

  /// Claims `key` (TransactionalStore): Redis answers duplicate / in_flight / previously_failed
  /// alone; otherwise PostgreSQL's begin() decides, and when it acquires, the transaction holds
  /// both claims. A PostgreSQL error is rethrown after the Redis claim is released.
  Transaction begin(std::string_view key, const AcquireParams& p) {
    Transaction t(this, key);
    if (auto r = fast_acquire(key, p)) {
      if (answered(*r)) {
        t.decision_ = std::move(*r);
        return t;
      }
      if (r->status == AcquireStatus::acquired) t.fast_holder_ = r->holder;
    }
    try {
      t.pg_.emplace(truth_->begin(key, p));
    } catch (...) {
      t.release_fast();
      throw;
    }
    t.decision_ = t.pg_->decision();
    if (t.decision_.status != AcquireStatus::acquired)
      settle(key, std::exchange(t.fast_holder_, Holder{}), t.decision_, p.retention);
    else
      count(truth_decisions_);
    return t;
  }

  /// True when the PostgreSQL store is in transactional mode: the guard then runs handlers in begin()'s transaction.
  [[nodiscard]] bool transactional() const noexcept { return truth_->transactional(); }
  /// PostgreSQL's limits: every record must fit the truth (Redis takes far more).
  [[nodiscard]] StoreLimits limits() const noexcept { return truth_->limits(); }
  /// The options in force.
  [[nodiscard]] const TieredStoreOptions& options() const noexcept { return options_; }
  /// Hands the store's advisories (Redis failing and answering again, and its Redis store's) to
  /// `o` as well, those raised so far first. A guard attaches its own observer.
  void attach_observer(const std::shared_ptr<Observer>& o) const {
    detail::attach_to_relay(options_.observer, o);
    if (RedisStore* f = fast()) f->attach_observer(o);
  }
  /// The PostgreSQL store (the truth).
  [[nodiscard]] PostgresStore& truth() const noexcept { return *truth_; }
  /// The Redis store, or null while one of its own could not be built yet (Redis down).
  [[nodiscard]] RedisStore* fast() const noexcept { return fast_.load(std::memory_order_acquire); }
  /// True while Redis is being skipped after a failure (the store decides on PostgreSQL alone).
  [[nodiscard]] bool degraded() const noexcept { return degraded_.load(std::memory_order_relaxed); }
  /// Where the decisions were taken so far.
  [[nodiscard]] TieredStoreStats stats() const noexcept {
    TieredStoreStats s;
    s.fast_duplicates = fast_duplicates_.load(std::memory_order_relaxed);
    s.truth_duplicates = truth_duplicates_.load(std::memory_order_relaxed);
    s.fast_other = fast_other_.load(std::memory_order_relaxed);
    s.truth_decisions = truth_decisions_.load(std::memory_order_relaxed);
    s.repairs = repairs_.load(std::memory_order_relaxed);
    s.fast_errors = fast_errors_.load(std::memory_order_relaxed);
    s.fast_skipped = fast_skipped_.load(std::memory_order_relaxed);
    return s;
  }

private:
  using clock = std::chrono::steady_clock;

  static TieredStoreOptions relayed(TieredStoreOptions o) {
    o.observer = detail::WarningRelay::wrap(std::move(o.observer));
    return o;
  }

  void check() const {
    if (options_.fast_retry_after < millis{0})
      throw invalid_options_error("idem: TieredStoreOptions::fast_retry_after is negative; use 0 to ask Redis every time");
  }

  static void count(std::atomic<std::uint64_t>& c) noexcept { c.fetch_add(1, std::memory_order_relaxed); }

  // The Redis store if it may be asked now: built, and not within fast_retry_after of a failure.
  RedisStore* fast_now() noexcept {
    if (clock::now().time_since_epoch().count() < fast_down_until_.load(std::memory_order_relaxed)) return nullptr;
    if (RedisStore* f = fast_.load(std::memory_order_acquire)) return f;
    if (!fast_options_) return nullptr;
    // Building connects: one thread tries, the others go on with PostgreSQL meanwhile.
    std::unique_lock lock(build_mu_, std::try_to_lock);
    if (!lock.owns_lock()) return nullptr;
    try {
      build_fast();
    } catch (const std::exception& e) {
      fast_failed(e);
    }
    return fast_.load(std::memory_order_acquire);
  }

  void build_fast() {
    if (fast_.load(std::memory_order_acquire)) return;
    owned_fast_ = std::make_unique<RedisStore>(*fast_options_);
    fast_.store(owned_fast_.get(), std::memory_order_release);
    fast_answered();
  }

  // Any failure of Redis is survivable (PostgreSQL decides alone): skip Redis for a while and
  // say so once per outage, not once per message.
  void fast_failed(const std::exception& e, std::string_view key = {}) noexcept {
    count(fast_errors_);
    const auto until = clock::now() + options_.fast_retry_after;
    fast_down_until_.store(until.time_since_epoch().count(), std::memory_order_relaxed);
    if (!degraded_.exchange(true) && options_.observer) {
      try {
        const std::string on = key.empty() ? std::string() : fmt::format(" on key '{}'", detail::printable(key));
        options_.observer->on_warning(fmt::format("idem: TieredStore: Redis failed{} ({}); deciding on PostgreSQL "
                                                  "alone (exact, slower), asking Redis again every {} ms",
                                                  on, e.what(), options_.fast_retry_after.count()));
      } catch (...) {
      }
    }
  }
  void fast_answered() noexcept {
    if (degraded_.load(std::memory_order_relaxed) && degraded_.exchange(false) && options_.observer)
      options_.observer->on_warning("idem: TieredStore: Redis answers again; duplicates are answered by Redis");
  }

  // Redis's acquire, or nullopt when Redis is skipped or failed. Bad input (usage_error) is the
  // caller's mistake and propagates: PostgreSQL would refuse it alike.
  std::optional<AcquireResult> fast_acquire(std::string_view key, const AcquireParams& p) {
    RedisStore* f = fast_now();
    if (!f) {
      count(fast_skipped_);
      return std::nullopt;
    }
    try {
      AcquireResult r = f->acquire(key, p);
      fast_answered();
      return r;
    } catch (const store_error& e) {
      fast_failed(e, key);
    } catch (const corrupt_record_error& e) {
      fast_failed(e, key);
    }
    return std::nullopt;
  }

  // Redis's answers that stand alone. A duplicate or a permanent failure is only ever written to
  // Redis after PostgreSQL holds it; in_flight at worst delays a delivery. A mismatch is not: the
  // Redis fingerprint may come from a claim PostgreSQL refused, so PostgreSQL confirms it.
  bool answered(const AcquireResult& r) noexcept {
    switch (r.status) {
      case AcquireStatus::duplicate: count(fast_duplicates_); return true;
      case AcquireStatus::in_flight:
      case AcquireStatus::previously_failed: count(fast_other_); return true;
      default: return false;
    }
  }

  // After PostgreSQL decided `d` for a key Redis let us claim as `fh`: keep the claim (acquired),
  // repair Redis from the truth (duplicate, permanent failure), or release it (in_flight, mismatch).
  void settle(std::string_view key, const Holder& fh, const AcquireResult& d, millis retention) {
    count(truth_decisions_);
    if (d.status == AcquireStatus::duplicate) count(truth_duplicates_);
    if (fh.fence == 0) return;
    switch (d.status) {
      case AcquireStatus::acquired: return;
      case AcquireStatus::duplicate:
        count(repairs_);
        fast_write(key, fh, [&](RedisStore& f, const Holder& h) {
          return d.result_unavailable ? f.complete_unavailable(key, h, d.payload, retention)
                                      : f.complete(key, h, d.payload, retention);
        });
        return;
      case AcquireStatus::previously_failed: {
        count(repairs_);
        FailParams fp;
        fp.error = d.payload;
        fp.permanent = true;
        fp.retention = retention;
        fast_write(key, fh, [&](RedisStore& f, const Holder& h) { return f.fail(key, h, fp); });
        return;
      }
      default: fast_release(key, fh); return;
    }
  }

  // A Redis write that follows PostgreSQL's decision: best effort (PostgreSQL already holds the
  // truth; a Redis record left behind costs a PostgreSQL round trip later, never a re-run).
  template <class W>
  void fast_write(std::string_view key, const Holder& fh, W&& write) noexcept {
    if (fh.fence == 0) return;
    RedisStore* f = fast_.load(std::memory_order_acquire);
    if (!f) return;
    try {
      write(*f, fh);
      fast_answered();
    } catch (const std::exception& e) {
      fast_failed(e, key);
    }
  }

  // Frees a Redis claim PostgreSQL did not confirm (or whose run ended without a record), so the
  // next delivery goes on to PostgreSQL at once instead of after the Redis lease.
  void fast_release(std::string_view key, const Holder& fh) noexcept {
    FailParams fp;
    fp.error = "released by TieredStore";
    fp.release = true;
    fp.retention = release_retention;
    fast_write(key, fh, [&](RedisStore& f, const Holder& h) { return f.fail(key, h, fp); });
  }

  // The Redis claim of the holder with this token (lease mode: the holder carries PostgreSQL's
  // fence, Redis's may differ), or nullopt.
  std::optional<Holder> fast_holder_of(std::string_view key, std::uint64_t token) noexcept {
    RedisStore* f = fast_now();
    if (!f || token == 0) return std::nullopt;
    try {
      auto rec = f->inspect(key);
      fast_answered();
      if (rec && rec->state == State::in_progress && rec->holder.token == token) return rec->holder;
    } catch (const std::exception& e) {
      fast_failed(e);
    }
    return std::nullopt;
  }

  // Lease mode's writes: PostgreSQL first (its status is the answer), then Redis: the same write
  // when PostgreSQL took it, a release when it did not.
  template <class W>
  WriteStatus mirrored(std::string_view key, const Holder& h, WriteStatus ws, W&& write) {
    if (auto fh = fast_holder_of(key, h.token)) {
      if (ws == WriteStatus::ok)
        fast_write(key, *fh, write);
      else
        fast_release(key, *fh);
    }
    return ws;
  }

  // A released Redis record only remembers the key's fence and fingerprint; PostgreSQL decides
  // its next claim, so it need not outlive a few leases.
  static constexpr millis release_retention{std::chrono::hours{1}};

  PostgresStore* truth_;
  TieredStoreOptions options_;
  std::optional<RedisOptions> fast_options_;  // set when the store builds its own RedisStore
  std::unique_ptr<RedisStore> owned_fast_;
  std::atomic<RedisStore*> fast_{nullptr};
  std::mutex build_mu_;
  std::atomic<clock::rep> fast_down_until_{0};
  std::atomic<bool> degraded_{false};
  std::atomic<std::uint64_t> fast_duplicates_{0}, truth_duplicates_{0}, fast_other_{0}, truth_decisions_{0},
      repairs_{0}, fast_errors_{0}, fast_skipped_{0};
};

static_assert(StateStore<TieredStore>);
static_assert(TransactionalStore<TieredStore>);
static_assert(HasStoreLimits<TieredStore>);
static_assert(CompletesUnavailable<TieredStore>);

}  // namespace idem
