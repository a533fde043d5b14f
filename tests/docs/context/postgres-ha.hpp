// What docs/postgres-ha.md's block needs (tests/docs/CMakeLists.txt).
#pragma once

#include <idem/postgres.hpp>
