#pragma once
// Internal to idem_redis: the implementation behind idem::RedisClient — what its connections are
// opened with (TLS, the hello; in Sentinel mode the master last found, and when to ask again;
// opening.hpp opens them), the slot map in cluster mode, the checks made at construction, and the
// engine every store on the client sends through (core(): connection.hpp, engine.cpp). No pool: a
// connection made here for a check is closed after it.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <hiredis/hiredis.h>

#include "command.hpp"
#include "reply.hpp"
#include "reply_machine.hpp"
#include "idem/core/error.hpp"
#include "idem/redis/client.hpp"
#include "idem/redis/options.hpp"
#include "scripts.hpp"
#include "tls.hpp"
#include "store_requests.hpp"

namespace idem::detail::asio_redis {
struct RedisCore;
}

namespace idem::detail::redis {

struct ReaderFree {
  void operator()(redisReader* r) const noexcept { redisReaderFree(r); }
};
using ReaderPtr = std::unique_ptr<redisReader, ReaderFree>;


// What differs between the stores in the advice an error reply carries.
struct ReplyErrorHints {
  std::string_view corrupt;  // after IDEMCORRUPT's text
  std::string_view oom;      // after OOM's
  std::string_view noperm;   // after NOPERM's
  std::string_view who;      // "RedisStore" or "idem", in the Redis Cluster message
  bool usage_code = false;   // IDEMUSAGE (raised by the script) is a usage_error
};
extern const ReplyErrorHints store_hints;
extern const ReplyErrorHints sequence_hints;

// Maps a Redis error reply to the idem exception that says what to do about it.
[[noreturn]] void throw_reply_error(std::string_view text, std::string_view what, const ReplyErrorHints& hints);
// A reply of a shape idem's scripts never send.
[[noreturn]] void throw_bad_reply(std::string_view what);
std::string ms(millis d);


// What the server's settings allow, read by CONFIG GET (ServerConfig::problem says when it could not be).
struct ServerConfig {
  std::string policy;              // maxmemory-policy
  std::uint64_t maxmemory = 0;     // bytes; 0 = no limit, nothing is evicted
  std::uint64_t max_bulk_len = 0;  // proto-max-bulk-len: the longest argument the server takes
  std::string problem;             // why the settings could not be read (e.g. NOPERM), "" when they were
};

// `what()` is built only when the reply is an error, so the hot path formats no message.
template <class What>
void throw_if_error(const redisReply* r, const ReplyErrorHints& hints, const What& what) {
  if (is_error(r)) throw_reply_error(reply_text(r), what(), hints);
}

// The options with the URL (when set) parsed into them and checked (invalid_options_error naming the field).
RedisOptions resolve_options(RedisOptions o);

// "host:port" entries parsed (invalid_options_error naming a bad one, as `what`).
std::vector<Endpoint> endpoints(const std::vector<std::string>& list, int default_port, const char* what);
// RedisOptions::sentinels parsed.
std::vector<Endpoint> sentinel_endpoints(const RedisOptions& o);

// The most elements one reply aggregate may announce. hiredis 0.14 allocates an array's element
// table from the count in its header, before any element arrives, so one corrupt or hostile
// header ("*333333333") asks for gigabytes; idem's largest replies (a batch, a SCAN page,
// CLUSTER SLOTS) hold thousands.
inline constexpr int max_reply_elements = 1 << 20;
// Makes `r` refuse an aggregate over max_reply_elements: the read fails as hiredis fails one it
// cannot allocate (REDIS_ERR_OOM), so the connection is dropped as broken and never half-read.
void limit_aggregates(redisReader* r) noexcept;
// A reader error's text for users: hiredis's own, except that its "Out of memory" also names the limit.
const char* reader_error(int err, const char* errstr) noexcept;

// hiredis's reply parser, bounded (limit_aggregates): bytes in, whole replies out. Every connection
// reads its replies through one, whoever does its I/O (the engine's strand, a blocked caller, an
// opening), so replies are parsed, and bytes that are not RESP refused, in one place.
class RespReader {
public:
  RespReader();
  // False when the bytes cannot be RESP: the connection is then broken (error()).
  bool feed(const char* data, std::size_t n) noexcept;
  // The next whole reply; null when more bytes are needed, or when they are not RESP (failed()).
  ReplyPtr next() noexcept;
  [[nodiscard]] bool failed() const noexcept { return failed_; }
  // What was wrong with the bytes the server at `where` sent.
  [[nodiscard]] std::string error(std::string_view where) const;

private:
  ReaderPtr r_;
  bool failed_ = false;
};

// One step of a connection's I/O, plain or TLS, without blocking. The three loops that drive a
// connection (the engine's strand, a blocked caller on its own thread, an opening's coroutine)
// wait for the socket each in its own way and share these steps and their failures' words.
enum class IoStep { done, wait, failed };
// Writes `data` from `done` on (send(2) with MSG_NOSIGNAL, or TLS): done when all of it is written,
// wait when the socket is full, failed otherwise (io_reason says why).
IoStep write_step(int fd, TlsSession* tls, std::string_view data, std::size_t& done) noexcept;
// Reads what has arrived into `reader` through `buf`: done when bytes were fed (reader.failed() says
// whether they were RESP), wait when none have arrived, failed when the connection ended or broke.
IoStep read_step(int fd, TlsSession* tls, RespReader& reader, char* buf, std::size_t size) noexcept;
// Why a step failed, from the errno it left: TLS's refusal, errno's text, or (0) "the server closed it".
std::string io_reason(const TlsSession* tls, int err);
// "connection to Redis at W broke[ during]: why"; `during` is empty or e.g. "while sending".
IoFailure io_broke(std::string_view where, std::string_view why, std::string_view during = {});
// "Redis at W did not answer[ during] within command_timeout (N ms)", a timeout.
IoFailure io_timed_out(std::string_view where, millis command_timeout, std::string_view during = {});

// min_replica_acks: after `what` (a run of script `s`) changed a record, the reply to the WAIT sent
// with it must count o.min_replica_acks replicas: store_error when WAIT was refused, durability_error
// when too few replicas acknowledged (`where` names the primary).
void check_wait(const redisReply* wait, Script s, std::string_view what, const RedisOptions& o,
                const std::string& where);
// AUTH [user] password onto `p`, when there is a password.
void add_auth(Pipeline& p, const std::string& user, const std::string& password);

// What a new connection sends before any caller's request, and what its answers must say, without
// I/O (opening.cpp sends it and reads the answers).
struct Hello {
  Pipeline requests;        // AUTH, SELECT, ROLE under Sentinel, or a lone PING over TLS; may be empty
  bool check_role = false;  // the last answer is ROLE's, and must say master
};
// For a connection to the data node: `sentinel`, the master the sentinels named; `tls`, over TLS
// (TLS 1.3 tells a client the server refused its certificate only at its first read: one answer
// makes that a failure of the connect, not a request in doubt on a connection that seemed open).
Hello hello_for(const RedisOptions& o, bool sentinel, bool tls);
// The answers to h.requests, in order: an error reply throws what it maps to (AUTH or SELECT
// refused); false when ROLE does not say master; true when the connection may carry requests.
bool hello_accepted(const Hello& h, const std::vector<ReplyPtr>& answers);
// The first error reply among a hello's answers (its text), "" when there is none: a refusal
// hello_accepted throws, and the sentinels' lookup collects into its message.
std::string_view hello_refusal(const std::vector<ReplyPtr>& answers);

// Sentinel mode: the hello a sentinel is sent, asking for o.sentinel_master (AUTH first when the
// sentinels have a password; the last answer is get-master-addr-by-name's), and that answer read:
// the master, or nothing when the sentinel does not know the name.
Hello sentinel_hello(const RedisOptions& o);
std::optional<Endpoint> parse_master_addr(const redisReply* r);
// "host:port", "[v6]:port", or the socket path (port 0).
std::string describe(const Endpoint& e);

class Cluster;

class Client {
public:
  explicit Client(RedisOptions o);
  // A client used only for its connections (opening.hpp) and its engine, for a caller that
  // sends commands of its own (the Redis Streams publisher, RedisAdmin): nothing is loaded, nor
  // connected until the first command — in cluster mode but the slot map, read here.
  struct FactoryOnly {};
  Client(RedisOptions o, FactoryOnly);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  [[nodiscard]] const RedisOptions& options() const noexcept { return opt_; }
  // Where new connections go: host:port, the socket path, or the master last discovered.
  [[nodiscard]] std::string where() const;
  [[nodiscard]] std::uint64_t discoveries() const noexcept { return discoveries_.load(); }
  [[nodiscard]] RedisClientStats stats() const noexcept;
  // Cluster mode: the slot of the key made of `parts` (the stores route by it); -1 otherwise.
  [[nodiscard]] int slot_of(std::initializer_list<std::string_view> parts) const;
  [[nodiscard]] bool clustered() const noexcept { return cluster_ != nullptr; }
  // The engine every blocking store built on this client sends through (one loop thread, its
  // lanes, its slot map), started on first use. Thread-safe.
  asio_redis::RedisCore& core();
  // Cluster mode: the slot map and its routing, for a caller that routes by itself (AsyncRedisStore).
  Cluster& cluster() noexcept { return *cluster_; }

