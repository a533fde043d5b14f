#!/usr/bin/env bash
# Starts and stops a throwaway rabbitmq-server: the one fixture of every RabbitMQ test
# (the RabbitMQ consumer and its template's test, the outbox tests, scripts/bench-outbox).
#
#   rabbitmq_broker.sh start STATE_DIR    # a fresh node on free ports -> STATE_DIR/port (AMQP)
#   rabbitmq_broker.sh halt STATE_DIR     # stops the node, keeps its data and ports (a broker outage)
#   rabbitmq_broker.sh resume STATE_DIR   # starts the halted node again, same port, same data
#   rabbitmq_broker.sh stop STATE_DIR     # stops the node and removes everything it had
#
# The node is our own: its name (idem-test-PID@localhost), its AMQP, distribution and epmd ports
# (free ones, picked at random), and its mnesia, log, feature-flags, plugins and cookie files live
# in a fresh temp dir (STATE_DIR/dir names it). It binds to 127.0.0.1 only, loads no plugins, and
# never touches a system rabbitmq-server. As root the server runs as the rabbitmq user (it refuses
# root), so the temp dir is owned by rabbitmq. Up to 3 start attempts (fresh ports; a resume keeps
# its ports), each bounded by 60 s. A node that cannot start is an error (exit 1), never a skip.
# Every process is stopped by its PID or process group, never by name: SIGTERM to the node's PID
# (or rabbitmqctl stop), then its process group if anything is left, then our epmd.
#
# With IDEM_RABBITMQ_TLS_DIR set (a dir with ca.pem, server.pem, server.key: what
# tests/support/rabbitmq_tls_broker.sh makes) the node also has a TLS listener on a free port of
# 127.0.0.1 -> STATE_DIR/tls_port (verify_peer, a client certificate optional). Unset: no change.
set -uo pipefail

cmd=${1:?usage: rabbitmq_broker.sh start|halt|resume|stop STATE_DIR}
state=${2:?usage: rabbitmq_broker.sh start|halt|resume|stop STATE_DIR}
rmq_bin=${IDEM_RABBITMQ_BIN:-/usr/lib/rabbitmq/bin}
[[ -x $rmq_bin/rabbitmq-server && -x $rmq_bin/rabbitmqctl ]] ||
  { echo "rabbitmq_broker.sh: rabbitmq-server not found in $rmq_bin (install rabbitmq-server)" >&2; exit 1; }
command -v epmd >/dev/null || { echo "rabbitmq_broker.sh: epmd not found (erlang-base)" >&2; exit 1; }

as_rabbit=()
[[ $(id -u) -eq 0 ]] && as_rabbit=(runuser -u rabbitmq --)

port_free() {  # nothing listening on 127.0.0.1:$1
  if command -v ss >/dev/null; then
    ! ss -Htln "sport = :$1" 2>/dev/null | grep -q .
  else
    ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
  fi
}
# Below the kernel's ephemeral range (ip_local_port_range, 32768+ by default): a port picked
# there could be taken by any test's outgoing connection between the check and the node's bind,
# which is how a start failed with dist_port_already_used / nodistribution under load.
port_floor=10000
port_ceiling=$(( $(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768) - 1 ))
((port_ceiling > port_floor + 1000)) || port_ceiling=32767
pick_port() {
  local p
  for _ in $(seq 1 50); do
    p=$(( ($(od -An -N2 -tu2 /dev/urandom | tr -d ' ') % (port_ceiling - port_floor)) + port_floor ))
    port_free "$p" && { echo "$p"; return 0; }
  done
  return 1
}

set_env() {
  rabbit_env=(
    HOME="$tmp" PATH="$PATH" RABBITMQ_NODENAME="$node"
    RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_NODE_PORT="$amqp_port" RABBITMQ_DIST_PORT="$dist_port"
    ERL_EPMD_ADDRESS=127.0.0.1 ERL_EPMD_PORT="$epmd_port"
    RABBITMQ_CONF_ENV_FILE="$tmp/rabbitmq-env.conf" RABBITMQ_CONFIG_FILE="$tmp/rabbitmq.conf"
    RABBITMQ_ADVANCED_CONFIG_FILE="$tmp/advanced.config"
    RABBITMQ_MNESIA_BASE="$tmp/mnesia" RABBITMQ_LOG_BASE="$tmp/log" RABBITMQ_LOGS="$tmp/log/node.log"
    RABBITMQ_FEATURE_FLAGS_FILE="$tmp/feature_flags" RABBITMQ_ENABLED_PLUGINS_FILE="$tmp/enabled_plugins"
    RABBITMQ_ENABLED_PLUGINS="" RABBITMQ_PLUGINS_EXPAND_DIR="$tmp/plugins-expand" RABBITMQ_PID_FILE="$tmp/node.pid"
    RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
    RABBITMQ_CTL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
  )
}
ctl() {  # rabbitmqctl against our node, bounded
  local limit=$1
  shift
  timeout "$limit" "${as_rabbit[@]}" env -i "${rabbit_env[@]}" "$rmq_bin/rabbitmqctl" -n "$node" -q "$@"
}
load_state() {
  [[ -f $state/dir ]] || { echo "rabbitmq_broker.sh: no broker in $state" >&2; return 1; }
  tmp=$(cat "$state/dir")
  node=$(cat "$state/node")
  read -r amqp_port dist_port epmd_port <"$state/ports"
  set_env
}

