// idem in the peer benchmark's table (../shared/peers style): the same four cases as its bench.mjs
// (new keys / duplicates, 1 and --conc in flight; a no-op handler returning {"ok":true,"n":100};
// --dupkeys completed keys replayed round-robin; FLUSHALL before each run; a warm-up, then --reps
// timed runs of --ops, median), for three ways of running idem's guard:
//   blocking     RedisStore (default options: 8 lanes, then multiplexed), one thread per call in flight
//   multiplexed  AsyncRedisStore's blocking calls, one thread per call in flight (8 lanes, then multiplexed)
//   async        run_async on AsyncRedisStore: one thread, --conc coroutines in flight, one connection
// (multiplexed and async auto-batch: steps queued behind a write leave as one script call; the
// -nobatch modes set RedisOptions::auto_batch = 1, one call per step, to show what it buys)
// and writes bench.mjs's JSON schema (--json FILE), one "peer" per mode, so the harness's report
// puts the rows next to the peers'. Server commands per call come from INFO commandstats deltas,
// server CPU per call (serverCpuUsPerOp) from INFO cpu deltas, both over each timed run alone.
#include <utility>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>

#include <hiredis/hiredis.h>

#include "idem/asio/guard.hpp"
#include "idem/asio/redis_store.hpp"
#include "idem/redis.hpp"

namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

namespace {

struct Args {
  int port = 6390;
  std::string url;  // instead of the port: any URL the stores take (rediss://, redis-cluster://)
  int ops = 20000, reps = 3, warmup = 2000, conc = 16, dupkeys = 1000;
  std::vector<std::string> modes{"blocking", "multiplexed", "async"};
  std::vector<std::string> cases{"new-seq", "new-c16", "dup-seq", "dup-c16"};
  std::string json;
};

const std::string kResult = R"({"ok":true,"n":100})";

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string x; std::getline(in, x, ',');)
    if (!x.empty()) out.push_back(x);
  return out;
}

[[noreturn]] void usage(int rc) {
  std::fprintf(rc ? stderr : stdout,
               "usage: idem_peers_bench [--redis-port P | --url URL] [--json FILE] [--ops N] [--reps N] [--warmup N]\n"
               "                        [--conc N] [--dupkeys N] [--modes blocking,multiplexed,async,...]\n"
               "                        [--cases new-seq,new-c16,dup-seq,dup-c16]\n"
               "Runs idem's guard in the peer benchmark's cases against a running redis-server on 127.0.0.1\n"
               "(FLUSHALL before each run: use a server of its own) and prints one line per case; --json\n"
               "writes the peer harness's schema (bench.mjs) so its report.mjs puts idem next to the peers.\n"
               "Modes: blocking, multiplexed, async (auto-batching on), multiplexed-nobatch, async-nobatch.\n"
               "--url runs the stores on any URL they take (rediss://...?tls_ca_file=F, redis-cluster://a,b):\n"
               "no FLUSHALL and no commandstats then (server cmds/op 0); the keys are new per run anyway.\n"
               "Server CPU per call (INFO cpu used_cpu_user + used_cpu_sys over each timed run, / calls): the\n"
               "server's with --redis-port; with --url the sum over the server, the Sentinel's master or the\n"
               "cluster's masters (slot map at start), not measured over TLS (n/a, JSON null).\n"
               "--warmup 0 runs no warm-up. Cases: new-seq, dup-seq (1 in flight), new-c16, dup-c16 (--conc\n"
               "in flight), new-cN, dup-cN (N in flight).\n");
  std::exit(rc);
}

// A bad argument: one line, exit code 2.
[[noreturn]] void refuse(const std::string& why) {
  std::fprintf(stderr, "idem_peers_bench: %s (--help for usage)\n", why.c_str());
  std::exit(2);
}

