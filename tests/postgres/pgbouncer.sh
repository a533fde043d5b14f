#!/bin/sh
# A PgBouncer of the test's own in front of a test PostgreSQL (Debian's pgbouncer, /usr/sbin).
#   pgbouncer.sh start STATE_DIR PG session|transaction  -> STATE_DIR/conninfo, STATE_DIR/base
#     PG: the server's port, or a file holding its conninfo (pg_cluster.sh's, "... port=N ...")
#   pgbouncer.sh stop STATE_DIR                                 stops it by the PID in its pidfile
# It listens on 127.0.0.1 at a free port with an ini of its own in a fresh temp dir (auth_type
# trust, a userlist naming postgres), never on the system service's 6432. As root it runs as the
# postgres user (pgbouncer refuses root). One that cannot start is an error (exit 1), never a skip.
set -eu

usage="usage: pgbouncer.sh start STATE_DIR PG_PORT|CONNINFO_FILE session|transaction | stop STATE_DIR"
cmd=${1:?$usage}
state=${2:?$usage}
bouncer=${IDEM_PGBOUNCER:-/usr/sbin/pgbouncer}

as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

case "$cmd" in
start)
  pg_port=${3:?$usage}
  if [ -f "$pg_port" ]; then pg_port=$(sed -n 's/.*port=\([0-9]*\).*/\1/p' "$pg_port"); fi
  [ -n "$pg_port" ] || { echo "pgbouncer.sh: no PostgreSQL port in $3" >&2; exit 1; }
  mode=${4:?$usage}
  case "$mode" in session|transaction) ;; *) echo "pgbouncer.sh: mode must be session or transaction" >&2; exit 1 ;; esac
  [ -x "$bouncer" ] || { echo "pgbouncer.sh: $bouncer not found (install pgbouncer)" >&2; exit 1; }
  mkdir -p "$state"
  base=$(mktemp -d /tmp/idem-pgbouncer.XXXXXX)
  chmod 755 "$base"
  [ "$(id -u)" = 0 ] && chown postgres "$base"
  echo "$base" > "$state/base"
  echo '"postgres" ""' > "$base/userlist.txt"
  tries=0
  while :; do
    tries=$((tries + 1))
    port=$(( ($(od -An -N2 -tu2 /dev/urandom | tr -d ' ') % 20000) + 10000 ))
    # Session mode holds a server session per client for the client's life: as many as a test's
    # pools open. Transaction mode gets a small pool: consecutive transactions of one client then
    # land on different server sessions, as under load.
    if [ "$mode" = session ]; then servers=40; else servers=3; fi
    cat > "$base/pgbouncer.ini" <<INI
[databases]
postgres = host=127.0.0.1 port=$pg_port dbname=postgres
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
auth_type = trust
auth_file = $base/userlist.txt
pool_mode = $mode
default_pool_size = $servers
max_client_conn = 200
ignore_startup_parameters = extra_float_digits
logfile = $base/pgbouncer.log
pidfile = $base/pgbouncer.pid
INI
    [ "$(id -u)" = 0 ] && chown postgres "$base/pgbouncer.ini" "$base/userlist.txt"
    if as_pg "$bouncer" -d "$base/pgbouncer.ini" >/dev/null 2>&1; then
      i=0
      while [ $i -lt 100 ]; do
        if [ -s "$base/pgbouncer.pid" ] && grep -q "listening on 127.0.0.1:$port" "$base/pgbouncer.log" 2>/dev/null; then
          echo "host=127.0.0.1 port=$port user=postgres dbname=postgres" > "$state/conninfo"
          echo "pgbouncer.sh: $mode pooling on 127.0.0.1:$port in front of 127.0.0.1:$pg_port ($base)"
          exit 0
        fi
        i=$((i + 1))
        sleep 0.05
      done
      [ -s "$base/pgbouncer.pid" ] && kill "$(cat "$base/pgbouncer.pid")" 2>/dev/null || true
    fi
    if [ $tries -ge 5 ]; then
      echo "pgbouncer.sh: pgbouncer did not start; its log:" >&2
      cat "$base/pgbouncer.log" >&2 2>/dev/null || true
      exit 1
    fi
    sleep 0.2
  done
  ;;
stop)
  [ -f "$state/base" ] || exit 0
  base=$(cat "$state/base")
  if [ -s "$base/pgbouncer.pid" ]; then
    pid=$(cat "$base/pgbouncer.pid")
    # SIGTERM is its immediate shutdown; it holds no data, so one that lingers is killed.
    kill "$pid" 2>/dev/null || true
    i=0
    while kill -0 "$pid" 2>/dev/null && [ $i -lt 10 ]; do
      i=$((i + 1))
      sleep 0.05
    done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  case "$base" in /tmp/idem-pgbouncer.*) rm -rf "$base" ;; esac
  rm -f "$state/base" "$state/conninfo"
  rmdir "$state" 2>/dev/null || true
  ;;
*)
  echo "$usage" >&2
  exit 1
  ;;
esac
