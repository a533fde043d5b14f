// OutboxRelay: claims committed outbox rows (SKIP LOCKED, per-key order), publishes them, marks
// them sent in the claiming transaction, backs failed rows off, and purges sent rows.

#include "idem/outbox/relay.hpp"

#include <fcntl.h>
#include <libpq-fe.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "idem/core/error.hpp"
#include "idem/outbox/writer.hpp"
#include "idem/postgres/store.hpp"

namespace idem {

namespace {

using Clock = std::chrono::steady_clock;

struct ResultDeleter {
  void operator()(PGresult* r) const noexcept { PQclear(r); }
};
using Result = std::unique_ptr<PGresult, ResultDeleter>;

bool ok(const PGresult* r) {
  const auto st = r ? PQresultStatus(r) : PGRES_FATAL_ERROR;
  return st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK;
}

std::string first_line(const char* m) {
  std::string s = m ? m : "";
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  return s;
}

// The typed error of a failed statement: a dead session is a connection_error, anything the server
// answered a store_error with its SQLSTATE; all retryable (the relay only ever tries again).
[[noreturn]] void fail(std::string_view what, const PGresult* r, PGconn* c) {
  const char* state = r ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : nullptr;
  const std::string msg =
      fmt::format("idem: outbox relay {}: {}", what,
                  first_line(r && *PQresultErrorMessage(r) ? PQresultErrorMessage(r) : PQerrorMessage(c)));
  if (PQstatus(c) != CONNECTION_OK || !state) throw connection_error(msg, state ? state : "08006", true);
  throw store_error(msg, state, true);
}

std::int64_t be(const char* p, int n) {
  std::uint64_t v = 0;
  for (int i = 0; i < n; ++i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  if (n == 4) return static_cast<std::int32_t>(static_cast<std::uint32_t>(v));
  return static_cast<std::int64_t>(v);
}

std::string bytes(const PGresult* r, int row, int col) {
  return {PQgetvalue(r, row, col), static_cast<std::size_t>(PQgetlength(r, row, col))};
}

std::int64_t integer(const PGresult* r, int row, int col, int width) {
  if (PQgetisnull(r, row, col) || PQgetlength(r, row, col) != width)
    throw corrupt_record_error(fmt::format("idem: outbox row with an unexpected column {}", col));
  return be(PQgetvalue(r, row, col), width);
}

// The headers column: (u32 length, name, u32 length, value)* big-endian, as OutboxWriter wrote it.
bool decode_headers(std::string_view in, std::vector<std::pair<std::string, std::string>>& out) {
  std::size_t at = 0;
  auto piece = [&](std::string& s) {
    if (in.size() - at < 4) return false;
    const auto n = static_cast<std::size_t>(static_cast<std::uint32_t>(be(in.data() + at, 4)));
    at += 4;
    if (in.size() - at < n) return false;
    s.assign(in.data() + at, n);
    at += n;
    return true;
  };
  while (at < in.size()) {
    std::pair<std::string, std::string> h;
    if (!piece(h.first) || !piece(h.second)) return false;
    out.push_back(std::move(h));
  }
  return true;
}

std::string seq_array(const std::vector<std::int64_t>& seqs) {
  std::string a = "{";
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    if (i) a += ',';
    a += std::to_string(seqs[i]);
  }
  return a + "}";
}

const char* const now_ms = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint";

OutboxRelayOptions checked(OutboxRelayOptions o) {
  auto bad = [](const std::string& m) { throw invalid_options_error(fmt::format("idem: OutboxRelayOptions::{}", m)); };
  if (o.batch < 1 || o.batch > 10'000) bad("batch must be 1..10000");
  if (o.poll_interval <= millis{0}) bad("poll_interval must be > 0 (the fallback when a NOTIFY is lost)");
  if (o.backoff_initial <= millis{0}) bad("backoff_initial must be > 0");
  if (o.backoff_max < o.backoff_initial) bad("backoff_max must be >= backoff_initial");
  if (o.retention < millis{0}) bad("retention must be >= 0 (0 = delete rows once sent)");
  if (o.purge_interval <= millis{0}) bad("purge_interval must be > 0");
  if (o.claim_idle_timeout != millis{0} && o.claim_idle_timeout < millis{1000})
    bad("claim_idle_timeout must be 0 (never) or >= 1000 ms");
  return o;
}

}  // namespace

struct OutboxRelay::Impl {
  Impl(OutboxPublisher* p, std::unique_ptr<OutboxPublisher> own, OutboxRelayOptions o)
      : owned(std::move(own)),
        pub(p ? p : owned.get()),
        opt(checked(std::move(o))),
        // Validates schema, table and conninfo exactly as the store does, and migrates like it.
        store(PostgresOptions{.conninfo = opt.postgres.conninfo,
                              .pool = {.size = 1},
                              .statement_timeout = opt.postgres.statement_timeout,
                              .transaction_pooler = opt.postgres.transaction_pooler},
              PostgresStoreOptions{.schema = opt.schema, .table = opt.table, .outbox = true}),
        qo("\"" + opt.schema + "\".\"" + outbox_table_name(opt.table) + "\""),
        channel(outbox_channel(opt.schema, opt.table)) {
    if (!pub) throw invalid_options_error("idem: OutboxRelay needs a publisher (got null)");
    if (::pipe2(wake, O_NONBLOCK | O_CLOEXEC) != 0) throw error("idem: outbox relay: pipe2 failed", false);
  }
  ~Impl() {
    drop(work);
    drop(listen);
    ::close(wake[0]);
    ::close(wake[1]);
  }

