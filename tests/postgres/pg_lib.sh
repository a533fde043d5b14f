# Sourced by pg_cluster.sh and pg_pair.sh (POSIX sh): `bindir`, the newest PostgreSQL server
# binaries (IDEM_PG_BIN overrides), and as_pg, which runs a command as the postgres user when we
# are root (initdb and the server refuse to run as root).
pg_lib_name=${pg_lib_name:-$(basename "$0" .sh)}
bindir=${IDEM_PG_BIN:-}
if [ -z "$bindir" ]; then
  for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
    if [ -x "$d/initdb" ]; then bindir=$d; break; fi
  done
fi
if [ -z "$bindir" ] && command -v initdb >/dev/null 2>&1; then bindir=$(dirname "$(command -v initdb)"); fi
[ -n "$bindir" ] && [ -x "$bindir/initdb" ] || { echo "$pg_lib_name: initdb not found (install postgresql)" >&2; exit 1; }

as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}
