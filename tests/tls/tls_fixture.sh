#!/bin/sh
# The TLS tests' shared fixture: throwaway certificates (make_certs.sh) and a PostgreSQL that
# takes TLS connections only (ssl = on; pg_hba: hostssl, and `cert` auth for the role idem-app).
#   tls_fixture.sh start STATE_DIR  -> STATE_DIR/certs/*, STATE_DIR/conninfo (sslmode=verify-full),
#                                      STATE_DIR/pg/* (tests/postgres/pg_cluster.sh's state)
#   tls_fixture.sh stop STATE_DIR
# The Redis TLS servers are started by the tests themselves (tls_support.hpp) with these certificates.
set -eu
cmd=${1:?usage: tls_fixture.sh start|stop STATE_DIR}
state=${2:?usage: tls_fixture.sh start|stop STATE_DIR}
here=$(cd "$(dirname "$0")" && pwd)
pg_cluster="$here/../postgres/pg_cluster.sh"

case "$cmd" in
start)
  "$0" stop "$state" >/dev/null 2>&1 || true
  mkdir -p "$state"
  rm -rf "$state/certs"
  sh "$here/make_certs.sh" "$state/certs" >/dev/null
  sh "$pg_cluster" start "$state/pg"
  base=$(cat "$state/pg/datadir")
  bindir=$(cat "$state/pg/bindir")
  port=$(sed -E 's/.*port=([0-9]+).*/\1/' "$state/pg/conninfo")
  # The server's key must belong to the server's user, mode 0600, or PostgreSQL refuses to start TLS.
  for f in server.crt server.key ca.crt; do cp "$state/certs/$f" "$base/data/$f"; done
  chmod 600 "$base/data/server.key"
  if [ "$(id -u)" = 0 ]; then chown postgres "$base/data/server.crt" "$base/data/server.key" "$base/data/ca.crt"; fi
  cat >"$base/data/pg_hba.conf" <<HBA
local   all all                  trust
hostssl all idem-app 127.0.0.1/32 cert
hostssl all all      127.0.0.1/32 trust
HBA
  psql() { "$bindir/psql" -X -q -v ON_ERROR_STOP=1 -h "$base" -p "$port" -U postgres -d postgres "$@"; }
  if [ "$(id -u)" = 0 ]; then
    psql() { runuser -u postgres -- "$bindir/psql" -X -q -v ON_ERROR_STOP=1 -h "$base" -p "$port" -U postgres -d postgres "$@"; }
  fi
  psql -c "ALTER SYSTEM SET ssl = on" -c "ALTER SYSTEM SET ssl_cert_file = 'server.crt'" \
    -c "ALTER SYSTEM SET ssl_key_file = 'server.key'" -c "ALTER SYSTEM SET ssl_ca_file = 'ca.crt'" \
    -c "ALTER SYSTEM SET ssl_min_protocol_version = 'TLSv1.2'" \
    -c "CREATE ROLE \"idem-app\" LOGIN" -c "GRANT CREATE ON DATABASE postgres TO \"idem-app\"" \
    -c "SELECT pg_reload_conf()" >/dev/null
  # The reload is asynchronous: wait until the server says TLS is on.
  for _ in $(seq 1 100); do
    [ "$(psql -At -c 'SHOW ssl')" = on ] && break
    sleep 0.05
  done
  [ "$(psql -At -c 'SHOW ssl')" = on ] || { echo "tls_fixture: ssl did not turn on" >&2; cat "$base/server.log" >&2; exit 1; }
  echo "host=localhost hostaddr=127.0.0.1 port=$port user=postgres dbname=postgres sslmode=verify-full sslrootcert=$state/certs/ca.crt" \
    >"$state/conninfo"
  echo "tls_fixture: certificates in $state/certs, PostgreSQL (TLS only) on 127.0.0.1:$port"
  ;;
stop)
  [ -d "$state/pg" ] && sh "$pg_cluster" stop "$state/pg"
  rm -f "$state/conninfo"
  rm -rf "$state/certs"
  ;;
*)
  echo "tls_fixture: unknown command $cmd" >&2
  exit 2
  ;;
esac
