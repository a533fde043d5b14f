// PostgresStore's batch path in lease mode (BatchStore): acquire_many and BatchWriter.
//
// acquire_many decides a batch with ONE statement per acquire_many_chunk keys (kAcquireMany,
// statements.cpp: arrays of keys, fingerprints, tokens, ... through unnest), the chunks pipelined
// in one round trip. One statement expresses every rule of the single acquire but one: a key whose
// row another transaction has locked makes the single acquire's FOR UPDATE NOWAIT fail with 55P03,
// answered in_flight for that key, and inside one statement that error ends the whole statement.
// Catching it per key would take a plpgsql exception block, a subtransaction per key (and past 64
// of them every other session's snapshots slow down), and a new function, a schema version
// that processes still running the older library would refuse. That case is rare (the row is
// locked only while another session writes it, or by a claimant of an older library), so a chunk
// that fails with it is decided again key by key with the single acquire statement, pipelined (one
// more round trip): every key gets exactly acquire()'s answer, the common batch pays one statement.
// claim_wait = bounded waits up to lock_timeout per held key, and a wait inside one statement
// would end it for all: there every key goes through the single statement, pipelined.
//
// BatchWriter sends each write as the guard makes it, in pipeline mode with a sync after each, so
// each completion is its own transaction and commits as soon as the server reaches it, whatever
// happens to the consumer after; finish() reads them all. A durable commit waits for its WAL
// flush, and one session's commits flush one after another: a batch of fast handlers would be
// bound by the disk's flush rate (measured: batch 100 at 2.3x the per-message rate, the server
// idle in I/O wait). So the writes go round-robin over up to batch_sessions sessions: commits
// waiting at the same moment on different sessions share one flush (PostgreSQL's group commit),
// and each completion stays its own durable transaction. The first session is waited for like
// any call's; the others are taken only if the pool has them free (never waited for), so a busy
// pool makes the batch slower, never stuck. Writes of different keys need no order between them,
// and a batch writes each key once.

#include <algorithm>
#include <deque>
#include <optional>
#include <unordered_map>
#include <utility>

#include <fmt/format.h>

#include "idem/core/error.hpp"
#include "idem/core/validate.hpp"
#include "store_impl.hpp"

namespace idem {
namespace detail {

namespace {

// PostgreSQL's binary array format, one dimension, no NULLs: ndim, has-null flag, element type
// OID, then (size, lower bound 1), then each element as its length and its bytes.
void put32(std::string& s, std::uint32_t v) {
  for (int i = 3; i >= 0; --i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xffu));
}

std::string array_header(std::uint32_t element_oid, std::size_t n) {
  std::string s;
  put32(s, 1);
  put32(s, 0);
  put32(s, element_oid);
  put32(s, static_cast<std::uint32_t>(n));
  put32(s, 1);
  return s;
}

constexpr std::uint32_t bytea_oid = 17, int8_oid = 20, text_oid = 25;

template <class Seq>
std::string bytes_array(std::uint32_t oid, const Seq& v) {
  std::string s = array_header(oid, v.size());
  for (const auto& e : v) {
    put32(s, static_cast<std::uint32_t>(e.size()));
    s.append(e.data(), e.size());
  }
  return s;
}

// Keys sent twice in one statement could not be decided as two acquires in a row would: the
// later copies of a key go in later rounds, after the earlier ones are decided (the guard never
// sends repeats: it settles them by their first item).
std::vector<std::vector<std::size_t>> rounds_of(std::span<const AcquireRequest> requests) {
  std::vector<std::vector<std::size_t>> rounds;
  std::unordered_map<std::string_view, std::size_t> seen;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    std::size_t& n = seen[requests[i].key];
    if (rounds.size() <= n) rounds.emplace_back();
    rounds[n].push_back(i);
    ++n;
  }
  return rounds;
}

// What a statement's error means for a chunk of kAcquireMany: a key's row held by another
// transaction (55P03), a record that kept changing (40001), a deadlock (40P01: the claim never
// waits, but a transaction of the application's might), the shared lock table full of the
// chunk's claim locks (53200). Each is answered per key by the single statement.
bool decide_one_by_one(const std::string& code) {
  return code == "55P03" || code == "40001" || code == "40P01" || code == "53200";
}

}  // namespace