// The whole of `v` as a decimal integer in [min, max]; anything else (sign, text, overflow) refused.
int number(const std::string& opt, const std::string& v, int min, int max = INT_MAX) {
  int x = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (v.empty() || ec != std::errc() || end != v.data() + v.size() || x < min || x > max)
    refuse(opt + " takes a whole number " +
           (max == INT_MAX ? ">= " + std::to_string(min) : "in " + std::to_string(min) + ".." + std::to_string(max)) +
           ", not '" + v + "'");
  return x;
}

const std::vector<std::string> kModes{"blocking", "multiplexed", "async", "multiplexed-nobatch", "async-nobatch"};

// Calls in flight of a case: -seq 1, -c16 --conc (as the harness's bench.mjs), -cN N; 0 = not a case.
int in_flight(const std::string& kase, int conc) {
  if (kase.rfind("new-", 0) != 0 && kase.rfind("dup-", 0) != 0) return 0;
  const std::string rest = kase.substr(4);
  if (rest == "seq") return 1;
  if (rest == "c16") return conc;
  if (rest.size() < 2 || rest[0] != 'c') return 0;
  int n = 0;
  const auto [end, ec] = std::from_chars(rest.data() + 1, rest.data() + rest.size(), n);
  return ec == std::errc() && end == rest.data() + rest.size() && n > 0 ? n : 0;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) refuse(k + " needs a value");
      return argv[++i];
    };
    if (k == "--help" || k == "-h") usage(0);
    else if (k == "--redis-port" || k == "--port") a.port = number(k, next(), 1, 65535);
    else if (k == "--url") a.url = next();
    else if (k == "--json" || k == "--out") a.json = next();
    else if (k == "--ops") a.ops = number(k, next(), 1);
    else if (k == "--reps") a.reps = number(k, next(), 1);
    else if (k == "--warmup") a.warmup = number(k, next(), 0);  // 0 = no warm-up
    else if (k == "--conc") a.conc = number(k, next(), 1);
    else if (k == "--dupkeys") a.dupkeys = number(k, next(), 1);
    else if (k == "--modes") a.modes = split(next());
    else if (k == "--cases") a.cases = split(next());
    else refuse("unknown option " + k);
  }
  if (a.modes.empty()) refuse("--modes names no mode");
  for (const auto& m : a.modes)
    if (std::find(kModes.begin(), kModes.end(), m) == kModes.end())
      refuse("unknown mode '" + m + "' (blocking, multiplexed, async, multiplexed-nobatch, async-nobatch)");
  if (a.cases.empty()) refuse("--cases names no case");
  for (const auto& c : a.cases)
    if (in_flight(c, a.conc) == 0) refuse("unknown case '" + c + "' (new-seq, new-c16, dup-seq, dup-c16, new-cN, dup-cN)");
  return a;
}

// The stores' options: the port on 127.0.0.1, or --url.
idem::RedisOptions base_options(const Args& a) {
  idem::RedisOptions o;
  if (a.url.empty()) o.port = a.port;
  else o.url = a.url;
  return o;
}

// A hiredis connection of the bench's own (not one of the stores').
struct ContextFree {
  void operator()(redisContext* c) const noexcept { redisFree(c); }
};
using Context = std::unique_ptr<redisContext, ContextFree>;

// The reply to `argv` on `c` as text (a status, a bulk string, an integer); throws on an error reply.
std::string command_on(redisContext* c, const std::vector<std::string>& argv) {
  std::vector<const char*> ptr;
  std::vector<std::size_t> len;
  for (const auto& x : argv) {
    ptr.push_back(x.data());
    len.push_back(x.size());
  }
  auto* r = static_cast<redisReply*>(redisCommandArgv(c, static_cast<int>(argv.size()), ptr.data(), len.data()));
  if (r == nullptr) throw std::runtime_error(std::string("redis: ") + c->errstr);
  std::string s = r->type == REDIS_REPLY_INTEGER ? std::to_string(r->integer)
                  : r->str                       ? std::string(r->str, r->len)
                                                 : std::string{};
  const bool err = r->type == REDIS_REPLY_ERROR;
  freeReplyObject(r);
  if (err) throw std::runtime_error("redis: " + argv[0] + ": " + s);
  return s;
}

