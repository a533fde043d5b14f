// An effect that ran is never run again because its result could not be stored: a result over the
// store's limit completes the key without it; a key limit above the store's is refused up front.
#include <catch2/catch.hpp>

#include <string>

#include "core/test_stores.hpp"
#include "idem/idem.hpp"

using Catch::Matchers::Contains;
using idem::Status;

TEST_CASE("a result over the store's limit completes the key without it", "[guard][limits]") {
  idem::MemoryStore inner;
  idem::test::LimitedStore store{inner, {.max_key_bytes = 64, .max_result_bytes = 16}};
  auto counter = std::make_shared<idem::CountingObserver>();
  idem::IdempotencyGuard guard(store, {.max_key_bytes = 64, .observer = counter});
  int effects = 0;
  auto big = [&] {
    ++effects;
    return std::string(17, 'x');
  };
  try {
    guard.run("order-1", big);
    FAIL("no exception");
  } catch (const idem::result_not_stored_error& e) {
    CHECK_FALSE(e.retryable());
    CHECK_THAT(e.what(), Contains("17 bytes") && Contains("limit of 16") && Contains("will not run again"));
  }
  auto again = guard.run("order-1", big);
  CHECK(effects == 1);
  CHECK(again.status == Status::duplicate);
  CHECK(again.result_unavailable);
  CHECK_FALSE(again.value);
  CHECK_THAT(again.error, Contains("over the store's limit"));
  CHECK(again.action() == idem::BrokerAction::ack);
  // At the limit it is stored as usual.
  auto fits = guard.run("order-2", [] { return std::string(16, 'y'); });
  CHECK(fits.status == Status::executed);
  CHECK(guard.run("order-2", [] { return std::string(); }).value == std::string(16, 'y'));
  CHECK(counter->store_errors() == 0);
}

TEST_CASE("max_key_bytes above the store's own limit is refused at construction", "[guard][limits][validation]") {
  idem::MemoryStore inner;
  idem::test::LimitedStore store{inner, {.max_key_bytes = 64}};
  CHECK_THROWS_WITH(idem::IdempotencyGuard(store, {.max_key_bytes = 65}),
                    Contains("max_key_bytes is 65") && Contains("64 bytes this store takes"));
  CHECK_THROWS_AS(idem::IdempotencyGuard(store), idem::invalid_options_error);  // the default 1024 too
  CHECK_NOTHROW(idem::IdempotencyGuard(store, {.max_key_bytes = 64}));
}
