#pragma once
// Whether this test binary is built with AddressSanitizer or ThreadSanitizer (scripts/check's asan
// and tsan presets): such a build runs several times slower beside the other suites, so a test
// gives timed waits more room there, or runs fewer rounds of the same paths. Never a weaker check.

namespace idem_test {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool sanitized = true;
#else
inline constexpr bool sanitized = false;
#endif

}  // namespace idem_test
