// RedisStore beyond the contract: options and URLs, binary-safe keys, hash slots, record size,
// round trips per transition, script reload, batches, Unix socket, database index.
#include <catch2/catch.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include "idem/idem.hpp"
#include "idem/redis.hpp"
#include "idem/redis/hash_slot.hpp"
#include "redis_factory.hpp"

using namespace std::chrono_literals;
using idem::AcquireStatus;
using idem::RedisOptions;
using idem::RedisStore;
using idem::WriteStatus;
using idem::test::RedisServer;

namespace {

RedisServer& server() {
  static RedisServer s;
  return s;
}

idem::AcquireParams params(std::uint64_t token, idem::millis lease = 30s) {
  idem::AcquireParams p;
  p.lease = lease;
  p.retention = 60s;
  p.token = token;
  p.owner = "store-test";
  return p;
}

long evalsha_calls() {
  const std::string info = server().command({"INFO", "commandstats"});
  const auto at = info.find("cmdstat_evalsha:calls=");
  if (at == std::string::npos) return 0;
  return std::stol(info.substr(at + 22));
}

// Client commands (round trips when not pipelined) since the last CONFIG RESETSTAT.
long total_calls() {
  const std::string info = server().command({"INFO", "commandstats"});
  long total = 0;
  for (auto at = info.find("calls="); at != std::string::npos; at = info.find("calls=", at + 1)) {
    const auto line = info.rfind("cmdstat_", at);
    const std::string name = info.substr(line, info.find(':', line) - line);
    // Commands run inside the scripts are counted too; they are not round trips. Nor are the
    // harness's own INFO, AUTH and CONFIG.
    static const std::vector<std::string> internal{"cmdstat_get",  "cmdstat_set",  "cmdstat_pttl",
                                                   "cmdstat_time", "cmdstat_info", "cmdstat_auth",
                                                   "cmdstat_config"};
    if (std::none_of(internal.begin(), internal.end(), [&](const std::string& n) { return name.rfind(n, 0) == 0; }))
      total += std::stol(info.substr(at + 6));
  }
  return total;
}

}  // namespace

TEST_CASE("redis URL parsing", "[redis][options]") {
  auto o = idem::parse_redis_url("redis://alice:p%40ss%3Aw@db.example:6390/3");
  CHECK(o.host == "db.example");
  CHECK(o.port == 6390);
  CHECK(o.user == "alice");
  CHECK(o.password == "p@ss:w");
  CHECK(o.db == 3);
  CHECK(o.unix_socket.empty());

  o = idem::parse_redis_url("redis://localhost");
  CHECK(o.host == "localhost");
  CHECK(o.port == 6379);
  CHECK(o.db == 0);
  CHECK(o.password.empty());

  o = idem::parse_redis_url("redis://:only-pass@[::1]:7000/");
  CHECK(o.host == "::1");
  CHECK(o.port == 7000);
  CHECK(o.user.empty());
  CHECK(o.password == "only-pass");

  o = idem::parse_redis_url("unix://bob:pw@/run/redis/redis.sock?db=2");
  CHECK(o.unix_socket == "/run/redis/redis.sock");
  CHECK(o.user == "bob");
  CHECK(o.db == 2);

  for (const char* bad : {"", "localhost:6379", "http://x", "rediss://h?tls_min_version=1.0", "redis://", "redis://h:0",
                          "redis://h:70000", "redis://h:port", "redis://h/db", "redis://h/-1", "redis://u:%zz@h",
                          "redis://alice:@h", "unix://relative.sock", "redis://h?timeout=1", "redis://[::1"}) {
    INFO("url: " << bad);
    CHECK_THROWS_AS(idem::parse_redis_url(bad), idem::invalid_options_error);
  }
  // The password never appears in a message.
  try {
    idem::parse_redis_url("redis://u:topsecret@h:badport");
    FAIL("accepted a bad port");
  } catch (const idem::invalid_options_error& e) {
    CHECK(std::string(e.what()).find("topsecret") == std::string::npos);
    CHECK_FALSE(e.retryable());
  }
}

