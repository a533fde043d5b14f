#pragma once
/// @file version.hpp The library version; CMake reads these three lines.

/// Major version; find_package(idem) accepts an installed idem of the same major only.
#define IDEM_VERSION_MAJOR 0
/// Minor version.
#define IDEM_VERSION_MINOR 1
/// Patch version.
#define IDEM_VERSION_PATCH 0

#include <compare>

/// (internal) Turns a macro's value into a string literal.
#define IDEM_DETAIL_STRINGIFY(x) IDEM_DETAIL_STRINGIFY2(x)
/// (internal) The second step of IDEM_DETAIL_STRINGIFY.
#define IDEM_DETAIL_STRINGIFY2(x) #x
/// The version as a string literal, "major.minor.patch", made from the three numbers above.
#define IDEM_VERSION_STRING                 \
  IDEM_DETAIL_STRINGIFY(IDEM_VERSION_MAJOR) \
  "." IDEM_DETAIL_STRINGIFY(IDEM_VERSION_MINOR) "." IDEM_DETAIL_STRINGIFY(IDEM_VERSION_PATCH)

namespace idem {
/// The library version as "major.minor.patch" (what `idem --version` prints); docs/versioning.md.
inline constexpr const char* version_string = IDEM_VERSION_STRING;

/// A version as numbers, ordered: `idem::version() >= idem::Version{0, 2, 0}`.
struct Version {
  int major;  ///< incompatible changes (docs/versioning.md)
  int minor;  ///< additions, compatible
  int patch;  ///< fixes only
  /// Versions compare number by number, major first.
  friend constexpr bool operator==(const Version&, const Version&) = default;
  /// Versions compare number by number, major first.
  friend constexpr auto operator<=>(const Version&, const Version&) = default;
};

/// The version of the idem headers this code was compiled against.
constexpr Version version() noexcept { return {IDEM_VERSION_MAJOR, IDEM_VERSION_MINOR, IDEM_VERSION_PATCH}; }
}  // namespace idem
