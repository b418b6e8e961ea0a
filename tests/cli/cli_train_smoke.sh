#!/usr/bin/env bash
# `troupe train` end to end on a tiny model and a generated text corpus: exit 0, one JSON
# metrics line per step with the documented fields, validation on the eval steps and the last,
# final weights that load back as `init`, and --set overriding the step count.
# Usage: cli_train_smoke.sh TROUPE
set -euo pipefail
troupe=${1:?usage: cli_train_smoke.sh TROUPE}
py=/usr/bin/python3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# A few KB of text.
words=(the quick brown fox jumps over lazy dog while a small model learns to count)
for i in $(seq 1 120); do
  echo "sentence $i: ${words[$((i % 15))]} ${words[$(((i * 7) % 15))]} ${words[$(((i * 3) % 15))]}."
done >"$tmp/corpus.txt"
[[ $(wc -c <"$tmp/corpus.txt") -gt 3000 ]]

cat >"$tmp/recipe.toml" <<TOML
seed = 7
steps = 6
eval_interval = 3
eval_batches = 2

[model]
vocab_size = 256
context = 16
layers = 1
heads = 2
width = 16

[data]
format = "text"
train = "$tmp/corpus.txt"
val_fraction = 0.2

[batch]
micro_batch = 2
seq_len = 16

[optimizer]
warmup_steps = 2

[output]
dir = "$tmp/run"
TOML

# check_metrics FILE STEPS VAL_STEPS: FILE has STEPS JSON lines, steps 1..STEPS in order, each
# with the documented keys and finite numbers; val_loss exactly on VAL_STEPS (comma list).
check_metrics() {
  "$py" - "$@" <<'PY'
import json, math, sys
path, steps, val_steps = sys.argv[1], int(sys.argv[2]), {int(s) for s in sys.argv[3].split(",") if s}
lines = open(path).read().splitlines()
assert len(lines) == steps, f"{path}: {len(lines)} lines, expected {steps}"
for n, line in enumerate(lines, 1):
    m = json.loads(line)
    assert isinstance(m, dict), f"line {n} is not an object"
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s"):
        assert key in m, f"line {n}: no {key}: {line}"
        assert isinstance(m[key], (int, float)) and math.isfinite(m[key]), f"line {n}: {key}: {line}"
    assert m["step"] == n, f"line {n}: step {m['step']}"
    assert 0 < m["loss"] < 10, f"line {n}: loss {m['loss']}"
    assert m["lr"] > 0 and m["grad_norm"] > 0 and m["tokens_per_s"] > 0, line
    if n in val_steps:
        assert "val_loss" in m and math.isfinite(m["val_loss"]) and m["val_loss"] > 0, f"line {n}: {line}"
    else:
        assert "val_loss" not in m, f"line {n}: unexpected val_loss: {line}"
print(f"{path}: {steps} lines ok")
PY
}

"$troupe" train "$tmp/recipe.toml" >"$tmp/run1.stdout" 2>"$tmp/run1.stderr" || {
  echo "FAIL: troupe train exited $?" >&2
  cat "$tmp/run1.stdout" "$tmp/run1.stderr" >&2
  exit 1
}
check_metrics "$tmp/run/metrics.jsonl" 6 3,6
[[ -s $tmp/run/final.safetensors ]] || { echo "FAIL: no final.safetensors" >&2; exit 1; }
[[ ! -e $tmp/run/final.safetensors.tmp ]] || { echo "FAIL: temporary weights left behind" >&2; exit 1; }
grep -q '^done: 6 steps.*, val loss [0-9.]*, ' "$tmp/run1.stdout" || { echo "FAIL: no summary line" >&2; exit 1; }

# The weights are a safetensors file with Hugging Face names and the real vocabulary.
"$py" - "$tmp/run/final.safetensors" <<'PY'
import json, struct, sys
data = open(sys.argv[1], "rb").read()
(n,) = struct.unpack("<Q", data[:8])
header = json.loads(data[8:8 + n])
assert header["transformer.wte.weight"]["shape"] == [256, 16], header["transformer.wte.weight"]
assert header["transformer.h.0.attn.c_attn.weight"]["shape"] == [16, 48]
assert all(v["dtype"] == "F32" for k, v in header.items() if k != "__metadata__")
end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
assert 8 + n + end == len(data), "data size mismatch"
print("final.safetensors header ok")
PY

# The final weights load back as init.
"$troupe" train "$tmp/recipe.toml" --set "init=$tmp/run/final.safetensors" --set steps=1 \
  --set "output.dir=$tmp/run2" >"$tmp/run2.stdout" 2>"$tmp/run2.stderr" || {
  echo "FAIL: training from init exited $?" >&2
  cat "$tmp/run2.stderr" >&2
  exit 1
}
check_metrics "$tmp/run2/metrics.jsonl" 1 1
# Without validation the summary says so (not "val loss nan").
"$troupe" train "$tmp/recipe.toml" --set eval_interval=0 --set steps=1 \
  --set "output.dir=$tmp/noval" >"$tmp/noval.stdout" 2>&1 || { echo "FAIL: no-validation run" >&2; exit 1; }
