// rabbitmq_consumer: a starting template for a RabbitMQ consumer with exactly-once effects
// (rabbitmq-c + IdempotencyGuard). Copy RabbitConsumer and put your logic in handle().
//
//   idem_rabbitmq_consumer --port 5672 [--host 127.0.0.1] [--queue payments] [--prefetch 50]
//   idem_rabbitmq_consumer --selftest --port P [--events 2000] [--dup-percent 20] [--consumers 2]
//
// --selftest is what tests/rabbitmq/run.sh runs against the real rabbitmq-server it starts: it
// declares the topology (a queue whose dead-letter exchange feeds a DLQ), publishes payment
// events with ~20% duplicates, a poison payment and a tampered re-use of an event id, runs
// several consumers (one connection each) sharing one guard, and checks that every payment was
// applied exactly once, the poison and the tampered message were dead-lettered, and the queue is
// empty.
//
// Broker action per outcome (the part to keep):
//   executed / duplicate / stale / lease_lost -> basic.ack
//   in_flight (another consumer holds the key) -> basic.nack requeue=true, after retry_after
//   previously_failed / mismatch               -> basic.reject requeue=false: the queue's
//                                                 x-dead-letter-exchange moves it to the DLQ
//   handler exception                          -> basic.nack requeue=true after a short pause
//                                                 (the guard's failure policy counts attempts;
//                                                 the last one becomes previously_failed)
//   idem::store_error                          -> basic.nack requeue=true after a pause; never ack
//
// The guard runs on idem::MemoryStore: per-process, so it dedupes only what this process sees
// (the consumers of --selftest share it because they are threads of one process). With several
// consumer processes, construct the guard on idem::RedisStore or idem::PostgresStore instead (the
// `Guard` alias below); nothing else changes.

#include <amqp.h>
#include <amqp_tcp_socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "idem/idem.hpp"

using namespace std::chrono_literals;
using SteadyClock = std::chrono::steady_clock;

namespace {

// Swap the store here: idem::IdempotencyGuard<idem::RedisStore> (shared by all consumer processes)
// or idem::PostgresStore in transactional mode (the ledger write then goes through ctx.tx).
using Store = idem::MemoryStore;
using Guard = idem::IdempotencyGuard<Store>;

std::atomic<bool> g_stop{false};
extern "C" void on_signal(int) { g_stop.store(true); }

// --- the business side ------------------------------------------------------------------------

struct Payment {
  std::string account;
  long amount = 0;
};

// Body: "account;amount[;note]". The event id travels as the AMQP message-id property.
std::optional<Payment> parse_payment(std::string_view s) {
  const auto a = s.find(';');
  if (a == std::string_view::npos || a == 0) return std::nullopt;
  auto rest = s.substr(a + 1);
  const std::string amount(rest.substr(0, rest.find(';')));
  char* end = nullptr;
  const long v = std::strtol(amount.c_str(), &end, 10);
  if (amount.empty() || *end != '\0') return std::nullopt;
  return Payment{std::string(s.substr(0, a)), v};
}

// Stands in for your database. apply() is the effect that must happen once per event id.
class Ledger {
public:
  void apply(const std::string& id, const Payment& p) {
    if (p.amount == 0) throw std::runtime_error("payment " + id + " rejected: amount is zero");
    std::lock_guard lock(mu_);
    balances_[p.account] += p.amount;
    ++applied_[id];
    ++total_;
  }
  long total_applied() const {
    std::lock_guard lock(mu_);
    return total_;
  }
  std::unordered_map<std::string, long> balances() const {
    std::lock_guard lock(mu_);
    return balances_;
  }
  int times_applied(const std::string& id) const {
    std::lock_guard lock(mu_);
    auto it = applied_.find(id);
    return it == applied_.end() ? 0 : it->second;
  }

private:
  mutable std::mutex mu_;
  std::unordered_map<std::string, long> balances_;
  std::unordered_map<std::string, int> applied_;
  long total_ = 0;
};

// --- a thin RAII layer over rabbitmq-c ----------------------------------------------------------

std::string describe(const amqp_rpc_reply_t& r) {
  switch (r.reply_type) {
    case AMQP_RESPONSE_NORMAL:
      return "ok";
    case AMQP_RESPONSE_NONE:
      return "missing RPC reply";
    case AMQP_RESPONSE_LIBRARY_EXCEPTION:
      return amqp_error_string2(r.library_error);
    case AMQP_RESPONSE_SERVER_EXCEPTION:
      if (r.reply.id == AMQP_CONNECTION_CLOSE_METHOD || r.reply.id == AMQP_CHANNEL_CLOSE_METHOD) {
        // Both close methods start with reply_code, reply_text.
        const auto* m = static_cast<const amqp_channel_close_t*>(r.reply.decoded);
        return "server closed: " + std::to_string(m->reply_code) + " " +
               std::string(static_cast<const char*>(m->reply_text.bytes), m->reply_text.len);
      }
      return "server exception, method " + std::to_string(r.reply.id);
  }
  return "unknown reply";
}

struct Endpoint {
  std::string host = "127.0.0.1";
  int port = 5672;
  std::string vhost = "/";
  std::string user = "guest";
  std::string password = "guest";
};

class Connection {
public:
  static constexpr amqp_channel_t channel = 1;

