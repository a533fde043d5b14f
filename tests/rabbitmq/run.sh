#!/usr/bin/env bash
# Starts a throwaway rabbitmq-server, runs a command against it, stops the server, and exits with
# the command's status.
#
#   tests/rabbitmq/run.sh CONSUMER [ARGS...]     # runs: CONSUMER --host 127.0.0.1 --port P ARGS...
#
# The node is our own: its name (idem-test-PID@localhost), its AMQP, distribution and epmd ports
# (free ones, picked at random), and its mnesia, log, feature-flags, plugins and cookie files live
# in a fresh temp dir. It binds to 127.0.0.1 only, loads no plugins, and never touches a system
# rabbitmq-server. As root the server runs as the rabbitmq user (it refuses root), so the temp dir
# is owned by rabbitmq. Up to 3 start attempts on fresh ports, each bounded by 60 s; a broker that
# cannot start is a FAILURE (exit 1), never a skip. The node is stopped on every exit path (trap):
# SIGTERM to its PID (or rabbitmqctl stop), then its process group if anything is left, then our
# epmd.
set -uo pipefail

consumer=${1:?usage: run.sh CONSUMER [ARGS...]}
shift
rmq_bin=${IDEM_RABBITMQ_BIN:-/usr/lib/rabbitmq/bin}
[[ -x $rmq_bin/rabbitmq-server && -x $rmq_bin/rabbitmqctl ]] ||
  { echo "run.sh: rabbitmq-server not found in $rmq_bin (install rabbitmq-server)" >&2; exit 1; }
command -v epmd >/dev/null || { echo "run.sh: epmd not found (erlang-base)" >&2; exit 1; }

port_free() {  # nothing listening on 127.0.0.1:$1
  if command -v ss >/dev/null; then
    ! ss -Htln "sport = :$1" 2>/dev/null | grep -q .
  else
    ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
  fi
}
pick_port() {
  local p
  for _ in $(seq 1 50); do
    p=$(( ($(od -An -N2 -tu2 /dev/urandom | tr -d ' ') % 20000) + 30000 ))
    port_free "$p" && { echo "$p"; return 0; }
  done
  return 1
}

tmp=$(mktemp -d /tmp/idem-rabbitmq.XXXXXX)
chmod 755 "$tmp"
as_rabbit=()
if [[ $(id -u) -eq 0 ]]; then
  chown rabbitmq:rabbitmq "$tmp"
  as_rabbit=(runuser -u rabbitmq --)
fi

node="idem-test-$$@localhost"
server_pid=""
epmd_port=""

# Everything the node and rabbitmqctl need, passed explicitly (runuser does not keep a custom
# environment by itself). HOME holds this node's own Erlang cookie.
set_env() {  # the ports are picked again for each start attempt
  rabbit_env=(
    HOME="$tmp"
    PATH="$PATH"
    RABBITMQ_NODENAME="$node"
    RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
    RABBITMQ_NODE_PORT="$amqp_port"
    RABBITMQ_DIST_PORT="$dist_port"
    ERL_EPMD_ADDRESS=127.0.0.1
    ERL_EPMD_PORT="$epmd_port"
    RABBITMQ_CONF_ENV_FILE="$tmp/rabbitmq-env.conf"
    RABBITMQ_CONFIG_FILE="$tmp/rabbitmq.conf"
    RABBITMQ_ADVANCED_CONFIG_FILE="$tmp/advanced.config"
    RABBITMQ_MNESIA_BASE="$tmp/mnesia"
    RABBITMQ_LOG_BASE="$tmp/log"
    RABBITMQ_LOGS="$tmp/log/node.log"
    RABBITMQ_FEATURE_FLAGS_FILE="$tmp/feature_flags"
    RABBITMQ_ENABLED_PLUGINS_FILE="$tmp/enabled_plugins"
    RABBITMQ_ENABLED_PLUGINS=""
    RABBITMQ_PLUGINS_EXPAND_DIR="$tmp/plugins-expand"
    RABBITMQ_PID_FILE="$tmp/node.pid"
    RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
    RABBITMQ_CTL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
  )
}
as_node() { "${as_rabbit[@]}" env -i "${rabbit_env[@]}" "$@"; }

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [[ -n $server_pid ]] && kill -0 "$server_pid" 2>/dev/null; then
    # The node's own PID (it writes it once booted): SIGTERM is a clean shutdown, and quicker
    # than rabbitmqctl stop, which boots a second Erlang VM. rabbitmqctl stop if there is no pid.
    local node_pid=""
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
  # The epmd on our private port (started by our node, detached); it refuses to die while a node
  # is still registered, which cannot be the case any more.
  [[ -n $epmd_port ]] && ERL_EPMD_PORT=$epmd_port epmd -kill >/dev/null 2>&1
  if ((rc != 0)) && [[ -d $tmp/log ]]; then
    echo "---- rabbitmq log (last 40 lines) ----" >&2
    tail -n 40 "$tmp"/log/*.log "$tmp/server.out" 2>/dev/null >&2 || true
  fi
  rm -rf "$tmp"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

: >"$tmp/rabbitmq-env.conf"
: >"$tmp/rabbitmq.conf"
echo "[]." >"$tmp/enabled_plugins"
[[ $(id -u) -eq 0 ]] && chown rabbitmq:rabbitmq "$tmp"/*

ctl() {  # rabbitmqctl against our node, bounded
  local limit=$1
  shift
  timeout "$limit" bash -c "$(declare -f as_node); $(declare -p as_rabbit rabbit_env); as_node '$rmq_bin/rabbitmqctl' -n '$node' -q $*"
}

# Up to 3 attempts (a picked port can be taken before the node binds it), each bounded by 60 s;
# a node that never comes up fails the test.
t0=$(date +%s.%N)
up=0
for attempt in 1 2 3; do
  amqp_port=$(pick_port) && dist_port=$(pick_port) && epmd_port=$(pick_port) ||
    { echo "run.sh: no free port found" >&2; exit 1; }
  set_env
  rm -rf "$tmp/mnesia" "$tmp/log" "$tmp/node.pid"
  setsid "${as_rabbit[@]}" env -i "${rabbit_env[@]}" "$rmq_bin/rabbitmq-server" >"$tmp/server.out" 2>&1 &
  server_pid=$!
  deadline=$((SECONDS + 60))
  while ((SECONDS < deadline)); do
    kill -0 "$server_pid" 2>/dev/null || break
    if ctl 15 await_startup --timeout 10 >"$tmp/await.out" 2>&1; then
      up=1
      break 2
    fi
    sleep 1
  done
  echo "run.sh: attempt $attempt: rabbitmq-server did not come up (ports $amqp_port/$dist_port/$epmd_port):" >&2
  tail -n 20 "$tmp/server.out" "$tmp/await.out" >&2 2>/dev/null
  if kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM -- "-$server_pid" 2>/dev/null
    sleep 2
    kill -KILL -- "-$server_pid" 2>/dev/null
  fi
  ERL_EPMD_PORT=$epmd_port epmd -kill >/dev/null 2>&1
  server_pid=""
done
((up == 1)) || { echo "run.sh: FAILED: rabbitmq-server could not be started" >&2; exit 1; }
printf 'run.sh: rabbitmq %s up on 127.0.0.1:%s in %.1f s\n' "$node" "$amqp_port" "$(echo "$(date +%s.%N) - $t0" | bc 2>/dev/null || echo 0)"

"$consumer" --host 127.0.0.1 --port "$amqp_port" "$@"
exit $?
