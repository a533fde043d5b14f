// The pure parts of the Redis Cluster routing (src/redis/cluster.hpp): redirection replies and
// CLUSTER SLOTS replies, parsed from the bytes a server sends (hiredis's reader builds the reply
// objects, as it does for the client), and the reader's limit on aggregates (client.hpp). No
// server: these are the shapes, the server tests are redis_cluster_test.
#include <catch2/catch.hpp>

#include <hiredis/hiredis.h>

#include <memory>
#include <string>
#include <tuple>
#include <utility>

#include "client.hpp"
#include "cluster.hpp"
#include "idem/core/error.hpp"
#include "reply_of.hpp"

using idem::detail::redis::parse_redirect;
using idem::detail::redis::parse_slots;
using idem_test::reply_of;

namespace {

std::string bulk(const std::string& s) { return "$" + std::to_string(s.size()) + "\r\n" + s + "\r\n"; }
std::string range(int first, int last, const std::string& host, int port) {
  return "*3\r\n:" + std::to_string(first) + "\r\n:" + std::to_string(last) + "\r\n*3\r\n" + bulk(host) + ":" +
         std::to_string(port) + "\r\n" + bulk("0123456789abcdef0123456789abcdef01234567");
}

}  // namespace

TEST_CASE("cluster: MOVED and ASK replies name the slot and the node", "[redis][cluster-unit]") {
  auto m = parse_redirect("MOVED 3999 127.0.0.1:6381");
  REQUIRE(m);
  CHECK_FALSE(m->ask);
  CHECK(m->slot == 3999);
  CHECK(m->to.host == "127.0.0.1");
  CHECK(m->to.port == 6381);

  auto a = parse_redirect("ASK 16383 [::1]:7000");
  REQUIRE(a);
  CHECK(a->ask);
  CHECK(a->slot == 16383);
  CHECK(a->to.host == "::1");
  CHECK(a->to.port == 7000);

  // A node that does not know its own address announces an empty host.
  auto e = parse_redirect("MOVED 1 :6380", "10.0.0.9");
  REQUIRE(e);
  CHECK(e->to.host == "10.0.0.9");

  for (const char* not_one : {"ERR unknown", "MOVED", "MOVED 16384 h:1", "MOVED -1 h:1", "MOVED x h:1", "MOVED 1 h",
                              "MOVED 1 h:0", "ASK 1 h:70000", "TRYAGAIN Multiple keys request during rehashing of slot",
                              "CROSSSLOT Keys in request don't hash to the same slot"}) {
    INFO(not_one);
    CHECK_FALSE(parse_redirect(not_one));
  }
}

TEST_CASE("cluster: CLUSTER SLOTS replies give each range its master", "[redis][cluster-unit]") {
  auto r = reply_of("*3\r\n" + range(0, 5460, "127.0.0.1", 7000) + range(5461, 10922, "", 7001) +
                    range(10923, 16383, "?", 7002));
  auto ranges = parse_slots(r.get(), "192.0.2.1");
  REQUIRE(ranges.size() == 3);
  CHECK(ranges[0].first == 0);
  CHECK(ranges[0].last == 5460);
  CHECK(ranges[0].master.host == "127.0.0.1");
  CHECK(ranges[0].master.port == 7000);
  CHECK(ranges[1].master.host == "192.0.2.1");  // "" and "?": the node that was asked
  CHECK(ranges[2].master.host == "192.0.2.1");
  CHECK(ranges[2].last == 16383);

  CHECK(parse_slots(reply_of("*0\r\n").get(), "h").empty());  // a node of no formed cluster
  for (const std::string& bad : {std::string("+OK\r\n"), "*1\r\n" + range(5, 4, "h", 1), "*1\r\n" + range(0, 16384, "h", 1),
                                 "*1\r\n" + range(0, 1, "h", 0), std::string("*1\r\n*2\r\n:0\r\n:1\r\n")}) {
    INFO(bad);
    CHECK_THROWS_AS(parse_slots(reply_of(bad).get(), "h"), idem::store_error);
  }
}

TEST_CASE("reader: an aggregate announcing over max_reply_elements is refused before it is allocated",
          "[redis][cluster-unit]") {
  using idem::detail::redis::max_reply_elements;
  const auto read = [](const std::string& resp, void** out) {
    std::unique_ptr<redisReader, void (*)(redisReader*)> reader(redisReaderCreate(), redisReaderFree);
    idem::detail::redis::limit_aggregates(reader.get());
    REQUIRE(redisReaderFeed(reader.get(), resp.data(), resp.size()) == REDIS_OK);
    const int rc = redisReaderGetReply(reader.get(), out);
    return std::make_pair(rc, reader->err);
  };
  void* r = nullptr;
  // The fuzzer's find: without the limit hiredis callocs 333,333,333 pointers (2.7 GB) here.
  auto [rc, err] = read("*333333333\r\n:6\r\n", &r);
  CHECK(rc == REDIS_ERR);
  CHECK(err == REDIS_ERR_OOM);
  CHECK(r == nullptr);
  CHECK(std::string(idem::detail::redis::reader_error(err, "Out of memory")).find(std::to_string(max_reply_elements)) !=
        std::string::npos);
  // Nested, too, and one over the limit.
  std::tie(rc, err) = read("*1\r\n*" + std::to_string(max_reply_elements + 1) + "\r\n", &r);
  CHECK(rc == REDIS_ERR);
  CHECK(r == nullptr);
  // Up to the limit, and the ordinary replies, read as before.
  std::tie(rc, err) = read("*" + std::to_string(max_reply_elements) + "\r\n", &r);
  CHECK(rc == REDIS_OK);
  CHECK(r == nullptr);  // announced, not complete: waits for its elements
  std::tie(rc, err) = read("*2\r\n:1\r\n$1\r\nx\r\n", &r);
  REQUIRE(rc == REDIS_OK);
  REQUIRE(r != nullptr);
  auto* reply = static_cast<redisReply*>(r);
  CHECK(reply->type == REDIS_REPLY_ARRAY);
  CHECK(reply->elements == 2);
  CHECK(reply->element[0]->integer == 1);
  CHECK(std::string(reply->element[1]->str, reply->element[1]->len) == "x");
  freeReplyObject(r);
  // Limiting a reader twice changes nothing.
  std::unique_ptr<redisReader, void (*)(redisReader*)> twice(redisReaderCreate(), redisReaderFree);
  idem::detail::redis::limit_aggregates(twice.get());
  const auto* fn = twice->fn;
  idem::detail::redis::limit_aggregates(twice.get());
  CHECK(twice->fn == fn);
}
