// The Redis record format (docs/versioning.md, "The Redis record format"; the layout is in
// src/redis/lua/record.lua): the scripts are rewritten for speed from time to time (a new key's
// record built without encode, the clock read once per call, an integer reply for a new key), and
// every such rewrite must write the same bytes and read what earlier versions wrote. These cases
// pin both: the bytes written for a new key, a fingerprinted key and a completion, on the single
// and the batch paths; and records laid out byte by byte as version 0.1 writes them, read by
// acquire, complete and inspect.
#include <catch2/catch.hpp>

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "idem/idem.hpp"
#include "idem/redis.hpp"
#include "redis_factory.hpp"

using namespace std::chrono_literals;
using idem::AcquireStatus;
using idem::RedisStore;
using idem::WriteStatus;
using idem::test::RedisServer;

namespace {

RedisServer& server() {
  static RedisServer s;
  return s;
}

idem::AcquireParams params(std::uint64_t token, std::string_view fingerprint = {}) {
  idem::AcquireParams p;
  p.lease = 30s;
  p.retention = 60s;
  p.token = token;
  p.owner = "store-test";
  p.fingerprint = fingerprint;  // a view: the callers pass literals, which outlive the batch
  return p;
}

std::string be(std::uint64_t v, int bytes) {
  std::string s;
  for (int i = bytes - 1; i >= 0; --i) s += static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}
std::string be_double(double d) { return be(std::bit_cast<std::uint64_t>(d), 8); }
double read_double(const std::string& s, std::size_t at) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < 8; ++i) v = (v << 8) | static_cast<unsigned char>(s.at(at + i));
  return std::bit_cast<double>(v);
}

// The server's clock in ms (TIME).
std::int64_t server_ms() {
  const std::string t = server().command({"TIME"});
  const auto nl = t.find('\n');
  return std::stoll(t.substr(0, nl)) * 1000 + std::stoll(t.substr(nl + 1)) / 1000;
}

constexpr std::uint64_t tok = 0x0102030405060708ULL;

// A record in format v1 as idem 0.1 writes it (record.lua's encode): header, generation in its
// narrowest width, token, then what the state needs, then the fingerprint and payload sections.
std::string v1(int state, std::uint64_t gen, std::uint64_t token, const std::string& middle, const std::string& fp,
               const std::string& payload, bool permanent = false) {
  int h = 0x80 | state | (permanent ? 0x04 : 0) | (fp.empty() ? 0 : 0x10) | (payload.empty() ? 0 : 0x20);
  std::string g;
  if (gen < 256) {
    g = be(gen, 1);
  } else if (gen < 65536) {
    h |= 0x08;
    g = be(gen, 2);
  } else {
    h |= 0x40;
    g = be(gen, 4);
  }
  std::string s(1, static_cast<char>(h));
  s += g + be(token, 8) + middle;
  if (!fp.empty()) s += be(fp.size(), 2) + fp;
  if (!payload.empty()) s += be(payload.size(), 4) + payload;
  return s;
}
std::string lease_owner(double lease_until, const std::string& owner) {
  return be_double(lease_until) + be(owner.size(), 2) + owner;
}

