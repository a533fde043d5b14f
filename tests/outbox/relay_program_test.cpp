// idem-outbox-relay, the program (src/outbox/relay_main.cpp, docs/relay.md), as an operator runs it:
// a separate process against real servers — rows on the PostgreSQL fixture server, published to a
// redis-server, librdkafka's mock cluster (hosted by this test process, reached over loopback), a
// nats-server -js, the RabbitMQ fixture broker — each row exactly once with its outbox id, then
// SIGTERM and exit 0. Also its settings (flags > IDEM_RELAY_* > config file; bad ones exit 2 naming
// the setting), --help, and /metrics scraped directly and by a real Prometheus server. One server
// per case; the RabbitMQ case ([rabbitmq]) is listed apart and run by its own CTest entry, which
// needs the broker fixture (without it the case fails: no broker port).

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "outbox_support.hpp"
#include "support/http_get.hpp"
#include "support/prometheus_server.hpp"
#include "support/temp_dir.hpp"
#ifdef IDEM_RELAY_TEST_KAFKA
#include "kafka_support.hpp"
#endif
#ifdef IDEM_RELAY_TEST_RABBITMQ
#include "rabbitmq_support.hpp"
#endif
#ifdef IDEM_RELAY_TEST_NATS
#include "nats/nats_server.hpp"
#endif

#ifndef IDEM_OUTBOX_RELAY_PROGRAM
#error "IDEM_OUTBOX_RELAY_PROGRAM must name the idem-outbox-relay executable"
#endif
#ifndef IDEM_PROMETHEUS_SERVER
#define IDEM_PROMETHEUS_SERVER ""
#endif

using namespace outboxtest;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// A temp dir removed at the end, with everything in it (tests/support/temp_dir.hpp).
struct TempDir : idem::test::TempDir {
  TempDir() : idem::test::TempDir("idem-relay-program-") {}
};

// A child process (the relay) with an environment of the test's choosing (the
// parent's without any IDEM_RELAY_* variable, plus `env`), stdout and stderr in a log file; it dies
// with the test (PR_SET_PDEATHSIG) and is SIGKILLed by the destructor if still running.
class Process {
 public:
  Process(std::vector<std::string> args, const std::vector<std::string>& env, std::string log) : log_(std::move(log)) {
    std::vector<std::string> envs;
    for (char** e = environ; *e; ++e)
      if (std::strncmp(*e, "IDEM_RELAY_", 11) != 0) envs.emplace_back(*e);
    envs.insert(envs.end(), env.begin(), env.end());
    std::vector<char*> argv, envp;  // built before fork: the child of a threaded process must not allocate
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : envs) envp.push_back(e.data());
    envp.push_back(nullptr);
    const pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(126);
      const int fd = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
        ::close(fd);
      }
      ::execve(argv[0], argv.data(), envp.data());
      ::_exit(127);
    }
  }
  ~Process() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      int st = 0;
      ::waitpid(pid_, &st, 0);
    }
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  [[nodiscard]] std::string log() const { return slurp(log_); }
  [[nodiscard]] bool running() {
    if (pid_ <= 0) return false;
    int st = 0;
    if (::waitpid(pid_, &st, WNOHANG) == pid_) {
      pid_ = -1;
      status_ = st;
      return false;
    }
    return true;
  }
  // Waits until the log matches `re` (true), or the process exits or `limit` passes (false).
  bool wait_log(const std::regex& re, std::chrono::milliseconds limit, std::smatch* m = nullptr) {
    const auto end = Clock::now() + limit;
    while (Clock::now() < end) {
      static thread_local std::string text;
      text = log();
      std::smatch local;
      if (std::regex_search(text, m ? *m : local, re)) return true;
      if (!running()) return false;
      std::this_thread::sleep_for(20ms);
    }
    return false;
  }
  // Its exit code (128 + signal when killed) once it ends, SIGKILLed after `limit`; -1 then.
  int wait(std::chrono::milliseconds limit = 20s) {
    const auto end = Clock::now() + limit;
    while (running()) {
      if (Clock::now() > end) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status_, 0);
        pid_ = -1;
        return -1;
      }
      std::this_thread::sleep_for(10ms);
    }
    return WIFEXITED(status_) ? WEXITSTATUS(status_) : 128 + WTERMSIG(status_);
  }
  int stop(int sig = SIGTERM, std::chrono::milliseconds limit = 20s) {
    if (pid_ > 0) ::kill(pid_, sig);
    return wait(limit);
  }

 private:
  std::string log_;
  pid_t pid_ = -1;
  int status_ = 0;
};

