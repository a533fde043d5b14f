// The process the outbox tests fork+exec and SIGKILL: a relay whose publisher, once the broker
// has the batch, writes a marker file and hangs, so the test kills it between publish and mark-sent.
//
//   idem_outbox_worker crash-after-publish CONNINFO SCHEMA TABLE REDIS_PORT MARKER

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>

#include "idem/outbox/outbox.hpp"

namespace {

class HangAfterPublish final : public idem::OutboxPublisher {
 public:
  HangAfterPublish(idem::OutboxPublisher& inner, std::string marker) : inner_(inner), marker_(std::move(marker)) {}
  void publish(std::span<const idem::OutboxMessage> batch) override {
    inner_.publish(batch);
    std::ofstream(marker_) << batch.size() << "\n";
    std::this_thread::sleep_for(std::chrono::minutes(5));
  }
  [[nodiscard]] std::string name() const override { return "hang-after-" + inner_.name(); }

 private:
  idem::OutboxPublisher& inner_;
  std::string marker_;
};

}  // namespace

int main(int argc, char** argv) try {
  if (argc != 7 || std::string(argv[1]) != "crash-after-publish") {
    std::fprintf(stderr, "usage: idem_outbox_worker crash-after-publish CONNINFO SCHEMA TABLE REDIS_PORT MARKER\n");
    return 2;
  }
  idem::RedisOptions ro;
  ro.port = std::stoi(argv[5]);
  idem::RedisStreamsPublisher pub{{.redis = ro}};
  HangAfterPublish hang{pub, argv[6]};
  idem::OutboxRelayOptions o;
  o.postgres.conninfo = argv[2];
  o.schema = argv[3];
  o.table = argv[4];
  idem::OutboxRelay relay{hang, o};
  relay.run_once();
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "idem_outbox_worker: %s\n", e.what());
  return 1;
}
