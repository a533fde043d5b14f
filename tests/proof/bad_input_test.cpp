// Bad input, counted (docs/guarantees.md, "Bad input"): each case is refused with its typed error
// and leaves the store exactly as it was. "As it was" is a snapshot taken before and compared
// after: the records of a held key and of a completed key, and the whole keyspace (MemoryStore's
// size, Redis's DBSIZE, the PostgreSQL table's digest). Servers are started by the tests: a
// redis-server of this process, the PostgreSQL fixture of tests/postgres.

#include <catch2/catch.hpp>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "idem/detail/random.hpp"
#include "idem/idem.hpp"

#ifdef IDEM_TEST_REDIS
#include "redis/redis_server.hpp"
#endif
#ifdef IDEM_TEST_POSTGRES
#include "postgres/pg_support.hpp"
#endif

using namespace std::chrono_literals;

namespace {

idem::AcquireParams params(std::uint64_t token = idem::detail::random_token()) {
  idem::AcquireParams p;
  p.lease = 30s;
  p.retention = 60s;
  p.token = token;
  p.owner = "bad-input-test";
  return p;
}

std::string show(const std::optional<idem::Record>& r) {
  if (!r) return "absent";
  return std::to_string(static_cast<int>(r->state)) + "/" + std::to_string(r->holder.fence) + "/" +
         std::to_string(r->holder.token) + "/" + std::to_string(r->lease_until_ms) + "/" + r->result + "/" + r->error +
         "/" + r->fingerprint + "/" + std::to_string(r->attempts);
}

// A store with a held key and a completed key, and `whole()`: the rest of its state.
template <class Store>
struct Fixture {
  Store& store;
  std::string held_key, done_key;
  idem::Holder held;
  std::function<std::string()> whole;

  Fixture(Store& s, std::string prefix, std::function<std::string()> w)
      : store(s), held_key(prefix + "held"), done_key(prefix + "done"), whole(std::move(w)) {
    auto a = store.acquire(held_key, params());
    REQUIRE(a.status == idem::AcquireStatus::acquired);
    held = a.holder;
    auto d = store.acquire(done_key, params());
    REQUIRE(d.status == idem::AcquireStatus::acquired);
    REQUIRE(store.complete(done_key, d.holder, "result", 60s) == idem::WriteStatus::ok);
  }

  std::string snapshot() { return show(store.inspect(held_key)) + "|" + show(store.inspect(done_key)) + "|" + whole(); }

  // `f` throws E and the store is as it was.
  template <class E, class F>
  void refused(const char* what, F&& f) {
    INFO(what);
    const std::string before = snapshot();
    CHECK_THROWS_AS(f(), E);
    CHECK(snapshot() == before);
  }
};

// The cases every store shares: the arguments of each transition.
template <class Store>
void transition_cases(Fixture<Store>& fx) {
  Store& s = fx.store;
  const std::string k = fx.held_key;
  const idem::Holder h = fx.held;
  auto with = [](auto edit) {
    idem::AcquireParams p = params();
    edit(p);
    return p;
  };
  fx.template refused<idem::invalid_key_error>("acquire: empty key", [&] { (void)s.acquire("", params()); });
  fx.template refused<idem::invalid_options_error>("acquire: token 0", [&] { (void)s.acquire(k, params(0)); });
  fx.template refused<idem::invalid_options_error>("acquire: lease 0",
                                                   [&] { (void)s.acquire(k, with([](auto& p) { p.lease = 0ms; })); });
  fx.template refused<idem::invalid_options_error>(
      "acquire: negative lease", [&] { (void)s.acquire(k, with([](auto& p) { p.lease = -1ms; })); });
  fx.template refused<idem::invalid_options_error>(
      "acquire: retention below the lease", [&] { (void)s.acquire(k, with([](auto& p) { p.retention = 1s; })); });
  fx.template refused<idem::invalid_options_error>("complete: fence 0",
                                                   [&] { (void)s.complete(k, {0, h.token}, "r", 60s); });
  fx.template refused<idem::invalid_options_error>("complete: token 0",
                                                   [&] { (void)s.complete(k, {h.fence, 0}, "r", 60s); });
  fx.template refused<idem::invalid_options_error>("complete: retention 0", [&] { (void)s.complete(k, h, "r", 0ms); });
  fx.template refused<idem::invalid_key_error>("complete: empty key", [&] { (void)s.complete("", h, "r", 60s); });
  fx.template refused<idem::invalid_options_error>("fail: zero holder", [&] {
    (void)s.fail(k, {0, 0}, idem::FailParams{.error = "e"});
  });
  fx.template refused<idem::invalid_options_error>("fail: negative retention", [&] {
    (void)s.fail(k, h, idem::FailParams{.error = "e", .retention = -1ms});
  });
  fx.template refused<idem::invalid_options_error>("extend: lease 0", [&] { (void)s.extend(k, h, 0ms); });
  fx.template refused<idem::invalid_options_error>("extend: zero holder", [&] { (void)s.extend(k, {0, 0}, 30s); });
  fx.template refused<idem::invalid_key_error>("inspect: empty key", [&] { (void)s.inspect(""); });
  // A batch is refused whole: the good requests before the bad one are not acquired either.
  fx.template refused<idem::invalid_key_error>("acquire_many: one empty key among good ones", [&] {
    const std::string a = fx.held_key + "-batch-a", b = fx.held_key + "-batch-b";
    std::vector<idem::AcquireRequest> reqs{{a, params()}, {b, params()}, {"", params()}};
    (void)s.acquire_many(reqs);
  });
}

}  // namespace

