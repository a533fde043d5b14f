#!/bin/sh
# Starts or stops a throwaway PostgreSQL cluster for the tests and the bench.
#   pg_cluster.sh start STATE_DIR [durable]   -> writes STATE_DIR/conninfo, STATE_DIR/datadir
#   pg_cluster.sh restart STATE_DIR
#   pg_cluster.sh stop STATE_DIR
# The data lives in a fresh mktemp dir (the postgres user must be able to reach it); STATE_DIR
# only holds the pointers. As root, initdb/pg_ctl run as the postgres user (initdb refuses root).
# "durable" keeps fsync and synchronous_commit on (the bench); tests turn them off for speed.
# A server that cannot start is an error (exit 1), never a skip.
set -eu

cmd=${1:?usage: pg_cluster.sh start|restart|stop STATE_DIR [durable]}
state=${2:?usage: pg_cluster.sh start|restart|stop STATE_DIR [durable]}
profile=${3:-fast}

. "$(dirname "$0")/pg_lib.sh"

case "$cmd" in
start)
  mkdir -p "$state"
  if [ -f "$state/datadir" ] && [ -d "$(cat "$state/datadir")" ]; then
    "$0" stop "$state" || true
  fi
  base=$(mktemp -d /tmp/idem-pg.XXXXXX)
  chmod 755 "$base"
  if [ "$(id -u)" = 0 ]; then chown postgres "$base"; fi
  echo "$base" > "$state/datadir"
  as_pg "$bindir/initdb" -D "$base/data" -A trust -U postgres -E UTF8 --locale=C --no-sync >"$base/initdb.log" 2>&1 ||
    { cat "$base/initdb.log" >&2; exit 1; }
  if [ "$profile" = durable ]; then
    settings="-c fsync=on -c synchronous_commit=on"
  else
    settings="-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
    # postgres_batch_test counts its own statements in pg_stat_statements (its table's name is
    # its own, so no other test's statements mix in); without the library that check is skipped.
    if [ -f "$(dirname "$bindir")/lib/pg_stat_statements.so" ]; then
      settings="$settings -c shared_preload_libraries=pg_stat_statements"
    fi
  fi
  tries=0
  while :; do
    tries=$((tries + 1))
    # A port in the dynamic range picked at random; if it is taken, pg_ctl fails and we try another.
    port=$(( ($(od -An -N2 -tu2 /dev/urandom | tr -d ' ') % 20000) + 10000 ))  # below the ephemeral range (32768+)
    if as_pg "$bindir/pg_ctl" -D "$base/data" -l "$base/server.log" -w -t 30 \
        -o "-c listen_addresses=127.0.0.1 -p $port -c unix_socket_directories=$base -c max_connections=200 $settings" start >/dev/null; then
      break
    fi
    if [ $tries -ge 5 ]; then
      echo "pg_cluster: PostgreSQL did not start; server log:" >&2
      cat "$base/server.log" >&2 || true
      exit 1
    fi
  done
  echo "host=127.0.0.1 port=$port user=postgres dbname=postgres" > "$state/conninfo"
  echo "$bindir" > "$state/bindir"
  echo "pg_cluster: started on 127.0.0.1:$port (data $base/data)"
  ;;
restart)
  base=$(cat "$state/datadir")
  as_pg "$bindir/pg_ctl" -D "$base/data" -l "$base/server.log" -w -t 30 -m fast restart >/dev/null
  ;;
stop)
  [ -f "$state/datadir" ] || exit 0
  base=$(cat "$state/datadir")
  if [ -d "$base/data" ]; then
    as_pg "$bindir/pg_ctl" -D "$base/data" -w -t 30 -m immediate stop >/dev/null 2>&1 || true
  fi
  case "$base" in /tmp/idem-pg.*) rm -rf "$base" ;; esac
  rm -f "$state/datadir" "$state/conninfo"
  ;;
*)
  echo "pg_cluster: unknown command $cmd" >&2
  exit 2
  ;;
esac
