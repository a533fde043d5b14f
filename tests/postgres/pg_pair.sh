#!/bin/sh
# A real replicated PostgreSQL pair for the failover tests: a primary and a streaming standby
# (pg_basebackup -R), in two "slots" a and b whose ports never change, so one multi-host conninfo
# reaches whichever slot is the primary now, as a client of a real cluster would.
#   pg_pair.sh start STATE_DIR [sync|async]  primary in slot a, standby in slot b, streaming; writes
#                                            STATE_DIR/conninfo (both slots, target_session_attrs=read-write),
#                                            STATE_DIR/{a,b}.conninfo (one slot each), STATE_DIR/primary
#   pg_pair.sh kill-primary STATE_DIR        SIGKILL the primary's postmaster and its children (by PID)
#   pg_pair.sh promote STATE_DIR             pg_ctl promote the standby: it becomes the primary
#   pg_pair.sh attach STATE_DIR              a new standby of the primary, made with pg_basebackup -R, in
#                                            the slot (and on the port) of the killed node; waits until it
#                                            streams (and, in sync mode, is the synchronous standby)
#   pg_pair.sh stop-standby STATE_DIR        stops the standby (SIGINT to its postmaster, by PID): in sync mode
#                                            commits then wait for a standby that is not there
#   pg_pair.sh start-standby STATE_DIR       starts the stopped standby again on its port (it does not wait
#                                            for it to stream: the primary may be gone)
#   pg_pair.sh stop STATE_DIR                stops every node by the PID in its postmaster.pid, removes the data
# sync: synchronous_standby_names = '*' and synchronous_commit = on, so a commit is acknowledged only
# once a standby has flushed it. A server that cannot start is an error (exit 1), never a skip.
set -eu

usage="usage: pg_pair.sh start|kill-primary|promote|attach|stop-standby|start-standby|stop STATE_DIR [sync|async]"
cmd=${1:?$usage}
state=${2:?$usage}

. "$(dirname "$0")/pg_lib.sh"

die() {
  echo "pg_pair: $*" >&2
  exit 1
}

sql() {  # sql PORT QUERY: one value, or nothing when the server does not answer
  "$bindir/psql" -X -At -h 127.0.0.1 -p "$1" -U postgres -d postgres -c "$2" 2>/dev/null || true
}

other() { if [ "$1" = a ]; then echo b; else echo a; fi; }

random_port() {  # below the ephemeral range (32768+), as pg_cluster.sh
  echo $(( ($(od -An -N2 -tu2 /dev/urandom | tr -d ' ') % 20000) + 10000 ))
}

# pg_start SLOT PORT: starts the node of SLOT on PORT; false when it did not start (port taken, ...).
# start_on_free_port SLOT WHAT TAKEN: starts SLOT's server on a random free port (not TAKEN), up
# to 5 ports tried, and records it in STATE/SLOT.port; exits with the server's log when none works.
start_on_free_port() {
  tries=0
  while :; do
    tries=$((tries + 1))
    port=$(random_port)
    [ "$port" = "$3" ] && continue
    if pg_start "$1" "$port"; then break; fi
    if [ $tries -ge 5 ]; then
      echo "pg_pair: $2 did not start; server log:" >&2
      node_log "$1"
      exit 1
    fi
  done
  echo "$port" > "$state/$1.port"
}

pg_start() {
  data=$(cat "$state/$1.data")
  as_pg "$bindir/pg_ctl" -D "$data" -l "$data/../$(basename "$data").log" -w -t 30 -o "-p $2" start >/dev/null 2>&1
}

node_log() {
  data=$(cat "$state/$1.data")
  cat "$data/../$(basename "$data").log" >&2 2>/dev/null || true
}

# wait_streaming: until the primary sees a standby streaming (sync mode: as its synchronous standby).
wait_streaming() {
  p=$(cat "$state/primary")
  pport=$(cat "$state/$p.port")
  want="state = 'streaming'"
  [ "$(cat "$state/mode")" = sync ] && want="$want AND sync_state = 'sync'"
  i=0
  while [ "$(sql "$pport" "SELECT count(*) FROM pg_stat_replication WHERE $want")" != 1 ]; do
    i=$((i + 1))
    if [ $i -ge 300 ]; then
      echo "pg_pair: the standby did not start streaming from slot $p in 30 s; its log:" >&2
      node_log "$(other "$p")"
      exit 1
    fi
    sleep 0.1
  done
}