// The program with `args`, run to its end (for --help, --check-config and the refusals).
struct Ran {
  int code = -1;
  std::string out;
};
Ran run_relay(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
  TempDir dir;
  std::vector<std::string> argv{IDEM_OUTBOX_RELAY_PROGRAM};
  argv.insert(argv.end(), args.begin(), args.end());
  Process p(argv, env, dir.path + "/out");
  const int code = p.wait(20s);
  return {code, p.log()};
}

// The relay as a daemon; its log in `dir`.
std::unique_ptr<Process> start_relay(const TempDir& dir, const std::vector<std::string>& args,
                                     const std::vector<std::string>& env = {}) {
  std::vector<std::string> argv{IDEM_OUTBOX_RELAY_PROGRAM};
  argv.insert(argv.end(), args.begin(), args.end());
  return std::make_unique<Process>(argv, env, dir.path + "/relay.log");
}

long unsent(const Env& env) {
  pgtest::Raw raw;
  return std::stol(raw.scalar("SELECT count(*) FROM " + env.outbox() + " WHERE sent_at IS NULL"));
}
long rows(const Env& env) {
  pgtest::Raw raw;
  return std::stol(raw.scalar("SELECT count(*) FROM " + env.outbox()));
}

// Until every row of the outbox is marked sent (the relay has the broker's acknowledgement).
void wait_all_sent(const Env& env, Process& relay, long expected, std::chrono::seconds limit = 20s) {
  const auto end = Clock::now() + limit;
  while (Clock::now() < end) {
    if (rows(env) == expected && unsent(env) == 0) return;
    if (!relay.running()) FAIL("the relay exited early:\n" << relay.log());
    std::this_thread::sleep_for(50ms);
  }
  FAIL("rows not all sent within " << limit.count() << " s; " << unsent(env) << " unsent; the relay's log:\n"
                                   << relay.log());
}

// The ids Env::write gives its rows: handler `prefix + "in-" + n`, its message 0.
std::multiset<std::string> expected_ids(const Env& env, const std::string& prefix, int from, int to) {
  std::multiset<std::string> ids;
  for (int n = from; n < to; ++n)
    ids.insert(idem::outbox_message_id(env.scope(), prefix + "in-" + std::to_string(n), 0));
  return ids;
}

using idem::test::http_get;

// The value of the sample `series` (name and labels exactly as exposed) in a /metrics text; -1 when absent.
double sample(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  return -1;
}

int metrics_port(Process& relay) {
  std::smatch m;
  if (!relay.wait_log(std::regex("metrics on http://127\\.0\\.0\\.1:([0-9]+)/metrics"), 10s, &m))
    FAIL("the relay did not say where /metrics is:\n" << relay.log());
  return std::stoi(m[1].str());
}

const std::regex started("relaying idem_test\\.[a-z0-9]+_outbox to ");
const std::regex stopped("stopped; published [0-9]+ rows");

}  // namespace

// ---------------------------------------------------------------------------------------------------