  explicit Connection(const Endpoint& ep) : conn_(amqp_new_connection()) {
    amqp_socket_t* sock = amqp_tcp_socket_new(conn_);
    if (!sock) throw std::runtime_error("amqp: cannot create a socket");
    timeval tv{5, 0};
    if (int rc = amqp_socket_open_noblock(sock, ep.host.c_str(), ep.port, &tv); rc != AMQP_STATUS_OK)
      throw std::runtime_error("amqp: connect to " + ep.host + ":" + std::to_string(ep.port) + ": " +
                               amqp_error_string2(rc));
    // TUNE: heartbeat (seconds) lets both sides notice a dead peer; rabbitmq-c answers heartbeats
    // only inside its calls, which the consume loop makes at least every 100 ms.
    check(amqp_login(conn_, ep.vhost.c_str(), 0, 131072, 30, AMQP_SASL_METHOD_PLAIN, ep.user.c_str(),
                     ep.password.c_str()),
          "login");
    amqp_channel_open(conn_, channel);
    check(amqp_get_rpc_reply(conn_), "channel.open");
  }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;
  ~Connection() {
    amqp_channel_close(conn_, channel, AMQP_REPLY_SUCCESS);
    amqp_connection_close(conn_, AMQP_REPLY_SUCCESS);
    amqp_destroy_connection(conn_);
  }
  amqp_connection_state_t get() const noexcept { return conn_; }

  void check(const amqp_rpc_reply_t& r, const char* what) const {
    if (r.reply_type != AMQP_RESPONSE_NORMAL)
      throw std::runtime_error(std::string("amqp: ") + what + ": " + describe(r));
  }
  void check_rpc(const char* what) const { check(amqp_get_rpc_reply(conn_), what); }
  void check_rc(int rc, const char* what) const {
    if (rc != AMQP_STATUS_OK) throw std::runtime_error(std::string("amqp: ") + what + ": " + amqp_error_string2(rc));
  }

