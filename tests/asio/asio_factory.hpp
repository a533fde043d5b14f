#pragma once
// An AsyncRedisStore over a redis-server the test starts, with an io_context run by its own thread
// (the store's blocking members wait for it; coroutines are co_spawned onto it).

#include <utility>

#include <future>
#include <thread>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_future.hpp>

#include "idem/asio/guard.hpp"
#include "idem/asio/redis_store.hpp"
#include "redis_factory.hpp"

namespace idem::test {

// An io_context and the thread that runs it until destruction.
struct IoThread {
  boost::asio::io_context io;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work = boost::asio::make_work_guard(io);
  std::thread thread{[this] { io.run(); }};
  IoThread() = default;
  IoThread(const IoThread&) = delete;
  IoThread& operator=(const IoThread&) = delete;
  ~IoThread() {
    work.reset();
    io.stop();
    thread.join();
  }
  // Runs the awaitable on the io thread and waits for its value (or exception).
  template <class T>
  T run(boost::asio::awaitable<T> a) {
    return boost::asio::co_spawn(io, std::move(a), boost::asio::use_future).get();
  }
};

struct AsyncRedisFactory : RedisFactoryBase {
  using store_type = AsyncRedisStore;
  static RedisServer& server() {
    static RedisServer s;
    return s;
  }
  IoThread io;
  AsyncRedisStore s{io.io.get_executor(), server().options()};
  store_type& store() { return s; }
};

}  // namespace idem::test