TEST_CASE("relay program: --help lists every setting, its variable and the exit codes", "[relay-program]") {
  const Ran r = run_relay({"--help"});
  CHECK(r.code == 0);
  for (const char* flag : {"--config",
                           "--publisher",
                           "--conninfo",
                           "--conninfo-file",
                           "--schema",
                           "--table",
                           "--batch",
                           "--poll-ms",
                           "--retention-ms",
                           "--backoff-max-ms",
                           "--claim-idle-timeout-ms",
                           "--transaction-pooler",
                           "--once",
                           "--metrics-listen",
                           "--check-config",
                           "--version",
                           "--redis",
                           "--stream-prefix",
                           "--maxlen",
                           "--kafka-brokers",
                           "--kafka-property",
                           "--kafka-timeout-ms",
                           "--kafka-client-id",
                           "--rabbitmq-url",
                           "--rabbitmq-user",
                           "--rabbitmq-password",
                           "--rabbitmq-ca-file",
                           "--rabbitmq-cert-file",
                           "--rabbitmq-key-file",
                           "--rabbitmq-verify-peer",
                           "--rabbitmq-verify-hostname",
                           "--rabbitmq-timeout-ms",
                           "--rabbitmq-key-header",
                           "--nats-url",
                           "--nats-subject-prefix",
                           "--nats-expect-stream",
                           "--nats-timeout-ms",
                           "IDEM_RELAY_CONNINFO",
                           "IDEM_RELAY_PUBLISHER",
                           "IDEM_RELAY_KAFKA_BROKERS",
                           "IDEM_RELAY_CONFIG",
                           "Exit status"}) {
    INFO(flag);
    CHECK(r.out.find(flag) != std::string::npos);
  }
  const Ran v = run_relay({"--version"});
  CHECK(v.code == 0);
  CHECK(v.out == std::string("idem-outbox-relay ") + idem::version_string + "\n");
}

TEST_CASE("relay program: flags win over IDEM_RELAY_* variables, which win over the config file", "[relay-program]") {
  TempDir dir;
  const std::string cfg = dir.file("relay.toml",
                                   "# a config file\n"
                                   "publisher = \"kafka\"\n"
                                   "conninfo = \"host=db password=file-secret\"\n"
                                   "schema = \"from_file\"\n"
                                   "table = \"from_file\"\n"
                                   "batch = 7\n"
                                   "poll_ms = 111\n"  // '_' for '-' is accepted
                                   "[kafka]\n"
                                   "brokers = \"file-broker:9092\"\n"
                                   "property = [\"socket.keepalive.enable=true\", \"sasl.password=file-secret\"]\n");
  const std::vector<std::string> env{"IDEM_RELAY_TABLE=from_env", "IDEM_RELAY_BATCH=8", "IDEM_RELAY_POLL_MS=222",
                                     "IDEM_RELAY_KAFKA_CLIENT_ID=from-env"};
  const Ran r = run_relay({"--config", cfg, "--batch", "9", "--check-config"}, env);
  INFO(r.out);
  REQUIRE(r.code == 0);
  CHECK(r.out.find("publisher = \"kafka\"\n") != std::string::npos);                 // file only
  CHECK(r.out.find("schema = \"from_file\"\n") != std::string::npos);                // file only
  CHECK(r.out.find("table = \"from_env\"\n") != std::string::npos);                  // env > file
  CHECK(r.out.find("poll-ms = 222\n") != std::string::npos);                         // env > file
  CHECK(r.out.find("batch = 9\n") != std::string::npos);                             // flag > env > file
  CHECK(r.out.find("kafka-brokers = \"file-broker:9092\"\n") != std::string::npos);  // [kafka] brokers
  CHECK(r.out.find("kafka-client-id = \"from-env\"\n") != std::string::npos);
  CHECK(r.out.find("\"socket.keepalive.enable=true\", \"sasl.password=<hidden>\"") != std::string::npos);
  CHECK(r.out.find("file-secret") == std::string::npos);  // neither the conninfo's password nor the property's
  CHECK(r.out.find("conninfo = \"<hidden>\"") != std::string::npos);

  // The file named by IDEM_RELAY_CONFIG; a flag still wins over it.
  const Ran e = run_relay({"--check-config", "--schema", "from_flag"}, {"IDEM_RELAY_CONFIG=" + cfg});
  INFO(e.out);
  REQUIRE(e.code == 0);
  CHECK(e.out.find("schema = \"from_flag\"\n") != std::string::npos);
  CHECK(e.out.find("table = \"from_file\"\n") != std::string::npos);
  CHECK(e.out.find("# config file: " + cfg) != std::string::npos);

  // Repeatable properties: flags (each one), or the variable (';'-separated).
  const Ran f =
      run_relay({"--config", cfg, "--check-config", "--kafka-property", "linger.ms=1", "--kafka-property", "acks=all"},
                {"IDEM_RELAY_KAFKA_PROPERTY=socket.timeout.ms=1000"});
  CHECK(f.out.find("kafka-property = [\"linger.ms=1\", \"acks=all\"]") != std::string::npos);
  const Ran g =
      run_relay({"--config", cfg, "--check-config"}, {"IDEM_RELAY_KAFKA_PROPERTY=socket.timeout.ms=1000;acks=all"});
  CHECK(g.out.find("kafka-property = [\"socket.timeout.ms=1000\", \"acks=all\"]") != std::string::npos);
}

