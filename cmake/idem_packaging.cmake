# idem's pkg-config files and its Debian packages (CPack). Included by the top-level
# CMakeLists.txt when IDEM_INSTALL is on, after every component's target exists.
#
# Install components: `dev` (headers, libraries, CMake package, .pc files: every install rule
# without a COMPONENT of its own, through CMAKE_INSTALL_DEFAULT_COMPONENT_NAME) and `tools` (the
# `idem` command and `idem-outbox-relay`).

# ---- pkg-config: idem.pc and one idem-<component>.pc per component built ------------------------
set(IDEM_PKGCONFIG_DIR "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}" OR IS_ABSOLUTE "${CMAKE_INSTALL_INCLUDEDIR}")
  set(IDEM_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
  set(IDEM_PC_LIBDIR "${CMAKE_INSTALL_FULL_LIBDIR}")
  set(IDEM_PC_INCLUDEDIR "${CMAKE_INSTALL_FULL_INCLUDEDIR}")
else()
  # Relative to the .pc file's own directory (pkg-config's ${pcfiledir}), so the files stay right
  # wherever the tree is installed or unpacked: cmake --install --prefix, CPack's /usr, dpkg -x.
  file(RELATIVE_PATH _idem_up "/idem-prefix/${IDEM_PKGCONFIG_DIR}" "/idem-prefix")
  string(REGEX REPLACE "/+$" "" _idem_up "${_idem_up}")
  set(IDEM_PC_PREFIX "\${pcfiledir}/${_idem_up}")
  set(IDEM_PC_LIBDIR "\${prefix}/${CMAKE_INSTALL_LIBDIR}")
  set(IDEM_PC_INCLUDEDIR "\${prefix}/${CMAKE_INSTALL_INCLUDEDIR}")
endif()

set(IDEM_PKGCONFIG_MODULES idem)
# The core: headers and libidem.a (the payload fingerprint over libcrypto, the default owner), over
# fmt, with threads. libcrypto is public: a static archive does not carry it.
set(IDEM_PC_REQUIRES "fmt libcrypto")
set(IDEM_PC_LIBS "-L\${libdir} -lidem -pthread")
configure_file("${CMAKE_CURRENT_LIST_DIR}/idem.pc.in" "${PROJECT_BINARY_DIR}/pkgconfig/idem.pc" @ONLY)

# idem_pkgconfig(<component> DESCRIPTION <text> [REQUIRES <module>...] [DEPS <module>...])
#   REQUIRES: what the component's headers need (always public: the consumer compiles against it).
#   DEPS: client libraries the component's library uses inside only. A static archive does not
#   carry them, so for one they are public too (plain `pkg-config --libs` must name them); a
#   shared library links them itself, so they become Requires.private.
# Nothing is written for a component that is not built.
function(idem_pkgconfig component)
  cmake_parse_arguments(PC "" "DESCRIPTION" "REQUIRES;DEPS" ${ARGN})
  set(target idem_${component})
  if(NOT TARGET ${target})
    return()
  endif()
  string(REPLACE "_" "-" module "idem-${component}")
  get_target_property(type ${target} TYPE)
  set(IDEM_PC_COMPONENT ${component})
  set(IDEM_PC_MODULE ${module})
  set(IDEM_PC_DESCRIPTION "${PC_DESCRIPTION}")
  set(requires ${PC_REQUIRES})
  set(requires_private "")
  set(IDEM_PC_LIBS "")
  if(type STREQUAL "STATIC_LIBRARY" OR type STREQUAL "SHARED_LIBRARY")
    get_target_property(name ${target} OUTPUT_NAME)
    if(NOT name)
      set(name ${target})
    endif()
    set(IDEM_PC_LIBS "-L\${libdir} -l${name}")
  endif()
  if(type STREQUAL "SHARED_LIBRARY")
    list(APPEND requires_private ${PC_DEPS})
  else()
    list(APPEND requires ${PC_DEPS})
  endif()
  list(REMOVE_DUPLICATES requires)
  string(REPLACE ";" " " IDEM_PC_REQUIRES "${requires}")
  set(IDEM_PC_OPTIONAL_LINES "")
  if(requires_private)
    string(REPLACE ";" " " _private "${requires_private}")
    set(IDEM_PC_OPTIONAL_LINES "Requires.private: ${_private}\n")
  endif()
  if(IDEM_PC_LIBS)
    string(APPEND IDEM_PC_OPTIONAL_LINES "Libs: ${IDEM_PC_LIBS}\n")
  endif()
  configure_file("${CMAKE_CURRENT_FUNCTION_LIST_DIR}/idem-component.pc.in" "${PROJECT_BINARY_DIR}/pkgconfig/${module}.pc" @ONLY)
  set(IDEM_PKGCONFIG_MODULES ${IDEM_PKGCONFIG_MODULES} ${module} PARENT_SCOPE)
endfunction()

idem_pkgconfig(redis DESCRIPTION "idem: RedisStore and RedisSequenceStore (hiredis, TLS over OpenSSL)"
               REQUIRES idem DEPS hiredis libssl libcrypto)
idem_pkgconfig(postgres DESCRIPTION "idem: PostgresStore, PostgresSequenceStore and the outbox writer (libpq)"
               REQUIRES idem libpq)
idem_pkgconfig(sqlite DESCRIPTION "idem: SqliteStore and SqliteSequenceStore in one SQLite file (libsqlite3)"
               REQUIRES idem DEPS sqlite3)
# Boost.Asio is header-only and has no pkg-config module: its headers are in the default include
# path on Debian (libboost-dev), so nothing is added for it.
idem_pkgconfig(asio DESCRIPTION "idem: AsyncRedisStore and run_async on Boost.Asio (needs libboost-dev headers)"
               REQUIRES idem-redis DEPS hiredis)
idem_pkgconfig(tiered DESCRIPTION "idem: TieredStore (Redis in front of PostgreSQL transactional mode)"
               REQUIRES idem-redis idem-postgres)
idem_pkgconfig(outbox DESCRIPTION "idem: the transactional outbox's relay and its Redis Streams publisher"
               REQUIRES idem-postgres idem-redis DEPS hiredis)
idem_pkgconfig(outbox_kafka DESCRIPTION "idem: the outbox's Kafka publisher (librdkafka)" REQUIRES idem DEPS rdkafka)
idem_pkgconfig(kafka DESCRIPTION "idem: Kafka consumer helpers (OffsetTracker, the consumer loop over librdkafka)" REQUIRES idem DEPS rdkafka)
idem_pkgconfig(outbox_rabbitmq DESCRIPTION "idem: the outbox's RabbitMQ publisher (librabbitmq)"
               REQUIRES idem DEPS librabbitmq)
idem_pkgconfig(rabbitmq DESCRIPTION "idem: the RabbitMQ queue consumer (librabbitmq)" REQUIRES idem DEPS librabbitmq)
idem_pkgconfig(nats DESCRIPTION "idem: the NATS JetStream pull consumer (libnats)" REQUIRES idem DEPS libnats)
idem_pkgconfig(outbox_nats DESCRIPTION "idem: the outbox's NATS JetStream publisher (libnats)" REQUIRES idem DEPS libnats)
idem_pkgconfig(http DESCRIPTION "idem: the Idempotency-Key HTTP policy (header-only)" REQUIRES idem)
idem_pkgconfig(http_httplib DESCRIPTION "idem: the cpp-httplib adapter of idem::http" REQUIRES idem-http DEPS cpp-httplib)
# Boost.Beast is header-only, in the default include path on Debian (libboost-dev).
idem_pkgconfig(http_beast DESCRIPTION "idem: the Boost.Beast adapter of idem::http (needs libboost-dev headers)"
               REQUIRES idem-http)
idem_pkgconfig(pqxx DESCRIPTION "idem: PostgresJoined over a libpqxx transaction (header-only)"
               REQUIRES idem-postgres DEPS libpqxx)
idem_pkgconfig(prometheus DESCRIPTION "idem: the Prometheus observer (prometheus-cpp)"
               REQUIRES idem DEPS prometheus-cpp-pull prometheus-cpp-core)

foreach(_module IN LISTS IDEM_PKGCONFIG_MODULES)
  install(FILES "${PROJECT_BINARY_DIR}/pkgconfig/${_module}.pc" DESTINATION "${IDEM_PKGCONFIG_DIR}" COMPONENT dev)
endforeach()
# For tests/package: the modules this build installs.
set(IDEM_PKGCONFIG_MODULES ${IDEM_PKGCONFIG_MODULES} CACHE INTERNAL "idem's pkg-config modules")

# ---- Debian packages: cpack -G DEB -> libidem-dev and idem-tools ---------------------------------
set(IDEM_DEB_MAINTAINER "idem maintainers <idem-maintainers@users.noreply.github.com>"
    CACHE STRING "Maintainer field of the Debian packages cpack makes")
set(CPACK_PACKAGE_NAME idem)
set(CPACK_PACKAGE_VENDOR "idem")
set(CPACK_PACKAGE_VERSION "${PROJECT_VERSION}")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "idem: ${PROJECT_DESCRIPTION} (C++20)")
set(CPACK_PACKAGE_CONTACT "${IDEM_DEB_MAINTAINER}")
set(CPACK_GENERATOR DEB)
set(CPACK_SOURCE_GENERATOR TGZ)
set(CPACK_SOURCE_IGNORE_FILES "/\\\\.git/" "/build/")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_ALL dev tools)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
# The package version is the library's: `idem --version` prints exactly the control file's
# Version (tests/package checks it), so there is no Debian revision suffix.
set(CPACK_DEBIAN_PACKAGE_VERSION "${PROJECT_VERSION}")