// The bench's own connections to the server(s) the stores use.
//  --redis-port P: one to 127.0.0.1:P, for FLUSHALL, INFO commandstats and INFO cpu.
//  --url: one to each server the stores write to, for INFO cpu only (no FLUSHALL, no commandstats):
//    redis:// or unix:// its server; redis-sentinel:// the master the sentinels name at start;
//    redis-cluster:// every master of the slot map read at start (a failover or resharding during
//    the run is not followed). Over TLS (rediss://, ?tls=yes) none: server CPU is not measured.
// Server CPU is used_cpu_user + used_cpu_sys of INFO cpu (the whole redis-server process: its main
// thread, plus any I/O threads and background work such as expiry, cron, a cluster's bus),
// summed over those servers.
class Admin {
public:
  explicit Admin(const Args& a) : own_(a.url.empty()) {
    if (own_) {
      servers_.push_back(connect("127.0.0.1", a.port, {}, {}));
      return;
    }
    const idem::RedisOptions o = idem::parse_redis_url(a.url);
    if (o.tls.enabled) {
      std::fprintf(stderr, "idem_peers_bench: TLS URL: server CPU per call is not measured (n/a)\n");
      return;
    }
    // The server, the Sentinel's master or the cluster's masters, as a client of idem's finds them.
    const std::string where = o.sentinels.empty() && o.cluster_nodes.empty()
                                  ? (o.unix_socket.empty() ? o.host + ":" + std::to_string(o.port) : o.unix_socket)
                                  : idem::RedisClient(o).address();
    try {
      if (o.sentinels.empty() && o.cluster_nodes.empty() && !o.unix_socket.empty())
        servers_.push_back(connect_unix(o.unix_socket, o.user, o.password));
      else
        for (const auto& at : split(where)) {
          const auto colon = at.rfind(':');
          if (colon == std::string::npos) throw std::runtime_error("cannot tell host and port in '" + at + "'");
          std::string host = at.substr(0, colon);
          if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
          servers_.push_back(connect(host, std::atoi(at.c_str() + colon + 1), o.user, o.password));
        }
      (void)cpu_seconds();  // INFO may be denied (ACL): then not measured, the bench still runs
    } catch (const std::exception& e) {
      servers_.clear();
      std::fprintf(stderr, "idem_peers_bench: server CPU per call not measured (n/a): %s\n", e.what());
      return;
    }
    std::fprintf(stderr, "idem_peers_bench: server CPU summed over %s\n", where.c_str());
  }
  // FLUSHALL, with --redis-port only.
  void flushall() {
    if (own_) (void)command_on(servers_.front().get(), {"FLUSHALL"});
  }
  // Calls per command since the last CONFIG RESETSTAT, with --redis-port only ({} with --url).
  std::map<std::string, long long> commandstats() {
    std::map<std::string, long long> out;
    if (!own_) return out;
    std::istringstream in(command_on(servers_.front().get(), {"INFO", "commandstats"}));
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("cmdstat_", 0) != 0) continue;
      const auto colon = line.find(':');
      const auto calls = line.find("calls=");
      if (colon == std::string::npos || calls == std::string::npos) continue;
      out[line.substr(8, colon - 8)] = std::atoll(line.c_str() + calls + 6);
    }
    return out;
  }
  // Seconds of CPU the server(s) have used (used_cpu_user + used_cpu_sys, summed); NaN when not measured.
  double cpu_seconds() {
    if (servers_.empty()) return std::nan("");
    double sum = 0;
    for (const auto& c : servers_) {
      double sys = std::nan(""), user = std::nan("");
      std::istringstream in(command_on(c.get(), {"INFO", "cpu"}));
      for (std::string line; std::getline(in, line);) {
        if (line.rfind("used_cpu_sys:", 0) == 0) sys = std::strtod(line.c_str() + 13, nullptr);
        else if (line.rfind("used_cpu_user:", 0) == 0) user = std::strtod(line.c_str() + 14, nullptr);
      }
      if (std::isnan(sys) || std::isnan(user)) throw std::runtime_error("INFO cpu has no used_cpu_sys / used_cpu_user");
      sum += sys + user;
    }
    return sum;
  }

