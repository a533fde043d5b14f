#pragma once
// Test support for idem::kafka's consumer: librdkafka's in-process mock cluster (real TCP
// listeners, the real protocol), payment events to produce into it, and a ledger to count effects.

#include <librdkafka/rdkafka.h>
#include <librdkafka/rdkafka_mock.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "rdkafka.hpp"  // src/kafka: idem::kafka's internal pieces

namespace idem_test {

/// One record read back from a topic.
struct Record {
  std::int32_t partition = 0;
  std::int64_t offset = 0;
  std::string key, value;
  std::vector<std::pair<std::string, std::string>> headers;  // in order
  std::int64_t timestamp = -1;                               // ms since the epoch; -1: none
  // The last value of header `name`, or nullopt.
  std::optional<std::string> header(const std::string& name) const {
    for (auto it = headers.rbegin(); it != headers.rend(); ++it)
      if (it->first == name) return it->second;
    return std::nullopt;
  }
};

/// A payment event; `id` is its idempotency key.
struct Payment {
  std::string id;
  std::string account;
  long amount = 0;
};

inline std::string encode(const Payment& p) { return p.id + ";" + p.account + ";" + std::to_string(p.amount); }

inline std::optional<Payment> parse(std::string_view s) {
  const auto a = s.find(';');
  const auto b = a == std::string_view::npos ? a : s.find(';', a + 1);
  if (b == std::string_view::npos || a == 0) return std::nullopt;
  try {
    return Payment{std::string(s.substr(0, a)), std::string(s.substr(a + 1, b - a - 1)),
                   std::stol(std::string(s.substr(b + 1)))};
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

/// The effect to make once per payment; amount 0 is a poison payment it always rejects.
class Ledger {
 public:
  void apply(const Payment& p) {
    if (p.amount == 0) throw std::runtime_error("payment " + p.id + " rejected: amount is zero");
    std::lock_guard lock(mu_);
    balances_[p.account] += p.amount;
    ++applied_[p.id];
    ++total_;
  }
  long total() const {
    std::lock_guard lock(mu_);
    return total_;
  }
  int times(const std::string& id) const {
    std::lock_guard lock(mu_);
    const auto it = applied_.find(id);
    return it == applied_.end() ? 0 : it->second;
  }
  std::map<std::string, long> balances() const {
    std::lock_guard lock(mu_);
    return balances_;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::string, long> balances_;
  std::unordered_map<std::string, int> applied_;
  long total_ = 0;
};

/// A 3-broker mock cluster living in a producer handle; the producer writes the test's events.
class MockCluster {
 public:
  MockCluster() {
    rd_kafka_conf_t* conf = rd_kafka_conf_new();
    idem::kafka::set_property(conf, "test.mock.num.brokers", "3");
    idem::kafka::set_property(conf, "linger.ms", "5");
    idem::kafka::set_property(conf, "enable.idempotence", "true");
    rd_kafka_conf_set_dr_msg_cb(conf, [](rd_kafka_t*, const rd_kafka_message_t* m, void* opaque) {
      if (m->err) static_cast<std::atomic<long>*>(opaque)->fetch_add(1);
    });
    rd_kafka_conf_set_opaque(conf, &delivery_errors_);
    char err[512];
    rk_ = rd_kafka_new(RD_KAFKA_PRODUCER, conf, err, sizeof err);
    if (!rk_) throw std::runtime_error(std::string("mock producer: ") + err);
    mc_ = rd_kafka_handle_mock_cluster(rk_);
    if (!mc_) throw std::runtime_error("librdkafka made no mock cluster");
    bootstraps_ = rd_kafka_mock_cluster_bootstraps(mc_);
  }
  ~MockCluster() {
    for (auto& [group, v] : verifiers_) {
      rd_kafka_consumer_close(v);
      rd_kafka_destroy(v);
    }
    rd_kafka_destroy(rk_);
  }
  MockCluster(const MockCluster&) = delete;
  MockCluster& operator=(const MockCluster&) = delete;

  const std::string& bootstraps() const { return bootstraps_; }
  rd_kafka_mock_cluster_t* mock() const { return mc_; }
  void create_topic(const std::string& topic, int partitions) {
    rd_kafka_mock_topic_create(mc_, topic.c_str(), partitions, 3);
  }

  void produce(const std::string& topic, std::int32_t partition, const std::string& key, const std::string& value) {
    rd_kafka_resp_err_t e;
    while ((e = rd_kafka_producev(
                rk_, RD_KAFKA_V_TOPIC(topic.c_str()), RD_KAFKA_V_PARTITION(partition),
                RD_KAFKA_V_KEY(key.data(), key.size()), RD_KAFKA_V_VALUE(const_cast<char*>(value.data()), value.size()),
                RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY), RD_KAFKA_V_END)) == RD_KAFKA_RESP_ERR__QUEUE_FULL)
      rd_kafka_poll(rk_, 10);
    if (e) throw std::runtime_error(std::string("produce: ") + rd_kafka_err2str(e));
  }
  /// One message with headers and, unless -1, its create time (ms since the epoch).
  void produce(const std::string& topic, std::int32_t partition, const std::string& key, const std::string& value,
               const std::vector<std::pair<std::string, std::string>>& headers, std::int64_t timestamp_ms = -1) {
    rd_kafka_resp_err_t e;
    for (;;) {
      rd_kafka_headers_t* h = rd_kafka_headers_new(headers.size());
      for (const auto& [n, v] : headers)
        rd_kafka_header_add(h, n.data(), static_cast<ssize_t>(n.size()), v.data(), static_cast<ssize_t>(v.size()));
      e = rd_kafka_producev(rk_, RD_KAFKA_V_TOPIC(topic.c_str()), RD_KAFKA_V_PARTITION(partition),
                            RD_KAFKA_V_KEY(key.data(), key.size()),
                            RD_KAFKA_V_VALUE(const_cast<char*>(value.data()), value.size()), RD_KAFKA_V_HEADERS(h),
                            RD_KAFKA_V_TIMESTAMP(timestamp_ms < 0 ? 0 : timestamp_ms),
                            RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY), RD_KAFKA_V_END);
      if (e == RD_KAFKA_RESP_ERR_NO_ERROR) break;
      rd_kafka_headers_destroy(h);  // not queued: still ours
      if (e != RD_KAFKA_RESP_ERR__QUEUE_FULL) throw std::runtime_error(std::string("produce: ") + rd_kafka_err2str(e));
      rd_kafka_poll(rk_, 10);
    }
  }

  /// Reads one partition from the beginning until `count` records arrived or `limit` passed.
  std::vector<Record> read(const std::string& topic, std::int32_t partition, std::size_t count,
                           std::chrono::milliseconds limit = std::chrono::seconds(10)) const {
    rd_kafka_conf_t* conf = rd_kafka_conf_new();
    idem::kafka::set_property(conf, "bootstrap.servers", bootstraps_);
    idem::kafka::set_property(conf, "group.id", "idem-test-reader");  // assign() only: never joins
    idem::kafka::set_property(conf, "enable.auto.commit", "false");
    char err[512];
    rd_kafka_t* rk = rd_kafka_new(RD_KAFKA_CONSUMER, conf, err, sizeof err);
    if (!rk) throw std::runtime_error(std::string("reader: ") + err);
    rd_kafka_poll_set_consumer(rk);
    auto parts = idem::kafka::to_list({{topic, partition, RD_KAFKA_OFFSET_BEGINNING}});
    rd_kafka_assign(rk, parts.get());
    std::vector<Record> out;
    const auto until = std::chrono::steady_clock::now() + limit;
    while (out.size() < count && std::chrono::steady_clock::now() < until) {
      rd_kafka_message_t* m = rd_kafka_consumer_poll(rk, 50);
      if (!m) continue;
      if (!m->err) {
        Record r{m->partition, m->offset, {}, {}, {}, rd_kafka_message_timestamp(m, nullptr)};
        if (m->key) r.key.assign(static_cast<const char*>(m->key), m->key_len);
        if (m->payload) r.value.assign(static_cast<const char*>(m->payload), m->len);
        std::vector<idem::kafka::Header> hs;
        idem::kafka::append_headers(m, hs);
        for (const auto& h : hs) r.headers.emplace_back(h.name, h.value);
        out.push_back(std::move(r));
      }
      rd_kafka_message_destroy(m);
    }
    rd_kafka_consumer_close(rk);
    rd_kafka_destroy(rk);
    return out;
  }

  void flush() {
    if (rd_kafka_flush(rk_, 15'000) != RD_KAFKA_RESP_ERR_NO_ERROR || delivery_errors_.load() != 0)
      throw std::runtime_error("mock produce did not complete");
  }

  /// The high watermark of each partition.
  std::vector<std::int64_t> end_offsets(const std::string& topic, int partitions) const {
    std::vector<std::int64_t> out;
    for (int p = 0; p < partitions; ++p) {
      std::int64_t lo = 0, hi = 0;
      if (rd_kafka_query_watermark_offsets(rk_, topic.c_str(), p, &lo, &hi, 5'000) != RD_KAFKA_RESP_ERR_NO_ERROR)
        throw std::runtime_error("watermarks unavailable");
      out.push_back(hi);
    }
    return out;
  }
  std::int64_t messages(const std::string& topic, std::int32_t partition) const {
    std::int64_t lo = 0, hi = 0;
    if (rd_kafka_query_watermark_offsets(rk_, topic.c_str(), partition, &lo, &hi, 5'000) != RD_KAFKA_RESP_ERR_NO_ERROR)
      return -1;
    return hi - lo;
  }

  /// The group's committed offsets, read from the coordinator (-1001 where nothing is committed).
  std::vector<std::int64_t> committed(const std::string& group, const std::string& topic, int partitions) {
    rd_kafka_t*& v = verifiers_[group];
    if (!v) {
      rd_kafka_conf_t* conf = rd_kafka_conf_new();
      idem::kafka::set_property(conf, "bootstrap.servers", bootstraps_);
      idem::kafka::set_property(conf, "group.id", group);
      char err[512];
      v = rd_kafka_new(RD_KAFKA_CONSUMER, conf, err, sizeof err);
      if (!v) throw std::runtime_error(std::string("verifier: ") + err);
    }
    std::vector<idem::kafka::PartitionOffset> want;
    for (int p = 0; p < partitions; ++p) want.push_back({topic, p, 0});
    auto list = idem::kafka::to_list(want);
    std::vector<std::int64_t> out;
    if (rd_kafka_committed(v, list.get(), 5'000) != RD_KAFKA_RESP_ERR_NO_ERROR) return out;
    for (int p = 0; p < partitions; ++p) out.push_back(list->elems[p].offset);
    return out;
  }

 private:
  rd_kafka_t* rk_ = nullptr;
  rd_kafka_mock_cluster_t* mc_ = nullptr;
  std::string bootstraps_;
  std::atomic<long> delivery_errors_{0};
  std::map<std::string, rd_kafka_t*> verifiers_;
};

// The events of one case: payments on 40 accounts, `dup_percent` of them published twice (half on
// the same partition later, half on the next one, as a producer retrying against a changed
// partitioner would), and optionally one poison payment published on two partitions.
struct Events {
  std::string topic = "payments";
  int partitions = 4;
  std::vector<Payment> pays;
  std::map<std::string, long> expected;
  std::string poison;  // its id, when there is one

  void publish(MockCluster& cluster, int events, int dup_percent, bool with_poison) {
    cluster.create_topic(topic, partitions);
    cluster.create_topic(topic + ".dlq", 1);
    std::mt19937 rng(2026);
    std::vector<std::pair<std::size_t, std::int32_t>> out;
    for (int i = 0; i < events; ++i) {
      Payment p{"pay-" + std::to_string(i), "acct-" + std::to_string(rng() % 40), 1 + static_cast<long>(rng() % 999)};
      const auto home = static_cast<std::int32_t>(rng() % static_cast<unsigned>(partitions));
      const auto next = static_cast<std::int32_t>((home + 1) % partitions);
      if (with_poison && i == events / 2) {
        p.amount = 0;
        poison = p.id;
        out.push_back({pays.size(), home});
        out.push_back({pays.size(), next});
      } else {
        expected[p.account] += p.amount;
        out.push_back({pays.size(), home});
        if (static_cast<int>(rng() % 100) < dup_percent) out.push_back({pays.size(), rng() % 2 ? home : next});
      }
      pays.push_back(std::move(p));
    }
    std::shuffle(out.begin(), out.end(), rng);
    for (const auto& [i, partition] : out) cluster.produce(topic, partition, pays[i].account, encode(pays[i]));
    cluster.flush();
  }

  // Each payment applied once (the poison never), balances exact; else what is wrong.
  std::string check(const Ledger& ledger) const {
    for (const Payment& p : pays) {
      const int n = ledger.times(p.id);
      if (n != (p.id == poison ? 0 : 1)) return p.id + " applied " + std::to_string(n) + " times";
    }
    return ledger.balances() == expected ? "" : "balances differ";
  }
  long amount() const {
    long sum = 0;
    for (const auto& [account, balance] : expected) sum += balance;
    return sum;
  }
  long effects() const { return static_cast<long>(pays.size()) - (poison.empty() ? 0 : 1); }
};

}  // namespace idem_test
