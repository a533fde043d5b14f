#pragma once
// Internal to idem_redis: the Redis stores' one connection (connection.cpp) and the request it
// carries (Op). The store (engine_store.cpp) formats requests and parses replies exactly as
// RedisStore does; the connection only moves them: queued while a write is under way, written
// together, replies matched in order, lost ones resent once as the same holder.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <boost/asio/any_io_executor.hpp>

#include "client.hpp"
#include "idem/redis/options.hpp"
#include "idem/redis/transport.hpp"
#include "reply_machine.hpp"
#include "scripts.hpp"

namespace idem::detail::asio_redis {

using namespace idem::detail::redis;
using Clock = std::chrono::steady_clock;

// One request: its bytes, what to do when its reply is lost, and what to do with the reply.
struct Op {
  virtual ~Op() = default;
  // `reply` is null when `e` is set; a resent request's error reply is turned into
  // outcome_unknown_error by the connection before this is called.
  virtual void finish(std::exception_ptr e, ReplyPtr reply) noexcept = 0;
  // With `waits`: true when the op checks the WAIT's reply itself (a coalesced call, per member)
  // and has taken it; false leaves the check to the connection.
  virtual bool keeps_wait(ReplyPtr& /*wait*/) noexcept { return false; }
  // A coalesced call: its steps, taken out to be sent alone (each keeps the call's resend state);
  // empty for one caller's request.
  virtual std::vector<std::unique_ptr<Op>> dissolve() { return {}; }

