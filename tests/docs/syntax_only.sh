#!/bin/sh
# The compiler launcher of the docs' blocks (tests/docs/CMakeLists.txt): runs the compile command
# it is given with -fsyntax-only (every error, template instantiations included, at a third of the
# time of making an object), then creates the object file the command names, empty, so the build
# sees the block up to date until the page changes. Nothing links these objects.
out=""
previous=""
for arg in "$@"; do
  [ "$previous" = "-o" ] && out=$arg
  previous=$arg
done
"$@" -fsyntax-only || exit
if [ -n "$out" ]; then
  : >"$out"
fi