  static void drop(PGconn*& c) noexcept {
    if (c) PQfinish(c);
    c = nullptr;
  }

  PGconn* connect() {
    PGconn* c = PQconnectdb(opt.postgres.conninfo.c_str());
    if (PQstatus(c) != CONNECTION_OK) {
      const std::string m = first_line(PQerrorMessage(c));
      PQfinish(c);
      throw connection_error(fmt::format("idem: outbox relay cannot connect to PostgreSQL: {}", m), "08001", true);
    }
    PQsetNoticeProcessor(c, [](void*, const char*) {}, nullptr);
    // Behind a transaction pooler a session setting would stay on a server connection other
    // clients get next: the claim sets its timeout with SET LOCAL instead (batch()).
    if (opt.postgres.transaction_pooler) return c;
    const std::string setup = "SET statement_timeout = " + std::to_string(opt.postgres.statement_timeout.count());
    Result r(PQexec(c, setup.c_str()));
    if (!ok(r.get())) {
      PQfinish(c);
      throw connection_error("idem: outbox relay session setup failed", "08001", true);
    }
    return c;
  }

  PGconn* session() {
    if (work && PQstatus(work) != CONNECTION_OK) drop(work);
    if (!work) {
      if (opt.migrate && !migrated) {
        store.migrate();
        migrated = true;
      }
      work = connect();
    }
    return work;
  }

  Result exec(PGconn* c, const std::string& sql, std::vector<std::string> params, std::string_view what,
              int format = 0) {
    std::vector<const char*> vals;
    for (const auto& p : params) vals.push_back(p.c_str());
    Result r(PQexecParams(c, sql.c_str(), static_cast<int>(vals.size()), nullptr, vals.data(), nullptr, nullptr,
                          format));
    if (!ok(r.get())) fail(what, r.get(), c);
    return r;
  }

  void emit(const OutboxRelayEvent& e) {
    std::function<void(const OutboxRelayEvent&)> f;
    {
      std::lock_guard lk(obs_mu);
      f = observer;
    }
    if (f) f(e);
  }

