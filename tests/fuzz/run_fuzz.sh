#!/bin/sh
# run_fuzz.sh BINARY [SECONDS] — runs one libFuzzer target of tests/fuzz for SECONDS (default:
# $IDEM_FUZZ_SECONDS, else 12) from its corpus in tests/fuzz/corpus/<target> (read only: new
# inputs go to a scratch corpus beside the binary) and prints the executions. A crash leaves its
# input as <binary dir>/artifacts/<target>-crash-*: add it to the corpus once fixed.
# fuzz_lua_record gets a redis-server of its own on a unix socket, stopped by its PID after.
set -u
bin=$1
secs=${2:-${IDEM_FUZZ_SECONDS:-6}}
name=$(basename "$bin")
here=$(cd "$(dirname "$0")" && pwd)
work=$(cd "$(dirname "$bin")" && pwd)/work-$name
mkdir -p "$work/corpus" "$(dirname "$bin")/artifacts"
server_pid=
cleanup() { [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null; }
trap cleanup EXIT INT TERM
if [ "$name" = fuzz_lua_record ]; then
  sock=$work/redis.sock
  rm -f "$sock"
  redis-server --port 0 --unixsocket "$sock" --save '' --appendonly no --dir "$work" --logfile "$work/redis.log" &
  server_pid=$!
  i=0
  while [ ! -S "$sock" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
  [ -S "$sock" ] || { echo "run_fuzz: redis-server did not start"; exit 1; }
  export IDEM_FUZZ_REDIS_SOCKET=$sock
fi
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
"$bin" -max_total_time="$secs" -print_final_stats=1 -timeout=10 -rss_limit_mb=1024 \
  -artifact_prefix="$(dirname "$bin")/artifacts/$name-" "$work/corpus" "$here/corpus/$name" >"$work/log" 2>&1
rc=$?
grep -E "^(INFO: Seed|stat::number_of_executed_units|stat::peak_rss_mb|Done [0-9]+ runs)|ERROR|SUMMARY|abort|==[0-9]+==" "$work/log" | head -40
if [ $rc -ne 0 ]; then
  echo "run_fuzz: $name found a failure (log: $work/log)"
  tail -60 "$work/log"
fi
exit $rc
