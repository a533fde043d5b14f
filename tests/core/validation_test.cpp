// Bad input: every case is a typed idem::usage_error (or codec/corrupt error) whose message says
// what to change, and none of them lets a handler run.
#include <catch2/catch.hpp>

#include <string>

#include <fmt/core.h>

#include "idem/idem.hpp"

// The fingerprint is compiled in libidem (src/core/fingerprint.cpp): no idem header brings
// OpenSSL's, nor declares its functions.
#ifdef EVP_MAX_MD_SIZE
#error "idem.hpp included <openssl/evp.h>"
#endif
#include <openssl/evp.h>  // this test's own check of the digest

using namespace std::chrono_literals;
using Catch::Matchers::Contains;

namespace {

struct Unencodable {
  int v = 0;
};
struct Undecodable {
  int v = 0;
};

idem::GuardOptions with(void (*edit)(idem::GuardOptions&)) {
  idem::GuardOptions o;
  edit(o);
  return o;
}

}  // namespace

template <>
struct idem::codec<Unencodable> {
  static std::string encode(const Unencodable&) { throw std::runtime_error("cannot serialise"); }
  static Unencodable decode(std::string_view) { return {}; }
};
template <>
struct idem::codec<Undecodable> {
  static std::string encode(const Undecodable& u) { return std::to_string(u.v); }
  static Undecodable decode(std::string_view) { throw std::runtime_error("unknown version"); }
};

TEST_CASE("empty key", "[validation]") {
  idem::MemoryStore store;
  idem::IdempotencyGuard guard(store);
  bool ran = false;
  CHECK_THROWS_MATCHES(guard.run("", [&] { ran = true; }), idem::invalid_key_error,
                       Catch::Matchers::Predicate<idem::invalid_key_error>(
                           [](const auto& e) { return std::string(e.what()).find("empty") != std::string::npos; }));
  CHECK_FALSE(ran);
}

TEST_CASE("key over the default 1 KiB limit", "[validation]") {
  idem::MemoryStore store;
  idem::IdempotencyGuard guard(store);
  CHECK_THROWS_WITH(guard.run(std::string(1025, 'k'), [] {}), Contains("1025 bytes") && Contains("max_key_bytes"));
  CHECK(guard.run(std::string(1024, 'k'), [] {}).status == idem::Status::executed);
}

TEST_CASE("configurable key limit", "[validation]") {
  idem::MemoryStore store;
  idem::IdempotencyGuard small(store, with([](auto& o) { o.max_key_bytes = 8; }));
  CHECK_THROWS_AS(small.run("123456789", [] {}), idem::invalid_key_error);
  idem::IdempotencyGuard big(store, with([](auto& o) { o.max_key_bytes = 4096; }));
  CHECK(big.run(std::string(3000, 'x'), [] {}).status == idem::Status::executed);
}

TEST_CASE("zero lease", "[validation]") {
  idem::MemoryStore store;
  CHECK_THROWS_WITH(idem::IdempotencyGuard(store, with([](auto& o) { o.lease = 0ms; })),
                    Contains("lease must be positive"));
}

TEST_CASE("negative lease", "[validation]") {
  idem::MemoryStore store;
  CHECK_THROWS_AS(idem::IdempotencyGuard(store, with([](auto& o) { o.lease = -5ms; })), idem::invalid_options_error);
}

TEST_CASE("retention shorter than the lease", "[validation]") {
  idem::MemoryStore store;
  CHECK_THROWS_WITH(idem::IdempotencyGuard(store, with([](auto& o) {
                      o.lease = 10s;
                      o.retention = 5s;
                    })),
                    Contains("shorter than the lease") && Contains("raise retention"));
}

TEST_CASE("max attempts of zero", "[validation]") {
  idem::MemoryStore store;
  CHECK_THROWS_WITH(idem::IdempotencyGuard(store, with([](auto& o) { o.failure.max_attempts = 0; })),
                    Contains("max_attempts is 0"));
}

TEST_CASE("negative backoff and max_backoff below backoff", "[validation]") {
  idem::MemoryStore store;
  CHECK_THROWS_AS(idem::IdempotencyGuard(store, with([](auto& o) { o.failure.backoff = -1ms; })),
                  idem::invalid_options_error);
  CHECK_THROWS_WITH(idem::IdempotencyGuard(store, with([](auto& o) {
                      o.failure.backoff = 10s;
                      o.failure.max_backoff = 1s;
                    })),
                    Contains("raise max_backoff"));
}

