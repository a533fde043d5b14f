// idem::http without a network: the sf-string key parser, the stored-response codec, the request
// fingerprint and the policy of Endpoint on a MemoryStore with a manual clock.

#include <atomic>
#include <catch2/catch.hpp>
#include <memory>
#include <string>
#include <thread>

#include "idem/http/endpoint.hpp"
#include "idem/idem.hpp"
#include "core/test_stores.hpp"

using idem::http::parse_idempotency_key;
using idem::http::Request;
using idem::http::Response;

namespace {

Request post(std::string_view key_field, std::string_view body = "{\"amount\":1}") {
  Request r;
  r.method = "POST";
  r.target = "/charges";
  r.body = body;
  if (!key_field.empty()) r.headers.emplace_back("Idempotency-Key", key_field);
  return r;
}

struct Fixture {
  std::shared_ptr<idem::ManualClock> clock = std::make_shared<idem::ManualClock>();
  idem::MemoryStore store{{.clock = clock}};
  idem::IdempotencyGuard<idem::MemoryStore> guard{store,
                                                  {.lease = idem::millis{2'000}, .retention = idem::millis{10'000}}};
  idem::http::Endpoint<idem::MemoryStore> endpoint{guard};
  int runs = 0;
  Response answer(const Request& req, int status = 201, std::string body = "ok") {
    return endpoint.handle(req, [&](const Request&) {
      ++runs;
      return Response{status, {{"Content-Type", "text/plain"}, {"Connection", "close"}}, body};
    });
  }
};

}  // namespace