TEST_CASE("relay program: a bad or missing setting exits 2 with one line naming it", "[relay-program]") {
  TempDir dir;
  const std::string bogus = dir.file("bogus.toml", "conninfo = \"host=db\"\nbacth = 3\n");
  const std::string ci = dir.file("conninfo", "host=db\n");
  const std::string badbatch = dir.file("badbatch.toml", "conninfo = \"host=db\"\nbatch = 0\n");
  struct Bad {
    std::vector<std::string> args, env;
    std::string names;
  };
  const std::vector<Bad> cases{
      {{"--conninfo", "host=db", "--redis", "redis://x", "--batch", "0"}, {}, "--batch"},
      {{"--conninfo", "host=db", "--redis", "redis://x"}, {"IDEM_RELAY_BATCH=lots"}, "--batch"},
      {{"--conninfo", "host=db", "--redis", "redis://x"}, {"IDEM_RELAY_POLL_MS=0"}, "(from IDEM_RELAY_POLL_MS)"},
      {{"--config", badbatch, "--redis", "redis://x"},
       {},
       "--batch: Value 0 not in range 1 to 10000 (from the config file)"},
      {{"--conninfo", "host=db", "--publisher", "kafak"}, {}, "--publisher"},
      {{"--conninfo", "host=db", "--redis", "redis://x", "--metrics-listen", "9465x"}, {}, "--metrics-listen"},
      {{"--conninfo", "host=db", "--publisher", "kafka", "--kafka-brokers", "b:9092", "--kafka-property", "linger.ms"},
       {},
       "--kafka-property"},
      {{"--config", bogus, "--redis", "redis://x"}, {}, "bacth"},
      {{"--redis", "redis://x"}, {"IDEM_RELAY_CONFIG=" + dir.path + "/missing.toml"}, "IDEM_RELAY_CONFIG"},
      {{"--redis", "redis://x"}, {}, "--conninfo"},
      {{"--conninfo", "host=db", "--conninfo-file", ci, "--redis", "redis://x"}, {}, "--conninfo-file"},
      {{"--conninfo", "host=db"}, {}, "--redis"},
      {{"--conninfo", "host=db", "--publisher", "kafka"}, {}, "--kafka-brokers"},
      {{"--conninfo", "host=db", "--publisher", "rabbitmq"}, {}, "--rabbitmq-url"},
      {{"--conninfo", "host=db", "--publisher", "nats"}, {}, "--nats-url"},
      {{"--conninfo", "host=db", "--redis", "redis://x", "--table", "Bad-Name"}, {}, "table"},
      {{"--conninfo", "host=db", "--publisher", "kafka", "--kafka-brokers", "b:9092", "--kafka-property",
        "enable.idempotence=false"},
       {},
       "enable.idempotence"},
  };
  for (const auto& c : cases) {
    const Ran r = run_relay(c.args, c.env);
    INFO(r.out);
    CHECK(r.code == 2);
    CHECK(r.out.find(c.names) != std::string::npos);
    // One line of our own (librdkafka may log its own lines on stderr before the refusal).
    std::istringstream in(r.out);
    int ours = 0;
    for (std::string line; std::getline(in, line);) ours += line.rfind("idem-outbox-relay: ", 0) == 0;
    CHECK(ours == 1);
  }
}