private:
  static Context checked(redisContext* c, const std::string& where) {
    Context ctx(c);
    if (ctx == nullptr || ctx->err)
      throw std::runtime_error("cannot connect to " + where + (ctx ? std::string(": ") + ctx->errstr : std::string{}));
    return ctx;
  }
  static void auth(redisContext* c, const std::string& user, const std::string& password) {
    if (password.empty()) return;
    if (user.empty()) (void)command_on(c, {"AUTH", password});
    else (void)command_on(c, {"AUTH", user, password});
  }
  static Context connect(const std::string& host, int port, const std::string& user, const std::string& password) {
    Context c = checked(redisConnect(host.c_str(), port), host + ":" + std::to_string(port));
    auth(c.get(), user, password);
    return c;
  }
  static Context connect_unix(const std::string& path, const std::string& user, const std::string& password) {
    Context c = checked(redisConnectUnix(path.c_str()), path);
    auth(c.get(), user, password);
    return c;
  }
  bool own_;
  std::vector<Context> servers_;
};

struct RunResult {
  double ops_per_sec = 0, p50 = 0, p99 = 0, ms = 0, cmds_per_op = 0;
  double cpu_us_per_op = std::nan("");  // server CPU µs per timed call; NaN when not measured
  std::map<std::string, double> cmds;
};

// Runs `calls` (keys in order) with `conc` in flight; `call(i)` returns the outcome's check.
double pct(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  return v[std::min(v.size() - 1, static_cast<std::size_t>(p / 100 * static_cast<double>(v.size())))];
}

class Mode {
public:
  virtual ~Mode() = default;
  // Runs keys[0..n) with `conc` in flight; latencies in ms per call; returns handler runs.
  virtual void run(const std::vector<std::string>& keys, int conc, std::vector<double>& lat) = 0;
  std::atomic<long long> handler_calls{0};
  std::atomic<long long> bad{0};
  // A call that threw: the run goes on (the others finish) and then fails with the first message.
  void failed(const std::exception& e) {
    std::lock_guard lk(mu);
    if (first_error.empty()) first_error = e.what();
    ++errors;
  }
  std::mutex mu;
  std::string first_error;
  long long errors = 0;
};

void check(Mode& m, const idem::Outcome<std::string>& out) {
  if (!out.value || *out.value != kResult) ++m.bad;
}

// One thread per call in flight, each taking the next key; `Guard` runs blocking.
template <class Guard>
void threaded(Mode& m, Guard& g, const std::vector<std::string>& keys, int conc, std::vector<double>& lat) {
  std::atomic<std::size_t> next{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < conc; ++t)
    ts.emplace_back([&] {
      for (;;) {
        const std::size_t i = next++;
        if (i >= keys.size()) return;
        const auto s = Clock::now();
        try {
          check(m, g.run(keys[i], [&] {
            ++m.handler_calls;
            return kResult;
          }));
        } catch (const std::exception& e) {
          m.failed(e);
        }
        lat[i] = std::chrono::duration<double, std::milli>(Clock::now() - s).count();
      }
    });
  for (auto& t : ts) t.join();
}

class Blocking final : public Mode {
public:
  explicit Blocking(const Args& a, int /*conc*/)
      : store_(base_options(a)),  // default options: pool.size (8) lanes, callers past them multiplexed
        guard_(store_, {.lease = 30s, .retention = 1h}) {}
  void run(const std::vector<std::string>& keys, int conc, std::vector<double>& lat) override {
    threaded(*this, guard_, keys, conc, lat);
  }

private:
  idem::RedisStore store_;
  idem::IdempotencyGuard<idem::RedisStore> guard_;
};

// An io_context on its own thread, for AsyncRedisStore.
struct IoThread {
  asio::io_context io{1};
  asio::executor_work_guard<asio::io_context::executor_type> work = asio::make_work_guard(io);
  std::thread thread{[this] { io.run(); }};
  ~IoThread() {
    work.reset();
    io.stop();
    thread.join();
  }
};

