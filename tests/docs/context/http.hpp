// The names docs/http.md's block uses without declaring them (tests/docs/CMakeLists.txt).
#pragma once

#include <string>

#include <httplib.h>

#include <idem/http/httplib.hpp>
#include <idem/redis.hpp>

using namespace std::chrono_literals;

extern idem::RedisStore store;
extern httplib::Server server;
std::string create_charge(const std::string& body);