std::string bytea_array(const std::vector<std::string_view>& v) { return bytes_array(bytea_oid, v); }
std::string text_array(const std::vector<std::string>& v) { return bytes_array(text_oid, v); }

std::string int8_array(const std::vector<std::int64_t>& v) {
  std::string s = array_header(int8_oid, v.size());
  for (std::int64_t e : v) {
    put32(s, 8);
    const auto u = static_cast<std::uint64_t>(e);
    put32(s, static_cast<std::uint32_t>(u >> 32));
    put32(s, static_cast<std::uint32_t>(u & 0xffffffffu));
  }
  return s;
}

void StoreImpl::acquire_distinct(std::span<const AcquireRequest> requests, const std::vector<std::size_t>& idx,
                                 std::vector<AcquireResult>& out) {
  std::vector<std::size_t> singles;  // decided one by one with kAcquireLease
  if (opt.claim_wait == PostgresClaimWait::bounded) {
    singles = idx;
  } else {
    std::deque<Params> params;  // a deque: Call keeps pointers to its elements
    std::vector<Call> calls;
    for (std::size_t at = 0; at < idx.size(); at += acquire_many_chunk) {
      const std::size_t end = std::min(idx.size(), at + acquire_many_chunk);
      std::vector<std::string_view> keys, fps;
      std::vector<std::int64_t> leases, retentions, tokens, locks;
      std::vector<std::string> owners;
      for (std::size_t j = at; j < end; ++j) {
        const AcquireRequest& r = requests[idx[j]];
        keys.push_back(r.key);
        fps.push_back(r.params.fingerprint);
        leases.push_back(r.params.lease.count());
        retentions.push_back(r.params.retention.count());
        tokens.push_back(as_i64(r.params.token));
        owners.push_back(clean_owner(r.params.owner));
        locks.push_back(claim_lock_id(r.key));
      }
      Params& p = params.emplace_back();
      p.owned_bin(bytea_array(keys)).owned_bin(bytea_array(fps)).owned_bin(int8_array(leases));
      p.owned_bin(int8_array(retentions)).owned_bin(int8_array(tokens)).owned_bin(text_array(owners));
      p.text(lock_timeout_text).owned_bin(int8_array(locks));
      calls.push_back({kAcquireMany, kAcquireManyAgain, &p});
    }
    std::vector<PostgresResult> results = exchange_many(calls, "acquire_many", true);
    const PGresult* failed = nullptr;
    for (std::size_t c = 0; c < results.size(); ++c) {
      const std::size_t at = c * acquire_many_chunk;
      const std::size_t n = std::min(idx.size(), at + acquire_many_chunk) - at;
      const PGresult* r = ResultAccess::native(results[c]);
      if (!result_ok(r)) {
        if (decide_one_by_one(sqlstate_of(r)))
          singles.insert(singles.end(), idx.begin() + static_cast<std::ptrdiff_t>(at),
                         idx.begin() + static_cast<std::ptrdiff_t>(at + n));
        else if (!failed)
          failed = r;
        continue;
      }
      if (static_cast<std::size_t>(PQntuples(r)) != n || PQnfields(r) != 7)
        throw corrupt_record_error("idem: postgres acquire_many returned an unexpected shape");
      std::vector<bool> seen(n, false);
      for (int row = 0; row < PQntuples(r); ++row) {
        const std::int64_t i = be_int(r, row, 0, 8);
        if (i < 1 || static_cast<std::size_t>(i) > n || seen[static_cast<std::size_t>(i - 1)])
          throw corrupt_record_error(fmt::format("idem: postgres acquire_many answered key {} of {}", i, n));
        seen[static_cast<std::size_t>(i - 1)] = true;
        const std::size_t k = idx[at + static_cast<std::size_t>(i - 1)];
        out[k] = decode_acquire_row(r, row, 1, requests[k].params.token);
      }
    }
    if (failed) throw_result("acquire_many", failed, nullptr, store_missing);
  }
  if (singles.empty()) return;
  std::deque<Params> params;
  std::vector<Call> calls;
  for (std::size_t k : singles) {
    params.push_back(acquire_params(requests[k].key, requests[k].params, clean_owner(requests[k].params.owner), false));
    calls.push_back({kAcquireLease, kAcquireAgain, &params.back()});
  }
  std::vector<PostgresResult> results = exchange_many(calls, "acquire", true);
  const PGresult* failed = nullptr;
  for (std::size_t j = 0; j < singles.size(); ++j) {
    const PGresult* r = ResultAccess::native(results[j]);
    const AcquireRequest& req = requests[singles[j]];
    if (result_ok(r))
      out[singles[j]] = decode_acquire_lease(r, req.params.token);
    else if (sqlstate_of(r) == "55P03")
      out[singles[j]] = lock_busy(req.params);  // as acquire() answers it
    else if (!failed)
      failed = r;
  }
  if (failed) throw_result("acquire", failed, nullptr, store_missing);
}

}  // namespace detail