TEST_CASE("redis-sentinel URL parsing", "[redis][options][sentinel]") {
  auto o = idem::parse_redis_url("redis-sentinel://app:p%40ss@s1.example:5000,[::1],s3:26380/orders/2");
  CHECK(o.sentinels == std::vector<std::string>{"s1.example:5000", "[::1]:26379", "s3:26380"});
  CHECK(o.sentinel_master == "orders");
  CHECK(o.user == "app");
  CHECK(o.password == "p@ss");
  CHECK(o.db == 2);
  CHECK(o.sentinel_user.empty());

  o = idem::parse_redis_url("redis-sentinel://h:1/m?sentinel_user=watch&sentinel_password=s%26cret");
  CHECK(o.sentinels == std::vector<std::string>{"h:1"});
  CHECK(o.sentinel_master == "m");
  CHECK(o.sentinel_user == "watch");
  CHECK(o.sentinel_password == "s&cret");
  CHECK(o.db == 0);

  // A plain URL after a sentinel one leaves no sentinel behind.
  o = idem::parse_redis_url("redis://h:7000", o);
  CHECK(o.sentinels.empty());

  for (const char* bad : {"redis-sentinel://h:1", "redis-sentinel://h:1/", "redis-sentinel:///m", "redis-sentinel://h:1,/m",
                          "redis-sentinel://h:0/m", "redis-sentinel://h:1/m/x", "redis-sentinel://h:1/m?db=1&x=2",
                          "redis://h?sentinel_user=u"}) {
    INFO("url: " << bad);
    CHECK_THROWS_AS(idem::parse_redis_url(bad), idem::invalid_options_error);
  }
  try {
    idem::parse_redis_url("redis-sentinel://h:1/m?sentinel_password=topsecret&bogus=1");
    FAIL("accepted an unknown parameter");
  } catch (const idem::invalid_options_error& e) {
    CHECK(std::string(e.what()).find("topsecret") == std::string::npos);
  }
}

TEST_CASE("redis options are validated before connecting", "[redis][options]") {
  auto bad = [](auto change) {
    RedisOptions o = server().options();
    change(o);
    CHECK_THROWS_AS(RedisStore(o), idem::invalid_options_error);
  };
  bad([](RedisOptions& o) { o.pool.size = 0; });
  bad([](RedisOptions& o) { o.port = 0; });
  bad([](RedisOptions& o) { o.db = -1; });
  // Past the kernel's limit for a socket path: refused here, not found at the first connect.
  bad([](RedisOptions& o) { o.unix_socket = "/tmp/" + std::string(120, 'd') + "/redis.sock"; });
  bad([](RedisOptions& o) { o.connect_timeout = 0ms; });
  bad([](RedisOptions& o) { o.command_timeout = -1ms; });
  bad([](RedisOptions& o) { o.pool.wait = -1ms; });
  bad([](RedisOptions& o) { o.host.clear(); });
  bad([](RedisOptions& o) { o.user = "u"; });
  bad([](RedisOptions& o) { o.key_prefix = "idem{:"; });
  bad([](RedisOptions& o) { o.key_prefix = "{}:"; });
  bad([](RedisOptions& o) { o.key_prefix = "{a}{b}:"; });
  bad([](RedisOptions& o) { o.url = "rediss://127.0.0.1?tls_ca_file=/nonexistent/ca.pem"; });
  bad([](RedisOptions& o) { o.min_replica_acks = -1; });
  bad([](RedisOptions& o) {
    o.min_replica_acks = 1;
    o.replica_ack_timeout = 0ms;
  });
  bad([](RedisOptions& o) {
    o.min_replica_acks = 1;
    o.replica_ack_timeout = o.command_timeout;
  });
  bad([](RedisOptions& o) { o.sentinels = {"127.0.0.1:26379"}; });  // no sentinel_master
  bad([](RedisOptions& o) { o.sentinel_master = "m"; });            // no sentinels
  bad([](RedisOptions& o) {
    o.sentinels = {"127.0.0.1:port"};
    o.sentinel_master = "m";
  });
  bad([](RedisOptions& o) {
    o.sentinels = {"127.0.0.1:26379"};
    o.sentinel_master = "m";
    o.sentinel_user = "watch";
  });
  RedisOptions ok = server().options();
  ok.key_prefix = "{idem}:";  // one whole tag: all keys in one slot, accepted
  CHECK_NOTHROW(RedisStore(ok));
}