set(CPACK_DEBIAN_DEV_PACKAGE_NAME libidem-dev)
set(CPACK_DEBIAN_DEV_PACKAGE_SECTION libdevel)
# CPack puts CPACK_PACKAGE_DESCRIPTION_SUMMARY first (the synopsis); these are the bodies.
set(CPACK_COMPONENT_DEV_DESCRIPTION
    "Development files of idem, a C++20 library: headers, static libraries, the CMake package (find_package(idem)) and pkg-config files (idem, idem-redis, idem-postgres, ...).")
# What a consumer compiling and linking against the headers and the static libraries needs: the
# -dev packages of every client library a built component uses (the static archives do not carry
# them), and pkg-config, which idem's CMake package calls to find hiredis.
set(_idem_dev_depends "libfmt-dev (>= 9)" "libssl-dev")
if(TARGET idem_redis)
  list(APPEND _idem_dev_depends libhiredis-dev pkg-config)
endif()
if(TARGET idem_postgres)
  list(APPEND _idem_dev_depends libpq-dev)
endif()
if(TARGET idem_sqlite)
  list(APPEND _idem_dev_depends libsqlite3-dev)
endif()
if(TARGET idem_asio)
  list(APPEND _idem_dev_depends "libboost-dev (>= 1.74)")
endif()
if(TARGET idem_outbox_kafka OR TARGET idem_kafka)
  list(APPEND _idem_dev_depends librdkafka-dev)
