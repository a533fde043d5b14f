// redis_streams_consumer: a starting template for a Redis Streams consumer with exactly-once
// effects. idem::StreamsConsumer reads the consumer group (taking over what dead consumers left
// pending), idem::consume runs each batch through the guard and settles every entry with its
// verdict: acked, dead-lettered to <stream>:dlq, or left pending to be retried. Copy it and put
// your logic in apply().
//
//   idem_redis_streams_consumer [--redis URL] [--stream payments] [--group payments] [--consumer NAME]
//                               [--lease-ms 30000] [--count 32] [--handler-ms 0]
//
// Entries carry event_id, account and amount. The effect here is a balance in Redis, applied at
// most once per event id by one script (a crash between the effect and the guard's completion
// leaves the record in progress: after the lease the entry is taken over, and the script sees the
// event already applied). With your own database, make the effect and its "applied" mark one
// transaction, or use PostgresStore's transactional mode. docs/consuming.md has the failure modes.

#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>

#include <fmt/core.h>
#include <hiredis/hiredis.h>

#include "idem/idem.hpp"
#include "idem/redis.hpp"
#include "idem/redis/streams_consumer.hpp"

namespace {

std::stop_source g_stop;
extern "C" void on_signal(int) { g_stop.request_stop(); }

const char* opt(int argc, char** argv, const char* name, const char* def) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  return def;
}

// ---- YOUR LOGIC: the effect of one payment. Here: the account's balance, the event marked
// applied and logged in the same script, so a second run of the same event changes nothing.
class Ledger {
public:
  explicit Ledger(const idem::RedisOptions& o) : c_(redisConnect(o.host.c_str(), o.port), redisFree) {
    if (!c_ || c_->err) throw std::runtime_error("ledger: cannot connect to Redis");
  }
  void apply(const std::string& stream, const std::string& event, const std::string& account, long amount) {
    static const char* lua =
        "if redis.call('SET', KEYS[1], 1, 'NX') then redis.call('INCRBY', KEYS[2], ARGV[1]); "
        "redis.call('RPUSH', KEYS[3], ARGV[2]) return 1 end return 0";
    const std::string applied = stream + ":applied:" + event, balance = stream + ":balance:" + account;
    const std::string log = stream + ":effects", amt = std::to_string(amount);
    auto* r = static_cast<redisReply*>(redisCommand(c_.get(), "EVAL %s 3 %s %s %s %s %s", lua, applied.c_str(),
                                                    balance.c_str(), log.c_str(), amt.c_str(), event.c_str()));
    const bool ok = r && r->type == REDIS_REPLY_INTEGER;
    if (r) freeReplyObject(r);
    if (!ok) throw std::runtime_error("ledger: the effect was not written");
  }

private:
  std::unique_ptr<redisContext, void (*)(redisContext*)> c_;
};

}  // namespace

int main(int argc, char** argv) try {
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--help") == 0) {
      std::puts("usage: idem_redis_streams_consumer [--redis URL] [--stream S] [--group G] [--consumer NAME]\n"
                "         [--lease-ms N] [--count N] [--handler-ms N]\n"
                "Reads the consumer group G of stream S and applies each payment (event_id, account, amount)\n"
                "exactly once, until SIGINT or SIGTERM; entries that cannot succeed go to S:dlq.\n"
                "--handler-ms: time each payment takes (to try crashes mid-handler).");
      return 0;
    }
  const idem::RedisOptions redis = idem::parse_redis_url(opt(argc, argv, "--redis", "redis://127.0.0.1:6379"));
  const std::string stream = opt(argc, argv, "--stream", "payments");
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);

  // The records: same server, their own key prefix. The lease outlasts the handler's worst case.
  idem::RedisOptions records = redis;
  records.key_prefix = "idem:" + stream + ":";
  idem::RedisStore store(records);
  idem::GuardOptions go;
  go.lease = idem::millis{std::atol(opt(argc, argv, "--lease-ms", "30000"))};
  go.retention = std::chrono::hours(24);
  // record, not release: a poison message fails twice and is dead-lettered instead of looping.
  go.failure = {.mode = idem::FailureMode::record, .max_attempts = 2, .backoff = idem::millis{0}};
  idem::IdempotencyGuard guard(store, go);

  idem::StreamsConsumer consumer({.redis = redis,
                                  .stream = stream,
                                  .group = opt(argc, argv, "--group", "payments"),
                                  .consumer = opt(argc, argv, "--consumer", host),
                                  .count = static_cast<std::size_t>(std::atol(opt(argc, argv, "--count", "32"))),
                                  .block = idem::millis{200},
                                  .claim_idle = go.lease});  // a dead consumer's entries after one lease
  Ledger ledger(redis);
  const idem::millis work{std::atol(opt(argc, argv, "--handler-ms", "0"))};
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);

  // Every field of an entry is a header; the key is its event_id (the outbox relay's entries carry
  // `id`, the default key). An entry without one has an empty key and is dead-lettered.
  idem::ConsumeOptions co;
  co.key_of = [](const idem::Delivery& d) { return std::string(d.header("event_id").value_or("")); };
  idem::consume(consumer, guard, g_stop.get_token(), [&](const idem::Delivery& d) {
    const auto account = d.header("account"), amount = d.header("amount");
    if (!account || !amount) throw std::invalid_argument("entry without account or amount");
    if (*account == "poison") throw std::runtime_error("poison payment");
    std::this_thread::sleep_for(work);
    ledger.apply(stream, std::string(*d.header("event_id")), std::string(*account), std::atol(std::string(*amount).c_str()));
    return std::string("applied");
  }, co);
  const auto st = consumer.stats();
  fmt::print("read {}, resumed {}, claimed {}, acked {}, dead-lettered {}, left pending {}\n", st.read, st.resumed,
             st.claimed, st.acked, st.dead_lettered, st.left_pending);
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "idem_redis_streams_consumer: {}\n", e.what());
  return 1;
}