TEST_CASE("bad input: MemoryStore refuses each case and changes nothing", "[bad_input]") {
  idem::MemoryStore store(idem::MemoryStoreOptions{.shards = 1, .max_records = 3});
  Fixture<idem::MemoryStore> fx(store, "mem:", [&] { return std::to_string(store.size()); });
  transition_cases(fx);
  (void)store.acquire("mem:third", params());
  fx.refused<idem::capacity_error>("acquire: a new key at max_records",
                                   [&] { (void)store.acquire("mem:fourth", params()); });
  fx.refused<idem::invalid_options_error>("MemoryStoreOptions: zero shards",
                                          [] { idem::MemoryStore bad(idem::MemoryStoreOptions{.shards = 0}); });
}

#ifdef IDEM_TEST_REDIS
namespace {
idem::test::RedisServer& redis_server() {
  static idem::test::RedisServer s;
  return s;
}
}  // namespace

TEST_CASE("bad input: RedisStore refuses each case and changes nothing", "[bad_input]") {
  auto& server = redis_server();
  idem::RedisOptions o = server.options();
  o.key_prefix = "bad:";
  idem::RedisStore store(o);
  const std::string ns = "t" + std::to_string(idem::detail::random_token() % 1000000) + ":";
  // The whole keyspace, values included: DBSIZE and every key's bytes under the prefix.
  auto whole = [&] {
    std::string out = server.command({"DBSIZE"});
    for (const char* name : {"held", "done", "corrupt", "list"}) out += "|" + server.command({"GET", "bad:" + ns + name});
    return out;
  };
  Fixture<idem::RedisStore> fx(store, ns, whole);
  transition_cases(fx);

  fx.refused<idem::invalid_options_error>("acquire: fingerprint over 65535 bytes", [&] {
    idem::AcquireParams p = params();
    const std::string fp(65536, 'f');
    p.fingerprint = fp;
    (void)store.acquire(ns + "fp", p);
  });

  // A value idem did not write under its prefix: refused by the Lua codec, never overwritten.
  const std::string corrupt = ns + "corrupt";
  server.command({"SET", "bad:" + corrupt, "not an idem record"});
  fx.refused<idem::corrupt_record_error>("corrupt record: acquire", [&] { (void)store.acquire(corrupt, params()); });
  fx.refused<idem::corrupt_record_error>("corrupt record: complete",
                                         [&] { (void)store.complete(corrupt, {1, 7}, "r", 60s); });
  fx.refused<idem::corrupt_record_error>("corrupt record: fail",
                                         [&] { (void)store.fail(corrupt, {1, 7}, idem::FailParams{.error = "e"}); });
  fx.refused<idem::corrupt_record_error>("corrupt record: extend", [&] { (void)store.extend(corrupt, {1, 7}, 30s); });
  fx.refused<idem::corrupt_record_error>("corrupt record: inspect", [&] { (void)store.inspect(corrupt); });
  // A valid header and token but a truncated lease: the 20-byte fast path of complete must not take it.
  server.command({"SET", "bad:" + corrupt, std::string("\x81\x01", 2) + "ABCDEFGH" + std::string(9, '\0')});
  fx.refused<idem::corrupt_record_error>("corrupt record: truncated in_progress, complete",
                                         [&] { (void)store.complete(corrupt, {1, 0x4142434445464748ULL}, "r", 60s); });
  const std::string list = ns + "list";
  server.command({"RPUSH", "bad:" + list, "x"});
  fx.refused<idem::store_error>("a non-string value under the prefix: acquire (WRONGTYPE)",
                                [&] { (void)store.acquire(list, params()); });

  // URLs and options: refused before anything connects.
  for (const char* url : {"http://localhost", "rediss://localhost:6379?tls_min_version=1.0", "redis://localhost:99999", "redis://host:0",
                          "redis://u%zz:p@host", "redis://host/?timeout=5", "redis://user:@host", "redis://host/abc",
                          "redis-sentinel://h:26379/", "redis-cluster://h:7000/3", "unix://relative.sock", "redis://"}) {
    fx.refused<idem::invalid_options_error>(url, [&] {
      idem::RedisOptions bad;
      bad.url = url;
      idem::RedisStore s(bad);
    });
  }
  fx.refused<idem::invalid_options_error>("RedisOptions: key_prefix with a stray brace", [&] {
    idem::RedisOptions bad = server.options();
    bad.key_prefix = "idem:{x:";
    idem::RedisStore s(bad);
  });
  fx.refused<idem::invalid_options_error>("RedisOptions: command_timeout 0", [&] {
    idem::RedisOptions bad = server.options();
    bad.command_timeout = 0ms;
    idem::RedisStore s(bad);
  });
}
#endif