  // Starts an EVALSHA of `s` with `numkeys` keys; the caller adds keys and arguments.
  static Command evalsha(Script s, std::size_t numkeys);
  // One plain command on this server (not in cluster mode: the cluster's construction asks each
  // node through a client of the node's); `during` names it in I/O errors; an error reply is
  // returned. Never resent. The stores' requests go through the engine (core()), not here.
  ReplyPtr call(std::string_view req, const char* during);
  // maxmemory, maxmemory-policy and proto-max-bulk-len, in one round trip; the first call after
  // construction takes what the construction's session read (no connection of its own).
  ServerConfig server_config();

  // What opening a connection needs (opening.hpp's open_ready, on the engine's strand or a
  // private loop): the TLS context (null without TLS), the sentinels (empty outside Sentinel
  // mode), the server outside Sentinel mode.
  [[nodiscard]] const Tls* tls() const noexcept { return tls_.get(); }
  [[nodiscard]] const std::vector<Endpoint>& sentinels() const noexcept { return sentinels_; }
  [[nodiscard]] Endpoint server() const;
  // Sentinel mode: the master to connect to, or nothing when the sentinels are to be asked first
  // (none known yet, or it is in doubt and they were not asked within the last 100 ms); the
  // opening that asks then reports learned_master or discovery_failed. Thread-safe.
  [[nodiscard]] std::optional<Endpoint> known_master() const;
  void learned_master(const Endpoint& m, std::size_t sentinel) const;
  void discovery_failed() const noexcept { rediscover_.store(true); }
  // The sentinel that answered last: asked first next time.
  [[nodiscard]] std::size_t first_sentinel() const;
  // A connection broke or a server answered as a replica: in Sentinel mode, the next opening asks
  // the sentinels again.
  void doubt_master() const noexcept { suspect(); }

private:
  // Something suggests the master changed (a broken connection, READONLY, too few acks): in
  // Sentinel mode, ask the sentinels again before the next connection.
  void suspect() const noexcept {
    if (!sentinels_.empty()) rediscover_.store(true);
  }

