// PostgresStore across processes: many consumers on the same keys, a consumer killed mid-handler,
// a paused lease holder, and a server restart. Children are fork+exec'd (posix_spawn) helpers.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "idem/postgres.hpp"
#include "pg_support.hpp"

extern char** environ;

using namespace std::chrono_literals;

namespace {

// A spawned child with a pipe to its stdin and one from its stdout; killed if still running.
class Child {
public:
  explicit Child(const std::vector<std::string>& args) {
    int in[2], out[2];
    REQUIRE(::pipe2(in, O_CLOEXEC) == 0);
    REQUIRE(::pipe2(out, O_CLOEXEC) == 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    const int rc = ::posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    ::close(in[0]);
    ::close(out[1]);
    to_ = in[1];
    from_ = out[0];
    REQUIRE(rc == 0);
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::kill(pid_, SIGCONT);
      ::waitpid(pid_, nullptr, 0);
    }
    if (to_ >= 0) ::close(to_);
    if (from_ >= 0) ::close(from_);
  }
  pid_t pid() const { return pid_; }
  void signal(int sig) { ::kill(pid_, sig); }
  void write_line(const std::string& s) {
    const std::string l = s + "\n";
    REQUIRE(::write(to_, l.data(), l.size()) == static_cast<ssize_t>(l.size()));
  }
  // The next line of the child's stdout, or "" on EOF / timeout.
  std::string read_line(std::chrono::milliseconds timeout = 30s) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      auto nl = buf_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return line;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left <= 0ms) return "";
      pollfd p{from_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return "";
      char tmp[512];
      const ssize_t n = ::read(from_, tmp, sizeof tmp);
      if (n <= 0) return "";
      buf_.append(tmp, static_cast<std::size_t>(n));
    }
  }
  // Exit status (or -signal), waiting at most `timeout`; kills the child on timeout.
  int wait(std::chrono::milliseconds timeout = 60s) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    int st = 0;
    for (;;) {
      const pid_t r = ::waitpid(pid_, &st, WNOHANG);
      if (r == pid_) break;
      if (std::chrono::steady_clock::now() >= deadline) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &st, 0);
        pid_ = -1;
        return -1000;
      }
      std::this_thread::sleep_for(10ms);
    }
    pid_ = -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
  }

private:
  pid_t pid_ = -1;
  int to_ = -1, from_ = -1;
  std::string buf_;
};

int run_script(const std::vector<std::string>& args) {
  std::vector<std::string> a{"/bin/sh", IDEM_PG_CLUSTER_SCRIPT};
  a.insert(a.end(), args.begin(), args.end());
  Child c(a);
  return c.wait(120s);
}

}  // namespace

TEST_CASE("postgres: 8 processes on the same keys, transactional: each key once, the sum exact",
          "[postgres][process][tx]") {
  pgtest::Raw raw;
  const std::string t = "bal_" + pgtest::random_hex(8);
  raw.exec("CREATE TABLE " + t + " (id int PRIMARY KEY, balance bigint NOT NULL); INSERT INTO " + t +
           " VALUES (1, 0); CREATE TABLE " + t + "_applied (key text PRIMARY KEY, fence bigint NOT NULL)");
  pgtest::store().migrate();  // so the children do not all race to create it
  const int procs = 8, keys = 40;
  const std::string prefix = "p" + pgtest::random_hex() + ":";
  std::vector<std::unique_ptr<Child>> kids;
  for (int i = 0; i < procs; ++i)
    kids.push_back(std::make_unique<Child>(std::vector<std::string>{
        IDEM_PG_WORKER, "tx-increment", pgtest::conninfo(), t, prefix, std::to_string(keys), std::to_string(i + 1)}));
  int executed = 0;
  for (auto& k : kids) {
    const std::string line = k->read_line(90s);
    INFO("child said: " << line);
    REQUIRE(line.rfind("executed ", 0) == 0);
    executed += std::stoi(line.substr(9));
    CHECK(k->wait() == 0);
  }
  CHECK(executed == keys);
  CHECK(raw.scalar("SELECT balance FROM " + t + " WHERE id = 1") == std::to_string(keys));
  CHECK(raw.scalar("SELECT count(*) FROM " + t + "_applied") == std::to_string(keys));
  CHECK(raw.scalar("SELECT count(*) FROM idem_test.records WHERE key::text LIKE '%' AND state = 2 AND "
                   "position(convert_to('" + prefix + "', 'UTF8') in key) = 1") == std::to_string(keys));
  raw.exec("DROP TABLE " + t + ", " + t + "_applied");
}

