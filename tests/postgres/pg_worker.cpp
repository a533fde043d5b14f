// Helper process for the multi-process PostgresStore tests (fork+exec'd by postgres_process_test).
//   pg_worker tx-increment CONNINFO TABLE PREFIX KEYS SEED
//       transactional mode: every key once, each run adds 1 to TABLE's balance inside the handler;
//       prints "executed N" (how many handlers this process committed).
//   pg_worker tx-hang CONNINFO TABLE KEY
//       transactional mode: writes a business row, prints "ready", then hangs until SIGKILLed.
//   pg_worker tx-hold CONNINFO KEY LEASE_MS
//       transactional mode: claims, prints "ready", waits for a line on stdin, commits, prints the status.
//   pg_worker lease-hold CONNINFO KEY LEASE_MS
//       lease mode: acquires, prints "ready", waits for a line on stdin, completes, prints the status.
//   pg_worker batch CONNINFO PREFIX ITEMS HANDLER_MS
//       lease mode: one run_batch over keys PREFIX0..PREFIX<ITEMS-1>; each handler sleeps
//       HANDLER_MS, prints "ran <i>" (unbuffered, before its completion is sent) and returns i.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "idem/postgres.hpp"

using namespace std::chrono_literals;

namespace {

idem::PostgresStore open_store(const std::string& conninfo, idem::PostgresMode mode) {
  idem::PostgresOptions o;
  o.conninfo = conninfo;
  o.pool.size = 2;
  return idem::PostgresStore(o, {.schema = "idem_test", .table = "records", .mode = mode});
}

int tx_increment(const std::string& ci, const std::string& table, const std::string& prefix, int keys, unsigned seed) {
  idem::PostgresStore store = open_store(ci, idem::PostgresMode::transactional);
  idem::GuardOptions go;
  go.wait_for_in_flight = 0ms;
  idem::IdempotencyGuard guard(store, go);
  std::vector<int> order(static_cast<std::size_t>(keys));
  for (int i = 0; i < keys; ++i) order[static_cast<std::size_t>(i)] = i;
  std::mt19937 rng(seed);
  std::shuffle(order.begin(), order.end(), rng);
  int executed = 0;
  std::vector<int> pending = order;
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (!pending.empty() && std::chrono::steady_clock::now() < deadline) {
    std::vector<int> again;
    for (int i : pending) {
      const std::string k = prefix + std::to_string(i);
      auto out = guard.run(k, [&](const auto& ctx) {
        ctx.tx->exec("UPDATE " + table + " SET balance = balance + 1 WHERE id = 1");
        ctx.tx->exec("INSERT INTO " + table + "_applied (key, fence) VALUES ($1, $2)", k, ctx.fence);
        return i;
      });
      if (out.status == idem::Status::executed) ++executed;
      else if (out.status == idem::Status::in_flight) again.push_back(i);
      else if (out.status != idem::Status::duplicate || *out.value != i) {
        std::cerr << "unexpected status for " << k << "\n";
        return 3;
      }
    }
    pending.swap(again);
    if (!pending.empty()) std::this_thread::sleep_for(5ms);
  }
  if (!pending.empty()) return 4;
  std::cout << "executed " << executed << std::endl;
  return 0;
}

int tx_hang(const std::string& ci, const std::string& table, const std::string& key) {
  idem::PostgresStore store = open_store(ci, idem::PostgresMode::transactional);
  idem::IdempotencyGuard guard(store);
  guard.run(key, [&](const auto& ctx) {
    ctx.tx->exec("INSERT INTO " + table + " (id) VALUES ($1)", key);
    std::cout << "ready" << std::endl;
    for (int i = 0; i < 600; ++i) std::this_thread::sleep_for(100ms);  // killed long before
  });
  return 5;
}

int hold(const std::string& ci, const std::string& key, int lease_ms, idem::PostgresMode mode) {
  idem::PostgresStore store = open_store(ci, mode);
  idem::GuardOptions go;
  go.lease = std::chrono::milliseconds(lease_ms);
  go.retention = 600s;
  idem::IdempotencyGuard guard(store, go);
  auto out = guard.run(key, [&](const auto& ctx) {
    std::cout << "ready " << ctx.fence << std::endl;
    std::string line;
    std::getline(std::cin, line);
    return std::string("from-paused-holder");
  });
  std::cout << idem::to_string(out.status) << std::endl;
  return 0;
}

int batch(const std::string& ci, const std::string& prefix, int items, int handler_ms) {
  idem::PostgresStore store = open_store(ci, idem::PostgresMode::lease);
  idem::IdempotencyGuard guard(store, {.lease = 30s, .retention = 600s});
  std::vector<std::string> keys;
  for (int i = 0; i < items; ++i) keys.push_back(prefix + std::to_string(i));
  std::vector<idem::BatchItem> batch;
  for (const auto& k : keys) batch.push_back({k, ""});
  auto r = guard.run_batch(batch, [&](const idem::BatchItem& it) {
    std::this_thread::sleep_for(std::chrono::milliseconds(handler_ms));
    const int i = std::stoi(std::string(it.key.substr(prefix.size())));
    std::cout << "ran " << i << std::endl;  // before the completion is sent: the parent's cue
    return i;
  });
  std::cout << "done " << r.executed() << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::vector<std::string> a(argv, argv + argc);
    if (a.size() == 7 && a[1] == "tx-increment")
      return tx_increment(a[2], a[3], a[4], std::stoi(a[5]), static_cast<unsigned>(std::stoul(a[6])));
    if (a.size() == 5 && a[1] == "tx-hang") return tx_hang(a[2], a[3], a[4]);
    if (a.size() == 5 && a[1] == "lease-hold") return hold(a[2], a[3], std::stoi(a[4]), idem::PostgresMode::lease);
    if (a.size() == 6 && a[1] == "batch") return batch(a[2], a[3], std::stoi(a[4]), std::stoi(a[5]));
    if (a.size() == 5 && a[1] == "tx-hold") return hold(a[2], a[3], std::stoi(a[4]), idem::PostgresMode::transactional);
    std::cerr << "usage: see pg_worker.cpp\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "pg_worker: " << e.what() << "\n";
    return 1;
  }
}