  std::size_t run_once() {
    PGconn* c = nullptr;
    try {
      c = session();
      return batch(c);
    } catch (...) {
      // A failed statement aborted the transaction; a dead session is replaced at the next batch.
      if (c && PQstatus(c) == CONNECTION_OK && PQtransactionStatus(c) != PQTRANS_IDLE) Result(PQexec(c, "ROLLBACK"));
      if (c && PQstatus(c) != CONNECTION_OK) drop(work);
      ++errors;
      throw;
    }
  }

  std::size_t batch(PGconn* c) {
    // A queue table's statistics are stale more often than not (rows arrive and leave in bursts):
    // with a low row estimate the planner reads every unsent row through a bitmap and sorts them,
    // instead of walking the unsent index in seq order up to the LIMIT. The claim's plan is fixed
    // by hand: index scans only.
    std::string begin = "BEGIN; SET LOCAL enable_bitmapscan = off; SET LOCAL enable_seqscan = off";
    if (opt.postgres.transaction_pooler)
      begin += "; SET LOCAL statement_timeout = " + std::to_string(opt.postgres.statement_timeout.count());
    if (opt.claim_idle_timeout.count() > 0)
      begin += "; SET LOCAL idle_in_transaction_session_timeout = " + std::to_string(opt.claim_idle_timeout.count());
    {
      Result r(PQexec(c, begin.c_str()));
      if (!ok(r.get())) fail("begin", r.get(), c);
    }
    // Due rows in outbox order, skipping those other relays hold; `held`: an earlier unsent row of
    // the same key is not in this claim (another relay has it, or it is backing off), so this one
    // must wait for it. Held rows stay locked until the commit, which only delays them.
    const std::string claim =
        "WITH c AS MATERIALIZED (SELECT seq, message_key FROM " + qo + " WHERE sent_at IS NULL AND next_attempt_at <= " +
        now_ms + " ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED) "
        // NOT IN (a hashed subplan: seq is never NULL): one probe per earlier row of the key.
        "SELECT o.seq, o.id, o.destination, o.message_key, o.payload, o.headers, o.attempts, EXISTS (SELECT 1 FROM " +
        qo + " e WHERE e.message_key = c.message_key AND e.sent_at IS NULL AND e.seq < c.seq AND e.seq NOT IN "
        "(SELECT seq FROM c)) FROM c JOIN " + qo + " o ON o.seq = c.seq ORDER BY o.seq";
    Result rows = exec(c, claim, {std::to_string(opt.batch)}, "claim", 1);
    const PGresult* r = rows.get();
    std::vector<OutboxMessage> msgs;
    std::vector<std::int64_t> seqs, corrupt;
    std::size_t held = 0;
    for (int i = 0; i < PQntuples(r); ++i) {
      if (integer(r, i, 7, 1) != 0) {
        ++held;
        continue;
      }
      OutboxMessage m;
      m.sequence = integer(r, i, 0, 8);
      m.id = bytes(r, i, 1);
      m.destination = bytes(r, i, 2);
      m.message_key = bytes(r, i, 3);
      m.payload = bytes(r, i, 4);
      m.attempts = static_cast<std::uint32_t>(integer(r, i, 6, 4));
      if (!decode_headers(bytes(r, i, 5), m.headers)) {
        corrupt.push_back(m.sequence);  // fail closed: never published, visible in last_error
        continue;
      }
      seqs.push_back(m.sequence);
      msgs.push_back(std::move(m));
    }
    held_back += held;
    if (!corrupt.empty()) back_off(c, corrupt, "corrupt headers column (not written by OutboxWriter)");
    std::size_t published_rows = 0;
    if (!msgs.empty()) {
      std::string why;
      try {
        pub->publish(msgs);
      } catch (const std::exception& e) {
        why = e.what();
        if (why.empty()) why = "publish failed";
      }
      if (why.empty()) {
        const std::string mark = opt.retention.count() == 0
                                     ? "DELETE FROM " + qo + " WHERE seq = ANY ($1::bigint[])"
                                     : "UPDATE " + qo + " SET sent_at = " + now_ms + " WHERE seq = ANY ($1::bigint[])";
        exec(c, mark, {seq_array(seqs)}, "mark sent");
        // Other relays may hold rows back behind these: wake them at the commit.
        exec(c, "SELECT pg_notify($1, '')", {channel}, "notify");
        published_rows = msgs.size();
      } else {
        back_off(c, seqs, why);
        ++publish_failures;
        emit({OutboxRelayEvent::Kind::publish_failed, msgs.size(), why});
      }
    }
    Result done(PQexec(c, "COMMIT"));
    if (!ok(done.get())) fail("commit", done.get(), c);
    if (published_rows) {
      published += published_rows;
      ++batches;
      emit({OutboxRelayEvent::Kind::published, published_rows, {}});
    }
    return published_rows;
  }