# make_standby SLOT GEN: a base backup of the primary (-R: standby.signal and primary_conninfo).
make_standby() {
  p=$(cat "$state/primary")
  base=$(cat "$state/base")
  data="$base/$1$2/data"
  mkdir -p "$base/$1$2"
  [ "$(id -u)" = 0 ] && chown postgres "$base/$1$2"
  as_pg "$bindir/pg_basebackup" -h 127.0.0.1 -p "$(cat "$state/$p.port")" -U postgres -D "$data" -R -X stream \
    -c fast --no-sync >"$base/$1$2/basebackup.log" 2>&1 || { cat "$base/$1$2/basebackup.log" >&2; die "pg_basebackup failed"; }
  echo "$data" > "$state/$1.data"
}

# running PID: the process exists and has not exited (a zombie has: it holds no port or file).
running() {
  st=$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)
  [ -n "$st" ] && [ "$st" != Z ]
}

# The PIDs of a node: its postmaster (postmaster.pid) and the postmaster's children.
node_pids() {
  data=$(cat "$state/$1.data")
  [ -f "$data/postmaster.pid" ] || return 0
  pm=$(head -n 1 "$data/postmaster.pid")
  [ -n "$pm" ] && running "$pm" || return 0
  echo "$pm"
  ps -o pid= --ppid "$pm" 2>/dev/null || true
}

# gone PID...: true when none of them runs any more.
gone() {
  for pid in "$@"; do
    if running "$pid"; then return 1; fi
  done
  return 0
}

case "$cmd" in
start)
  mode=${3:-sync}
  case "$mode" in sync|async) ;; *) die "mode must be sync or async, not $mode" ;; esac
  mkdir -p "$state"
  if [ -f "$state/base" ]; then sh "$0" stop "$state" || true; fi
  base=$(mktemp -d /tmp/idem-pgpair.XXXXXX)
  chmod 755 "$base"
  [ "$(id -u)" = 0 ] && chown postgres "$base"
  echo "$base" > "$state/base"
  echo "$mode" > "$state/mode"
  echo 1 > "$state/generation"
  mkdir -p "$base/a1"
  [ "$(id -u)" = 0 ] && chown postgres "$base/a1"
  echo "$base/a1/data" > "$state/a.data"
  as_pg "$bindir/initdb" -D "$base/a1/data" -A trust -U postgres -E UTF8 --locale=C --no-sync >"$base/a1/initdb.log" 2>&1 ||
    { cat "$base/a1/initdb.log" >&2; exit 1; }
  # Every node inherits these through its base backup. fsync off for speed (the tests SIGKILL
  # servers, they do not crash the machine, so the page cache survives); synchronous_commit stays
  # on because off would not wait for the standby either.
  {
    echo "listen_addresses = '127.0.0.1'"
    echo "unix_socket_directories = '$base'"
    echo "max_connections = 100"
    echo "fsync = off"
    echo "full_page_writes = off"
    echo "wal_level = replica"
    echo "max_wal_senders = 10"
    echo "wal_keep_size = '128MB'"
    echo "hot_standby = on"
    echo "wal_retrieve_retry_interval = '200ms'"
    echo "synchronous_commit = on"
    if [ "$mode" = sync ]; then echo "synchronous_standby_names = '*'"; fi
  } >> "$base/a1/data/postgresql.conf"
  start_on_free_port a "the primary" ""
  echo a > "$state/primary"
  make_standby b 1
  start_on_free_port b "the standby" "$(cat "$state/a.port")"
  pa=$(cat "$state/a.port")
  pb=$(cat "$state/b.port")
  echo "host=127.0.0.1 port=$pa user=postgres dbname=postgres" > "$state/a.conninfo"
  echo "host=127.0.0.1 port=$pb user=postgres dbname=postgres" > "$state/b.conninfo"
  echo "host=127.0.0.1,127.0.0.1 port=$pa,$pb user=postgres dbname=postgres target_session_attrs=read-write connect_timeout=5" \
    > "$state/conninfo"
  wait_streaming
  echo "pg_pair: primary on 127.0.0.1:$pa, $mode standby on 127.0.0.1:$pb (data $base)"
  ;;
