// The consumer process of nats_process_test: a NatsConsumer behind a guard on a RedisStore. Each
// effect is a line appended to a file; the message keyed `hang` prints "hanging" and never returns,
// so the test can SIGKILL the process with its batch fetched, partly run and unacked.
//
//   idem_nats_worker <nats-url> <stream> <subject> <redis-port> <effects-file>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <stop_token>
#include <string>
#include <thread>

#include <fcntl.h>
#include <unistd.h>

#include "idem/idem.hpp"
#include "idem/nats/consumer.hpp"
#include "idem/redis.hpp"

int main(int argc, char** argv) {
  if (argc != 6) {
    std::cerr << "usage: idem_nats_worker <nats-url> <stream> <subject> <redis-port> <effects-file>\n";
    return 2;
  }
  idem::RedisOptions ro;
  ro.port = std::atoi(argv[4]);
  ro.command_timeout = idem::millis{5000};
  idem::RedisStore store(ro);
  idem::GuardOptions go;
  go.lease = idem::millis{1500};
  idem::IdempotencyGuard guard(store, go);

  idem::NatsConsumerOptions o;
  o.url = argv[1];
  o.stream = argv[2];
  o.durable = "workers";
  o.subject = argv[3];
  o.batch = 10;
  o.fetch_wait = idem::millis{100};
  o.ack_wait = idem::millis{1000};
  idem::NatsConsumer consumer(o);
  const std::string effects = argv[5];
  consumer.run(std::stop_token{}, [&](const idem::NatsMessage& m) {
    const std::string key = *m.header("Idem-Key");
    auto out = guard.run(key, [&] {
      if (key == "hang") {
        std::cout << "hanging" << std::endl;
        for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
      }
      const std::string line = key + "\n";
      const int fd = ::open(effects.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (fd < 0 || ::write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) std::abort();
      ::close(fd);
    });
    return idem::NatsConsumer::decide(out);
  });
}