endif()
if(TARGET idem_outbox_rabbitmq OR TARGET idem_rabbitmq)
  list(APPEND _idem_dev_depends librabbitmq-dev)
endif()
if(TARGET idem_nats OR TARGET idem_outbox_nats)
  list(APPEND _idem_dev_depends libnats-dev)
endif()
if(TARGET idem_prometheus)
  list(APPEND _idem_dev_depends prometheus-cpp-dev)
endif()
string(REPLACE ";" ", " CPACK_DEBIAN_DEV_PACKAGE_DEPENDS "${_idem_dev_depends}")

set(CPACK_DEBIAN_TOOLS_PACKAGE_NAME idem-tools)
set(CPACK_DEBIAN_TOOLS_PACKAGE_SECTION admin)
set(CPACK_COMPONENT_TOOLS_DESCRIPTION
    "Command-line tools of idem: the idem command (inspect, list, release, purge, stats, doctor, conformance of idem's Redis and PostgreSQL stores) and the idem-outbox-relay program.")
# idem-tools depends on the runtime libraries, not on libidem-dev: idem's own libraries are static
# archives linked into both programs, so what they load at run time is hiredis, libpq, OpenSSL,
# fmt and libstdc++ only. dpkg-shlibdeps (dpkg-dev) reads those from the binaries, so the
# Depends line names the exact runtime packages (libhiredis0.14, libpq5, libssl3, libfmt9, ...)
# instead of a hand-kept list, and installing the tools pulls in no headers.
set(CPACK_DEBIAN_TOOLS_PACKAGE_SHLIBDEPS ON)

include(CPack)
