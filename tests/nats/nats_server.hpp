#pragma once
// A real `nats-server -js` for one test process: a free 127.0.0.1 port, JetStream file storage in
// a temp dir of its own (so a restart keeps the streams), stopped by PID. A server that cannot
// start fails the test (throws); it never skips. Children get PR_SET_PDEATHSIG, so a crashed test
// leaves no server behind. Also the test's own JetStream client (publish, stream and consumer state).

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <nats/nats.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../support/process.hpp"  // free_port, spawn

#ifndef IDEM_NATS_SERVER
#define IDEM_NATS_SERVER "nats-server"
#endif

namespace idem::test::nats {

using idem::test::free_port;
using idem::test::spawn;

// Waits for `pid` up to `limit`, then SIGKILLs it; its exit code or 128 + signal.
inline int reap(pid_t pid, std::chrono::milliseconds limit = std::chrono::seconds(10)) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int status = 0;
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0 && errno != EINTR) return -1;
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

class NatsServer {
public:
  NatsServer() : port_(free_port()) {
    std::random_device rd;
    dir_ = (std::filesystem::temp_directory_path() / ("idem-nats-" + std::to_string(::getpid()) + "-" + std::to_string(rd())))
               .string();
    std::filesystem::create_directories(dir_ + "/js");
    start();
  }
  ~NatsServer() {
    stop();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  NatsServer(const NatsServer&) = delete;
  NatsServer& operator=(const NatsServer&) = delete;

  [[nodiscard]] std::string url() const { return "nats://127.0.0.1:" + std::to_string(port_); }
  [[nodiscard]] pid_t pid() const { return pid_; }

  /// Starts it (again, on the same port and storage); throws with its log when it does not come up.
  void start() {
    const int log = ::open((dir_ + "/server.log").c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    pid_ = spawn({IDEM_NATS_SERVER, "-js", "-a", "127.0.0.1", "-p", std::to_string(port_), "-sd", dir_ + "/js"}, log);
    ::close(log);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
    while (std::chrono::steady_clock::now() < deadline) {
      if (jetstream_ready()) return;
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) break;  // it exited: port taken, bad flag, ...
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    std::ifstream in(dir_ + "/server.log");
    std::stringstream text;
    text << in.rdbuf();
    stop();
    throw std::runtime_error("test: nats-server -js did not start on port " + std::to_string(port_) + ":\n" + text.str());
  }

  /// Stops it (SIGTERM: JetStream flushes its files) and waits for it.
  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    reap(pid_);
    pid_ = -1;
  }

private:
  bool jetstream_ready() const {
    natsConnection* nc = nullptr;
    natsOptions* o = nullptr;
    natsOptions_Create(&o);
    natsOptions_SetURL(o, url().c_str());
    natsOptions_SetTimeout(o, 500);
    natsOptions_SetMaxReconnect(o, 0);
    const natsStatus s = natsConnection_Connect(&nc, o);
    natsOptions_Destroy(o);
    if (s != NATS_OK) return false;
    jsCtx* js = nullptr;
    jsAccountInfo* ai = nullptr;
    bool ok = natsConnection_JetStream(&js, nc, nullptr) == NATS_OK && js_GetAccountInfo(&ai, js, nullptr, nullptr) == NATS_OK;
    if (ai != nullptr) jsAccountInfo_Destroy(ai);
    jsCtx_Destroy(js);
    natsConnection_Destroy(nc);
    return ok;
  }

  int port_;
  std::string dir_;
  pid_t pid_ = -1;
};

/// The durable's counters as the server reports them.
struct ConsumerState {
  std::uint64_t pending = 0;       ///< not yet delivered
  std::int64_t ack_pending = 0;    ///< delivered, not yet acked
  std::int64_t redelivered = 0;    ///< delivered more than once, not yet acked
};

/// The test's own JetStream client.
class Client {
public:
  explicit Client(const std::string& url) {
    natsOptions* o = nullptr;
    natsOptions_Create(&o);
    natsOptions_SetURL(o, url.c_str());
    natsOptions_SetMaxReconnect(o, -1);
    natsOptions_SetReconnectWait(o, 100);
    const natsStatus s = natsConnection_Connect(&nc_, o);
    natsOptions_Destroy(o);
    if (s != NATS_OK) throw std::runtime_error(std::string("test: cannot connect to ") + url + ": " + natsStatus_GetText(s));
    if (natsConnection_JetStream(&js_, nc_, nullptr) != NATS_OK) throw std::runtime_error("test: no JetStream context");
  }
  ~Client() {
    jsCtx_Destroy(js_);
    natsConnection_Destroy(nc_);
  }
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  void add_stream(const std::string& name, const std::string& subject) {
    jsStreamConfig cfg;
    jsStreamConfig_Init(&cfg);
    const char* subjects[] = {subject.c_str()};
    cfg.Name = name.c_str();
    cfg.Subjects = subjects;
    cfg.SubjectsLen = 1;
    cfg.Storage = js_FileStorage;
    jsStreamInfo* si = nullptr;
    jsErrCode code{};
    const natsStatus s = js_AddStream(&si, js_, &cfg, nullptr, &code);
    if (si != nullptr) jsStreamInfo_Destroy(si);
    if (s != NATS_OK) throw std::runtime_error("test: cannot add stream " + name + " (" + std::to_string(code) + ")");
  }

