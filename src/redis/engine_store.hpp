#pragma once
// Internal to idem_redis: a Redis store's transitions on the one engine (connection.hpp), with
// both faces — submit_* for async callers, blocking members that wait — so RedisStore and
// AsyncRedisStore are the same code: requests formatted and replies parsed by store_requests.hpp,
// sent by the engine (auto-batched, pipelined, routed by slot, lost replies settled).

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>

#include "connection.hpp"
#include "idem/core/batch_store.hpp"
#include "idem/core/record.hpp"
#include "idem/core/store.hpp"
#include "idem/sequence/sequence_store.hpp"

namespace idem::detail::asio_redis {

// The answers of many requests sent together (acquire_many, a BatchWriter): each request's
// completion fills its slot on the connection's strand (or the caller's thread); the caller
// waits until none is pending.
template <class T>
struct Gather {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<T> values;
  std::vector<std::exception_ptr> errors;
  std::size_t pending = 0;
  std::atomic<bool> failed{false};

  std::size_t add() {
    std::lock_guard lk(mu);
    values.emplace_back();
    errors.emplace_back();
    ++pending;
    return values.size() - 1;
  }
  void wait() {
    std::unique_lock lk(mu);
    cv.wait(lk, [&] { return pending == 0; });
  }
  // After wait(): the answers in order, or the first error.
  std::vector<T> take() {
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
    return std::move(values);
  }
};

template <class T>
struct GatherSlot final : Done<T> {
  GatherSlot(std::shared_ptr<Gather<T>> g, std::size_t i) : g_(std::move(g)), i_(i) {}
  void complete(std::exception_ptr e, T value) override {
    std::lock_guard lk(g_->mu);
    if (e) {
      g_->errors[i_] = std::move(e);
      g_->failed = true;
    } else {
      g_->values[i_] = std::move(value);
    }
    if (--g_->pending == 0) g_->cv.notify_all();
  }

private:
  std::shared_ptr<Gather<T>> g_;
  std::size_t i_;
};

// A BatchWriter's writes: each goes out when it is made, finish() waits for every answer.
struct BatchState : Gather<WriteStatus> {
  std::vector<WriteStatus> finish() {
    wait();
    return take();
  }
};

// The blocking client a store's connections are opened with (TLS, AUTH, SELECT, Sentinel
// discovery and ROLE check; in cluster mode its slot map), built from `o`; its constructor makes
// the connection check, and `limits` gets what check_server reads (an evicting policy refused).
std::shared_ptr<Client> factory_of(const RedisOptions& o, StoreLimits& limits);

class EngineStore {
public:
  // `o` resolved (URL applied); `factory` opens the connections (its options are `o`'s).
  EngineStore(boost::asio::any_io_executor ex, const RedisOptions& o, std::shared_ptr<Client> factory);
  ~EngineStore();  // fails what is pending, closes the connections
  EngineStore(const EngineStore&) = delete;
  EngineStore& operator=(const EngineStore&) = delete;

  void submit_acquire(std::string_view key, const AcquireParams& p, DonePtr<AcquireResult> done);
  void submit_complete(std::string_view key, const Holder& h, std::string_view text, millis retention,
                       bool unavailable, DonePtr<WriteStatus> done);
  void submit_fail(std::string_view key, const Holder& h, const FailParams& f, DonePtr<WriteStatus> done);
  void submit_extend(std::string_view key, const Holder& h, millis lease, DonePtr<WriteStatus> done);
  void submit_inspect(std::string_view key, DonePtr<std::optional<Record>> done);