kill-primary)
  p=$(cat "$state/primary")
  pids=$(node_pids "$p")
  [ -n "$pids" ] || die "the primary (slot $p) is not running"
  # Stopped first, the postmaster forks no backend between the listing and the kill (one forked
  # then would live on until it noticed, and answer a client meanwhile).
  pm=$(echo "$pids" | head -n 1)
  kill -STOP "$pm"
  pids=$(node_pids "$p")
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null || true
  i=0
  # shellcheck disable=SC2086
  until gone $pids; do
    i=$((i + 1))
    [ $i -ge 100 ] && die "the killed primary's processes did not exit in 10 s: $pids"
    sleep 0.1
  done
  echo "$p" > "$state/dead"
  ;;
promote)
  p=$(cat "$state/primary")
  s=$(other "$p")
  data=$(cat "$state/$s.data")
  as_pg "$bindir/pg_ctl" -D "$data" -w -t 30 promote >/dev/null || { node_log "$s"; die "pg_ctl promote of slot $s failed"; }
  [ "$(sql "$(cat "$state/$s.port")" "SELECT pg_is_in_recovery()")" = f ] || die "slot $s is still in recovery after promote"
  echo "$s" > "$state/primary"
  ;;
attach)
  p=$(cat "$state/primary")
  s=$(other "$p")
  [ -z "$(node_pids "$s")" ] || die "slot $s still runs a server: kill-primary and promote first"
  old=$(dirname "$(cat "$state/$s.data")")
  gen=$(( $(cat "$state/generation") + 1 ))
  echo "$gen" > "$state/generation"
  make_standby "$s" "$gen"
  case "$old" in /tmp/idem-pgpair.*/*) rm -rf "$old" ;; esac
  # Same slot, same port: the killed node's listening socket is closed once its processes exited.
  i=0
  until pg_start "$s" "$(cat "$state/$s.port")"; do
    i=$((i + 1))
    if [ $i -ge 20 ]; then
      echo "pg_pair: the new standby did not start on port $(cat "$state/$s.port"); server log:" >&2
      node_log "$s"
      exit 1
    fi
    sleep 0.25
  done
  rm -f "$state/dead"
  wait_streaming
  ;;
stop-standby)
  s=$(other "$(cat "$state/primary")")
  pids=$(node_pids "$s")
  [ -n "$pids" ] || die "the standby (slot $s) is not running"
  kill -INT "$(echo "$pids" | head -n 1)"
  i=0
  # shellcheck disable=SC2086
  until gone $pids; do
    i=$((i + 1))
    [ $i -ge 100 ] && die "the standby's processes did not exit in 10 s: $pids"
    sleep 0.1
  done
  ;;
start-standby)
  s=$(other "$(cat "$state/primary")")
  [ -z "$(node_pids "$s")" ] || die "the standby (slot $s) is already running"
  pg_start "$s" "$(cat "$state/$s.port")" || { node_log "$s"; die "the standby (slot $s) did not start again"; }
  ;;
stop)
  [ -f "$state/base" ] || exit 0
  base=$(cat "$state/base")
  for s in a b; do
    [ -f "$state/$s.data" ] || continue
    pids=$(node_pids "$s")
    [ -n "$pids" ] || continue
    pm=$(echo "$pids" | head -n 1)
    # SIGQUIT is pg_ctl's immediate shutdown: the postmaster ends its children itself.
    kill -QUIT "$pm" 2>/dev/null || true
    i=0
    # shellcheck disable=SC2086
    until gone $pids; do
      i=$((i + 1))
      if [ $i -ge 100 ]; then
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null || true
        break
      fi
      sleep 0.1
    done
  done
  case "$base" in /tmp/idem-pgpair.*) rm -rf "$base" ;; esac
  rm -f "$state/base" "$state/conninfo" "$state/a.conninfo" "$state/b.conninfo" "$state/a.data" "$state/b.data" \
    "$state/a.port" "$state/b.port" "$state/primary" "$state/dead" "$state/mode" "$state/generation"
  rmdir "$state" 2>/dev/null || true
  ;;
*)
  die "unknown command $cmd"
  ;;
esac