TEST_CASE("relay program: --publisher redis (the default) publishes each row once with its id, SIGTERM exits 0",
          "[relay-program][redis]") {
  Env env;
  TempDir dir;
  idem::test::RedisServer redis;
  env.write("orders", 12, 3, "r-");
  // Today's flags, with the conninfo from the environment and the table from a config file.
  const std::string cfg = dir.file("relay.ini", "[default]\nschema = idem_test\ntable = " + env.table + "\n");
  auto relay = start_relay(dir,
                           {"--config", cfg, "--redis", "redis://127.0.0.1:" + std::to_string(redis.port()),
                            "--stream-prefix", "p:", "--poll-ms", "200", "--batch", "5"},
                           {"IDEM_RELAY_CONNINFO=" + pgtest::conninfo()});
  REQUIRE(relay->wait_log(started, 10s));
  CHECK(relay->log().find("to Redis redis://127.0.0.1:" + std::to_string(redis.port())) != std::string::npos);
  wait_all_sent(env, *relay, 12);
  env.write("orders", 6, 3, "s-");  // while it runs: woken by NOTIFY
  wait_all_sent(env, *relay, 18);
  CHECK(relay->stop(SIGTERM) == 0);
  CHECK(std::regex_search(relay->log(), stopped));

  std::multiset<std::string> got;
  std::map<std::string, int> last_index;  // per key, the payload's index within the key must grow
  for (const auto& e : read_stream(redis.port(), "p:orders")) {
    got.insert(e.id);
    const int idx = std::stoi(e.payload.substr(e.payload.find(':') + 1));
    auto [it, fresh] = last_index.emplace(e.key, idx);
    if (!fresh) {
      CHECK(idx > it->second);
      it->second = idx;
    }
  }
  auto want = expected_ids(env, "r-", 0, 12);
  want.merge(expected_ids(env, "s-", 0, 6));
  CHECK(got == want);
}

TEST_CASE("relay program: --once publishes what is due and exits 0", "[relay-program][redis]") {
  Env env;
  idem::test::RedisServer redis;
  env.write("once", 4, 2, "o-");
  const Ran r = run_relay({"--conninfo", pgtest::conninfo(), "--schema", "idem_test", "--table", env.table, "--redis",
                           "redis://127.0.0.1:" + std::to_string(redis.port()), "--once"});
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK(read_stream(redis.port(), "once").size() == 4);
  CHECK(unsent(env) == 0);
}

TEST_CASE("relay program: /metrics while the broker is down: backlog, its age and failures, then SIGTERM exits 0",
          "[relay-program][metrics]") {
  Env env;
  TempDir dir;
  env.write("down", 5, 5, "d-");
  const int closed = idem::test::free_port();  // nothing listens there: every publish fails
  auto relay = start_relay(
      dir,
      {"--schema", "idem_test", "--table", env.table, "--redis", "redis://127.0.0.1:" + std::to_string(closed),
       "--poll-ms", "100", "--metrics-listen", "127.0.0.1:0"},
      {"IDEM_RELAY_CONNINFO=" + pgtest::conninfo()});
  const int port = metrics_port(*relay);
  const std::string labels = "{publisher=\"redis\",outbox=\"idem_test." + env.table + "\"}";
  std::string text;
  const auto end = Clock::now() + 15s;
  while (Clock::now() < end) {
    const auto r = http_get(port, "/metrics");
    REQUIRE(r.status == 200);
    text = r.body;
    if (sample(text, "idem_outbox_relay_publish_failures_total" + labels) >= 1 &&
        sample(text, "idem_outbox_relay_oldest_unsent_age_seconds" + labels) > 0)
      break;
    std::this_thread::sleep_for(100ms);
  }
  INFO(text);
  CHECK(sample(text, "idem_outbox_relay_publish_failures_total" + labels) >= 1);
  CHECK(sample(text, "idem_outbox_relay_backlog_rows" + labels) == 5);
  CHECK(sample(text, "idem_outbox_relay_oldest_unsent_age_seconds" + labels) > 0);
  CHECK(sample(text, "idem_outbox_relay_published_total" + labels) == 0);
  CHECK(sample(text, "idem_build_info{version=\"" + std::string(idem::version_string) +
                         "\",program=\"idem-outbox-relay\"}") == 1);
  CHECK(text.find("# TYPE idem_outbox_relay_published_total counter") != std::string::npos);
  CHECK(relay->stop(SIGTERM) == 0);
  CHECK(unsent(env) == 5);  // nothing lost
}

