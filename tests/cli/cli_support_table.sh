#!/usr/bin/env bash
# docs/support.md's table is the one `troupe train --help-support` prints from the rules that
# refuse what is not built (engine/support.hpp): fails, showing the difference, when they differ.
# Usage: cli_support_table.sh TROUPE DOC
set -u
troupe=${1:?usage: cli_support_table.sh TROUPE DOC}
doc=${2:?usage: cli_support_table.sh TROUPE DOC}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$troupe" train --help-support >"$tmp/generated" || { echo "FAIL: --help-support failed"; exit 1; }
grep -q '^| a job with' "$tmp/generated" || { echo "FAIL: --help-support printed no table"; exit 1; }
sed -n '/^<!-- support table: /,/^<!-- end support table -->/p' "$doc" | sed '1d;$d' >"$tmp/documented"
if ! diff -u "$tmp/documented" "$tmp/generated"; then
  echo "FAIL: $doc's table differs from troupe train --help-support (regenerate it)"
  exit 1
fi
echo "support table: $(($(wc -l <"$tmp/generated") - 2)) rows, docs equal the code"
