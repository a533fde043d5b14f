# Shared by scripts/*: install what is missing (Debian 12, apt), nothing else.
# shellcheck shell=bash

idem_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# idem_help "$@" — with -h or --help, prints the calling script's leading comment block (its
# usage) and exits; every script calls it first.
idem_help() {
  case "${1:-}" in
    -h | --help)
      awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"
      exit 0
      ;;
  esac
}

# ensure_packages PKG... — apt-get install the ones dpkg does not report as installed.
ensure_packages() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    echo "== installing: ${missing[*]}"
    local sudo=()
    [[ $(id -u) -eq 0 ]] || sudo=(sudo)
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get update -qq
    # policy-rc.d keeps freshly installed servers (redis, postgresql, rabbitmq) from being started
    # as system services: the tests start their own instances on free loopback ports.
    local policy=/usr/sbin/policy-rc.d created_policy=0
    if [[ ! -e $policy && $(id -u) -eq 0 ]]; then
      printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && created_policy=1
    fi
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" || {
      ((created_policy)) && rm -f "$policy"
      return 1
    }
    ((created_policy)) && rm -f "$policy"
  fi
  return 0
}

core_packages=(cmake ninja-build g++ pkg-config libssl-dev libfmt-dev)
all_packages=("${core_packages[@]}" catch2 libhiredis-dev libpq-dev libfmt-dev redis-server redis-tools
              openssl postgresql postgresql-contrib librdkafka-dev librabbitmq-dev rabbitmq-server util-linux procps
              prometheus-cpp-dev libcli11-dev nlohmann-json3-dev libboost-dev)
# The package tests (tests/package): make builds the pkg-config consumer; cpack's DEB generator
# reads the tools' runtime dependencies with dpkg-shlibdeps (dpkg-dev); dpkg-deb comes with dpkg.
all_packages+=(make dpkg-dev)
# The PostgreSQL stores behind a pooler (tests/postgres/pgbouncer.sh starts one of its own).
all_packages+=(pgbouncer)
# The model check (tests/proof, docs/proof.md) and the fuzz targets (tests/fuzz, clang's libFuzzer).
all_packages+=(spin clang libclang-rt-14-dev)
# The API reference (docs/CMakeLists.txt: `--target docs`) and the operations kit's checks
# (tests/prometheus: promtool and a real prometheus server against docs/operations/).
all_packages+=(doxygen prometheus)
# idem::http's cpp-httplib adapter, examples/http_payments and tests/http (its client).
all_packages+=(libcpp-httplib-dev)
# idem::nats (src/nats) and its tests, which start a real nats-server -js (tests/nats).
all_packages+=(libnats-dev nats-server)
# idem::pqxx (include/idem/pqxx.hpp): PostgresJoined over the application's libpqxx transaction.
all_packages+=(libpqxx-dev)
# idem::sqlite (src/sqlite): SqliteStore in one SQLite file, no server.
all_packages+=(libsqlite3-dev)
