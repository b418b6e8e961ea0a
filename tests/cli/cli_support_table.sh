#!/usr/bin/env bash
# A table in the docs that the code generates is the one the code prints now: docs/support.md's
# (`troupe train --help-support`, from the rules that refuse what a device cannot run,
# engine/parallel/support.hpp) and docs/recipe.md's (`troupe train --help-keys`, from the recipe schema,
# engine/training/recipe.cpp). Fails, showing the difference, when they differ.
# Usage: cli_support_table.sh TROUPE DOC OPTION NAME
#   DOC holds the table between the lines "<!-- NAME: troupe train OPTION -->" and
#   "<!-- end NAME -->".
set -u
usage="usage: cli_support_table.sh TROUPE DOC OPTION NAME"
troupe=${1:?$usage}
doc=${2:?$usage}
option=${3:?$usage}
name=${4:?$usage}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$troupe" train "$option" >"$tmp/generated" || { echo "FAIL: train $option failed"; exit 1; }
grep -q '^|---' "$tmp/generated" || { echo "FAIL: train $option printed no table"; exit 1; }
grep -qx "<!-- $name: troupe train $option -->" "$doc" ||
  { echo "FAIL: $doc has no line <!-- $name: troupe train $option -->"; exit 1; }
sed -n "/^<!-- $name: /,/^<!-- end $name -->/p" "$doc" | sed '1d;$d' >"$tmp/documented"
if ! diff -u "$tmp/documented" "$tmp/generated"; then
  echo "FAIL: $doc's $name differs from troupe train $option (regenerate it)"
  exit 1
fi
echo "$name: $(($(wc -l <"$tmp/generated") - 2)) rows, $doc equals the code"