  /// Ready messages in `queue` (passive declare: fails if the queue does not exist).
  std::uint32_t message_count(const std::string& queue) {
    auto* ok = amqp_queue_declare(conn_, channel, amqp_cstring_bytes(queue.c_str()), 1, 0, 0, 0, amqp_empty_table);
    check_rpc("queue.declare passive");
    return ok->message_count;
  }

private:
  amqp_connection_state_t conn_;
};

// The topology the consumer expects: `queue` dead-letters into exchange `<queue>.dlx`, which
// routes everything to `<queue>.dlq`. Declaring it in the consumer is idempotent; in production
// it usually lives in a policy or in your deployment tooling instead.
void declare_topology(Connection& c, const std::string& queue) {
  const std::string dlx = queue + ".dlx", dlq = queue + ".dlq";
  amqp_exchange_declare(c.get(), Connection::channel, amqp_cstring_bytes(dlx.c_str()), amqp_cstring_bytes("fanout"), 0,
                        1, 0, 0, amqp_empty_table);
  c.check_rpc("exchange.declare dlx");
  amqp_queue_declare(c.get(), Connection::channel, amqp_cstring_bytes(dlq.c_str()), 0, 1, 0, 0, amqp_empty_table);
  c.check_rpc("queue.declare dlq");
  amqp_queue_bind(c.get(), Connection::channel, amqp_cstring_bytes(dlq.c_str()), amqp_cstring_bytes(dlx.c_str()),
                  amqp_cstring_bytes(""), amqp_empty_table);
  c.check_rpc("queue.bind dlq");
  amqp_table_entry_t arg;
  arg.key = amqp_cstring_bytes("x-dead-letter-exchange");
  arg.value.kind = AMQP_FIELD_KIND_UTF8;
  arg.value.value.bytes = amqp_cstring_bytes(dlx.c_str());
  amqp_table_t args{1, &arg};
  amqp_queue_declare(c.get(), Connection::channel, amqp_cstring_bytes(queue.c_str()), 0, 1, 0, 0, args);
  c.check_rpc("queue.declare");
}

// --- the consumer template --------------------------------------------------------------------

struct Settings {
  Endpoint endpoint;
  std::string queue = "payments";
  std::string tag = "idem-consumer";
  std::uint16_t prefetch = 50;  // TUNE: unacked messages in flight per consumer (basic.qos)
  idem::millis min_retry{50};   // floor of the delay before a requeue
  // Ceiling of that delay. An in_flight outcome's retry_after is the holder's whole remaining
  // lease (30 s here), but most holders finish far sooner, and the redelivery then answers
  // Duplicate: retry well before that. (GuardOptions::wait_for_in_flight is the other knob.)
  idem::millis max_retry{1'000};
  idem::millis store_retry{1'000};  // delay before requeueing after a retryable store error
};

struct Stats {
  std::atomic<long> delivered{0}, redelivered{0}, executed{0}, duplicates{0}, stale{0}, lease_lost{0}, acked{0},
      requeued{0}, dead_lettered{0}, handler_errors{0}, store_errors{0};
};

class RabbitConsumer {
public:
  RabbitConsumer(Settings s, Guard& guard, Ledger& ledger, Stats& stats)
      : s_(std::move(s)), conn_(s_.endpoint), guard_(guard), ledger_(ledger), stats_(stats) {
    declare_topology(conn_, s_.queue);
    amqp_basic_qos(conn_.get(), Connection::channel, 0, s_.prefetch, 0);
    conn_.check_rpc("basic.qos");
    amqp_basic_consume(conn_.get(), Connection::channel, amqp_cstring_bytes(s_.queue.c_str()),
                       amqp_cstring_bytes(s_.tag.c_str()), 0, /*no_ack=*/0, 0, amqp_empty_table);
    conn_.check_rpc("basic.consume");
  }

  /// Consumes until keep_going() says no or a signal arrives; then requeues what it still holds.
  void run(const std::function<bool()>& keep_going) {
    while (!g_stop.load() && keep_going()) {
      nack_due();
      amqp_maybe_release_buffers(conn_.get());
      timeval tv = wait_time();
      amqp_envelope_t env;
      const amqp_rpc_reply_t r = amqp_consume_message(conn_.get(), &env, &tv, 0);
      if (r.reply_type == AMQP_RESPONSE_LIBRARY_EXCEPTION && r.library_error == AMQP_STATUS_TIMEOUT) continue;
      if (r.reply_type != AMQP_RESPONSE_NORMAL)
        throw std::runtime_error("amqp: consume: " + describe(r) + " (connection or channel lost; reconnect)");
      handle(env);
      amqp_destroy_envelope(&env);
    }
    // Unacked deliveries go back to the queue when the channel closes; requeue the delayed ones now.
    for (const auto& d : delayed_) nack(d.tag);
    delayed_.clear();
  }

private:
  struct Delayed {
    std::uint64_t tag;
    SteadyClock::time_point due;
  };

  void handle(const amqp_envelope_t& env) {
    stats_.delivered.fetch_add(1);
    if (env.redelivered) stats_.redelivered.fetch_add(1);
    const amqp_basic_properties_t& props = env.message.properties;
    const std::string_view body(static_cast<const char*>(env.message.body.bytes), env.message.body.len);
    if (!(props._flags & AMQP_BASIC_MESSAGE_ID_FLAG) || props.message_id.len == 0) {
      // No stable id, no deduplication: never guess one from the body or the delivery tag.
      dead_letter(env.delivery_tag);
      return;
    }
    const std::string id(static_cast<const char*>(props.message_id.bytes), props.message_id.len);
    const std::optional<Payment> pay = parse_payment(body);
    if (!pay) {
      dead_letter(env.delivery_tag);
      return;
    }
    try {
      auto out = guard_.run(id, body, [&](const idem::Context& ctx) {
        // ---- YOUR LOGIC GOES HERE. It runs at most once per message id (docs/guarantees.md
        // explains the crash window between the effect and the completion; ctx.fence can fence
        // downstream writes). What it returns is replayed to duplicates.
        ledger_.apply(id, *pay);
        return static_cast<long>(ctx.fence);
      });
      switch (out.status) {
        case idem::Status::executed:
          stats_.executed.fetch_add(1);
          break;
        case idem::Status::duplicate:
          stats_.duplicates.fetch_add(1);
          break;
        case idem::Status::stale:
          stats_.stale.fetch_add(1);
          break;
        case idem::Status::lease_lost:
          // The handler ran but its lease had been taken over: ack, and alert (raise the lease).
          stats_.lease_lost.fetch_add(1);
          std::fprintf(stderr, "[%s] lease lost on %s\n", s_.tag.c_str(), id.c_str());
          break;
        default:
          break;
      }
      switch (out.action()) {
        case idem::BrokerAction::ack:
          ack(env.delivery_tag);
          break;
        case idem::BrokerAction::requeue:
          requeue_later(env.delivery_tag, std::min(out.retry_after, s_.max_retry));
          break;
        case idem::BrokerAction::dead_letter:
          dead_letter(env.delivery_tag);
          break;
      }
    } catch (...) {
      // One mapping from the exception to the broker action (idem::action_of), as for a batch item.
      const std::exception_ptr e = std::current_exception();
      bool from_store = false, retryable = true;
      try {
        std::rethrow_exception(e);
      } catch (const idem::error& x) {
        // Store down / timeout (retryable) or an unreadable record (not retryable: alert a human).
        from_store = !x.from_handler();
        retryable = x.retryable();
        std::fprintf(stderr, "[%s] idem error on %s: %s\n", s_.tag.c_str(), id.c_str(), x.what());
      } catch (...) {
      }
      // The handler threw (recorded per the guard's failure policy), or the store failed.
      (from_store ? stats_.store_errors : stats_.handler_errors).fetch_add(1);
      switch (idem::action_of(e)) {
        case idem::BrokerAction::ack:  // the effect ran and will not run again (its result was not stored)
          ack(env.delivery_tag);
          break;
        case idem::BrokerAction::dead_letter:
          dead_letter(env.delivery_tag);
          break;
        case idem::BrokerAction::requeue:
          requeue_later(env.delivery_tag, !from_store ? s_.min_retry : retryable ? s_.store_retry : idem::millis{30'000});
          break;
      }
    }
  }

  void ack(std::uint64_t tag) {
    conn_.check_rc(amqp_basic_ack(conn_.get(), Connection::channel, tag, 0), "basic.ack");
    stats_.acked.fetch_add(1);
  }
  void nack(std::uint64_t tag) {
    conn_.check_rc(amqp_basic_nack(conn_.get(), Connection::channel, tag, 0, /*requeue=*/1), "basic.nack");
  }
  // requeue=false: the broker routes the message to the queue's dead-letter exchange. A queue
  // without x-dead-letter-exchange would drop it: declare one (declare_topology does).
  void dead_letter(std::uint64_t tag) {
    conn_.check_rc(amqp_basic_reject(conn_.get(), Connection::channel, tag, /*requeue=*/0), "basic.reject");
    stats_.dead_lettered.fetch_add(1);
  }

  // RabbitMQ has no delayed requeue: keep the delivery (it holds a prefetch slot) and nack it when
  // the delay is over, so the redelivery does not spin while the key is still in flight.
  void requeue_later(std::uint64_t tag, idem::millis after) {
    stats_.requeued.fetch_add(1);
    delayed_.push_back({tag, SteadyClock::now() + std::max(after, s_.min_retry)});
  }
  void nack_due() {
    const auto now = SteadyClock::now();
    auto due = std::stable_partition(delayed_.begin(), delayed_.end(), [&](const Delayed& d) { return d.due > now; });
    for (auto it = due; it != delayed_.end(); ++it) nack(it->tag);
    delayed_.erase(due, delayed_.end());
  }
  timeval wait_time() const {
    auto wait = std::chrono::duration_cast<std::chrono::microseconds>(100ms);
    const auto now = SteadyClock::now();
    for (const auto& d : delayed_)
      wait = std::min(wait, std::max(std::chrono::microseconds{1'000},
                                     std::chrono::duration_cast<std::chrono::microseconds>(d.due - now)));
    return timeval{0, static_cast<suseconds_t>(wait.count())};
  }

  Settings s_;
  Connection conn_;
  Guard& guard_;
  Ledger& ledger_;
  Stats& stats_;
  std::vector<Delayed> delayed_;
};

// --- command line -------------------------------------------------------------------------------

std::string arg(int argc, char** argv, const char* name, const std::string& dflt) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == name) return argv[i + 1];
  return dflt;
}
bool flag(int argc, char** argv, const char* name) {
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == name) return true;
  return false;
}

// TUNE: lease above the handler's worst case (or heartbeat = true); retention above the longest
// redelivery horizon (DLQ replays included); failure policy: attempts before a dead letter.
idem::GuardOptions guard_options(std::shared_ptr<idem::Observer> obs, idem::millis backoff) {
  idem::GuardOptions o;
  o.lease = 30s;
  o.retention = std::chrono::hours{24 * 7};
  o.failure = {.mode = idem::FailureMode::record, .max_attempts = 3, .backoff = backoff, .max_backoff = 60s};
  o.observer = std::move(obs);
  return o;
}

Settings settings_from(int argc, char** argv) {
  Settings s;
  s.endpoint.host = arg(argc, argv, "--host", s.endpoint.host);
  s.endpoint.port = std::stoi(arg(argc, argv, "--port", "5672"));
  s.endpoint.user = arg(argc, argv, "--user", s.endpoint.user);
  s.endpoint.password = arg(argc, argv, "--password", s.endpoint.password);
  s.queue = arg(argc, argv, "--queue", s.queue);
  s.prefetch = static_cast<std::uint16_t>(std::stoi(arg(argc, argv, "--prefetch", "50")));
  return s;
}

int run_real(int argc, char** argv) {
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  Store store;
  Guard guard(store, guard_options(nullptr, 1s));
  Ledger ledger;
  Stats stats;
  RabbitConsumer consumer(settings_from(argc, argv), guard, ledger, stats);
  consumer.run([] { return true; });
  std::printf("executed %ld, duplicates %ld, dead-lettered %ld\n", stats.executed.load(), stats.duplicates.load(),
              stats.dead_lettered.load());
  return 0;
}

// --- the --selftest run -------------------------------------------------------------------------

int run_selftest(int argc, char** argv) {
  Settings base = settings_from(argc, argv);
  base.queue = arg(argc, argv, "--queue", "idem.selftest." + std::to_string(::getpid()));
  const int events = std::stoi(arg(argc, argv, "--events", "2000"));
  const int dup_percent = std::stoi(arg(argc, argv, "--dup-percent", "20"));
  const int consumers = std::stoi(arg(argc, argv, "--consumers", "2"));
  const auto time_limit = std::chrono::seconds(std::stoi(arg(argc, argv, "--time-limit", "40")));
  if (events < 10 || dup_percent < 0 || dup_percent > 100 || consumers < 1) {
    std::fprintf(stderr, "--selftest needs --events >= 10, --dup-percent 0..100, --consumers >= 1\n");
    return 2;
  }
  const auto t0 = SteadyClock::now();

  // Publish: payments with ids, ~dup_percent re-published right behind or later (both kinds of
  // redelivery), a poison payment (the ledger rejects amount 0), and a tampered copy of one id
  // (same account and amount, different note: a fingerprint mismatch) published last.
  std::mt19937 rng(2026);
  struct Msg {
    std::string id, body;
  };
  std::vector<Msg> outbox;
  std::unordered_map<std::string, long> expected;
  std::vector<std::string> ids;
  const int poison = events / 2;
  for (int i = 0; i < events; ++i) {
    const std::string id = "pay-" + std::to_string(i);
    const std::string account = "acct-" + std::to_string(rng() % 40);
    const long amount = i == poison ? 0 : 1 + static_cast<long>(rng() % 999);
    if (i != poison) expected[account] += amount;
    ids.push_back(id);
    Msg m{id, account + ";" + std::to_string(amount) + ";original"};
    outbox.push_back(m);
    if (static_cast<int>(rng() % 100) < dup_percent) {
      const auto at = outbox.size() - std::min<std::size_t>(outbox.size() - 1, rng() % 50);
      outbox.insert(outbox.begin() + static_cast<std::ptrdiff_t>(at), m);  // duplicate, nearby
    }
  }
  const std::size_t tampered = 7;
  {
    Msg t = outbox.front();
    for (const auto& m : outbox)
      if (m.id == ids[tampered]) t = m;
    t.body = t.body.substr(0, t.body.rfind(';')) + ";tampered";
    outbox.push_back(t);
  }
  {
    Connection pub(base.endpoint);
    declare_topology(pub, base.queue);
    amqp_queue_purge(pub.get(), Connection::channel, amqp_cstring_bytes(base.queue.c_str()));
    pub.check_rpc("queue.purge");
    amqp_queue_purge(pub.get(), Connection::channel, amqp_cstring_bytes((base.queue + ".dlq").c_str()));
    pub.check_rpc("queue.purge dlq");
    for (const Msg& m : outbox) {
      amqp_basic_properties_t props;
      props._flags = AMQP_BASIC_MESSAGE_ID_FLAG | AMQP_BASIC_DELIVERY_MODE_FLAG | AMQP_BASIC_CONTENT_TYPE_FLAG;
      props.message_id = amqp_cstring_bytes(m.id.c_str());
      props.delivery_mode = AMQP_DELIVERY_PERSISTENT;
      props.content_type = amqp_cstring_bytes("text/plain");
      pub.check_rc(
          amqp_basic_publish(pub.get(), Connection::channel, amqp_empty_bytes, amqp_cstring_bytes(base.queue.c_str()),
                             0, 0, &props, amqp_cstring_bytes(m.body.c_str())),
          "basic.publish");
    }
    // Publishes reach the queue process asynchronously: wait (bounded) until all are enqueued.
    // (A production publisher uses publisher confirms instead.)
    std::uint32_t n = 0;
    for (int i = 0; i < 200 && (n = pub.message_count(base.queue)) != outbox.size(); ++i)
      std::this_thread::sleep_for(50ms);
    if (n != outbox.size()) {
      std::fprintf(stderr, "published %zu, queue holds %u\n", outbox.size(), n);
      return 1;
    }
  }
  const auto published_at = SteadyClock::now();
  // Dead letters expected: every copy of the poison payment, and the tampered message.
  const auto expected_dlq = 1 + std::count_if(outbox.begin(), outbox.end(), [&](const Msg& m) {
                              return m.id == ids[static_cast<std::size_t>(poison)];
                            });

  Store store;
  auto obs = std::make_shared<idem::CountingObserver>();
  Guard guard(store, guard_options(obs, 20ms));
  Ledger ledger;
  Stats stats;
  std::atomic<bool> stop{false};
  std::atomic<long> failures{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < consumers; ++i) {
    Settings s = base;
    s.tag = "consumer-" + std::to_string(i);
    s.prefetch = 20;
    threads.emplace_back([&, s] {
      try {
        RabbitConsumer c(s, guard, ledger, stats);
        c.run([&] { return !stop.load(); });
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[%s] fatal: %s\n", s.tag.c_str(), e.what());
        failures.fetch_add(1);
      }
    });
  }
  // Every published message ends acked or dead-lettered exactly once; requeues are not final.
  const long finals_expected = static_cast<long>(outbox.size());
  bool timed_out = false;
  while (failures.load() == 0 && stats.acked.load() + stats.dead_lettered.load() < finals_expected) {
    if (SteadyClock::now() - t0 > time_limit) {
      timed_out = true;
      break;
    }
    std::this_thread::sleep_for(10ms);
  }
  const auto consumed_at = SteadyClock::now();
  stop.store(true);
  for (auto& t : threads) t.join();

  std::uint32_t left = 0, dlq = 0;
  try {
    Connection admin(base.endpoint);
    left = admin.message_count(base.queue);
    dlq = admin.message_count(base.queue + ".dlq");
    amqp_queue_delete(admin.get(), Connection::channel, amqp_cstring_bytes(base.queue.c_str()), 0, 0);
    amqp_queue_delete(admin.get(), Connection::channel, amqp_cstring_bytes((base.queue + ".dlq").c_str()), 0, 0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "admin: %s\n", e.what());
    failures.fetch_add(1);
  }

  long once = 0, twice = 0, never = 0;
  for (int i = 0; i < events; ++i) {
    if (i == poison) continue;
    const int n = ledger.times_applied(ids[static_cast<std::size_t>(i)]);
    once += n == 1;
    twice += n > 1;
    never += n == 0;
  }
  const bool balances_ok = ledger.balances() == expected;
  const bool poison_skipped = ledger.times_applied(ids[static_cast<std::size_t>(poison)]) == 0;
  auto secs = [](SteadyClock::duration d) { return std::chrono::duration<double>(d).count(); };

  std::printf("idem rabbitmq_consumer --selftest: %d payments, %zu messages, %d consumers, prefetch 20\n", events,
              outbox.size(), consumers);
  std::printf("  %-32s %8ld\n", "deliveries", stats.delivered.load());
  std::printf("  %-32s %8ld\n", "  flagged redelivered", stats.redelivered.load());
  std::printf("  %-32s %8ld\n", "executed", stats.executed.load());
  std::printf("  %-32s %8ld\n", "duplicates suppressed", stats.duplicates.load());
  std::printf("  %-32s %8ld\n", "requeued (nack after delay)", stats.requeued.load());
  std::printf("  %-32s %8ld\n", "handler errors (poison tries)", stats.handler_errors.load());
  std::printf("  %-32s %8ld\n", "dead-lettered", stats.dead_lettered.load());
  std::printf("  %-32s %8u (expected %ld)\n", "messages in the DLQ", dlq, static_cast<long>(expected_dlq));
  std::printf("  %-32s %8u\n", "messages left in the queue", left);
  std::printf("  %-32s %8.2f\n", "publish seconds", secs(published_at - t0));
  std::printf("  %-32s %8.2f\n", "consume seconds", secs(consumed_at - published_at));
  std::printf("  effects applied once: %ld of %d (twice or more: %ld, never: %ld); balances %s\n", once, events - 1,
              twice, never, balances_ok ? "exact" : "WRONG");
  if (timed_out) std::printf("  TIMED OUT after %lld s\n", static_cast<long long>(time_limit.count()));
  const bool ok = failures.load() == 0 && !timed_out && once == events - 1 && twice == 0 && never == 0 && balances_ok &&
                  poison_skipped && dlq == expected_dlq && left == 0 && stats.dead_lettered.load() == expected_dlq;
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return flag(argc, argv, "--selftest") ? run_selftest(argc, argv) : run_real(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "idem_rabbitmq_consumer: %s\n", e.what());
    return 1;
  }
}
