// The names docs/operations.md's block uses without declaring them (tests/docs/CMakeLists.txt).
#pragma once

#include <memory>

#include <prometheus/registry.h>

#include <idem/idem.hpp>

extern idem::MemoryStore store;
extern std::shared_ptr<prometheus::Registry> registry;
