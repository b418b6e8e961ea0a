#!/usr/bin/env bash
# examples/embedded_trainer (the embedding API, docs/embedding.md) on a tiny recipe: it prints
# every step, pauses half-way, commits a checkpoint that `troupe ckpt verify` accepts, swaps the
# schedule, finishes and writes final weights equal to `troupe train`'s of the same recipe with
# the same schedule swap; bad input is one line and exit 2.
# Usage: cli_embedded_trainer.sh EMBEDDED_TRAINER TROUPE
set -euo pipefail
example=${1:?usage: cli_embedded_trainer.sh EMBEDDED_TRAINER TROUPE}
troupe=${2:?usage: cli_embedded_trainer.sh EMBEDDED_TRAINER TROUPE}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() {
  echo "FAIL: $*" >&2
  exit 1
}
# shellcheck source=tests/cli/tiny_recipe.sh
source "$(dirname "${BASH_SOURCE[0]}")/tiny_recipe.sh"
tiny_recipe "$tmp" "$tmp/embedded" 8
"$example" "$tmp/recipe.toml" >"$tmp/out" 2>"$tmp/err" || { cat "$tmp/out" "$tmp/err" >&2; fail "the example failed"; }
[ "$(grep -c '^step [0-9]/8 loss ' "$tmp/out")" -eq 8 ] || { cat "$tmp/out" >&2; fail "not 8 step lines"; }
grep -q "^paused after step 4$" "$tmp/out" || fail "no pause after step 4"
grep -q "^schedule gpipe: from the next step$" "$tmp/out" || fail "no schedule swap"
grep -q "^finished: 8 steps" "$tmp/out" || fail "not finished"
checkpoint=$(sed -n 's/^checkpoint //p' "$tmp/out")
"$troupe" ckpt verify "$checkpoint" >/dev/null || fail "the checkpoint does not verify"
[ -s "$tmp/embedded/final.safetensors" ] || fail "no final weights"
# The same run as one command: the first 4 steps under 1F1B, the rest under GPipe (the same
# numbers: a schedule changes the order of work, not its arithmetic).
"$troupe" train "$tmp/recipe.toml" --set "output.dir=$tmp/cli" >/dev/null 2>&1 || fail "troupe train"
cmp "$tmp/embedded/final.safetensors" "$tmp/cli/final.safetensors" || fail "final weights differ from troupe train"
set +e
"$example" "$tmp/recipe.toml" "optimizer.lr=-1" >/dev/null 2>"$tmp/bad"
rc=$?
set -e
[ "$rc" -eq 2 ] || fail "bad input: exit $rc"
grep -q "optimizer.lr" "$tmp/bad" && [ "$(wc -l <"$tmp/bad")" -eq 1 ] || fail "bad input: $(cat "$tmp/bad")"
echo "embedded trainer: 8 steps in two parts, a checkpoint, a schedule swap; weights equal troupe train's"