TEST_CASE("max_key_bytes of zero", "[validation]") {
  idem::MemoryStore store;
  CHECK_THROWS_AS(idem::IdempotencyGuard(store, with([](auto& o) { o.max_key_bytes = 0; })),
                  idem::invalid_options_error);
}

TEST_CASE("negative wait_for_in_flight", "[validation]") {
  idem::MemoryStore store;
  CHECK_THROWS_AS(idem::IdempotencyGuard(store, with([](auto& o) { o.wait_for_in_flight = -1ms; })),
                  idem::invalid_options_error);
}

TEST_CASE("heartbeat with a lease too short to split", "[validation]") {
  idem::MemoryStore store;
  CHECK_THROWS_AS(idem::IdempotencyGuard(store, with([](auto& o) {
                    o.lease = 2ms;
                    o.heartbeat = true;
                  })),
                  idem::invalid_options_error);
}

TEST_CASE("MemoryStore with zero shards", "[validation]") {
  CHECK_THROWS_AS(idem::MemoryStore(idem::MemoryStoreOptions{.shards = 0}), idem::invalid_options_error);
}

TEST_CASE("a codec that throws on encode", "[validation]") {
  idem::MemoryStore store;
  idem::IdempotencyGuard guard(store);
  int effects = 0;
  CHECK_THROWS_AS(guard.run("k", [&] { ++effects; return Unencodable{1}; }), idem::result_not_stored_error);
  CHECK_THROWS_WITH(guard.run("k2", [] { return Unencodable{1}; }),
                    Contains("encode threw") && Contains("cannot serialise") && Contains("not stored"));
  // The effect ran: the key is completed without its result, so a redelivery never runs it again.
  auto again = guard.run("k", [&] { ++effects; return Unencodable{2}; });
  CHECK(effects == 1);
  CHECK(again.status == idem::Status::duplicate);
  CHECK(again.result_unavailable);
  CHECK_FALSE(again.value);
  CHECK_THAT(again.error, Contains("cannot serialise"));
  auto rec = store.inspect("k");
  REQUIRE(rec);
  CHECK(rec->state == idem::State::completed);
  CHECK(rec->permanent);
}

TEST_CASE("a stored result that cannot be decoded is a corrupt record, never a duplicate", "[validation]") {
  idem::MemoryStore store;
  idem::IdempotencyGuard guard(store);
  REQUIRE(guard.run("k", [] { return Undecodable{3}; }).status == idem::Status::executed);
  CHECK_THROWS_AS(guard.run("k", [] { return Undecodable{4}; }), idem::corrupt_record_error);
  REQUIRE(guard.run("s", [] { return std::string("not a number"); }).status == idem::Status::executed);
  bool ran = false;
  CHECK_THROWS_WITH(guard.run("s", [&] {
                      ran = true;
                      return 5;
                    }),
                    Contains("cannot be decoded"));
  CHECK_FALSE(ran);
}

TEST_CASE("store-level checks: zero token, zero holder", "[validation]") {
  idem::MemoryStore store;
  CHECK_THROWS_WITH(store.acquire("k", idem::AcquireParams{.token = 0}), Contains("token must be non-zero"));
  CHECK_THROWS_AS(store.complete("k", idem::Holder{}, "", 1s), idem::invalid_options_error);
  CHECK_THROWS_AS(store.extend("k", idem::Holder{1, 1}, 0ms), idem::invalid_options_error);
}

TEST_CASE("errors say whether a retry can help", "[validation]") {
  CHECK_FALSE(idem::invalid_key_error("x").retryable());
  CHECK(idem::connection_error("x").retryable());
  CHECK_FALSE(idem::outcome_unknown_error("x").retryable());
  CHECK_FALSE(idem::corrupt_record_error("x").retryable());
}

TEST_CASE("idem.hpp does not pull OpenSSL's headers, and fingerprints as libcrypto does", "[validation]") {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  const std::string payload(1000, 'p');
  REQUIRE(EVP_Digest(payload.data(), payload.size(), md, &len, EVP_sha256(), nullptr) == 1);
  std::string hex;
  for (unsigned i = 0; i < len; ++i) hex += fmt::format("{:02x}", md[i]);
  CHECK(idem::fingerprint(payload) == hex);
}

