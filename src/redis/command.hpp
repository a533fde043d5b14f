#pragma once
// Internal to idem_redis: one Redis command's arguments, formatted into RESP by hiredis
// (redisFormatSdsCommandArgv), and a pipeline of formatted commands. Arguments are kept in small
// inline buffers, so a transition's request costs one allocation (hiredis's buffer).

#include <algorithm>
#include <array>
#include <charconv>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <new>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <hiredis/hiredis.h>

namespace idem::detail::redis {

// A vector that lives on the stack while it holds at most N elements.
template <class T, std::size_t N>
class SmallVec {
public:
  void push_back(T v) {
    if (heap_.empty() && n_ < N) {
      fixed_[n_++] = v;
      return;
    }
    if (heap_.empty()) heap_.assign(fixed_.begin(), fixed_.begin() + static_cast<std::ptrdiff_t>(n_));
    heap_.push_back(v);
    ++n_;
  }
  void append(const T* p, std::size_t n) {
    if (heap_.empty() && n_ + n <= N) {
      std::copy(p, p + n, fixed_.begin() + static_cast<std::ptrdiff_t>(n_));
    } else {
      if (heap_.empty()) heap_.assign(fixed_.begin(), fixed_.begin() + static_cast<std::ptrdiff_t>(n_));
      heap_.insert(heap_.end(), p, p + n);
    }
    n_ += n;
  }
  [[nodiscard]] T* data() noexcept { return heap_.empty() ? fixed_.data() : heap_.data(); }
  [[nodiscard]] const T* data() const noexcept { return heap_.empty() ? fixed_.data() : heap_.data(); }
  [[nodiscard]] std::size_t size() const noexcept { return n_; }
  T& operator[](std::size_t i) noexcept { return data()[i]; }

private:
  std::array<T, N> fixed_;  // left uninitialised: only the first n_ are ever read
  std::vector<T> heap_;
  std::size_t n_ = 0;
};

// A formatted request: hiredis's buffer (an sds string), freed by hiredis.
struct Request {
  struct Free {
    void operator()(char* p) const noexcept { redisFreeSdsCommand(p); }
  };
  std::unique_ptr<char, Free> data;
  std::size_t size = 0;
  [[nodiscard]] std::string_view view() const noexcept { return {data.get(), size}; }
};

// One command's arguments. Views (`arg(string_view)`) must outlive format(); numbers, tokens and
// keys are copied into the command.
class Command {
public:
  Command& arg(std::string_view s) {
    ptrs_.push_back(s.data());
    lens_.push_back(s.size());
    offsets_.push_back(viewed);
    return *this;
  }
  Command& arg(const char* s) { return arg(std::string_view(s)); }
  template <std::integral Int>
    requires(!std::is_same_v<Int, bool>)
  Command& arg(Int v) {
    char tmp[24];
    const auto res = std::to_chars(tmp, tmp + sizeof tmp, v);
    return copy({tmp, static_cast<std::size_t>(res.ptr - tmp)});
  }
  // A holder's token as the scripts store it: 8 bytes, big-endian.
  Command& token(std::uint64_t t) {
    std::array<char, 8> b{};
    for (int i = 7; i >= 0; --i, t >>= 8) b[static_cast<std::size_t>(i)] = static_cast<char>(t & 0xff);
    return copy({&b[0], b.size()});
  }
  // One argument made of several parts (a key: prefix + user key), copied.
  Command& joined(std::initializer_list<std::string_view> parts) {
    ptrs_.push_back(nullptr);
    offsets_.push_back(bytes_.size());
    std::size_t n = 0;
    for (std::string_view p : parts) {
      bytes_.append(p.data(), p.size());
      n += p.size();
    }
    lens_.push_back(n);
    return *this;
  }

  [[nodiscard]] Request format() {
    for (std::size_t i = 0; i < ptrs_.size(); ++i)
      if (offsets_[i] != viewed) ptrs_[i] = bytes_.data() + offsets_[i];
    // The sds variant formats with hiredis's own integer writer; the plain one calls sprintf per
    // argument, which costs a transition about half a microsecond more.
    sds out = nullptr;
    const auto n = redisFormatSdsCommandArgv(&out, static_cast<int>(ptrs_.size()), ptrs_.data(), lens_.data());
    if (n < 0 || out == nullptr) throw std::bad_alloc();
    return Request{std::unique_ptr<char, Request::Free>(out), static_cast<std::size_t>(n)};
  }

private:
  static constexpr std::size_t inline_args = 12;
  static constexpr std::size_t viewed = static_cast<std::size_t>(-1);

  Command& copy(std::string_view s) { return joined({s}); }

  SmallVec<const char*, inline_args> ptrs_;
  SmallVec<std::size_t, inline_args> lens_;
  SmallVec<std::size_t, inline_args> offsets_;  // into bytes_ for copied arguments, else `viewed`
  SmallVec<char, 256> bytes_;
};

// Formatted commands sent in one write, each still addressable (a NOSCRIPT reply resends some).
class Pipeline {
public:
  static constexpr bool asking = false;  // (an ASK redirection resends one request, never a pipeline)
  void add(const Request& r) { add(r.view()); }
  void add(std::string_view formatted) {
    all_.append(formatted);
    ends_.push_back(all_.size());
  }
  [[nodiscard]] std::size_t size() const noexcept { return ends_.size(); }
  [[nodiscard]] std::string_view all() const noexcept { return all_; }
  [[nodiscard]] std::string_view operator[](std::size_t i) const noexcept {
    const std::size_t from = i == 0 ? 0 : ends_[i - 1];
    return std::string_view(all_).substr(from, ends_[i] - from);
  }

private:
  std::string all_;
  std::vector<std::size_t> ends_;
};

}  // namespace idem::detail::redis
