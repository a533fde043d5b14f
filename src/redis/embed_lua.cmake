# Build step (cmake -P): prepends lua/record.lua to each script named in SCRIPTS, writes the
# result to OUT_DIR/<name>.lua (runnable with redis-cli --eval) and all of them as C++ string
# literals to OUT_DIR/idem_redis_scripts.hpp, so the sources stay plain .lua files.
string(REPLACE "," ";" SCRIPTS "${SCRIPTS}")
file(READ "${SRC_DIR}/record.lua" _prelude)
set(_hpp "// Generated from src/redis/lua/*.lua by embed_lua.cmake; do not edit.\n#pragma once\n#include <string_view>\n\nnamespace idem::detail::redis_lua {\n")
foreach(_name IN LISTS SCRIPTS)
  file(READ "${SRC_DIR}/${_name}.lua" _body)
  set(_full "${_prelude}\n${_body}")
  string(FIND "${_full}" ")idem_lua\"" _clash)
  if(NOT _clash EQUAL -1)
    message(FATAL_ERROR "${_name}.lua contains the raw-string delimiter )idem_lua\"")
  endif()
  file(WRITE "${OUT_DIR}/${_name}.lua" "${_full}")
  string(APPEND _hpp "inline constexpr std::string_view ${_name} = R\"idem_lua(${_full})idem_lua\";\n")
endforeach()
string(APPEND _hpp "}  // namespace idem::detail::redis_lua\n")
file(WRITE "${OUT_DIR}/idem_redis_scripts.hpp.tmp" "${_hpp}")
file(COPY_FILE "${OUT_DIR}/idem_redis_scripts.hpp.tmp" "${OUT_DIR}/idem_redis_scripts.hpp" ONLY_IF_DIFFERENT)