grep -q '^done: 1 steps.*final loss [0-9.]*, no validation, ' "$tmp/noval.stdout" ||
  { echo "FAIL: summary without validation: $(grep '^done' "$tmp/noval.stdout")" >&2; exit 1; }

# --set steps overrides the recipe.
"$troupe" train "$tmp/recipe.toml" --set steps=3 --set "output.dir=$tmp/run3" \
  >"$tmp/run3.stdout" 2>"$tmp/run3.stderr" || {
  echo "FAIL: --set steps=3 run exited $?" >&2
  cat "$tmp/run3.stderr" >&2
  exit 1
}
check_metrics "$tmp/run3/metrics.jsonl" 3 3

# Same recipe, same seed: the same losses (runs are reproducible from the recipe).
"$py" - "$tmp/run/metrics.jsonl" "$tmp/run3/metrics.jsonl" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
# Steps 1..2 see the same batches, weights and learning rates (the schedule depends on the
# total step count only after warmup, which is 2 steps).
for x, y in zip(a[:2], b[:2]):
    assert x["loss"] == y["loss"], (x, y)
print("reproducible losses ok")
PY
# The same recipe as a traced two-stage 1F1B pipeline: the trace reads back, its summary has
# both stages and a bubble, and the timeline renders.
"$troupe" train "$tmp/recipe.toml" --set model.layers=2 --set parallel.pp=2 \
  --set parallel.micro_batches=3 --set steps=3 --set "output.dir=$tmp/run4" \
  --trace "$tmp/run4.trace.json" >"$tmp/run4.stdout" 2>"$tmp/run4.stderr" || {
  echo "FAIL: traced pipeline run exited $?" >&2
  cat "$tmp/run4.stderr" >&2
  exit 1
}
check_metrics "$tmp/run4/metrics.jsonl" 3 3
"$troupe" trace summary "$tmp/run4.trace.json" >"$tmp/summary.txt" || {
  echo "FAIL: trace summary exited $?" >&2
  exit 1
}
for needle in "stage 0 · dp 0" "stage 1 · dp 0" "bubble: measured" "schedule 1f1b, p=2, m=3"; do
  grep -qF "$needle" "$tmp/summary.txt" || {
    echo "FAIL: trace summary lacks '$needle':" >&2
    cat "$tmp/summary.txt" >&2
    exit 1
  }
done
"$troupe" trace render "$tmp/run4.trace.json" -o "$tmp/run4.svg" || {
  echo "FAIL: trace render exited $?" >&2
  exit 1
}
head -c 200 "$tmp/run4.svg" | grep -q "<svg" || {
  echo "FAIL: render did not write an SVG" >&2
  exit 1
}
# --dry-run prints the per-rank memory plan and allocates, trains and writes nothing.
"$troupe" train "$tmp/recipe.toml" --dry-run --set model.layers=2 --set parallel.pp=2 --set parallel.dp=4 --set parallel.zero=2 \
  --set "output.dir=$tmp/dry" >"$tmp/dry.txt" 2>&1 || {
  echo "FAIL: --dry-run exited $?" >&2
  cat "$tmp/dry.txt" >&2
  exit 1
}
for needle in "memory plan per rank" "4 psi + 12 psi/N (ZeRO-2)" "model state" "activations"; do
  grep -qF "$needle" "$tmp/dry.txt" || {
    echo "FAIL: --dry-run output lacks '$needle':" >&2
    cat "$tmp/dry.txt" >&2
    exit 1
  }
done
[ "$(grep -c '^[01] ' "$tmp/dry.txt")" = 2 ] || { echo "FAIL: --dry-run: not one line per rank" >&2; cat "$tmp/dry.txt" >&2; exit 1; }
[ ! -e "$tmp/dry" ] || { echo "FAIL: --dry-run wrote $tmp/dry" >&2; exit 1; }
# With activation checkpointing the plan says what it saves on each rank.
"$troupe" train "$tmp/recipe.toml" --dry-run --set model.layers=4 --set parallel.pp=2 --set parallel.micro_batches=4 \
  --set activation_checkpoint.mode=full --set "output.dir=$tmp/dry" >"$tmp/dry-ac.txt" 2>&1 || {
  echo "FAIL: --dry-run with activation_checkpoint.mode=full exited $?" >&2
  cat "$tmp/dry-ac.txt" >&2
  exit 1
}
grep -q "activation checkpointing (full): .*rank 0: .* instead of .*, saves " "$tmp/dry-ac.txt" || {
  echo "FAIL: --dry-run does not report what checkpointing saves:" >&2
  cat "$tmp/dry-ac.txt" >&2
  exit 1
}
echo "smoke test passed"
