#!/usr/bin/env bash
# The examples a user copies (examples/README.md) do what they say:
#  - custom_schedule registers "gpipe_lifo", prints its plan, has the simulator refuse a broken
#    schedule, and trains a recipe with parallel.schedule = "gpipe_lifo" to the loss of GPipe
#    within 1e-5 (the same work; only the order of the backwards, and so of the gradient sums,
#    differs);
#  - examples/3d_parallel.toml (PP=2 x DP=2 x TP=2 in one process), shortened, gives the serial
#    loop's losses within 1e-5;
#  - examples/default.toml (the tiny GPT), shortened, trains and `troupe sample` reads its
#    weights.
# Usage: cli_examples.sh TROUPE CUSTOM_SCHEDULE EXAMPLES_DIR
set -euo pipefail
troupe=${1:?usage: cli_examples.sh TROUPE CUSTOM_SCHEDULE EXAMPLES_DIR}
custom=${2:?usage: cli_examples.sh TROUPE CUSTOM_SCHEDULE EXAMPLES_DIR}
examples=${3:?usage: cli_examples.sh TROUPE CUSTOM_SCHEDULE EXAMPLES_DIR}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() {
  echo "FAIL: $*" >&2
  exit 1
}
close() {  # close A_JSONL B_JSONL TOLERANCE LABEL: every step's loss within relative TOLERANCE
  python3 - "$@" <<'PY'
import json, sys
a, b, tol, label = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
la = [json.loads(l)["loss"] for l in open(a)]
lb = [json.loads(l)["loss"] for l in open(b)]
assert len(la) == len(lb) and la, f"{label}: {len(la)} steps against {len(lb)}"
worst = max(abs(x - y) / abs(y) for x, y in zip(la, lb))
assert worst <= tol, f"{label}: losses differ by {worst:.3g} relative (tolerance {tol})"
print(f"{label}: {len(la)} steps within {worst:.2g} relative")
PY
}

# shellcheck source=tests/cli/tiny_recipe.sh
source "$(dirname "${BASH_SOURCE[0]}")/tiny_recipe.sh"
tiny_recipe "$tmp" "$tmp/custom" 6 4
timeout 120 "$custom" "$tmp/recipe.toml" >"$tmp/custom.out" 2>"$tmp/custom.err" ||
  { cat "$tmp/custom.out" "$tmp/custom.err" >&2; fail "custom_schedule failed"; }
grep -q "^rank 0: 0F0 0F1 0F2 0F3 0B3 0B2 0B1 0B0$" "$tmp/custom.out" ||
  { cat "$tmp/custom.out" >&2; fail "no gpipe_lifo plan for rank 0"; }
grep -q "^rank 1: 1F0 1F1 1F2 1F3 1B3 1B2 1B1 1B0$" "$tmp/custom.out" || fail "no plan for rank 1"
grep -q "^broken: refused: .*broken" "$tmp/custom.out" || { cat "$tmp/custom.out" >&2; fail "the broken schedule was not refused"; }
grep -q "^finished: 6 steps with gpipe_lifo" "$tmp/custom.out" || fail "did not finish"
timeout 120 "$troupe" train "$tmp/recipe.toml" --set parallel.schedule=gpipe \
  --set "output.dir=$tmp/gpipe" >/dev/null 2>&1 || fail "troupe train with gpipe"
close "$tmp/custom/metrics.jsonl" "$tmp/gpipe/metrics.jsonl" 1e-5 "gpipe_lifo vs gpipe"

short=(--set steps=2 --set eval_interval=0 --threads 1)
timeout 300 "$troupe" train "$examples/3d_parallel.toml" "${short[@]}" --set "output.dir=$tmp/3d" \
  >"$tmp/3d.out" 2>&1 || { cat "$tmp/3d.out" >&2; fail "examples/3d_parallel.toml"; }
timeout 300 "$troupe" train "$examples/3d_parallel.toml" "${short[@]}" --engine serial \
  --set "output.dir=$tmp/3d_serial" >/dev/null 2>&1 || fail "examples/3d_parallel.toml, serial"
close "$tmp/3d/metrics.jsonl" "$tmp/3d_serial/metrics.jsonl" 1e-5 "3D parallel vs serial"

timeout 300 "$troupe" train "$examples/default.toml" "${short[@]}" --set "output.dir=$tmp/tiny" \
  >/dev/null 2>&1 || fail "examples/default.toml"
timeout 60 "$troupe" sample "$tmp/tiny/final.safetensors" --prompt "The " --tokens 16 --seed 1 \
  >"$tmp/sample.out" 2>&1 || { cat "$tmp/sample.out" >&2; fail "troupe sample of the tiny GPT"; }
[ -s "$tmp/sample.out" ] || fail "no sample"
echo "examples: custom_schedule, 3d_parallel, default (tiny GPT) and its sample"