std::vector<AcquireResult> PostgresStore::acquire_many(std::span<const AcquireRequest> requests) {
  for (const AcquireRequest& r : requests) {
    detail::check_acquire(r.key, r.params);
    detail::check_pg_key(r.key);
  }
  std::vector<AcquireResult> out(requests.size());
  for (const auto& round : detail::rounds_of(requests)) impl_->acquire_distinct(requests, round, out);
  return out;
}

struct PostgresStore::BatchWriter::Impl {
  struct Write {
    detail::Stmt st;
    detail::Stmt again;
    const char* what;
    std::string key, value;  // the bytes params points at (a deque element never moves)
    detail::Params params;
    std::size_t lane = 0;    // the session it went on (lanes[lane])
  };

  detail::StoreImpl* store;
  // The sessions of this batch's writes, from the first write to finish(); lanes[0] is waited for.
  std::vector<std::unique_ptr<detail::Pipeline>> lanes;
  bool no_session = false;  // the first write could not get one: finish() sends them all
  bool no_more_lanes = false;  // the pool had no free session (or opening one failed): stop asking
  std::string why;
  std::deque<Write> writes;

  // The lane for the next write: round-robin, opening lanes up to batch_sessions while the pool
  // has free sessions.
  std::size_t lane_for(std::size_t n) {
    const std::size_t want = store->opt.batch_sessions;
    if (lanes.size() < want && !no_more_lanes && n >= lanes.size()) {
      try {
        auto session = store->client.pool().try_checkout();
        if (session)
          lanes.push_back(std::make_unique<detail::Pipeline>(*store, std::move(session)));
        else
          no_more_lanes = true;
      } catch (const store_error&) {  // an extra session is an optimisation: go on with those open
        no_more_lanes = true;
      }
    }
    return n % lanes.size();
  }

  // Sends the last write made.
  void send() {
    if (lanes.empty() && !no_session) {
      try {
        lanes.push_back(std::make_unique<detail::Pipeline>(*store));
      } catch (const store_error& e) {  // no session now: finish() tries again, and reports what it gets
        no_session = true;
        why = e.what();
      }
    }
    if (lanes.empty()) return;
    Write& w = writes.back();
    w.lane = lane_for(writes.size() - 1);
    lanes[w.lane]->send(w.st, w.params);
  }
};