class Multiplexed final : public Mode {
public:
  Multiplexed(const Args& a, std::size_t batch)
      : store_(io_.io.get_executor(), options(a, batch)), guard_(store_, {.lease = 30s, .retention = 1h}) {}
  // batch: RedisOptions::auto_batch (1 = one script call per step)
  static idem::RedisOptions options(const Args& a, std::size_t batch) {
    idem::RedisOptions o = base_options(a);
    o.auto_batch = batch;
    return o;
  }
  void run(const std::vector<std::string>& keys, int conc, std::vector<double>& lat) override {
    threaded(*this, guard_, keys, conc, lat);
  }

private:
  IoThread io_;
  idem::AsyncRedisStore store_;
  idem::IdempotencyGuard<idem::AsyncRedisStore> guard_;
};

class Async final : public Mode {
public:
  Async(const Args& a, std::size_t batch)
      : store_(io_.get_executor(), Multiplexed::options(a, batch)), guard_(store_, {.lease = 30s, .retention = 1h}) {}
  // `conc` coroutines on this thread's io_context, each taking the next key.
  void run(const std::vector<std::string>& keys, int conc, std::vector<double>& lat) override {
    std::size_t next = 0;
    int live = conc;  // the connection's read stays pending, so run() would not return by itself
    for (int w = 0; w < conc; ++w)
      asio::co_spawn(
          io_,
          [&]() -> asio::awaitable<void> {
            for (;;) {
              const std::size_t i = next++;
              if (i >= keys.size()) {
                if (--live == 0) io_.stop();
                co_return;
              }
              const auto s = Clock::now();
              try {
                check(*this, co_await guard_.run_async(keys[i], "", [&] {
                  ++handler_calls;
                  return kResult;
                }));
              } catch (const std::exception& e) {
                failed(e);
              }
              lat[i] = std::chrono::duration<double, std::milli>(Clock::now() - s).count();
            }
          },
          asio::detached);
    io_.restart();
    io_.run();
  }

private:
  asio::io_context io_{1};
  idem::AsyncRedisStore store_;
  idem::IdempotencyGuard<idem::AsyncRedisStore> guard_;
};

std::unique_ptr<Mode> make_mode(const std::string& name, const Args& a) {
  if (name == "blocking") return std::make_unique<Blocking>(a, a.conc);
  if (name == "multiplexed") return std::make_unique<Multiplexed>(a, idem::RedisOptions{}.auto_batch);
  if (name == "async") return std::make_unique<Async>(a, idem::RedisOptions{}.auto_batch);
  // auto-batching off: one script call per step, as before it existed
  if (name == "multiplexed-nobatch") return std::make_unique<Multiplexed>(a, 1);
  if (name == "async-nobatch") return std::make_unique<Async>(a, 1);
  throw std::runtime_error("unknown mode '" + name +
                           "' (blocking, multiplexed, async, multiplexed-nobatch, async-nobatch)");
}

int run_seq = 0;