TEST_CASE("redis keys are binary-safe and stored under prefix + key", "[redis][keys]") {
  RedisStore store(server().options());
  const std::string ns = "bin-" + idem::test::random_hex() + ":";
  const std::vector<std::string> keys{
      ns + "with space", ns + "cr\rlf\n", ns + "quote\"'`", ns + "{tag}x", ns + "}{", ns + "\xc3\xa9t\xc3\xa9 \xe2\x9c\x93",
      ns + std::string("nul\0byte", 8), ns + std::string("\0", 1), ns + "\xff\xfe"};
  std::uint64_t token = 100;
  for (const auto& k : keys) {
    INFO("key " << k.size() << " bytes");
    auto r = store.acquire(k, params(++token));
    REQUIRE(r.status == AcquireStatus::acquired);
    REQUIRE(store.complete(k, r.holder, "v:" + k, 60s) == WriteStatus::ok);
    CHECK(server().command({"EXISTS", "idem:" + k}) == "1");
  }
  for (const auto& k : keys) {
    auto d = store.acquire(k, params(++token));
    CHECK(d.status == AcquireStatus::duplicate);
    CHECK(d.payload == "v:" + k);
  }
  // Keys differing only after a NUL byte are distinct records.
  CHECK(store.acquire(ns + std::string("nul\0other", 9), params(++token)).status == AcquireStatus::acquired);
  CHECK(store.redis_key(std::string("a\0b", 3)) == std::string("idem:a\0b", 8));
  // A fingerprint too long for the record's 16-bit length is refused before anything is sent.
  const std::string huge(70'000, 'f');
  auto p = params(++token);
  p.fingerprint = huge;
  CHECK_THROWS_AS(store.acquire(ns + "huge-fp", p), idem::invalid_options_error);
  p.fingerprint = std::string_view(huge).substr(0, 65'535);
  CHECK(store.acquire(ns + "big-fp", p).status == AcquireStatus::acquired);
  CHECK(store.inspect(ns + "big-fp")->fingerprint.size() == 65'535);
}

TEST_CASE("redis cluster hash slots follow the hash-tag rules", "[redis][keys]") {
  CHECK(idem::redis_hash_slot("123456789") == 0x31C3);  // CRC16/XMODEM check value
  CHECK(idem::redis_hash_slot("{user1000}.following") == idem::redis_hash_slot("{user1000}.followers"));
  CHECK(idem::redis_hash_slot("idem:{order-7}:a") == idem::redis_hash_slot("user1000-other{order-7}"));
  CHECK(idem::redis_hash_slot("foo{}{bar}") == idem::redis_hash_slot("foo{}{bar}"));
  CHECK(idem::redis_hash_slot("foo{}{bar}") != idem::redis_hash_slot("bar"));  // empty tag: whole key
  CHECK(idem::redis_hash_slot("foo{{bar}}zap") == idem::redis_hash_slot("{bar"));
  CHECK(idem::redis_hash_slot("foo{bar}{zap}") == idem::redis_hash_slot("bar"));
  // With the default prefix, a user's tag decides the slot, so related keys can share one.
  RedisStore store(server().options());
  CHECK(idem::redis_hash_slot(store.redis_key("{cust-9}:charge")) ==
        idem::redis_hash_slot(store.redis_key("{cust-9}:refund")));
}

TEST_CASE("redis completed record with an empty result fits in 100 bytes", "[redis][memory]") {
  RedisStore store(server().options());
  const std::string key = "order-" + idem::test::random_hex().substr(0, 7);  // 13 bytes, "idem:" prefix
  auto r = store.acquire(key, params(77));
  REQUIRE(store.complete(key, r.holder, "", 24h) == WriteStatus::ok);
  const long bytes = std::stol(server().command({"MEMORY", "USAGE", store.redis_key(key), "SAMPLES", "0"}));
  INFO("MEMORY USAGE of a completed record, key " << store.redis_key(key).size() << " bytes: " << bytes);
  CHECK(bytes <= 100);
  CHECK(std::stol(server().command({"STRLEN", store.redis_key(key)})) == 10);
  const long ttl = std::stol(server().command({"PTTL", store.redis_key(key)}));
  CHECK(ttl > 86'000'000);
  CHECK(ttl <= 86'400'000);
}

TEST_CASE("redis transitions cost one round trip each", "[redis][roundtrips]") {
  RedisStore store(server().options());
  const std::string k = "rt-" + idem::test::random_hex();
  server().command({"CONFIG", "RESETSTAT"});
  auto r = store.acquire(k, params(1, 200ms));
  CHECK(total_calls() == 1);  // acquire: one EVALSHA
  REQUIRE(store.extend(k, r.holder, 200ms) == WriteStatus::ok);
  CHECK(total_calls() == 2);
  std::this_thread::sleep_for(300ms);
  auto t = store.acquire(k, params(2));
  CHECK(t.takeover);
  CHECK(total_calls() == 3);  // takeover: one
  REQUIRE(store.complete(k, t.holder, "x", 60s) == WriteStatus::ok);
  CHECK(total_calls() == 4);  // complete: one
  CHECK(store.acquire(k, params(3)).status == AcquireStatus::duplicate);
  CHECK(total_calls() == 5);  // duplicate: one, result included
  CHECK(evalsha_calls() == 5);
}

TEST_CASE("redis scripts reload after SCRIPT FLUSH", "[redis][scripts]") {
  RedisStore store(server().options());
  const std::string k = "flush-" + idem::test::random_hex();
  auto r = store.acquire(k, params(1));
  REQUIRE(r.status == AcquireStatus::acquired);
  REQUIRE(server().command({"SCRIPT", "FLUSH"}) == "OK");
  CHECK(store.complete(k, r.holder, "after flush", 60s) == WriteStatus::ok);
  REQUIRE(server().command({"SCRIPT", "FLUSH"}) == "OK");
  CHECK(store.acquire(k, params(2)).payload == "after flush");
  REQUIRE(server().command({"SCRIPT", "FLUSH"}) == "OK");
  std::vector<std::string> names{k + "-a", k + "-b"};
  std::vector<std::string_view> views(names.begin(), names.end());
  auto batch = store.acquire_batch(views, params(3));
  CHECK(batch[0].status == AcquireStatus::acquired);
  CHECK(batch[1].status == AcquireStatus::acquired);
  // Only the script that met NOSCRIPT was loaded again, under the SHA1 of its generated file.
  CHECK(server().command({"SCRIPT", "EXISTS", idem::test::generated_script_sha(server(), "many")}) == "1");
  CHECK(server().command({"SCRIPT", "EXISTS", idem::test::generated_script_sha(server(), "fail")}) == "0");
}

TEST_CASE("redis batch claim and complete", "[redis][batch]") {
  RedisStore store(server().options());
  const std::string ns = "batch-" + idem::test::random_hex() + ":";
  // One key is already completed, one is held by someone else.
  auto done = store.acquire(ns + "3", params(9));
  REQUIRE(store.complete(ns + "3", done.holder, "old", 60s) == WriteStatus::ok);
  REQUIRE(store.acquire(ns + "5", params(9)).status == AcquireStatus::acquired);
  std::vector<std::string> names;
  for (int i = 0; i < 600; ++i) names.push_back(ns + std::to_string(i));
  std::vector<std::string_view> views(names.begin(), names.end());
  server().command({"CONFIG", "RESETSTAT"});
  auto claims = store.acquire_batch(views, params(10));
  REQUIRE(claims.size() == 600);
  // The duplicates read first (one MGET per 256 keys: key 3 is completed), then the other 599
  // as one many.lua call per auto_batch (128) steps, pipelined.
  CHECK(total_calls() == 3 + 5);
  std::vector<idem::CompleteItem> items;
  for (std::size_t i = 0; i < claims.size(); ++i) {
    if (i == 3) {
      CHECK(claims[i].status == AcquireStatus::duplicate);
      CHECK(claims[i].payload == "old");
    } else if (i == 5) {
      CHECK(claims[i].status == AcquireStatus::in_flight);
    } else {
      REQUIRE(claims[i].status == AcquireStatus::acquired);
      CHECK(claims[i].holder.fence == 1);
      items.push_back({views[i], claims[i].holder, "ok"});
    }
  }
  items.push_back({views[3], idem::Holder{1, 10}, "stale"});  // not a holder: lease_lost
  server().command({"CONFIG", "RESETSTAT"});
  auto st = store.complete_batch(items, 60s);
  CHECK(total_calls() == 5);  // 600 steps, 128 to a call
  REQUIRE(st.size() == items.size());
  for (std::size_t i = 0; i + 1 < st.size(); ++i) CHECK(st[i] == WriteStatus::ok);
  CHECK(st.back() == WriteStatus::lease_lost);
  auto again = store.acquire_batch(views, params(11));
  for (std::size_t i = 0; i < again.size(); ++i) {
    if (i == 5) continue;
    CHECK(again[i].status == AcquireStatus::duplicate);
  }
  CHECK(store.acquire_batch({}, params(12)).empty());
  std::vector<std::string_view> with_empty{views[0], ""};
  CHECK_THROWS_AS(store.acquire_batch(with_empty, params(12)), idem::invalid_key_error);
}

namespace {
struct Warnings : idem::Observer {
  std::vector<std::string> seen;
  void on_warning(std::string_view m) noexcept override { seen.emplace_back(m); }
};

long calls_of(RedisServer& srv, const std::string& cmd) {
  const std::string info = srv.command({"INFO", "commandstats"});
  const auto at = info.find("cmdstat_" + cmd + ":calls=");
  return at == std::string::npos ? 0 : std::stol(info.substr(at + cmd.size() + 15));
}

// Three completed keys (one with an empty result), one held, then acquire_many of them and a new key.
void batch_of_duplicates(RedisStore& store, RedisServer& srv, const std::string& ns, long mget_calls) {
  for (int i = 0; i < 3; ++i) {
    const std::string k = ns + "done" + std::to_string(i);
    auto a = store.acquire(k, params(40 + static_cast<std::uint64_t>(i)));
    REQUIRE(store.complete(k, a.holder, i == 2 ? "" : "r" + std::to_string(i), 60s) == WriteStatus::ok);
  }
  REQUIRE(store.acquire(ns + "held", params(50)).status == AcquireStatus::acquired);
  const std::string d0 = ns + "done0", d1 = ns + "done1", d2 = ns + "done2", held = ns + "held", fresh = ns + "new";
  srv.command({"CONFIG", "RESETSTAT"});
  const std::vector<idem::AcquireRequest> req{{d0, params(60)}, {fresh, params(61)}, {d1, params(62)},
                                              {held, params(63)}, {d2, params(64)}, {d0, params(65)}};
  const auto out = store.acquire_many(req);
  REQUIRE(out.size() == req.size());
  CHECK(out[0].status == AcquireStatus::duplicate);
  CHECK(out[0].payload == "r0");
  CHECK(out[0].attempts == 1);
  CHECK(out[1].status == AcquireStatus::acquired);
  CHECK(out[1].holder.token == 61);
  CHECK(out[2].payload == "r1");
  CHECK(out[3].status == AcquireStatus::in_flight);
  CHECK(out[4].status == AcquireStatus::duplicate);
  CHECK(out[4].payload.empty());  // header 0x82: the record of an empty result, read too
  CHECK(out[5].status == AcquireStatus::duplicate);
  CHECK(calls_of(srv, "mget") == mget_calls);
  CHECK(calls_of(srv, "evalsha") == 1);
  // Only duplicates of the usual record: no script at all.
  srv.command({"CONFIG", "RESETSTAT"});
  const std::vector<idem::AcquireRequest> dups{{d0, params(70)}, {d1, params(71)}};
  for (const auto& r : store.acquire_many(dups)) CHECK(r.status == AcquireStatus::duplicate);
  CHECK(calls_of(srv, "evalsha") == (mget_calls ? 0 : 1));
}
}  // namespace

TEST_CASE("redis batch: completed keys read by one MGET, the script decides only the rest", "[redis][batch]") {
  RedisStore store(server().options());
  batch_of_duplicates(store, server(), "mget-" + idem::test::random_hex() + ":", 1);
}

// Fresh traffic has no duplicates: an MGET that found none is skipped by the next 7 batches, the
// gap doubling with each empty read in a row (8, 16, ... 64); a skipped batch whose script answers
// a duplicate makes the next one read first, and reads go on while they find some.
TEST_CASE("redis batch: reads first after duplicates, ever less often while reads find none", "[redis][batch]") {
  RedisStore store(server().options());
  const std::string ns = "probe-" + idem::test::random_hex() + ":";
  std::uint64_t token = 100;
  int fresh_keys = 0;
  auto batch_of = [&](const std::vector<std::string>& keys) {
    std::vector<idem::AcquireRequest> req;
    for (const auto& k : keys) req.push_back({k, params(++token)});
    return store.acquire_many(req);
  };
  auto fresh_batches = [&](int n) {
    for (int i = 0; i < n; ++i) {
      const std::string k = ns + "fresh" + std::to_string(fresh_keys++);
      for (const auto& r : batch_of({k})) REQUIRE(r.status == AcquireStatus::acquired);
    }
  };
  const std::string a = ns + "a", b = ns + "b";
  server().command({"CONFIG", "RESETSTAT"});
  const auto first = batch_of({a, b});  // read first: nothing found
  CHECK(calls_of(server(), "mget") == 1);
  for (std::size_t i = 0; i < 2; ++i) {
    REQUIRE(first[i].status == AcquireStatus::acquired);
    REQUIRE(store.complete(i == 0 ? a : b, first[i].holder, "r", 60s) == WriteStatus::ok);
  }
  server().command({"CONFIG", "RESETSTAT"});
  for (const auto& r : batch_of({a, b})) CHECK(r.status == AcquireStatus::duplicate);  // skipped: the script answers
  CHECK(calls_of(server(), "mget") == 0);
  CHECK(calls_of(server(), "evalsha") == 1);
  server().command({"CONFIG", "RESETSTAT"});
  for (int i = 0; i < 2; ++i)
    for (const auto& r : batch_of({a, b})) CHECK(r.status == AcquireStatus::duplicate);
  CHECK(calls_of(server(), "mget") == 2);
  CHECK(calls_of(server(), "evalsha") == 0);

  // Fresh traffic: one read finds nothing, the next one comes 8 batches later, the one after 16.
  server().command({"CONFIG", "RESETSTAT"});
  fresh_batches(1);
  CHECK(calls_of(server(), "mget") == 1);
  fresh_batches(7);
  CHECK(calls_of(server(), "mget") == 1);
  fresh_batches(1);
  CHECK(calls_of(server(), "mget") == 2);
  fresh_batches(15);
  CHECK(calls_of(server(), "mget") == 2);
  fresh_batches(1);
  CHECK(calls_of(server(), "mget") == 3);
}

TEST_CASE("redis batch: a user without +mget is warned once and every key goes through the script", "[redis][batch]") {
  static RedisServer srv{{"user idem-nomget on >pw ~* -@all +evalsha +script|load +get +set +pttl +pexpire +time "
                          "+config|get +info +config|resetstat"}};
  RedisOptions o;
  o.url = "redis://idem-nomget:pw@127.0.0.1:" + std::to_string(srv.port()) + "/0";
  auto w = std::make_shared<Warnings>();
  o.observer = w;
  RedisStore store(o);
  const std::size_t before = w->seen.size();
  batch_of_duplicates(store, srv, "nomget-" + idem::test::random_hex() + ":", 0);
  REQUIRE(w->seen.size() == before + 1);
  CHECK(w->seen.back().find("+mget") != std::string::npos);
}

TEST_CASE("redis over a unix socket and in another database", "[redis][connect]") {
  RedisOptions o;
  o.url = std::string("unix://") + idem::test::admin_user + ":" + server().admin_password() + "@" +
          server().socket_path() + "?db=3";
  RedisStore store(o);
  CHECK(store.options().unix_socket == server().socket_path());
  CHECK(store.options().db == 3);
  const std::string k = "db3-" + idem::test::random_hex();
  auto r = store.acquire(k, params(1));
  REQUIRE(r.status == AcquireStatus::acquired);
  CHECK(server().command({"EXISTS", "idem:" + k}) == "0");  // not in db 0
  CHECK(server().command({"EVAL", "redis.call('SELECT', 3) return redis.call('EXISTS', KEYS[1])", "1",
                          "idem:" + k}) == "1");
}

TEST_CASE("redis store is move-only and a moved-from store says so", "[redis][api]") {
  static_assert(!std::is_copy_constructible_v<RedisStore>);
  static_assert(std::is_nothrow_move_constructible_v<RedisStore>);
  RedisStore a(server().options());
  RedisStore b(std::move(a));
  const std::string k = "moved-" + idem::test::random_hex();
  CHECK(b.acquire(k, params(1)).status == AcquireStatus::acquired);
  CHECK_THROWS_AS(a.acquire(k, params(2)), idem::usage_error);  // NOLINT(bugprone-use-after-move)
}

TEST_CASE("redis guard end to end with fingerprints and a pool shared by threads", "[redis][guard]") {
  RedisOptions o = server().options();
  o.pool.size = 2;  // fewer connections than threads: callers wait for a free one
  RedisStore store(o);
  idem::IdempotencyGuard guard(store, {.lease = 10s, .retention = 60s});
  const std::string ns = "guard-" + idem::test::random_hex() + ":";
  std::atomic<int> runs{0}, odd{0};  // Catch2 assertions are not thread-safe: count, check after
  std::vector<std::thread> ts;
  for (int t = 0; t < 6; ++t)
    ts.emplace_back([&] {
      for (int i = 0; i < 50; ++i) {
        auto out = guard.run(ns + std::to_string(i), "payload-" + std::to_string(i), [&] {
          runs.fetch_add(1);
          return i * 2;
        });
        const bool fine = out.status == idem::Status::executed || out.status == idem::Status::in_flight ||
                          (out.status == idem::Status::duplicate && *out.value == i * 2);
        if (!fine) odd.fetch_add(1);
      }
    });
  for (auto& t : ts) t.join();
  CHECK(runs.load() == 50);
  CHECK(odd.load() == 0);
  auto m = guard.run(ns + "7", "another payload", [] { return 0; });
  CHECK(m.status == idem::Status::mismatch);
}