PostgresStore::BatchWriter::BatchWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PostgresStore::BatchWriter::BatchWriter(BatchWriter&&) noexcept = default;
PostgresStore::BatchWriter& PostgresStore::BatchWriter::operator=(BatchWriter&&) noexcept = default;
PostgresStore::BatchWriter::~BatchWriter() = default;

void PostgresStore::BatchWriter::complete(std::string_view key, const Holder& h, std::string_view result,
                                          millis retention) {
  detail::StoreImpl& s = *impl_->store;
  if (result.size() > s.opt.max_result_bytes)
    throw usage_error(
        fmt::format("idem: a result of {} bytes is over PostgresStoreOptions::max_result_bytes ({}); "
                    "nothing was written, use complete_unavailable",
                    result.size(), s.opt.max_result_bytes));
  auto& w = impl_->writes.emplace_back();
  try {
    w.st = detail::kComplete;
    w.again = detail::kCompleteAgain;
    w.what = "complete";
    w.key = std::string(key);
    w.value = std::string(result);
    w.params = s.completion(w.key, h, w.value, retention);
  } catch (...) {
    impl_->writes.pop_back();
    throw;
  }
  impl_->send();
}

void PostgresStore::BatchWriter::fail(std::string_view key, const Holder& h, const FailParams& f) {
  detail::check_holder(key, h);
  detail::check_lease(f.retention, "retention");
  auto& w = impl_->writes.emplace_back();
  w.st = detail::kFail;
  w.again = detail::kFailAgain;
  w.what = "fail";
  w.key = std::string(key);
  w.value = f.error;
  w.params.bin(w.key).num(detail::as_i64(h.fence)).num(detail::as_i64(h.token)).bin(w.value);
  w.params.boolean(!f.release && f.permanent).num(f.release ? 0 : std::max<std::int64_t>(0, f.backoff.count()));
  w.params.num(f.retention.count());
  impl_->send();
}

std::vector<WriteStatus> PostgresStore::BatchWriter::finish() {
  Impl& m = *impl_;
  std::vector<detail::Reply> replies(m.writes.size());
  std::vector<detail::Call> calls;
  calls.reserve(m.writes.size());
  for (std::size_t i = 0; i < m.writes.size(); ++i) {
    calls.push_back({m.writes[i].st, m.writes[i].again, &m.writes[i].params});
    if (!m.lanes.empty()) {
      replies[i] = m.lanes[m.writes[i].lane]->next();  // each lane answers in its own send order
    } else {
      replies[i].fate = detail::Fate::unsent;
      replies[i].why = m.why;
    }
  }
  m.lanes.clear();  // given back (or dropped) before settle checks out another
  m.no_session = false;
  m.no_more_lanes = false;
  bool sync_cut = false;
  millis cancelled_after{0};  // the bound of idem's own cancel, when one cut a wait
  const auto note_cuts = [&] {
    for (const auto& r : replies) {
      sync_cut = sync_cut || r.sync_cut;
      if (r.sync_cut) cancelled_after = std::max(cancelled_after, r.cancelled_after);
    }
  };
  note_cuts();
  m.store->settle(calls, replies, "batch write", true);
  note_cuts();
  if (sync_cut) detail::throw_sync_cancelled("batch write", cancelled_after);
  std::vector<WriteStatus> out;
  out.reserve(replies.size());
  for (std::size_t i = 0; i < replies.size(); ++i) {
    const PGresult* r = detail::ResultAccess::native(replies[i].result);
    if (!detail::result_ok(r)) detail::throw_result(m.writes[i].what, r, nullptr, detail::store_missing);
    out.push_back(replies[i].result.affected() == 1 ? WriteStatus::ok : WriteStatus::lease_lost);
  }
  m.writes.clear();
  return out;
}

PostgresStore::BatchWriter PostgresStore::batch_writer() {
  auto impl = std::make_unique<BatchWriter::Impl>();
  impl->store = impl_.get();
  return BatchWriter(std::move(impl));
}

}  // namespace idem