RunResult one_run(Mode& m, Admin& admin, const std::string& mode, const std::string& kase, int n, const Args& a) {
  admin.flushall();
  // Without FLUSHALL (--url) another invocation's keys are still there: this one's are its own.
  static const std::string invocation =
      a.url.empty() ? std::string() : std::to_string(std::chrono::system_clock::now().time_since_epoch().count()) + "-";
  const std::string id = invocation + mode + "-" + std::to_string(run_seq++);
  std::vector<std::string> keys;
  const bool dup = kase.rfind("dup", 0) == 0;
  if (!dup) {
    for (int i = 0; i < n; ++i) keys.push_back(id + "-" + std::to_string(i));
  } else {
    std::vector<std::string> seed;
    for (int j = 0; j < a.dupkeys; ++j) seed.push_back(id + "-dup-" + std::to_string(j));
    std::vector<double> ignore(seed.size());
    m.run(seed, 1, ignore);
    for (int i = 0; i < n; ++i) keys.push_back(seed[static_cast<std::size_t>(i % a.dupkeys)]);
  }
  const int conc = in_flight(kase, a.conc);
  const long long h0 = m.handler_calls;
  m.bad = 0;
  m.errors = 0;
  m.first_error.clear();
  // The stats bracket the timed calls alone (not FLUSHALL, not the duplicates' seeding), as bench.mjs's.
  const auto s0 = admin.commandstats();
  const double cpu0 = admin.cpu_seconds();
  std::vector<double> lat(keys.size());
  const auto t0 = Clock::now();
  m.run(keys, conc, lat);
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  const double cpu1 = admin.cpu_seconds();
  const auto s1 = admin.commandstats();
  if (m.errors)
    throw std::runtime_error(mode + " " + kase + ": " + std::to_string(m.errors) + " calls failed, the first: " + m.first_error);
  const long long ran = m.handler_calls - h0;
  if (dup && ran != 0) throw std::runtime_error(mode + " " + kase + ": the handler ran " + std::to_string(ran) + " times on replayed keys");
  if (!dup && ran != n) throw std::runtime_error(mode + " " + kase + ": the handler ran " + std::to_string(ran) + " times for " + std::to_string(n) + " new keys");
  if (m.bad) throw std::runtime_error(mode + " " + kase + ": " + std::to_string(m.bad.load()) + " calls returned a wrong result");
  RunResult r;
  r.ms = ms;
  r.cpu_us_per_op = (cpu1 - cpu0) * 1e6 / n;  // NaN stays NaN (not measured)
  r.ops_per_sec = n / ms * 1000;
  std::sort(lat.begin(), lat.end());
  r.p50 = pct(lat, 50);
  r.p99 = pct(lat, 99);
  long long total = 0;
  for (const auto& [k, v] : s1) {
    const auto it = s0.find(k);
    const long long d = v - (it == s0.end() ? 0 : it->second);
    if (d > 0 && k != "info") {
      r.cmds[k] = static_cast<double>(d) / n;
      total += d;
    }
  }
  r.cmds_per_op = static_cast<double>(total) / n;
  return r;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string num(double x, int prec = 4) {
  if (std::isnan(x)) return "null";  // not measured: the report shows n/a
  char b[64];
  std::snprintf(b, sizeof b, "%.*f", prec, x);
  return b;
}

}  // namespace