TEST_CASE("postgres: a consumer SIGKILLed mid-handler commits nothing, and redelivery runs cleanly",
          "[postgres][process][tx]") {
  pgtest::Raw raw;
  const std::string t = "kill_" + pgtest::random_hex(8);
  raw.exec("CREATE TABLE " + t + " (id text PRIMARY KEY)");
  idem::PostgresStore s = pgtest::store(idem::PostgresMode::transactional);
  s.migrate();
  const std::string k = "k" + pgtest::random_hex() + ":killed";
  Child c({IDEM_PG_WORKER, "tx-hang", pgtest::conninfo(), t, k});
  REQUIRE(c.read_line() == "ready");
  c.signal(SIGKILL);
  CHECK(c.wait() == -SIGKILL);
  CHECK_FALSE(s.inspect(k).has_value());
  CHECK(raw.scalar("SELECT count(*) FROM " + t) == "0");
  idem::GuardOptions go;
  go.wait_for_in_flight = 10s;  // the server notices the dead client within moments
  idem::IdempotencyGuard g(s, go);
  auto out = g.run(k, [&](const auto& ctx) {
    ctx.tx->exec("INSERT INTO " + t + " (id) VALUES ($1)", k);
    return ctx.attempt;
  });
  CHECK(out.status == idem::Status::executed);
  CHECK(*out.value == 1u);  // the killed attempt left no trace, not even in attempts
  CHECK(raw.scalar("SELECT count(*) FROM " + t) == "1");
  raw.exec("DROP TABLE " + t);
}

namespace {
// The end of both paused-holder cases: the holder wakes up after the taker's run, finds its claim
// gone (lease_lost) and exits cleanly; the record keeps the taker's result.
void resume_paused_holder(Child& c, idem::PostgresStore& s, const std::string& k) {
  c.signal(SIGCONT);
  c.write_line("go");
  CHECK(c.read_line() == "lease_lost");
  CHECK(c.wait() == 0);
  auto rec = s.inspect(k);
  REQUIRE(rec);
  CHECK(rec->result == "from-taker");
}
}  // namespace

TEST_CASE("postgres: a SIGSTOPped lease holder gets lease_lost after a takeover", "[postgres][process]") {
  idem::PostgresStore s = pgtest::store();
  s.migrate();
  const std::string k = "k" + pgtest::random_hex() + ":paused";
  Child c({IDEM_PG_WORKER, "lease-hold", pgtest::conninfo(), k, "300"});
  REQUIRE(c.read_line() == "ready 1");
  c.signal(SIGSTOP);
  std::this_thread::sleep_for(450ms);
  idem::IdempotencyGuard g(s, {.lease = 30s, .retention = 600s});
  auto out = g.run(k, [](const auto& ctx) {
    CHECK(ctx.takeover);
    return std::string("from-taker");
  });
  CHECK(out.status == idem::Status::executed);
  CHECK(out.fence == 2);
  resume_paused_holder(c, s, k);
}

TEST_CASE("postgres: a paused transactional holder loses its claim after one idle lease", "[postgres][process][tx]") {
  idem::PostgresStore s = pgtest::store(idem::PostgresMode::transactional);
  s.migrate();
  const std::string k = "k" + pgtest::random_hex() + ":tx-paused";
  Child c({IDEM_PG_WORKER, "tx-hold", pgtest::conninfo(), k, "300"});
  REQUIRE(c.read_line() == "ready 1");
  c.signal(SIGSTOP);
  idem::GuardOptions go;
  go.wait_for_in_flight = 5s;  // the server ends the paused session after 300 ms idle in transaction
  idem::IdempotencyGuard g(s, go);
  const auto t0 = std::chrono::steady_clock::now();
  auto out = g.run(k, [](const auto&) { return std::string("from-taker"); });
  CHECK(out.status == idem::Status::executed);
  CHECK(std::chrono::steady_clock::now() - t0 < 3s);
  resume_paused_holder(c, s, k);
}