  void back_off(PGconn* c, const std::vector<std::int64_t>& seqs, const std::string& why) {
    const std::string sql = "UPDATE " + qo + " SET attempts = attempts + 1, last_error = $2, next_attempt_at = " +
                            now_ms + " + LEAST($4::bigint, ($3::bigint * power(2, LEAST(attempts, 30)))::bigint) "
                            "WHERE seq = ANY ($1::bigint[])";
    std::string text = why.substr(0, 1000);
    std::replace(text.begin(), text.end(), '\0', '?');
    exec(c, sql, {seq_array(seqs), text, std::to_string(opt.backoff_initial.count()),
                  std::to_string(opt.backoff_max.count())},
         "back off");
  }

  std::size_t purge() {
    PGconn* c = session();
    const std::string sql = "DELETE FROM " + qo + " WHERE seq IN (SELECT seq FROM " + qo +
                            " WHERE sent_at IS NOT NULL AND sent_at < " + now_ms +
                            " - $1::bigint ORDER BY sent_at LIMIT 1000 FOR UPDATE SKIP LOCKED)";
    std::size_t total = 0;
    for (int round = 0; round < 1000; ++round) {
      Result r = exec(c, sql, {std::to_string(opt.retention.count())}, "purge");
      const std::size_t n = std::strtoull(PQcmdTuples(r.get()), nullptr, 10);
      total += n;
      if (n < 1000) break;
    }
    purged += total;
    if (total) emit({OutboxRelayEvent::Kind::purged, total, {}});
    return total;
  }

  // LISTEN on a session of its own; false when it cannot be set up (then the loop polls). A
  // transaction pooler hands each transaction any server session, so a LISTEN would hear nothing:
  // the relay polls, and says so once.
  bool ensure_listen() {
    if (opt.postgres.transaction_pooler) {
      if (!pooler_warned) {
        pooler_warned = true;
        emit({OutboxRelayEvent::Kind::warning, 0,
              fmt::format("behind a transaction pooler LISTEN cannot work: the relay polls every {} ms instead of "
                          "waking on NOTIFY (point it at the server or a session-mode pool to wake at once)",
                          opt.poll_interval.count())});
      }
      return false;
    }
    if (listen && PQstatus(listen) == CONNECTION_OK) return true;
    drop(listen);
    try {
      listen = connect();
    } catch (const error&) {
      return false;
    }
    const std::string sql = "LISTEN \"" + channel + "\"";
    Result r(PQexec(listen, sql.c_str()));
    if (!ok(r.get())) {
      drop(listen);
      return false;
    }
    return true;
  }

  // Waits for a NOTIFY, the stop pipe or `timeout`, whichever comes first.
  void wait(millis timeout) {
    pollfd fds[2] = {{wake[0], POLLIN, 0}, {-1, POLLIN, 0}};
    if (listen) fds[1].fd = PQsocket(listen);
    const int n = ::poll(fds, fds[1].fd >= 0 ? 2 : 1, static_cast<int>(timeout.count()));
    if (n <= 0) return;
    if (fds[0].revents) {
      char buf[64];
      while (::read(wake[0], buf, sizeof buf) > 0) {
      }
    }
    if (fds[1].fd >= 0 && fds[1].revents) {
      if (PQconsumeInput(listen) != 1) {
        drop(listen);
        return;
      }
      while (PGnotify* note = PQnotifies(listen)) {
        PQfreemem(note);
        ++notifications;
      }
    }
  }