int main(int argc, char** argv) try {
  const Args a = parse(argc, argv);
  Admin admin(a);
  std::ostringstream js;
  js << "{\n  \"tool\": \"idem_peers_bench\",\n  \"node\": \"n/a (C++)\",\n  \"ops\": " << a.ops << ", \"reps\": " << a.reps << ", \"warmup\": "
     << a.warmup << ", \"conc\": " << a.conc << ", \"dupKeys\": " << a.dupkeys << ",\n  \"peers\": [";
  bool first_peer = true;
  for (const std::string& mode : a.modes) {
    auto m = make_mode(mode, a);
    const std::string label = mode == "blocking"      ? "idem IdempotencyGuard::run on RedisStore (8 lanes, then multiplexed; one thread per call in flight)"
                              : mode == "multiplexed" ? "idem IdempotencyGuard::run on AsyncRedisStore (8 lanes, then multiplexed; one thread per call in flight)"
                                                      : "idem IdempotencyGuard::run_async on AsyncRedisStore (one thread, coroutines, one pipelined connection)";
    std::fprintf(stderr, "== idem-%s: %s\n", mode.c_str(), label.c_str());
    js << (first_peer ? "" : ",") << "\n    {\"name\": \"idem-" << mode << "\", \"label\": \"" << label
       << "\", \"versions\": {\"idem\": \"" << IDEM_VERSION_MAJOR << "." << IDEM_VERSION_MINOR << "." << IDEM_VERSION_PATCH
       << "\"}, \"cases\": {";
    first_peer = false;
    bool first_case = true;
    // Client commands per call (the harness's "round trips": commands sent by the client, not
    // those its Lua runs): idem sends only EVALSHA, so it is commandstats' evalsha count per call.
    std::map<std::string, double> client_cmds;
    for (const std::string& kase : a.cases) {
      if (a.warmup > 0) (void)one_run(*m, admin, mode, kase, a.warmup, a);  // --warmup 0: none
      std::vector<RunResult> runs;
      for (int r = 0; r < a.reps; ++r) runs.push_back(one_run(*m, admin, mode, kase, a.ops, a));
      auto med = [&](auto f) {
        std::vector<double> v;
        for (const auto& r : runs) v.push_back(f(r));
        return median(v);
      };
      const double ops = med([](const RunResult& r) { return r.ops_per_sec; });
      const double p50 = med([](const RunResult& r) { return r.p50; });
      const double p99 = med([](const RunResult& r) { return r.p99; });
      const double cpo = med([](const RunResult& r) { return r.cmds_per_op; });
      // NaN in every run when the server's CPU is not measured (TLS); never in some runs only.
      const double cpu = std::isnan(runs[0].cpu_us_per_op) ? runs[0].cpu_us_per_op
                                                            : med([](const RunResult& r) { return r.cpu_us_per_op; });
      if (kase.size() > 4 && kase.substr(kase.size() - 3) == "seq" && runs[0].cmds.count("evalsha"))
        client_cmds[kase.substr(0, 3)] = runs[0].cmds.at("evalsha");
      std::string each;
      for (const auto& r : runs) each += (each.empty() ? "" : "/") + std::to_string(static_cast<long long>(r.ops_per_sec));
      const std::string cpu_text = std::isnan(cpu) ? "n/a" : num(cpu, 1);
      std::fprintf(stderr, "  %-8s %8.0f ops/s  p50 %.3f ms  p99 %.3f ms  server cmds/op %.2f  server %s us/call  runs %s\n",
                   kase.c_str(), ops, p50, p99, cpo, cpu_text.c_str(), each.c_str());
      std::printf("RESULT mode=%s case=%s ops_per_sec=%.0f p50_ms=%.4f p99_ms=%.4f cmds_per_op=%.2f server_cpu_us_per_op=%s\n",
                  mode.c_str(), kase.c_str(), ops, p50, p99, cpo, cpu_text.c_str());
      js << (first_case ? "" : ",") << "\n      \"" << kase << "\": {\"opsPerSec\": " << num(ops, 1) << ", \"p50\": " << num(p50)
         << ", \"p99\": " << num(p99) << ", \"serverCmdsPerOp\": " << num(cpo, 3) << ", \"serverCpuUsPerOp\": " << num(cpu, 2) << ", \"cmds\": {";
      first_case = false;
      bool fc = true;
      for (const auto& [k, v] : runs[0].cmds) {
        js << (fc ? "" : ", ") << "\"" << k << "\": " << num(v, 3);
        fc = false;
      }
      js << "}, \"runs\": [";
      for (std::size_t i = 0; i < runs.size(); ++i)
        js << (i ? ", " : "") << "{\"opsPerSec\": " << static_cast<long long>(runs[i].ops_per_sec) << ", \"p50\": "
           << num(runs[i].p50) << ", \"p99\": " << num(runs[i].p99) << ", \"ms\": " << static_cast<long long>(runs[i].ms)
           << ", \"serverCpuUsPerOp\": " << num(runs[i].cpu_us_per_op, 2) << "}";
      js << "]}";
    }
    js << "\n    }, \"roundTrips\": {";
    bool first_rt = true;
    for (const auto& [kind, n] : client_cmds) {
      js << (first_rt ? "" : ", ") << "\"" << kind << "\": {\"roundTripsPerOp\": " << num(n, 3)
         << ", \"clientCmds\": {\"EVALSHA\": " << num(n, 3) << "}}";
      first_rt = false;
    }
    js << "}}";
  }
  js << "\n  ]\n}\n";
  admin.flushall();
  if (!a.json.empty()) {
    std::ofstream(a.json) << js.str();
    std::fprintf(stderr, "wrote %s\n", a.json.c_str());
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "idem_peers_bench: %s\n", e.what());
  return 1;
}
