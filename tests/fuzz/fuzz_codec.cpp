// libFuzzer: idem::codec<T> for the built-in types (include/idem/core/codec.hpp). Byte 0 picks the
// type, the rest is the stored text. Oracles: decode accepts the text or throws codec_error; what
// it accepts encodes to text that decodes to the same value (a replayed duplicate is the value
// the handler returned); and encode of any value of the type decodes back to it.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "idem/core/codec.hpp"

namespace {

template <class T>
bool same(const T& a, const T& b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
    return a == b && std::signbit(a) == std::signbit(b);
  } else {
    return a == b;
  }
}

template <class T>
void check(std::string_view text) {
  using C = idem::codec<T>;
  try {
    const T v = C::decode(text);
    const T again = C::decode(C::encode(v));
    if (!same(v, again)) std::abort();
  } catch (const idem::codec_error&) {
  }
  // The raw bytes as a value of T, where T is trivially copyable: encode must round-trip it.
  if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
    if (text.size() >= sizeof(T)) {
      T v;
      std::memcpy(&v, text.data(), sizeof(T));
      // x87's 80-bit format has encodings no arithmetic produces (unnormals, pseudo-denormals);
      // one multiplication turns them into the value (or NaN) a handler could actually return.
      if constexpr (std::is_same_v<T, long double>) v = v * 1.0L;
      if (!same(v, C::decode(C::encode(v)))) std::abort();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  switch (data[0] % 12) {
    case 0: check<std::string>(text); break;
    case 1: check<bool>(text); break;
    case 2: check<int>(text); break;
    case 3: check<unsigned>(text); break;
    case 4: check<long long>(text); break;
    case 5: check<unsigned long long>(text); break;
    case 6: check<short>(text); break;
    case 7: check<std::int8_t>(text); break;
    case 8: check<std::uint8_t>(text); break;
    case 9: check<float>(text); break;
    case 10: check<double>(text); break;
    case 11: check<long double>(text); break;
  }
  return 0;
}