  // A connection of its own for the construction's checks and a few diagnostics (no pool: the
  // stores' calls go through the engine), opened as the engine opens one, on a private loop
  // (opening.cpp): `requests` (`replies` of them) sent in one write, every reply read, the
  // connection closed. Failures are connection_error / timeout_error (these are
  // reads and SCRIPT LOADs: nothing is in doubt).
  std::vector<ReplyPtr> session(std::string_view requests, std::size_t replies, const char* during) const;
  static void check_loaded(const redisReply* r, Script s, const ReplyErrorHints& hints);

  RedisOptions opt_;
  std::unique_ptr<const Tls> tls_;  // null without TLS; built once, shared by every connection
  std::vector<Endpoint> sentinels_;
  mutable std::mutex master_mu_;         // guards master_, first_sentinel_ and last_discovery_
  mutable Endpoint master_;              // Sentinel mode: the master last discovered
  mutable std::size_t first_sentinel_ = 0;
  mutable std::chrono::steady_clock::time_point last_discovery_{};
  mutable std::atomic<bool> rediscover_;  // Sentinel mode: ask the sentinels before the next connection
  mutable std::atomic<std::uint64_t> discoveries_{0};
  std::mutex config_mu_;
  std::optional<ServerConfig> first_config_;  // read with the scripts' SCRIPT LOAD, for the first server_config()
  std::unique_ptr<Cluster> cluster_;  // cluster mode: the router over one Client per master
  std::once_flag core_once_;
  std::unique_ptr<asio_redis::RedisCore> core_;  // reset first in ~Client: it uses everything above

};


}  // namespace idem::detail::redis
