// idem-outbox-relay: the outbox relay as a program of its own. Drains the outbox of one
// PostgresStore table into Redis Streams until SIGINT / SIGTERM (or once, with --once).

#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include <fmt/format.h>

#include "idem/core/version.hpp"
#include "idem/outbox/redis_streams_publisher.hpp"
#include "idem/outbox/relay.hpp"

namespace {

const char* const help =
    "idem-outbox-relay: publishes the committed rows of an idem outbox (PostgreSQL) to Redis Streams.\n"
    "\n"
    "usage: idem-outbox-relay --conninfo STR | --conninfo-file PATH --redis URL [options]\n"
    "\n"
    "  --conninfo STR        libpq conninfo or URI of the database holding the outbox\n"
    "  --conninfo-file PATH  read the conninfo from the first line of PATH\n"
    "  --schema NAME         the store's schema (default idem)\n"
    "  --table NAME          the store's table; the outbox is <table>_outbox (default idem_records)\n"
    "  --redis URL           redis://[user[:password]@]host[:port][/db] or unix:///path\n"
    "  --stream-prefix P     prepended to each message's destination to name its stream (default none)\n"
    "  --maxlen N            trim each stream to about N entries (default 0 = never)\n"
    "  --batch N             rows per batch (default 256)\n"
    "  --poll-ms N           poll interval when no NOTIFY arrives (default 1000)\n"
    "  --retention-ms N      keep sent rows N ms before purging them (default 86400000; 0 = delete at once)\n"
    "  --transaction-pooler  the conninfo reaches a transaction-mode pooler (PgBouncer): no session\n"
    "                        settings, unnamed statements, and polling instead of LISTEN\n"
    "  --once                publish what is due, once, and exit (status 0 when that succeeded)\n"
    "  --help                this text\n"
    "  --version             print \"idem-outbox-relay X.Y.Z\" (the idem version) and exit\n"
    "\n"
    "Any number of relays may run against one outbox: rows are claimed with FOR UPDATE SKIP LOCKED,\n"
    "per-message_key order is kept, and a relay killed mid-batch leaves its rows to be published\n"
    "again with the same ids (consumers deduplicate on the entry's `id` field). docs/outbox.md.\n";

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "idem-outbox-relay: %s\n(see idem-outbox-relay --help)\n", why.c_str());
  std::exit(2);
}

long number(const std::string& k, const std::string& v, long lo, long hi) {
  char* end = nullptr;
  const long n = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || n < lo || n > hi) usage(fmt::format("{} must be a number in {}..{}", k, lo, hi));
  return n;
}

}  // namespace

int main(int argc, char** argv) try {
  idem::OutboxRelayOptions ro;
  idem::RedisStreamsPublisherOptions po;
  bool once = false;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") {
      std::fputs(help, stdout);
      return 0;
    }
    if (k == "--version") {
      fmt::print("idem-outbox-relay {}\n", idem::version_string);
      return 0;
    }
    if (k == "--once") {
      once = true;
      continue;
    }
    if (k == "--transaction-pooler") {
      ro.postgres.transaction_pooler = true;
      continue;
    }
    if (i + 1 >= argc) usage(fmt::format("missing value of {}", k));
    const std::string v = argv[++i];
    if (k == "--conninfo") {
      ro.postgres.conninfo = v;
    } else if (k == "--conninfo-file") {
      std::ifstream in(v);
      if (!in || !std::getline(in, ro.postgres.conninfo) || ro.postgres.conninfo.empty())
        usage(fmt::format("no conninfo in {}", v));
    } else if (k == "--schema") {
      ro.schema = v;
    } else if (k == "--table") {
      ro.table = v;
    } else if (k == "--redis") {
      po.redis.url = v;
    } else if (k == "--stream-prefix") {
      po.stream_prefix = v;
    } else if (k == "--maxlen") {
      po.maxlen = static_cast<std::size_t>(number(k, v, 0, 1L << 40));
    } else if (k == "--batch") {
      ro.batch = static_cast<std::size_t>(number(k, v, 1, 10'000));
    } else if (k == "--poll-ms") {
      ro.poll_interval = idem::millis{number(k, v, 1, 3'600'000)};
    } else if (k == "--retention-ms") {
      ro.retention = idem::millis{number(k, v, 0, 1L << 40)};
    } else {
      usage(fmt::format("unknown option {}", k));
    }
  }
  if (ro.postgres.conninfo.empty()) usage("give --conninfo or --conninfo-file");
  if (po.redis.url.empty()) usage("give --redis");

  idem::OutboxRelay relay{std::make_unique<idem::RedisStreamsPublisher>(po), ro};
  relay.set_observer([](const idem::OutboxRelayEvent& e) {
    if (e.kind == idem::OutboxRelayEvent::Kind::publish_failed || e.kind == idem::OutboxRelayEvent::Kind::error ||
        e.kind == idem::OutboxRelayEvent::Kind::warning)
      std::fprintf(stderr, "idem-outbox-relay: %s\n", e.error.c_str());
  });
  if (once) {
    relay.run_once();
    const auto s = relay.stats();
    return s.publish_failures == 0 ? 0 : 1;
  }
  // The relay's thread starts with these blocked too, so only sigwait below takes them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  relay.start();
  int sig = 0;
  sigwait(&stop_signals, &sig);
  relay.stop();
  const auto s = relay.stats();
  std::fprintf(stderr, "idem-outbox-relay: stopped; published %llu rows in %llu batches, %llu publish failures\n",
               static_cast<unsigned long long>(s.published), static_cast<unsigned long long>(s.batches),
               static_cast<unsigned long long>(s.publish_failures));
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "idem-outbox-relay: %s\n", e.what());
  return 1;
}