halt_node() {  # stops the running node (if any) and our epmd; keeps the data
  local server_pid node_pid
  server_pid=$(cat "$state/server_pid" 2>/dev/null || true)
  if [[ -n $server_pid ]] && kill -0 "$server_pid" 2>/dev/null; then
    # SIGTERM to the node's own PID is a clean shutdown, quicker than rabbitmqctl stop.
    node_pid=""
    [[ -s $tmp/node.pid ]] && node_pid=$(tr -dc '0-9' <"$tmp/node.pid")
    if [[ -n $node_pid ]] && kill -TERM "$node_pid" 2>/dev/null; then
      for _ in $(seq 1 150); do kill -0 "$node_pid" 2>/dev/null || break; sleep 0.1; done
    else
      ctl 20 stop >/dev/null 2>&1
    fi
    # Whatever is left of what we started: its process group (setsid made it the leader).
    if kill -0 "$server_pid" 2>/dev/null; then
      kill -TERM -- "-$server_pid" 2>/dev/null || true
      for _ in $(seq 1 50); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.1; done
      kill -KILL -- "-$server_pid" 2>/dev/null || true
    fi
  fi
  rm -f "$state/server_pid" "$tmp/node.pid"
  ERL_EPMD_PORT=$epmd_port epmd -kill >/dev/null 2>&1 || true
}

boot() {  # starts the node on the current ports; 0 once it answers, 1 if it did not come up in 60 s
  setsid "${as_rabbit[@]}" env -i "${rabbit_env[@]}" "$rmq_bin/rabbitmq-server" >>"$tmp/server.out" 2>&1 </dev/null &
  local server_pid=$!
  echo "$server_pid" >"$state/server_pid"
  local deadline=$((SECONDS + 60))
  while ((SECONDS < deadline)); do
    kill -0 "$server_pid" 2>/dev/null || break
    ctl 15 await_startup --timeout 10 >"$tmp/await.out" 2>&1 && return 0
    sleep 1
  done
  tail -n 20 "$tmp/server.out" "$tmp/await.out" >&2 2>/dev/null
  halt_node
  return 1
}

case "$cmd" in
start)
  [[ -f $state/dir ]] && "$0" stop "$state"
  mkdir -p "$state"
  tmp=$(mktemp -d /tmp/idem-rabbitmq.XXXXXX)
  chmod 755 "$tmp"
  node="idem-test-$$@localhost"
  : >"$tmp/rabbitmq-env.conf"
  : >"$tmp/rabbitmq.conf"
  echo "[]." >"$tmp/enabled_plugins"
  tls_src=${IDEM_RABBITMQ_TLS_DIR:-}
  if [[ -n $tls_src ]]; then  # the node's copies, readable by the rabbitmq user
    mkdir -p "$tmp/tls" && cp "$tls_src/ca.pem" "$tls_src/server.pem" "$tls_src/server.key" "$tmp/tls/" ||
      { echo "rabbitmq_broker.sh: IDEM_RABBITMQ_TLS_DIR=$tls_src has no ca.pem, server.pem, server.key" >&2
        "$0" stop "$state"; exit 1; }
  fi
  [[ $(id -u) -eq 0 ]] && chown -R rabbitmq:rabbitmq "$tmp"
  echo "$tmp" >"$state/dir"
  echo "$node" >"$state/node"
  for attempt in 1 2 3; do
    amqp_port=$(pick_port) && dist_port=$(pick_port) && epmd_port=$(pick_port) ||
      { echo "rabbitmq_broker.sh: no free port found" >&2; exit 1; }
    echo "$amqp_port $dist_port $epmd_port" >"$state/ports"
    if [[ -n $tls_src ]]; then
      tls_port=$amqp_port
      while [[ " $amqp_port $dist_port $epmd_port " == *" $tls_port "* ]]; do
        tls_port=$(pick_port) || { echo "rabbitmq_broker.sh: no free port found" >&2; exit 1; }
      done
      cat >"$tmp/rabbitmq.conf" <<EOF_TLS
listeners.ssl.default = 127.0.0.1:$tls_port
ssl_options.cacertfile = $tmp/tls/ca.pem
ssl_options.certfile = $tmp/tls/server.pem
ssl_options.keyfile = $tmp/tls/server.key
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = false
EOF_TLS
    fi
    set_env
    rm -rf "$tmp/mnesia" "$tmp/log"
    if boot; then
      [[ -n $tls_src ]] && echo "$tls_port" >"$state/tls_port"
      echo "$amqp_port" >"$state/port"
      exit 0
    fi
    echo "rabbitmq_broker.sh: attempt $attempt: rabbitmq-server did not come up (ports $amqp_port/$dist_port/$epmd_port)" >&2
  done
  echo "rabbitmq_broker.sh: FAILED: rabbitmq-server could not be started" >&2
  "$0" stop "$state"
  exit 1
  ;;
halt)
  load_state || exit 1
  halt_node
  ;;
resume)
  load_state || exit 1
  # A just-closed listening port can be busy for a moment: a few tries on the same ports.
  for attempt in 1 2 3; do
    boot && exit 0
    echo "rabbitmq_broker.sh: resume attempt $attempt failed" >&2
    sleep 2
  done
  exit 1
  ;;
stop)
  if load_state 2>/dev/null; then
    halt_node
    rm -rf "$tmp"
  fi
  # Only the files this script wrote: STATE_DIR itself goes only if nothing else is in it.
  rm -f "$state"/{dir,node,ports,port,server_pid,tls_port}
  rmdir "$state" 2>/dev/null || true
  ;;
*)
  echo "usage: rabbitmq_broker.sh start|halt|resume|stop STATE_DIR" >&2
  exit 2
  ;;
esac
