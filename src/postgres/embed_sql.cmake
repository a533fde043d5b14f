# Turns a .sql file into a C++ source defining one string constant, at build time, so the SQL
# stays a real file (testable with psql) and the library needs no files at run time.
# Usage: cmake -DIN=schema.sql -DOUT=schema_sql.cpp -DNAME=pg_schema_v1_sql -P embed_sql.cmake
file(READ "${IN}" _sql)
string(FIND "${_sql}" ")idem_sql\"" _clash)
if(NOT _clash EQUAL -1)
  message(FATAL_ERROR "${IN} contains the raw-string delimiter )idem_sql\"")
endif()
file(WRITE "${OUT}.tmp" "// Generated from ${IN}; do not edit.\nnamespace idem::detail {\nextern const char* const ${NAME};\nconst char* const ${NAME} = R\"idem_sql(${_sql})idem_sql\";\n}  // namespace idem::detail\n")
file(COPY_FILE "${OUT}.tmp" "${OUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUT}.tmp")