// The in_progress record of a new key: its fixed bytes, and its lease within [before, after] + 30 s.
void check_new_record(const std::string& raw, std::uint64_t token, const std::string& fp, std::int64_t before,
                      std::int64_t after) {
  const std::string owner = "store-test";
  REQUIRE(raw.size() == 2 + 8 + 8 + 2 + owner.size() + (fp.empty() ? 0 : 2 + fp.size()));
  CHECK(static_cast<unsigned char>(raw[0]) == (fp.empty() ? 0x81 : 0x91));
  CHECK(raw[1] == 1);
  CHECK(raw.substr(2, 8) == be(token, 8));
  const double lease = read_double(raw, 10);
  CHECK(lease == static_cast<double>(static_cast<std::int64_t>(lease)));  // whole ms, as encode wrote
  CHECK(lease >= static_cast<double>(before + 30'000));
  CHECK(lease <= static_cast<double>(after + 30'000));
  CHECK(raw.substr(18) == be(owner.size(), 2) + owner + (fp.empty() ? "" : be(fp.size(), 2) + fp));
}

}  // namespace

TEST_CASE("redis record format: a new key, a fingerprinted one and a completion are the v1 bytes", "[redis][format]") {
  RedisStore store(server().options());
  const std::string ns = "fmt-" + idem::test::random_hex() + ":";
  auto raw = [&](const std::string& k) { return server().command({"GET", store.redis_key(k)}); };

  const std::int64_t before = server_ms();
  auto a = store.acquire(ns + "plain", params(tok));
  auto f = store.acquire(ns + "fp", params(tok + 1, "fp-abc"));
  const std::vector<std::string> many_keys{ns + "many-1", ns + "many-2"};
  std::vector<idem::AcquireRequest> reqs;
  for (std::size_t i = 0; i < many_keys.size(); ++i) reqs.push_back({many_keys[i], params(tok + 10 + i, i ? "fp-x" : "")});
  auto m = store.acquire_many(reqs);
  const std::vector<std::string> batch_names{ns + "batch-1", ns + "batch-2"};
  const std::vector<std::string_view> batch_keys(batch_names.begin(), batch_names.end());
  auto b = store.acquire_batch(batch_keys, params(tok + 20));
  const std::int64_t after = server_ms();

  // What the caller gets for a new key (the scripts answer it with the integer 1)
  for (const auto* r : {&a, &f, &m[0], &m[1], &b[0], &b[1]}) {
    CHECK(r->status == AcquireStatus::acquired);
    CHECK(r->holder.fence == 1);
    CHECK(r->attempts == 1);
    CHECK_FALSE(r->takeover);
  }
  CHECK(a.holder.token == tok);
  CHECK(m[1].holder.token == tok + 11);
  CHECK(b[1].holder.token == tok + 20);

  check_new_record(raw(ns + "plain"), tok, "", before, after);
  check_new_record(raw(ns + "fp"), tok + 1, "fp-abc", before, after);
  check_new_record(raw(ns + "many-1"), tok + 10, "", before, after);
  check_new_record(raw(ns + "many-2"), tok + 11, "fp-x", before, after);
  check_new_record(raw(ns + "batch-1"), tok + 20, "", before, after);
  check_new_record(raw(ns + "batch-2"), tok + 20, "", before, after);

  // Completed: state 2, the same generation and token, no lease or owner, then the result.
  REQUIRE(store.complete(ns + "plain", a.holder, "res", 60s) == WriteStatus::ok);
  CHECK(raw(ns + "plain") == v1(2, 1, tok, "", "", "res"));
  REQUIRE(store.complete(ns + "fp", f.holder, "", 60s) == WriteStatus::ok);
  CHECK(raw(ns + "fp") == v1(2, 1, tok + 1, "", "fp-abc", ""));
  // A second acquisition of a new key by another holder of the same call is in_flight, not a write.
  const std::string twice_key = ns + "twice";
  std::vector<idem::AcquireRequest> twice{{twice_key, params(tok + 30)}, {twice_key, params(tok + 31)}};
  auto t = store.acquire_many(twice);
  CHECK(t[0].status == AcquireStatus::acquired);
  CHECK(t[1].status == AcquireStatus::in_flight);
}

TEST_CASE("redis record format: records written by the previous version are read", "[redis][format]") {
  RedisStore store(server().options());
  const std::string ns = "old-" + idem::test::random_hex() + ":";
  auto put = [&](const std::string& k, const std::string& v) {
    REQUIRE(server().command({"SET", store.redis_key(k), v, "PX", "60000"}) == "OK");
  };
  auto raw = [&](const std::string& k) { return server().command({"GET", store.redis_key(k)}); };
  const auto now = static_cast<double>(server_ms());

  // completed, 1-byte generation: a duplicate with its result
  put(ns + "done", v1(2, 3, tok, "", "", "r1"));
  auto d = store.acquire(ns + "done", params(7));
  CHECK(d.status == AcquireStatus::duplicate);
  CHECK(d.payload == "r1");
  CHECK(d.attempts == 3);
  // completed, 2-byte and 4-byte generations, a fingerprint
  put(ns + "done-300", v1(2, 300, tok, "", "F", "r300"));
  d = store.acquire(ns + "done-300", params(7, "F"));
  CHECK(d.status == AcquireStatus::duplicate);
  CHECK(d.payload == "r300");
  CHECK(d.attempts == 300);
  CHECK(store.acquire(ns + "done-300", params(7, "G")).status == AcquireStatus::mismatch);
  put(ns + "done-70000", v1(2, 70'000, tok, "", "", "r"));
  CHECK(store.acquire(ns + "done-70000", params(7)).attempts == 70'000);
  // completed without its result (the permanent bit on a completed record)
  put(ns + "unavail", v1(2, 1, tok, "", "", "why", true));
  d = store.acquire(ns + "unavail", params(7));
  CHECK(d.status == AcquireStatus::duplicate);
  CHECK(d.result_unavailable);
  CHECK(d.payload == "why");

  // in_progress with a live lease: in_flight; with a lapsed one: taken over, fence + 1
  put(ns + "live", v1(1, 1, tok, lease_owner(now + 3'600'000, "old"), "", ""));
  auto l = store.acquire(ns + "live", params(7));
  CHECK(l.status == AcquireStatus::in_flight);
  CHECK(l.retry_after > 3'000'000ms);
  put(ns + "lapsed", v1(1, 255, tok, lease_owner(1000, "old"), "fp", ""));
  auto o = store.acquire(ns + "lapsed", params(8, "fp"));
  REQUIRE(o.status == AcquireStatus::acquired);
  CHECK(o.takeover);
  CHECK(o.holder.fence == 256);  // and the record now takes a 2-byte generation
  const std::string taken = raw(ns + "lapsed");
  CHECK(static_cast<unsigned char>(taken[0]) == (0x80 | 1 | 0x10 | 0x08));
  CHECK(taken.substr(1, 2) == be(256, 2));

  // in_progress held by a holder of the previous version: it completes, fails and extends
  put(ns + "held", v1(1, 1, tok, lease_owner(now + 60'000, "old"), "", ""));
  CHECK(store.complete(ns + "held", idem::Holder{1, tok + 1}, "x", 60s) == WriteStatus::lease_lost);
  REQUIRE(store.complete(ns + "held", idem::Holder{1, tok}, "x", 60s) == WriteStatus::ok);
  CHECK(raw(ns + "held") == v1(2, 1, tok, "", "", "x"));
  put(ns + "held-fp", v1(1, 2, tok, lease_owner(now + 60'000, "old"), "fp", ""));
  REQUIRE(store.extend(ns + "held-fp", idem::Holder{2, tok}, 60s) == WriteStatus::ok);
  REQUIRE(store.complete(ns + "held-fp", idem::Holder{2, tok}, "y", 60s) == WriteStatus::ok);
  CHECK(raw(ns + "held-fp") == v1(2, 2, tok, "", "fp", "y"));

  // failed: permanent (previously_failed), and one whose backoff is over (acquired again)
  put(ns + "failed", v1(3, 2, tok, be_double(now + 60'000), "", "boom", true));
  auto p = store.acquire(ns + "failed", params(7));
  CHECK(p.status == AcquireStatus::previously_failed);
  CHECK(p.payload == "boom");
  put(ns + "retry", v1(3, 2, tok, be_double(1000), "", "boom"));
  auto r = store.acquire(ns + "retry", params(7));
  CHECK(r.status == AcquireStatus::acquired);
  CHECK(r.holder.fence == 3);
  CHECK_FALSE(r.takeover);

  // inspect reads every field of an old record
  auto rec = store.inspect(ns + "done-300");
  REQUIRE(rec);
  CHECK(rec->state == idem::State::completed);
  CHECK(rec->holder.fence == 300);
  CHECK(rec->holder.token == tok);
  CHECK(rec->fingerprint == "F");
  CHECK(rec->result == "r300");
}

TEST_CASE("redis record format: the usual in_progress record completes to the v1 bytes", "[redis][format]") {
  // complete.lua and complete_key (many.lua: complete_batch, auto-batching) read the usual record (header 0x81:
  // 1-byte generation, no fingerprint) with one struct.unpack and write the completed record with
  // one struct.pack: the bytes, the holder check and the retention of the general path.
  RedisStore store(server().options());
  const std::string ns = "usual-" + idem::test::random_hex() + ":";
  auto put = [&](const std::string& k, const std::string& v) {
    REQUIRE(server().command({"SET", store.redis_key(k), v, "PX", "3600000"}) == "OK");
  };
  auto raw = [&](const std::string& k) { return server().command({"GET", store.redis_key(k)}); };
  auto pttl = [&](const std::string& k) { return std::stoll(server().command({"PTTL", store.redis_key(k)})); };
  const auto now = static_cast<double>(server_ms());
  auto held = [&](std::uint64_t gen) { return v1(1, gen, tok, lease_owner(now + 60'000, "old"), "", ""); };

  // an empty result: header 0x82, nothing after the token; the retention is the completion's
  put(ns + "empty", held(1));
  REQUIRE(store.complete(ns + "empty", idem::Holder{1, tok}, "", 60s) == WriteStatus::ok);
  CHECK(raw(ns + "empty") == v1(2, 1, tok, "", "", ""));
  CHECK(pttl(ns + "empty") <= 60'000);
  CHECK(pttl(ns + "empty") > 50'000);
  // the same request again (its reply lost): answered as written, the record unchanged
  CHECK(store.complete(ns + "empty", idem::Holder{1, tok}, "", 60s) == WriteStatus::ok);
  CHECK(raw(ns + "empty") == v1(2, 1, tok, "", "", ""));
  // a result over 65535 bytes (the length's high bytes), fences 2, 3 and 255
  const std::string big(70'000, 'b');
  put(ns + "big", held(1));
  REQUIRE(store.complete(ns + "big", idem::Holder{1, tok}, big, 60s) == WriteStatus::ok);
  CHECK(raw(ns + "big") == v1(2, 1, tok, "", "", big));
  for (std::uint64_t gen : {2, 3, 255}) {
    const std::string k = ns + "gen-" + std::to_string(gen);
    put(k, held(gen));
    CHECK(store.complete(k, idem::Holder{gen - 1, tok}, "r", 60s) == WriteStatus::lease_lost);
    CHECK(store.complete(k, idem::Holder{gen + 1, tok}, "r", 60s) == WriteStatus::lease_lost);
    CHECK(store.complete(k, idem::Holder{gen, tok + 1}, "r", 60s) == WriteStatus::lease_lost);
    CHECK(raw(k) == held(gen));
    REQUIRE(store.complete(k, idem::Holder{gen, tok}, "r", 60s) == WriteStatus::ok);
    CHECK(raw(k) == v1(2, gen, tok, "", "", "r"));
  }
  // completed without its result: the general path (the permanent bit)
  put(ns + "unavail", held(1));
  REQUIRE(store.complete_unavailable(ns + "unavail", idem::Holder{1, tok}, "why", 60s) == WriteStatus::ok);
  CHECK(raw(ns + "unavail") == v1(2, 1, tok, "", "", "why", true));
  // complete_batch (many.lua, through complete_key)
  put(ns + "batch-1", held(1));
  put(ns + "batch-2", held(2));
  const std::string b1 = ns + "batch-1", b2 = ns + "batch-2";
  const std::vector<idem::CompleteItem> items{{b1, idem::Holder{1, tok}, "x"}, {b2, idem::Holder{1, tok}, "y"}};
  const auto w = store.complete_batch(items, 60s);
  REQUIRE(w.size() == 2);
  CHECK(w[0] == WriteStatus::ok);
  CHECK(w[1] == WriteStatus::lease_lost);
  CHECK(raw(ns + "batch-1") == v1(2, 1, tok, "", "", "x"));
  CHECK(raw(ns + "batch-2") == held(2));
  CHECK(pttl(ns + "batch-1") <= 60'000);
}