  AcquireResult acquire(std::string_view key, const AcquireParams& p);
  WriteStatus complete(std::string_view key, const Holder& h, std::string_view result, millis retention);
  WriteStatus complete_unavailable(std::string_view key, const Holder& h, std::string_view reason, millis retention);
  WriteStatus fail(std::string_view key, const Holder& h, const FailParams& f);
  WriteStatus extend(std::string_view key, const Holder& h, millis lease);
  std::optional<Record> inspect(std::string_view key);
  std::vector<AcquireResult> acquire_many(std::span<const AcquireRequest> requests);
  std::vector<AcquireResult> acquire_batch(std::span<const std::string_view> keys, const AcquireParams& p);
  std::vector<WriteStatus> complete_batch(std::span<const CompleteItem> items, millis retention);
  AsyncRedisStats stats() const noexcept;

  // The sequence store's requests (sequence_requests.hpp) on this engine. `unpaired`, when not
  // null, is the usage_error complete_advance answers (its record store on another connection).
  void submit_last_applied(std::string_view entity, DonePtr<std::optional<std::uint64_t>> done);
  void submit_advance(std::string_view entity, std::uint64_t seq, DonePtr<AdvanceResult> done);
  void submit_complete_advance(std::string_view key, const Holder& h, std::string_view result, millis retention,
                               std::string_view entity, std::uint64_t seq, const char* unpaired,
                               DonePtr<CompleteAdvanceResult> done);
  void submit_erase(std::string_view entity, DonePtr<bool> done);
  // What submit_complete_advance refuses before sending: `unpaired`, or on a cluster the key and
  // the entity's sequence in two slots.
  void check_complete_advance(std::string_view key, std::string_view entity, const char* unpaired) const;

  // Plain commands (not scripts) for the other Redis entry points (StreamsConsumer, the Streams
  // publisher, RedisAdmin): each to the server, or on a cluster to the master of `slot` (-1: any
  // master), redirections and a demoted master followed as for the scripts; sent once (a lost
  // reply is the caller's connection_error / timeout_error, never resent). `what` names it in
  // errors. The reply, an error reply included.
  struct PlainCommand {
    std::string bytes;  // the formatted command
    std::string what;
    int slot = -1;
    Endpoint node;  // cluster mode: a keyless command's node (a master of cluster_masters()), instead of a slot
  };
  void submit_command(PlainCommand c, DonePtr<ReplyPtr> done);
  ReplyPtr command(PlainCommand c);
  // Pipelined, in order on each connection; every reply, or the first error once all are in.
  std::vector<ReplyPtr> commands(std::vector<PlainCommand> cs);

  const RedisOptions options;
  const std::string wait;  // `WAIT n timeout`, sent after each write with min_replica_acks; else empty
  const std::shared_ptr<Engine> engine;

private:
  // acquire_many's first round trip: the duplicates a read decides.
  std::vector<std::optional<AcquireResult>> duplicates_first(std::span<const AcquireRequest> requests);
  std::unique_ptr<DuplicatesFirst> duplicates_first_;
};

// The loop a blocking store's engine runs on (RedisStore, RedisSequenceStore): one thread of its
// own, which never runs a caller's code (completions wake the blocked caller), so every blocking
// member may wait on it.
class Loop {
public:
  Loop() : work_(boost::asio::make_work_guard(io_)), thread_([this] { io_.run(); }) {}
  ~Loop() {
    work_.reset();
    io_.stop();  // an idle connection's timers would keep run() going
    thread_.join();
  }
  Loop(const Loop&) = delete;
  Loop& operator=(const Loop&) = delete;
  boost::asio::any_io_executor executor() { return io_.get_executor(); }

private:
  boost::asio::io_context io_;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work_;
  std::thread thread_;
};

// A RedisClient's engine and its loop (Client::core): every blocking store built on the client
// sends through it, so they share its connections (lanes) and one slot map. The client owns it and
// outlives it, so the engine's factory pointer does not own. The loop is declared first, destroyed
// last: the engine is shut down (pending calls failed) before its loop stops.
struct RedisCore {
  explicit RedisCore(Client& client)
      : store(loop.executor(), client.options(), std::shared_ptr<Client>(std::shared_ptr<Client>(), &client)) {}
  Loop loop;
  EngineStore store;
};

}  // namespace idem::detail::asio_redis
