#!/bin/sh
# The SQLite quickstart across a crash: runs idem_sqlite_quickstart on a fresh file with
# --crash-after (it SIGKILLs itself inside a handler, its write uncommitted), then again on the
# same file to the end, which checks that every message's effect is in the file exactly once.
# Used by scripts/demo and by the CTest entry "example: sqlite_quickstart (SIGKILL, restart)".
#
#   sqlite_quickstart_demo.sh BINARY [MESSAGES]
set -eu
bin=$1
messages=${2:-2000}
dir=$(mktemp -d "${TMPDIR:-/tmp}/idem-sqlite-demo-XXXXXX")
trap 'rm -rf "$dir"' EXIT
db="$dir/idem.db"
echo "== run 1: $messages messages on $db, SIGKILL inside handler $((messages / 2))"
status=0
"$bin" --db "$db" --messages "$messages" --crash-after $((messages / 2)) || status=$?
if [ "$status" -ne 137 ]; then
  echo "run 1 was to die of SIGKILL (status 137), it ended with status $status" >&2
  exit 1
fi
echo "== run 1 died of SIGKILL (status $status): the broker redelivers everything"
echo "== run 2: the same file, to the end"
"$bin" --db "$db" --messages "$messages"
