#pragma once
/// @file version.hpp The library version; CMake reads these three lines.

#define IDEM_VERSION_MAJOR 0
#define IDEM_VERSION_MINOR 1
#define IDEM_VERSION_PATCH 0

namespace idem {
/// The library version as "major.minor.patch".
inline constexpr const char* version_string = "0.1.0";
}  // namespace idem
