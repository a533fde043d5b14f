#pragma once
// What the broker consumers (StreamsConsumer, RabbitConsumer, NatsConsumer) share: their run()
// loop. (What each message's answer is comes from idem::verdict, guard/verdict.hpp.)

#include <algorithm>
#include <stop_token>
#include <thread>

#include "idem/core/error.hpp"
#include "idem/core/record.hpp"
#include "idem/detail/random.hpp"

namespace idem::detail {

// `step()` until `stop`. A retryable error (the broker or the store down) runs `on_error()` and
// backs off, from 50 ms doubling up to 1 s, each wait fully jittered; another runs `on_error()` and is thrown: a refused
// request or bad configuration needs a human.
template <class Step, class OnError>
void consume_loop(const std::stop_token& stop, Step&& step, OnError&& on_error) {
  auto pause = millis{50};
  while (!stop.stop_requested()) {
    try {
      step();
      pause = millis{50};
    } catch (const error& e) {
      on_error();
      if (!e.retryable()) throw;
      std::this_thread::sleep_for(jittered(pause));  // consumers that lost the broker together spread out
      pause = std::min(pause * 2, millis{1000});
    }
  }
}

}  // namespace idem::detail