TEST_CASE("http key: an sf-string is unquoted and unescaped") {
  CHECK(parse_idempotency_key(R"("abc-123")", 255).key == "abc-123");
  CHECK(parse_idempotency_key(R"(  "a\"b\\c"  )", 255).key == R"(a"b\c)");
  CHECK(parse_idempotency_key(R"("with space")", 255).key == "with space");
  CHECK(parse_idempotency_key(R"("x")", 1).ok());
}

TEST_CASE("http key: a bare key (a token, a UUID) is the key itself, unless accept_bare is off") {
  CHECK(parse_idempotency_key("abc", 255).key == "abc");
  CHECK(parse_idempotency_key(" 8e03978e-40d5-43e8-bc93-6e7f2b1c9a10 ", 255).key == "8e03978e-40d5-43e8-bc93-6e7f2b1c9a10");
  CHECK(parse_idempotency_key("key_1.x~!#$%&'*+^`|", 255).key == "key_1.x~!#$%&'*+^`|");
  CHECK(parse_idempotency_key("abc", 255).key == parse_idempotency_key("\"abc\"", 255).key);
  auto why = [](std::string_view f, std::size_t max = 255) {
    const auto p = parse_idempotency_key(f, max);
    CHECK_FALSE(p.ok());
    return p.error;
  };
  CHECK_THAT(why("a b"), Catch::Contains("quote the key"));
  CHECK_THAT(why("caf\xc3\xa9"), Catch::Contains("quote the key"));
  CHECK_THAT(why("a,b"), Catch::Contains("more than one"));
  CHECK_THAT(why("a;p=1"), Catch::Contains("parameters"));
  CHECK_THAT(why(std::string(256, 'k')), Catch::Contains("longer than 255"));
  CHECK_THAT(parse_idempotency_key("abc", 255, false).error, Catch::Contains("a token"));
}

TEST_CASE("http key: with accept_bare off, anything but one printable sf-string is refused, saying why") {
  auto why = [](std::string_view f, std::size_t max = 255) {
    const auto p = parse_idempotency_key(f, max, false);
    CHECK_FALSE(p.ok());
    return p.error;
  };
  CHECK_THAT(why("123"), Catch::Contains("a number"));
  CHECK_THAT(why("-1.5"), Catch::Contains("a number"));
  CHECK_THAT(why("abc"), Catch::Contains("a token"));
  CHECK_THAT(why("?1"), Catch::Contains("a boolean"));
  CHECK_THAT(why(":aGk=:"), Catch::Contains("byte sequence"));
  CHECK_THAT(why("(\"a\")"), Catch::Contains("inner list"));
  CHECK_THAT(why(""), Catch::Contains("empty"));
  CHECK_THAT(why("\"\""), Catch::Contains("empty string"));
  CHECK_THAT(why("\"abc"), Catch::Contains("closing quote"));
  CHECK_THAT(why(R"("a\n")"), Catch::Contains("backslash"));
  CHECK_THAT(why("\"a\tb\""), Catch::Contains("printable"));
  CHECK_THAT(why("\"caf\xc3\xa9\""), Catch::Contains("printable"));
  CHECK_THAT(why(R"("a";p=1)"), Catch::Contains("parameters"));
  CHECK_THAT(why(R"("a", "b")"), Catch::Contains("more than one"));
  CHECK_THAT(why(R"("a"b)"), Catch::Contains("after its string"));
  CHECK_THAT(why("\"" + std::string(256, 'k') + "\""), Catch::Contains("longer than 255"));
  CHECK_THAT(why(R"("abcd")", 3), Catch::Contains("longer than 3"));
}

TEST_CASE("http codec: status, headers and a binary body round-trip") {
  std::string body;
  for (int i = 0; i < 256; ++i) body += static_cast<char>(i);
  body += std::string("\0\0tail", 6);
  const Response in{
      402, {{"Content-Type", "application/octet-stream"}, {"X-Empty", ""}, {"X-Bin", std::string("a\0b", 3)}}, body};
  const Response out = idem::http::decode_response(idem::http::encode_response(in));
  CHECK(out.status == 402);
  REQUIRE(out.headers.size() == 3);
  CHECK(out.headers[2].value == std::string("a\0b", 3));
  CHECK(out.header("content-type") == "application/octet-stream");
  CHECK(out.body == body);
  CHECK(idem::http::decode_response(idem::http::encode_response(Response{204, {}, ""})).body.empty());
}

TEST_CASE("http codec: damaged or foreign values and bad statuses are refused") {
  const std::string good = idem::http::encode_response(Response{201, {{"A", "b"}}, "body"});
  CHECK_THROWS_AS(idem::http::decode_response("hello"), idem::codec_error);
  for (std::size_t cut = 0; cut < good.size() - 4; ++cut)  // every truncation inside the headers
    CHECK_THROWS_AS(idem::http::decode_response(good.substr(0, cut)), idem::codec_error);
  std::string huge_count = good;
  huge_count[idem::http::detail::response_magic.size() + 4] = '\x7f';
  CHECK_THROWS_AS(idem::http::decode_response(huge_count), idem::codec_error);
  CHECK_THROWS_AS(idem::http::encode_response(Response{42, {}, ""}), idem::codec_error);
  // The size limit rides on the stored value: over it, encoding refuses (the guard's unstorable path).
  CHECK_THROWS_AS(idem::codec<idem::http::detail::Stored>::encode({Response{200, {}, std::string(100, 'x')}, 50}),
                  idem::codec_error);
}

TEST_CASE("http fingerprint: method, target, chosen headers and body all count") {
  Request a = post("\"k\"");
  a.headers.emplace_back("Content-Type", "application/json");
  const auto fp = [](const Request& r, std::vector<std::string> h = {}) {
    return idem::http::request_fingerprint_payload(r, h);
  };
  Request b = a;
  b.body = "{\"amount\":2}";
  Request c = a;
  c.target = "/refunds";
  Request d = a;
  d.method = "PUT";
  CHECK(fp(a) != fp(b));
  CHECK(fp(a) != fp(c));
  CHECK(fp(a) != fp(d));
  Request e = a;
  e.headers.back().second = "text/plain";
  CHECK(fp(a) == fp(e));  // not a chosen header
  CHECK(fp(a, {"content-type"}) != fp(e, {"content-type"}));
}

TEST_CASE("http endpoint: missing, invalid and oversized input answers 4xx and stores nothing") {
  Fixture f;
  const Response missing = f.answer(post(""));
  CHECK(missing.status == 400);
  CHECK(missing.header("Content-Type") == "application/problem+json");
  CHECK_THAT(missing.body, Catch::Contains("missing-key") && Catch::Contains("kept for 10 s"));
  CHECK(f.answer(post("1 23")).status == 400);
  CHECK(f.answer(post("t\"ok")).status == 400);
  const std::string big(2 << 20, 'b');
  const Response too_big = f.answer(post("\"big\"", big));
  CHECK(too_big.status == 413);
  CHECK(f.runs == 0);
  CHECK_FALSE(f.store.inspect("http:big").has_value());
}

TEST_CASE("http endpoint: replay, 422 on another request, expiry runs again") {
  Fixture f;
  const Response first = f.answer(post("\"k1\""));
  CHECK(first.status == 201);
  CHECK(first.header("Idempotent-Replayed").empty());
  CHECK(first.header("Connection") == "close");  // the caller whose request ran gets every header
  const Response again = f.answer(post("\"k1\""), 201, "other");
  CHECK(again.status == 201);
  CHECK(again.body == "ok");
  CHECK(again.header("Idempotent-Replayed") == "true");
  CHECK(again.header("Connection").empty());  // hop-by-hop headers are never stored
  CHECK(f.answer(post("\"k1\"", "{\"amount\":9}")).status == 422);
  CHECK(f.runs == 1);
  f.clock->advance(idem::millis{10'001});
  CHECK(f.answer(post("\"k1\"")).header("Idempotent-Replayed").empty());
  CHECK(f.runs == 2);
}

TEST_CASE("http endpoint: a 4xx is stored, a 5xx and an exception release the key") {
  Fixture f;
  CHECK(f.answer(post("\"c\""), 402, "declined").status == 402);
  CHECK(f.answer(post("\"c\""), 201).header("Idempotent-Replayed") == "true");
  CHECK(f.answer(post("\"s\""), 503, "down").status == 503);
  // The released record says why (not "non-std exception"): inspect shows it to an operator.
  const auto released = f.store.inspect(f.endpoint.options().key_prefix + "s");
  REQUIRE(released);
  CHECK_THAT(released->error, Catch::Contains("status 503") && Catch::Contains("store_server_errors"));
  CHECK(f.answer(post("\"s\""), 201).status == 201);  // ran again
  CHECK(f.runs == 3);
  const Response thrown =
      f.endpoint.handle(post("\"t\""), [&](const Request&) -> Response { throw std::runtime_error("boom"); });
  CHECK(thrown.status == 500);
  CHECK(f.answer(post("\"t\"")).status == 201);
}

TEST_CASE("http endpoint: a request while the first runs answers 409 with Retry-After") {
  Fixture f;
  std::atomic<bool> inside{false}, release{false};
  std::thread first([&] {
    f.endpoint.handle(post("\"busy\""), [&](const Request&) {
      inside = true;
      while (!release) std::this_thread::yield();
      return Response{201, {}, "done"};
    });
  });
  while (!inside) std::this_thread::yield();
  const Response busy = f.answer(post("\"busy\""));
  release = true;
  first.join();
  CHECK(busy.status == 409);
  // The 2 s lease left, spread by up to half again (idem::verdict), in whole seconds.
  const auto retry_after = busy.header("Retry-After");
  CHECK((retry_after == "2" || retry_after == "3"));
  CHECK(f.answer(post("\"busy\"")).body == "done");
}

// Every guard answer and three kinds of exception, and the status code each becomes: the
// endpoint maps idem's outcome (and idem::verdict's Retry-After) and decides nothing else.
TEST_CASE("http endpoint: every guard answer and exception kind has its status code") {
  Fixture f;
  // executed, duplicate (replayed), mismatch: 201, 201 + Idempotent-Replayed, 422.
  CHECK(f.answer(post("\"a\"")).status == 201);
  CHECK(f.answer(post("\"a\"")).header("Idempotent-Replayed") == "true");
  CHECK(f.answer(post("\"a\"", "{\"amount\":2}")).status == 422);
  // lease_lost: the handler outlived its lease and another request took the key over.
  const Response lost = f.endpoint.handle(post("\"ll\""), [&](const Request&) {
    f.clock->advance(idem::millis{3'000});
    const auto taken = f.store.acquire(f.endpoint.options().key_prefix + "ll",
                                       {.lease = idem::millis{2'000}, .retention = idem::millis{10'000}, .token = 99});
    CHECK(taken.status == idem::AcquireStatus::acquired);
    return Response{201, {}, "late"};
  });
  CHECK(lost.status == 201);  // lease mode: the effect happened, so its caller gets its answer (not stored)
  // The handler's exception: 500, and the key is released for the client's retry.
  const auto boom = [](const Request&) -> Response { throw std::runtime_error("card declined by the network"); };
  CHECK(f.endpoint.handle(post("\"ex\""), boom).status == 500);
  CHECK(f.answer(post("\"ex\"")).status == 201);
  // previously_failed (a permanent failure another writer recorded): 500, not run again.
  const std::string pf = f.endpoint.options().key_prefix + "pf";
  const auto claim = f.store.acquire(pf, {.lease = idem::millis{2'000}, .retention = idem::millis{10'000}, .token = 7});
  REQUIRE(f.store.fail(pf, claim.holder, {.error = "declined", .permanent = true, .retention = idem::millis{10'000}}) ==
          idem::WriteStatus::ok);
  int ran = 0;
  CHECK(f.endpoint.handle(post("\"pf\""), [&](const Request&) { ++ran; return Response{201, {}, ""}; }).status == 500);
  CHECK(ran == 0);
  // A store error a retry can help: 503 with the verdict's Retry-After; one it cannot: 500.
  idem::test::FaultyStore faulty{f.store};
  idem::IdempotencyGuard<idem::test::FaultyStore> fg{faulty};
  idem::http::Endpoint<idem::test::FaultyStore> down{fg, {.retry = {.base = idem::millis{2'000}, .cap = idem::millis{4'000}}}};
  faulty.fail_acquire = true;
  const Response unavailable = down.handle(post("\"sd\""), [&](const Request&) { ++ran; return Response{201, {}, ""}; });
  CHECK(unavailable.status == 503);
  const auto retry_after = unavailable.header("Retry-After");
  CHECK((retry_after == "1" || retry_after == "2"));  // whole seconds, at least 1, at most the doubled base
  CHECK(ran == 0);
  // A bad key: 400, nothing stored.
  CHECK(f.answer(post("no quotes")).status == 400);
}

TEST_CASE("http endpoint: a response over the stored limit reaches its caller, retries get a problem") {
  Fixture f;
  idem::http::Endpoint<idem::MemoryStore> small{f.guard, {.max_stored_response_bytes = 64}};
  auto big = [](const Request&) { return Response{201, {}, std::string(1000, 'x')}; };
  CHECK(small.handle(post("\"large\""), big).body.size() == 1000);
  const Response retry = small.handle(post("\"large\""), big);
  CHECK(retry.status == 500);
  CHECK_THAT(retry.body, Catch::Contains("not stored"));
}

TEST_CASE("http endpoint: bad configuration is refused at construction") {
  Fixture f;
  using E = idem::http::Endpoint<idem::MemoryStore>;
  CHECK_THROWS_AS(E(f.guard, {.max_key_length = 0}), idem::invalid_options_error);
  CHECK_THROWS_AS(E(f.guard, {.max_key_length = 5000}), idem::invalid_options_error);
  CHECK_THROWS_AS(E(f.guard, {.max_stored_response_bytes = 0}), idem::invalid_options_error);
  idem::IdempotencyGuard<idem::MemoryStore> recording{f.store, {.failure = {.mode = idem::FailureMode::record}}};
  CHECK_THROWS_AS(E(recording), idem::invalid_options_error);
}
