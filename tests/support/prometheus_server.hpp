#pragma once
// A real Prometheus server (Debian: prometheus) for one test: a temp dir, a free loopback port, a
// 1 s scrape of one target's /metrics, optionally a rule file evaluated every second; its HTTP API
// asked through api() and query(). It is stopped by PID at the end (also when a check fails) and dies
// with the test; a prometheus that cannot start throws with its log, so the test fails, never skips.

#include <chrono>
#include <csignal>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/core.h>

#include "http_get.hpp"
#include "mini_json.hpp"
#include "process.hpp"  // free_port, spawn
#include "temp_dir.hpp"

namespace idem::test {

// One series of an instant query's answer.
struct Sample {
  std::map<std::string, std::string> labels;
  double value = 0;
};

struct PrometheusConfig {
  int target_port = 0;    // scraped at 127.0.0.1:target_port/metrics every second
  std::string job;        // the scrape job's name: the `job` label of what it scrapes
  std::string rule_file;  // loaded and evaluated every second, unless empty
};

class PrometheusServer {
public:
  // Starts `exe` (empty: prometheus was not found at configure time) with `config`, on a free port
  // (again when another process took it first), and waits for /-/ready. Throws, with the server's
  // log, when it cannot start.
  PrometheusServer(const std::string& exe, const PrometheusConfig& config) {
    if (exe.empty()) throw std::runtime_error("prometheus was not found at configure time: apt-get install prometheus");
    std::string yml =
        "global:\n"
        "  scrape_interval: 1s\n"
        "  scrape_timeout: 1s\n"
        "  evaluation_interval: 1s\n";
    if (!config.rule_file.empty()) yml += fmt::format("rule_files:\n  - \"{}\"\n", config.rule_file);
    yml += fmt::format(
        "scrape_configs:\n"
        "  - job_name: \"{}\"\n"
        "    static_configs:\n"
        "      - targets: [\"127.0.0.1:{}\"]\n",
        config.job, config.target_port);
    const std::string config_file = dir_.file("prometheus.yml", yml);
    std::string last_log, why;
    for (int attempt = 0; attempt < 3; ++attempt) {  // a port taken between free_port() and the bind: again
      port_ = free_port();
      log_ = fmt::format("{}/prometheus-{}.log", dir_.path, attempt);
      start(exe, config_file);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      why = "not ready within 20 s";
      while (std::chrono::steady_clock::now() < deadline) {
        if (exited()) {
          why = fmt::format("{} exited (status {:#x})", exe, exit_status_);
          break;
        }
        try {
          if (http_get(port_, "/-/ready").status == 200) return;
        } catch (const std::exception&) {
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      stop();
      last_log = log();
      if (last_log.find("address already in use") == std::string::npos) break;
    }
    throw std::runtime_error(fmt::format("prometheus did not start: {}; its log:\n{}", why, last_log));
  }
  ~PrometheusServer() { stop(); }
  PrometheusServer(const PrometheusServer&) = delete;
  PrometheusServer& operator=(const PrometheusServer&) = delete;

  [[nodiscard]] int port() const { return port_; }

  // The end of its log (the last 3000 characters).
  [[nodiscard]] std::string log() const {
    std::ifstream in(log_, std::ios::binary);
    std::ostringstream s;
    s << in.rdbuf();
    const std::string text = s.str();
    constexpr std::size_t n = 3000;
    return text.size() <= n ? text : "..." + text.substr(text.size() - n);
  }

  // GET path; the "data" of a {"status":"success"} JSON answer, else throws with the answer.
  [[nodiscard]] idem_test::Json api(const std::string& path) const {
    const HttpResponse r = http_get(port_, path);
    const idem_test::Json j = idem_test::parse_json(r.body);
    if (r.status != 200 || j["status"].str() != "success")
      throw std::runtime_error(fmt::format("prometheus {} answered {}: {}", path, r.status, r.body.substr(0, 500)));
    return j["data"];
  }

  // An instant query at `time` (Unix seconds; 0 = now): one Sample per series of the answer.
  [[nodiscard]] std::vector<Sample> query(const std::string& promql, double time = 0) const {
    std::string path = "/api/v1/query?query=" + url_encode(promql);
    if (time > 0) path += fmt::format("&time={:.3f}", time);
    const idem_test::Json data = api(path);
    std::vector<Sample> out;
    const auto value = [](const idem_test::Json& pair) { return std::stod(pair.arr().at(1).str()); };  // [ts, "value"]
    if (data["resultType"].str() == "scalar") return {Sample{{}, value(data["result"])}};
    for (const idem_test::Json& r : data["result"].arr()) {
      Sample smp{{}, value(r["value"])};
      for (const auto& [k, v] : r["metric"].obj()) smp.labels[k] = v.str();
      out.push_back(std::move(smp));
    }
    return out;
  }

private:
  void start(const std::string& exe, const std::string& config_file) {
    const int fd = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) throw std::runtime_error("test: cannot create " + log_);
    try {
      pid_ = spawn({exe, "--config.file=" + config_file, "--storage.tsdb.path=" + dir_.path + "/data",
                    fmt::format("--web.listen-address=127.0.0.1:{}", port_), "--log.level=info"},
                   fd);
    } catch (...) {
      ::close(fd);
      throw;
    }
    ::close(fd);
  }
  bool exited() {
    if (pid_ <= 0) return true;
    if (::waitpid(pid_, &exit_status_, WNOHANG) == pid_) {
      pid_ = -1;
      return true;
    }
    return false;
  }
  // SIGTERM by PID, SIGKILL after 5 s, and reaped.
  void stop() noexcept {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    int status = 0;
    while (::waitpid(pid_, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    pid_ = -1;
  }

  TempDir dir_{"idem-prometheus-"};
  std::string log_;
  int port_ = 0;
  pid_t pid_ = -1;
  int exit_status_ = 0;  // waitpid's status once the process has exited
};

}  // namespace idem::test