  std::string bytes;
  std::string key;            // the caller's key (its parse and messages use it)
  std::string label;          // set for a coalesced call and the connection's own requests
  const ReplyErrorHints* hints = &store_hints;  // the advice an error reply gets (the sequence store's differs)
  // "acquire of key 'k'", for messages: built only when one is (the hot path formats nothing).
  [[nodiscard]] std::string describe() const;
  Script script = Script::acquire;
  bool same_holder = true;    // a lost reply is asked again once as the same holder (not inspect)
  bool internal = false;      // the connection's own (a script reload, an idle PING): never a caller's
  bool probe = false;         // the idle health check's PING
  bool waits = false;         // a WAIT follows the script in `bytes` (min_replica_acks): two replies
  ReplyPtr script_reply;      // with `waits`, the script's reply while the WAIT's is awaited
  Attempt attempt;            // what it has been through (reply_machine.hpp): reload, resend, redirections
  Clock::time_point deadline; // command_timeout from the write
  // Auto-batching: a one-key step's place in `bytes` (its single-key EVALSHA), so the connection
  // can send it inside one `many` call with other callers' steps. `step` is many.lua's letter for
  // its full form ('A' acquire, 'C' complete, 'U' complete without the result, 'f' fail, 'e'
  // extend; coalesce() picks the short one where it fits), 0 when the request goes alone
  // (inspect, the connection's own).
  char step = 0;
  std::uint32_t key_at = 0;      // the key's bulk string
  std::uint32_t args_at = 0;     // the first argument's (they run to script_end)
  std::uint32_t script_end = 0;  // the end of the EVALSHA (a WAIT may follow it)
  // Cluster mode: the slot of the key (a coalesced call carries one slot's steps only, as the
  // server runs a script on one slot) and ASKING to send before it (an ASK answer: once, to the
  // slot's importing node).
  int slot = -1;
  // Cluster mode: a keyless command for one node (SCAN, INFO, SCRIPT LOAD of RedisAdmin), sent
  // there rather than by slot; empty host: by slot.
  Endpoint node;
  bool asking = false;
  bool asking_sent = false;  // ASKING went before it in this write: its +OK comes first
  bool solo = false;  // never coalesced again: its coalesced call met a slot split by a migration
};

// Cluster mode: what a node's connection hands back to the router instead of answering the caller.
struct Routing {
  virtual ~Routing() = default;
  // `op` was answered MOVED, ASK or TRYAGAIN: it ran nothing there; `d` says where it goes now.
  virtual void reroute(std::unique_ptr<Op> op, const Decision& d) = 0;
  // A node's connection broke or could not be opened: the slot map may be out of date.
  virtual void doubt() noexcept = 0;
};

// Auto-batching (coalesce.cpp). Marks `op` (its `bytes` the single-key EVALSHA of `s`, before
// any WAIT) as one that may be coalesced; leaves it alone for a script many.lua does not take.
void locate_step(Op& op, Script s);
// One `many` call carrying `steps` (two or more located ones, in arrival order): each gets the
// reply its own call would have had. `opt` and `where` (the connection's) outlive the call;
// `coalesced` counts the steps.
std::unique_ptr<Op> coalesce(std::vector<std::unique_ptr<Op>> steps, const RedisOptions& opt,
                             const std::string& where, std::atomic<std::uint64_t>& coalesced);
// A bound on one coalesced call's bytes, so a burst of large results is not one huge request.
inline constexpr std::size_t max_coalesced_bytes = 1 << 20;

template <class T>
using DonePtr = std::unique_ptr<Done<T>>;

// What a blocked caller waits for: set once by its Waiter (on any thread), read by the caller.
// Shared by the two, so the Waiter can notify after unlocking (a caller woken under the lock would
// only block again on the mutex, a second wake-up for the loop thread to pay at 256 in flight),
// and an answer given on the caller's own thread (a lane it wrote and read itself) costs no
// system call: nobody waits yet, where a promise's once-flag still woke.
template <class T>
struct Answer {
  std::mutex mu;
  std::condition_variable cv;
  bool ready = false;
  std::exception_ptr error;
  T value{};
  T get() {
    std::unique_lock lk(mu);
    cv.wait(lk, [this] { return ready; });
    if (error) std::rethrow_exception(error);
    return std::move(value);
  }
};

// A blocking call's completion: answers the caller on the thread that completes it (the
// connection's strand, or the caller's own), with no hop through another executor.
template <class T>
struct Waiter final : Done<T> {
  explicit Waiter(std::shared_ptr<Answer<T>> a) : answer(std::move(a)) {}
  Waiter(const Waiter&) = delete;
  Waiter& operator=(const Waiter&) = delete;
  // Dropped unanswered (never on a path the engine takes): the caller is told, not left waiting,
  // and its count among the blocked callers is given back.
  ~Waiter() override {
    if (!answered)
      complete(std::make_exception_ptr(store_error("idem: a Redis request was dropped unanswered", "", true)), T{});
  }
  std::shared_ptr<Answer<T>> answer;
  bool answered = false;  // kept here, not read from answer->ready: that would take the caller's lock
  // The store's count of blocked callers not yet answered (send_checked), given back before the
  // caller wakes, so its next call counts itself alone.
  std::shared_ptr<std::atomic<int>> blocked;
  void complete(std::exception_ptr e, T value) override {
    if (blocked) blocked->fetch_sub(1, std::memory_order_relaxed);
    set(std::move(e), std::move(value));
  }
  bool waits_here() const noexcept override { return true; }

private:
  void set(std::exception_ptr e, T value) {
    answered = true;
    {
      std::lock_guard lk(answer->mu);
      answer->error = std::move(e);
      answer->value = std::move(value);
      answer->ready = true;
    }
    answer->cv.notify_one();
  }
};

// Submits through `submit(DonePtr<T>)` and waits for the answer (the blocking members).
template <class T, class Submit>
T wait_for(Submit&& submit) {
  auto a = std::make_shared<Answer<T>>();
  submit(std::make_unique<Waiter<T>>(a));
  return a->get();
}

template <class T, class Parse>
struct Call final : Op {
  Call(DonePtr<T> d, Parse p) : done(std::move(d)), parse(std::move(p)) {}
  void finish(std::exception_ptr e, ReplyPtr reply) noexcept override {
    if (!e) {
      T value{};
      e = capture([&] {
        throw_if_error(reply.get(), *hints, [&] { return describe(); });
        value = parse(reply.get(), std::string_view(key));
      });
      if (!e) {
        done->complete(nullptr, std::move(value));
        return;
      }
    }
    done->complete(e, T{});
  }
  DonePtr<T> done;
  Parse parse;
};

// A plain command (not a script: XADD, XREADGROUP, CLUSTER SLOTS...): its reply is the caller's as
// it came, an error reply included. Never resent: a lost reply is the caller's error.
struct Plain final : Op {
  explicit Plain(DonePtr<ReplyPtr> d) : done(std::move(d)) {
    script = Script::inspect;  // writes no record: no WAIT is checked after it
    same_holder = false;
    attempt.idem_script = false;
  }
  void finish(std::exception_ptr e, ReplyPtr reply) noexcept override { done->complete(e, std::move(reply)); }
  DonePtr<ReplyPtr> done;
};

class Connection;

// A connection to the server of `o` on a strand of `ex`, opened with `factory` (the blocking
// client: opening.hpp) on the strand, at the first request and after each break. With `routing`
// (cluster mode), redirected requests go back to it.
std::shared_ptr<Connection> make_connection(boost::asio::any_io_executor ex, const RedisOptions& o,
                                            std::shared_ptr<const Client> factory,
                                            std::weak_ptr<Routing> routing = {});
// Queues `op` (any thread); its finish() runs on the connection's strand.
void submit(Connection& c, std::unique_ptr<Op> op);
// A blocked caller's `op` (or batch, as one coalesced call): written and read on the calling
// thread when the connection is idle (finish() runs there) and true; else false, the request(s)
// left with the caller (also when `ops` do not fit one coalesced call: fits_one_call). Never from
// the loop's own threads: it may wait on the socket.
bool try_call(Connection& c, std::unique_ptr<Op>& op);
bool try_call(Connection& c, std::vector<std::unique_ptr<Op>>& ops);
bool fits_one_call(const std::vector<std::unique_ptr<Op>>& ops, const RedisOptions& o) noexcept;
void submit(Connection& c, std::vector<std::unique_ptr<Op>> ops);
// Fails every pending request and closes the socket (the store is going away).
void shutdown(Connection& c);
AsyncRedisStats stats(const Connection& c) noexcept;

// What AsyncRedisStore sends through (engine.cpp): the one connection to a server (plain,
// TLS, Sentinel), or in cluster mode one connection per master, requests routed by slot.
class Engine;
// `client` is the store's blocking client: what connections are opened with, and in cluster mode
// the slot map.
std::shared_ptr<Engine> make_engine(boost::asio::any_io_executor ex, const RedisOptions& o,
                                    std::shared_ptr<Client> client);
// Sends `op` (any thread) to the server, or to the master of op->slot.
void submit(Engine& e, std::unique_ptr<Op> op);
// Sends every op of `ops` (any thread) in one turn of the loop, so they leave coalesced.
void submit(Engine& e, std::vector<std::unique_ptr<Op>> ops);
// A blocked caller's `op` (try_call above, on an idle lane), to the server or the master of op->slot.
void call(Engine& e, std::unique_ptr<Op> op);
// A blocked caller's batch (as above); in cluster mode it is submitted, split per master.
void call(Engine& e, std::vector<std::unique_ptr<Op>> ops);
void shutdown(Engine& e);
AsyncRedisStats stats(const Engine& e) noexcept;


// How many blocked callers at once the engine serves each on a connection of its own (its lanes:
// pool.size off a cluster, 1 on one); past that they are multiplexed.
int lanes(const Engine& e) noexcept;
// Counts a blocked caller in among the engine's (`count` is set to the count, for the caller to
// give back once answered): true when it is among the first lanes(e), to go through call().
bool count_blocked(Engine& e, std::shared_ptr<std::atomic<int>>& count);

// Sends the request `make` builds for `done`. A blocked caller among the first lanes(e) pending
// goes through call(): on its own thread on an idle connection of the engine's (a lane); with more
// pending it queues on the loop with them, so their steps leave coalesced rather than one after
// another behind a caller's own round trip. Input errors (make throws) complete `done` and send
// nothing.
template <class T, class Make>
void send_checked(Engine& e, DonePtr<T>& done, Make&& make) {
  bool alone = false;
  if (done->waits_here()) {  // a Waiter: the only Done that waits here
    auto& w = static_cast<Waiter<T>&>(*done);
    alone = count_blocked(e, w.blocked);
  }
  std::unique_ptr<Op> op;
  if (std::exception_ptr x = capture([&] { op = make(); })) return done->complete(x, T{});
  if (alone) return call(e, std::move(op));
  submit(e, std::move(op));
}

}  // namespace idem::detail::asio_redis
