#!/usr/bin/env bash
# Starts a throwaway rabbitmq-server, runs a command against it, stops the server, and exits with
# the command's status.
#
#   tests/rabbitmq/run.sh CONSUMER [ARGS...]     # runs: CONSUMER --host 127.0.0.1 --port P ARGS...
#
# The server is tests/support/rabbitmq_broker.sh's (its header says what the node is and how it is
# started and stopped): a broker that cannot start is a FAILURE (exit 1), never a skip, and the
# node is stopped on every exit path (trap). When the command fails, the node's log tail is shown.
set -uo pipefail

consumer=${1:?usage: run.sh CONSUMER [ARGS...]}
shift
broker="$(cd "$(dirname "${BASH_SOURCE[0]}")/../support" && pwd)/rabbitmq_broker.sh"
state=$(mktemp -d /tmp/idem-rabbitmq-run.XXXXXX)

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if ((rc != 0)) && [[ -s $state/dir ]]; then
    local dir
    dir=$(cat "$state/dir")
    echo "---- rabbitmq log (last 40 lines) ----" >&2
    tail -n 40 "$dir"/log/*.log "$dir/server.out" >&2 2>/dev/null || true
  fi
  "$broker" stop "$state" >/dev/null 2>&1
  rm -rf "$state"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

t0=$SECONDS
"$broker" start "$state" || { echo "run.sh: FAILED: rabbitmq-server could not be started" >&2; exit 1; }
port=$(cat "$state/port")
echo "run.sh: rabbitmq $(cat "$state/node") up on 127.0.0.1:$port in $((SECONDS - t0)) s"

"$consumer" --host 127.0.0.1 --port "$port" "$@"
exit $?