TEST_CASE("relay program: a real Prometheus scrapes the relay's /metrics", "[relay-program][metrics][prometheus]") {
  const std::string exe = IDEM_PROMETHEUS_SERVER;
  REQUIRE_FALSE(exe.empty());  // apt-get install prometheus
  Env env;
  TempDir dir;
  idem::test::RedisServer redis;
  auto relay =
      start_relay(dir, {"--conninfo", pgtest::conninfo(), "--schema", "idem_test", "--table", env.table, "--redis",
                        "redis://127.0.0.1:" + std::to_string(redis.port()), "--metrics-listen", "127.0.0.1:0"});
  // Prometheus: a 1 s scrape of the relay, on a free port (again on a clash); one that cannot start
  // fails the test here, with its log.
  const idem::test::PrometheusServer prom(exe, {.target_port = metrics_port(*relay), .job = "idem-outbox-relay"});

  env.write("scraped", 7, 7, "m-");
  wait_all_sent(env, *relay, 7);
  // Ask Prometheus (its query API) until its last scrape has the relay's count.
  const std::string query =
      "idem_outbox_relay_published_total{job=\"idem-outbox-relay\",publisher=\"redis\",outbox=\"idem_test." +
      env.table + "\"}";
  double value = -1;
  std::string answer;
  const auto end = Clock::now() + 20s;
  while (Clock::now() < end && value != 7) {
    try {
      const auto r = prom.query(query);
      answer = fmt::format("{} series", r.size());
      if (!r.empty()) {
        value = r[0].value;
        answer += fmt::format(", the first at {}", value);
      }
    } catch (const std::exception& e) {
      answer = e.what();  // the API's error, or a query before the first scrape
    }
    if (value != 7) std::this_thread::sleep_for(250ms);
  }
  INFO("prometheus answered: " << answer << "\nits log:\n" << prom.log());
  CHECK(value == 7);
  CHECK(relay->stop(SIGTERM) == 0);
}

#ifdef IDEM_RELAY_TEST_KAFKA
TEST_CASE("relay program: --publisher kafka (librdkafka's mock cluster) publishes each row once with its id",
          "[relay-program][kafka]") {
  idem::test::KafkaMockCluster cluster(1);
  const std::string topic = "relay-program-" + pgtest::random_hex(6);
  cluster.create_topic(topic, 2);
  Env env;
  TempDir dir;
  env.write(topic, 10, 5, "k-");
  const std::string ci = dir.file("conninfo", pgtest::conninfo() + "\n");
  auto relay = start_relay(
      dir,
      {"--conninfo-file", ci, "--schema", "idem_test", "--table", env.table, "--poll-ms", "200", "--kafka-property",
       "socket.keepalive.enable=true", "--kafka-property", "log_level=3", "--kafka-timeout-ms", "10000"},
      {"IDEM_RELAY_PUBLISHER=kafka", "IDEM_RELAY_KAFKA_BROKERS=" + cluster.brokers()});
  REQUIRE(relay->wait_log(started, 10s));
  CHECK(relay->log().find("to Kafka " + cluster.brokers()) != std::string::npos);
  wait_all_sent(env, *relay, 10);
  CHECK(relay->stop(SIGTERM) == 0);
  CHECK(std::regex_search(relay->log(), stopped));

  const auto records = idem::test::consume_topic(cluster.brokers(), topic, 2, 10, 15s);
  std::multiset<std::string> got;
  for (const auto& r : records) {
    got.insert(r.header("idem-outbox-id"));
    CHECK(r.value.rfind(r.key + ":", 0) == 0);  // the payload names its key
  }
  CHECK(got == expected_ids(env, "k-", 0, 10));
}
#endif