  /// Publishes `data` to `subject` with header Idem-Key: key (and Nats-Msg-Id when given).
  // Publishes `data` with exactly these headers (acknowledged by JetStream).
  void publish_with(const std::string& subject, const std::string& data,
                    const std::vector<std::pair<std::string, std::string>>& headers) {
    natsMsg* m = nullptr;
    natsMsg_Create(&m, subject.c_str(), nullptr, data.data(), static_cast<int>(data.size()));
    for (const auto& [k, v] : headers) natsMsgHeader_Add(m, k.c_str(), v.c_str());
    jsPubAck* pa = nullptr;
    jsErrCode code{};
    const natsStatus s = js_PublishMsg(&pa, js_, m, nullptr, &code);
    natsMsg_Destroy(m);
    if (pa != nullptr) jsPubAck_Destroy(pa);
    if (s != NATS_OK) throw std::runtime_error("test: publish to " + subject + " failed: " + natsStatus_GetText(s));
  }
  void publish(const std::string& subject, const std::string& key, const std::string& data, const std::string& msg_id = {}) {
    std::vector<std::pair<std::string, std::string>> headers{{"Idem-Key", key}};
    if (!msg_id.empty()) headers.emplace_back("Nats-Msg-Id", msg_id);
    publish_with(subject, data, headers);
  }

  /// Messages in a stream now.
  std::uint64_t stream_messages(const std::string& stream) {
    jsStreamInfo* si = nullptr;
    if (js_GetStreamInfo(&si, js_, stream.c_str(), nullptr, nullptr) != NATS_OK) throw std::runtime_error("test: no stream " + stream);
    const std::uint64_t n = si->State.Msgs;
    jsStreamInfo_Destroy(si);
    return n;
  }

  /// The stream's message at `seq` (destroy it with natsMsg_Destroy).
  natsMsg* stream_message(const std::string& stream, std::uint64_t seq) {
    natsMsg* m = nullptr;
    if (js_GetMsg(&m, js_, stream.c_str(), seq, nullptr, nullptr) != NATS_OK) throw std::runtime_error("test: no message");
    return m;
  }

  ConsumerState consumer(const std::string& stream, const std::string& durable) {
    jsConsumerInfo* ci = nullptr;
    const natsStatus s = js_GetConsumerInfo(&ci, js_, stream.c_str(), durable.c_str(), nullptr, nullptr);
    if (s != NATS_OK) throw std::runtime_error("test: no consumer " + durable);
    ConsumerState st{ci->NumPending, ci->NumAckPending, ci->NumRedelivered};
    jsConsumerInfo_Destroy(ci);
    return st;
  }

private:
  natsConnection* nc_ = nullptr;
  jsCtx* js_ = nullptr;
};

}  // namespace idem::test::nats
