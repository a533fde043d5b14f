#!/bin/sh
# idem --bash-completion and idem --man-page (what the package installs): the script parses, it
# offers every command of commands.inc and each command's options, and the man page has a section
# per command. Usage: check_docgen.sh <idem> <commands.inc>
set -eu
tool=$1
inc=$2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$tool" --bash-completion >"$out/idem.bash"
"$tool" --man-page >"$out/idem.1"
bash -n "$out/idem.bash"
head -1 "$out/idem.1" | grep -q '^\.TH IDEM 1 ' || { echo "idem.1 does not start with .TH IDEM 1"; exit 1; }
for c in $(sed -n 's/^IDEM_COMMAND(\([a-z_]*\)).*/\1/p' "$inc"); do
  grep -q "^    $c) words=" "$out/idem.bash" || { echo "the completion lacks the command $c"; exit 1; }
  grep -q "^\.SS \"idem $c\"" "$out/idem.1" || { echo "the man page lacks the command $c"; exit 1; }
done
# Every URL scheme the tool opens is named (the ENVIRONMENT section and --url).
for scheme in redis:// postgresql:// sqlite:///; do
  grep -qF -- "$scheme" "$out/idem.1" || { echo "the man page does not name $scheme"; exit 1; }
done
# Completing in a shell: the commands after `idem`, a command's options, the values of --state.
complete_line() { bash -c '. "$1"; shift; COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); _idem; printf "%s\n" "${COMPREPLY[@]}"' _ "$out/idem.bash" "$@"; }
complete_line idem rel | grep -qx release || { echo "idem rel<TAB> does not offer release"; exit 1; }
complete_line idem release --fe | grep -qx -- --fence || { echo "idem release --fe<TAB> does not offer --fence"; exit 1; }
complete_line idem list --state fa | grep -qx failed || { echo "idem list --state fa<TAB> does not offer failed"; exit 1; }
echo "docgen: completion and man page cover $(grep -c '^IDEM_COMMAND(' "$inc") commands"