#ifdef IDEM_RELAY_TEST_NATS
TEST_CASE("relay program: --publisher nats (nats-server -js) publishes each row once with its id, SIGINT exits 0",
          "[relay-program][nats]") {
  idem::test::nats::NatsServer server;
  idem::test::nats::Client client(server.url());
  client.add_stream("RELAYPROG", "relayprog.>");
  Env env;
  TempDir dir;
  env.write("orders", 8, 2, "n-");
  auto relay = start_relay(
      dir,
      {"--publisher", "nats", "--nats-url", server.url(), "--nats-subject-prefix", "relayprog.", "--nats-expect-stream",
       "RELAYPROG", "--schema", "idem_test", "--table", env.table, "--poll-ms", "200"},
      {"IDEM_RELAY_CONNINFO=" + pgtest::conninfo()});
  REQUIRE(relay->wait_log(started, 10s));
  wait_all_sent(env, *relay, 8);
  CHECK(relay->stop(SIGINT) == 0);  // SIGINT (Ctrl-C) as SIGTERM
  CHECK(relay->log().find("SIGINT: finishing the batch in flight") != std::string::npos);

  REQUIRE(client.stream_messages("RELAYPROG") == 8);
  std::multiset<std::string> got;
  for (std::uint64_t seq = 1; seq <= 8; ++seq) {
    natsMsg* m = client.stream_message("RELAYPROG", seq);
    const char* id = nullptr;
    if (natsMsgHeader_Get(m, "Nats-Msg-Id", &id) == NATS_OK && id) got.insert(id);
    CHECK(std::string(natsMsg_GetSubject(m)) == "relayprog.orders");
    natsMsg_Destroy(m);
  }
  CHECK(got == expected_ids(env, "n-", 0, 8));
}
#endif

#ifdef IDEM_RELAY_TEST_RABBITMQ
// Its own CTest entry runs it with the RabbitMQ broker fixture (tests/outbox/CMakeLists.txt).
TEST_CASE("relay program: --publisher rabbitmq (the fixture broker) publishes each row once with its id",
          "[rabbitmq]") {
  auto broker = idem::test::RabbitBroker::shared();
  const std::string queue = "relay-program." + pgtest::random_hex(6);
  idem::test::AmqpAdmin(broker->port()).declare_queue(queue);
  Env env;
  TempDir dir;
  env.write(queue, 9, 3, "q-");
  // Everything from the environment, as the systemd unit's EnvironmentFile gives it; the password in the URL.
  auto relay =
      start_relay(dir, {},
                  {"IDEM_RELAY_PUBLISHER=rabbitmq", "IDEM_RELAY_CONNINFO=" + pgtest::conninfo(),
                   "IDEM_RELAY_SCHEMA=idem_test", "IDEM_RELAY_TABLE=" + env.table, "IDEM_RELAY_POLL_MS=200",
                   "IDEM_RELAY_RABBITMQ_URL=amqp://guest:guest@127.0.0.1:" + std::to_string(broker->port()) + "/%2f",
                   "IDEM_RELAY_RABBITMQ_TIMEOUT_MS=10000"});
  REQUIRE(relay->wait_log(started, 10s));
  wait_all_sent(env, *relay, 9);
  CHECK(relay->stop(SIGTERM) == 0);
  const std::string log = relay->log();
  CHECK(log.find("to RabbitMQ amqp://127.0.0.1:" + std::to_string(broker->port())) != std::string::npos);
  CHECK(log.find("guest:guest") == std::string::npos);  // the password is never printed

  std::multiset<std::string> got;
  for (const auto& m : idem::test::AmqpAdmin(broker->port()).drain(queue)) {
    got.insert(m.message_id);
    CHECK(m.delivery_mode == 2);
  }
  idem::test::AmqpAdmin(broker->port()).delete_queue(queue);
  CHECK(got == expected_ids(env, "q-", 0, 9));
}
#endif