  void poke() noexcept {
    const char b = 1;
    [[maybe_unused]] const auto w = ::write(wake[1], &b, 1);
  }

  void run(std::stop_token stop) {
    std::stop_callback on_stop(stop, [this] { poke(); });
    auto next_purge = Clock::now();
    while (!stop.stop_requested()) {
      bool more = false;
      try {
        // LISTEN before the claim: a row committed after it wakes us, one committed before is claimed.
        ensure_listen();
        more = run_once() > 0;
        if (Clock::now() >= next_purge) {
          purge();
          next_purge = Clock::now() + opt.purge_interval;
        }
      } catch (const std::exception& e) {
        emit({OutboxRelayEvent::Kind::error, 0, e.what()});
        more = false;
      }
      if (!more && !stop.stop_requested()) wait(opt.poll_interval);
    }
  }

  std::unique_ptr<OutboxPublisher> owned;
  OutboxPublisher* pub;
  OutboxRelayOptions opt;
  PostgresStore store;
  std::string qo, channel;
  PGconn* work = nullptr;
  PGconn* listen = nullptr;
  bool migrated = false;
  int wake[2] = {-1, -1};
  std::atomic<std::uint64_t> published{0}, batches{0}, publish_failures{0}, errors{0}, held_back{0}, purged{0},
      notifications{0};
  std::mutex obs_mu;
  std::function<void(const OutboxRelayEvent&)> observer;
  bool pooler_warned = false;
  std::mutex thread_mu;
  std::jthread thread;
};

OutboxRelay::OutboxRelay(OutboxPublisher& publisher, OutboxRelayOptions options)
    : impl_(std::make_unique<Impl>(&publisher, nullptr, std::move(options))) {}

OutboxRelay::OutboxRelay(std::unique_ptr<OutboxPublisher> publisher, OutboxRelayOptions options)
    : impl_(std::make_unique<Impl>(nullptr, std::move(publisher), std::move(options))) {}

OutboxRelay::~OutboxRelay() { stop(); }

std::size_t OutboxRelay::run_once() { return impl_->run_once(); }

std::size_t OutboxRelay::purge() { return impl_->purge(); }

void OutboxRelay::run(std::stop_token stop) { impl_->run(std::move(stop)); }

void OutboxRelay::start() {
  std::lock_guard lk(impl_->thread_mu);
  if (impl_->thread.joinable()) throw usage_error("idem: OutboxRelay::start called twice");
  impl_->thread = std::jthread([this](std::stop_token st) { impl_->run(std::move(st)); });
}

void OutboxRelay::stop() {
  std::lock_guard lk(impl_->thread_mu);
  if (!impl_->thread.joinable()) return;
  impl_->thread.request_stop();
  impl_->thread.join();
  impl_->thread = std::jthread();
}

void OutboxRelay::migrate() {
  impl_->store.migrate();
  impl_->migrated = true;
}

OutboxRelayStats OutboxRelay::stats() const noexcept {
  const Impl& i = *impl_;
  return {i.published.load(), i.batches.load(), i.publish_failures.load(), i.errors.load(),
          i.held_back.load(), i.purged.load(), i.notifications.load()};
}

void OutboxRelay::set_observer(std::function<void(const OutboxRelayEvent&)> observer) {
  std::lock_guard lk(impl_->obs_mu);
  impl_->observer = std::move(observer);
}

void OutboxRelay::set_observer(std::shared_ptr<Observer> observer) {
  if (!observer) return set_observer(std::function<void(const OutboxRelayEvent&)>{});
  set_observer([o = std::move(observer)](const OutboxRelayEvent& e) { o->on_relay(e); });
}

const OutboxRelayOptions& OutboxRelay::options() const noexcept { return impl_->opt; }

}  // namespace idem
