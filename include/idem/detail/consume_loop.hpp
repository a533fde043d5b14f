#pragma once
// What the broker consumers (StreamsConsumer, RabbitConsumer, NatsConsumer) share: their run()
// loop and the reason a dead letter gives for an exception.

#include <algorithm>
#include <exception>
#include <stop_token>
#include <string>
#include <thread>

#include "idem/core/error.hpp"
#include "idem/core/record.hpp"

namespace idem::detail {

// `step()` until `stop`. A retryable error (the broker or the store down) runs `on_error()` and
// backs off, from 50 ms doubling up to 1 s; another runs `on_error()` and is thrown: a refused
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
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, millis{1000});
    }
  }
}

// The message of what `e` holds, for a dead letter.
inline std::string reason_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "a non-standard exception";
  }
}

}  // namespace idem::detail
