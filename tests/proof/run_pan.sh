#!/bin/sh
# run_pan.sh pass|fail PAN — runs a spin verifier (built by tests/proof/CMakeLists.txt) in its own
# directory and prints its state counts. "pass": the search must be exhaustive and find no error.
# "fail" (a mutated model): it must report an assertion violation, which the trail then explains.
set -u
expect=$1 pan=$2
dir=$(dirname "$pan")
cd "$dir" || exit 2
rm -f ./*.trail
# -m: depth bound far above the model's (it reports "depth reached"); -n: no unreached-code list.
out=$(./"$(basename "$pan")" -m100000 -n 2>&1)
rc=$?
printf '%s\n' "$out" | grep -E "pan:|State-vector|states, stored|states, matched|transitions|total actual memory|elapsed|errors:"
errors=$(printf '%s\n' "$out" | sed -nE 's/.*errors: ([0-9]+).*/\1/p' | tail -1)
if printf '%s\n' "$out" | grep -qE "max search depth too small|out of memory|search not completed"; then
  echo "run_pan: the search did not complete"
  exit 1
fi
case $expect in
  pass)
    [ "$rc" -eq 0 ] && [ "$errors" = 0 ] && exit 0
    echo "run_pan: the model has a violation (see $dir/*.trail; spin -t -p idem.pml replays it)"
    exit 1
    ;;
  fail)
    if [ -n "$errors" ] && [ "$errors" -gt 0 ] && printf '%s\n' "$out" | grep -q "assertion violated"; then
      echo "run_pan: the mutant is caught, as it must be"
      exit 0
    fi
    echo "run_pan: the mutated model passed: the checker no longer notices the check it removes"
    exit 1
    ;;
esac
exit 2