#ifdef IDEM_TEST_POSTGRES
TEST_CASE("bad input: PostgresStore refuses each case and changes nothing", "[bad_input]") {
  pgtest::Config cfg = pgtest::options();
  cfg.store.max_result_bytes = 16;
  idem::PostgresStore store = pgtest::store(cfg);
  pgtest::Raw raw;
  const std::string ns = pgtest::key("bad") + ":";
  // The whole table, every column of every row, as one digest.
  auto whole = [&] {
    return raw.scalar("SELECT count(*) || ':' || coalesce(md5(string_agg(t::text, ',' ORDER BY t.key)), '') FROM " +
                      cfg.store.schema + "." + cfg.store.table + " t");
  };
  Fixture<idem::PostgresStore> fx(store, ns, whole);
  transition_cases(fx);

  fx.refused<idem::invalid_key_error>("acquire: key over PostgresStore::max_key_bytes", [&] {
    (void)store.acquire(std::string(idem::PostgresStore::max_key_bytes + 1, 'k'), params());
  });
  fx.refused<idem::usage_error>("complete: result over max_result_bytes",
                                [&] { (void)store.complete(fx.held_key, fx.held, std::string(17, 'x'), 60s); });

  // A damaged row: the decoder refuses it, and the row is left for a human.
  const std::string damaged = ns + "damaged";
  {
    auto a = store.acquire(damaged, params());
    REQUIRE(a.status == idem::AcquireStatus::acquired);
    raw.exec("UPDATE " + cfg.store.schema + "." + cfg.store.table + " SET state = 9 WHERE key = convert_to('" +
             damaged + "', 'UTF8')");
  }
  fx.refused<idem::corrupt_record_error>("corrupt record: state 9, inspect", [&] { (void)store.inspect(damaged); });

  for (const char* ci : {"host=127.0.0.1 port=70000", "sslmode=bogus", "connect_timeout=soon", "this is not a conninfo",
                         "postgresql://h:99999/db", "target_session_attrs=maybe"}) {
    fx.refused<idem::invalid_options_error>(ci, [&] { idem::PostgresStore s(idem::PostgresOptions{.conninfo = ci}); });
  }
  for (const char* schema : {"bad-name", "pg_catalog", "Robert'); DROP TABLE students;--", ""}) {
    fx.refused<idem::invalid_options_error>(schema, [&] {
      pgtest::Config c = pgtest::options();
      c.store.schema = schema;
      (void)pgtest::store(c);
    });
  }
  fx.refused<idem::invalid_options_error>("table 'x;drop'", [&] {
    pgtest::Config c = pgtest::options();
    c.store.table = "x;drop";
    (void)pgtest::store(c);
  });
  fx.refused<idem::invalid_options_error>("max_result_bytes 0", [&] {
    pgtest::Config c = pgtest::options();
    c.store.max_result_bytes = 0;
    (void)pgtest::store(c);
  });
}
#endif