TEST_CASE("postgres: a batch SIGKILLed midway: every item whose handler returned is a duplicate after",
          "[postgres][process][batch]") {
  idem::PostgresStore s = pgtest::store();
  s.migrate();
  const std::string prefix = "b" + pgtest::random_hex() + ":";
  constexpr int items = 40;
  Child c({IDEM_PG_WORKER, "batch", pgtest::conninfo(), prefix, std::to_string(items), "15"});
  // Killed after a random number of handlers: each one's completion was sent (and, being its own
  // transaction, committed) as it returned.
  std::mt19937 rng(std::random_device{}());
  const int wait_for = 5 + static_cast<int>(rng() % 25);
  std::vector<int> ran;
  for (int i = 0; i < wait_for; ++i) {
    const std::string l = c.read_line();
    REQUIRE(l.rfind("ran ", 0) == 0);
    ran.push_back(std::stoi(l.substr(4)));
  }
  c.signal(SIGKILL);
  CHECK(c.wait() == -SIGKILL);
  // The last "ran" may not have sent its completion yet (killed between the two); every earlier
  // one was sent at least a handler (15 ms) before the kill, and ran and committed on its own.
  int completed = 0;
  for (std::size_t k = 0; k + 1 < ran.size(); ++k) {
    auto rec = s.inspect(prefix + std::to_string(ran[k]));
    REQUIRE(rec);
    CHECK(rec->state == idem::State::completed);
    completed += rec->state == idem::State::completed;
  }
  INFO("killed after " << wait_for << " handlers of " << items);
  CHECK(completed == wait_for - 1);
  idem::IdempotencyGuard g(s, {.lease = 30s, .retention = 600s});
  std::vector<std::string> keys;
  for (std::size_t k = 0; k + 1 < ran.size(); ++k) keys.push_back(prefix + std::to_string(ran[k]));
  std::vector<idem::BatchItem> again;
  for (const auto& k : keys) again.push_back({k, ""});
  int reran = 0;
  auto r = g.run_batch(again, [&](const idem::BatchItem&) { return ++reran; });
  CHECK(reran == 0);
  for (std::size_t k = 0; k < again.size(); ++k) {
    CHECK(r.outcomes[k].status == idem::Status::duplicate);
    CHECK(*r.outcomes[k].value == ran[k]);
  }
  // The items not reached stay claimed until their lease lapses: not run by anyone meanwhile.
  auto rest = s.acquire(prefix + std::to_string(items - 1), pgtest::ap(7));
  CHECK(rest.status == idem::AcquireStatus::in_flight);
}

TEST_CASE("postgres: after a server restart the first call on each of N idle pooled sessions succeeds",
          "[postgres][process][fault]") {
  const std::string state = std::string(IDEM_PG_CONNINFO_FILE_DEFAULT) + ".restart-" + pgtest::random_hex(6);
  REQUIRE(run_script({"start", state}) == 0);
  struct Stop {
    std::string st;
    ~Stop() { run_script({"stop", st}); }
  } stop{state};
  std::string ci;
  {
    std::ifstream in(state + "/conninfo");
    std::getline(in, ci);
  }
  REQUIRE_FALSE(ci.empty());
  constexpr int n = 4;
  auto o = pgtest::options();
  o.client.conninfo = ci;
  o.client.pool.size = n;
  auto client = std::make_shared<idem::PostgresClient>(o.client);
  idem::PostgresStore s(client, o.store);
  // Fill the pool: n transactions at once open n sessions (the lease store shares their
  // statements: same table), and all go back idle.
  {
    auto tx_opt = o.store;
    tx_opt.mode = idem::PostgresMode::transactional;
    idem::PostgresStore txs(client, tx_opt);
    std::vector<idem::PostgresStore::Transaction> open;
    for (int i = 0; i < n; ++i) open.push_back(txs.begin(pgtest::key("fill"), pgtest::ap(100 + i)));
    for (auto& t : open) REQUIRE(t.commit("r", 60s) == idem::WriteStatus::ok);
  }
  auto a = s.acquire("restart-key", pgtest::ap(1));
  REQUIRE(a.status == idem::AcquireStatus::acquired);
  REQUIRE(run_script({"restart", state}) == 0);
  // Every session in the pool is dead now; none of the next n calls may fail, the lease-mode
  // complete of a handler that already ran first of all.
  CHECK(s.complete("restart-key", a.holder, "after restart", 600s) == idem::WriteStatus::ok);
  const auto k = pgtest::key("after");
  auto b = s.acquire(k, pgtest::ap(2));
  CHECK(b.status == idem::AcquireStatus::acquired);
  CHECK(s.complete(k, b.holder, "b", 60s) == idem::WriteStatus::ok);
  auto d = s.acquire("restart-key", pgtest::ap(3));
  CHECK(d.status == idem::AcquireStatus::duplicate);
  CHECK(d.payload == "after restart");
}
