#pragma once
// The io thread a Redis process-test worker's AsyncRedisStore runs on (its async mode): started
// only in that mode, stopped and joined when the worker returns, so the store (declared after it)
// is destroyed first.

#include <thread>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>

namespace idem_test {

class WorkerIo {
public:
  explicit WorkerIo(bool run) {
    if (run) thread_ = std::thread([this] { io_.run(); });
  }
  ~WorkerIo() {
    io_.stop();
    if (thread_.joinable()) thread_.join();
  }
  WorkerIo(const WorkerIo&) = delete;
  WorkerIo& operator=(const WorkerIo&) = delete;

  boost::asio::io_context::executor_type executor() { return io_.get_executor(); }

private:
  boost::asio::io_context io_{1};
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work_ = boost::asio::make_work_guard(io_);
  std::thread thread_;
};

}  // namespace idem_test
