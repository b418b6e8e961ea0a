#!/usr/bin/env bash
# `troupe train` on bad input: for each case the exit code is exactly 2, stderr is exactly one
# line naming the key or file at fault, and the output directory is not created. A bad key
# must also leave an existing output directory's files untouched.
# Usage: cli_bad_input.sh TROUPE
set -u
troupe=${1:?usage: cli_bad_input.sh TROUPE}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0

fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

# A corpus big enough for the tiny recipe below.
for i in $(seq 1 100); do echo "line $i of a small corpus for bad-input tests."; done >"$tmp/corpus.txt"

# write_recipe PATH [VAR=VALUE...]: the tiny valid recipe with the given values replaced (TOP is
# extra text before the first table, TAIL extra text at the end).
write_recipe() {
  local path=$1
  shift
  local TOP="" TAIL="" STEPS=2 SEQ_LEN=16 TRAIN="$tmp/corpus.txt" INIT=""
  local kv
  for kv in "$@"; do
    local k=${kv%%=*} v=${kv#*=}
    printf -v "$k" '%s' "$v"
  done
  cat >"$path" <<TOML
$TOP
steps = $STEPS
eval_interval = 1
eval_batches = 1
init = "$INIT"

[model]
vocab_size = 256
context = 16
layers = 1
heads = 2
width = 16

[data]
format = "text"
train = "$TRAIN"
val_fraction = 0.1

[batch]
micro_batch = 2
seq_len = $SEQ_LEN

[output]
dir = "$tmp/default-out"
$TAIL
TOML
}

# expect_bad NAME NEEDLE... -- ARGS...: runs `troupe train ARGS --set output.dir=$tmp/out-NAME`
# and checks exit 2, one stderr line containing every NEEDLE, no output dir.
expect_bad() {
  local name=$1
  shift
  local needles=()
  while [[ $1 != -- ]]; do
    needles+=("$1")
    shift
  done
  shift
  local out="$tmp/out-$name"
  local before=$failures
  local rc=0
  "$troupe" train "$@" --set "output.dir=$out" >"$tmp/$name.stdout" 2>"$tmp/$name.stderr" || rc=$?
  local err
  err=$(cat "$tmp/$name.stderr")
  if [[ $rc -ne 2 ]]; then
    fail "$name: exit code $rc, expected 2 (stderr: $err)"
  fi
  local lines
  lines=$(wc -l <"$tmp/$name.stderr")
  if [[ $lines -ne 1 || -z $err || $(tail -c 1 "$tmp/$name.stderr" | od -An -c | tr -d ' ') != '\n' ]]; then
    fail "$name: stderr is not exactly one line: [$err]"
  fi
  local n
  for n in "${needles[@]}"; do
    if [[ $err != *"$n"* ]]; then
      fail "$name: stderr does not name '$n': [$err]"
    fi
  done
  if [[ -e $out ]]; then
    fail "$name: output dir $out was created"
  fi
  if [[ -e $tmp/default-out ]]; then
    fail "$name: the recipe's own output dir was created"
  fi
  [[ $failures -eq $before ]] && echo "ok: $name: $err"
}

# A valid recipe first: the fixture itself must pass the checks (1 step, to a scratch dir).
write_recipe "$tmp/valid.toml"
if ! "$troupe" train "$tmp/valid.toml" --set steps=1 --set "output.dir=$tmp/valid-out" \
  >"$tmp/valid.stdout" 2>"$tmp/valid.stderr"; then
  fail "the valid fixture recipe failed: $(cat "$tmp/valid.stderr")"
fi

write_recipe "$tmp/unknown.toml" 'TOP=colour = "blue"'
expect_bad unknown-key colour -- "$tmp/unknown.toml"

write_recipe "$tmp/nested-unknown.toml" 'TAIL=[model2]
x = 1'
expect_bad nested-unknown-key model2.x -- "$tmp/nested-unknown.toml"

write_recipe "$tmp/type.toml" 'STEPS="six"'
expect_bad wrong-type steps -- "$tmp/type.toml"

write_recipe "$tmp/shape.toml" SEQ_LEN=32
expect_bad seq-len-over-context batch.seq_len -- "$tmp/shape.toml"

write_recipe "$tmp/nodata.toml" "TRAIN=$tmp/no-such-corpus.txt"
expect_bad missing-data data.train no-such-corpus.txt -- "$tmp/nodata.toml"

write_recipe "$tmp/noinit.toml" "INIT=$tmp/no-such-weights.safetensors"
expect_bad missing-init init no-such-weights.safetensors -- "$tmp/noinit.toml"

printf 'not a safetensors file' >"$tmp/garbage.safetensors"
write_recipe "$tmp/badinit.toml" "INIT=$tmp/garbage.safetensors"
expect_bad corrupt-init init garbage.safetensors -- "$tmp/badinit.toml"

printf 'tiny' >"$tmp/tiny.txt"
write_recipe "$tmp/tinydata.toml" "TRAIN=$tmp/tiny.txt"
expect_bad corpus-too-small data.train -- "$tmp/tinydata.toml"

write_recipe "$tmp/ok.toml"
expect_bad set-unknown-key optimizer.momentum -- "$tmp/ok.toml" --set optimizer.momentum=0.9
expect_bad set-malformed steps -- "$tmp/ok.toml" --set steps
expect_bad set-wrong-type steps -- "$tmp/ok.toml" --set steps=many
expect_bad threads-zero --threads -- "$tmp/ok.toml" --threads 0
expect_bad set-bad-enum optimizer.decay -- "$tmp/ok.toml" --set optimizer.decay=step
expect_bad missing-recipe no-such-recipe.toml -- "$tmp/no-such-recipe.toml"
# Nonsensical parallel layouts are refused up front, naming the key.
expect_bad pp-over-layers parallel.pp -- "$tmp/ok.toml" --set parallel.pp=9
expect_bad pp-zero parallel.pp -- "$tmp/ok.toml" --set parallel.pp=0
expect_bad unknown-schedule parallel.schedule 2f2b -- "$tmp/ok.toml" --set parallel.schedule=2f2b
expect_bad interleaved-without-chunks parallel.schedule -- "$tmp/ok.toml" \
  --set model.layers=4 --set parallel.pp=2 --set parallel.schedule=interleaved_1f1b \
  --set parallel.micro_batches=2
expect_bad chunks-without-interleaving parallel.schedule -- "$tmp/ok.toml" \
  --set model.layers=4 --set parallel.pp=1 --set parallel.virtual_stages=2
expect_bad split-wrong-sum parallel.layer_split -- "$tmp/ok.toml" \
  --set model.layers=4 --set parallel.pp=2 --set "parallel.layer_split=[1,2]"
expect_bad split-wrong-length parallel.layer_split -- "$tmp/ok.toml" \
  --set model.layers=4 --set parallel.pp=2 --set "parallel.layer_split=[4]"
expect_bad split-wrong-type parallel.layer_split -- "$tmp/ok.toml" \
  --set "parallel.layer_split=[1.5]"
expect_bad dp-zero parallel.dp -- "$tmp/ok.toml" --set parallel.dp=0
expect_bad micro-batches-zero parallel.micro_batches -- "$tmp/ok.toml" --set parallel.micro_batches=0
expect_bad tp-heads parallel.tp model.heads -- "$tmp/ok.toml" --set parallel.tp=3
# Devices and number formats: bf16 / fp16 need the GPU, fp16 needs dynamic loss scaling, the GPU
# attention kernel's head sizes, and the actor engine runs on CPUs.
expect_bad bad-device device tpu -- "$tmp/ok.toml" --set device=tpu
expect_bad bf16-on-cpu precision.dtype cuda -- "$tmp/ok.toml" --set precision.dtype=bf16
expect_bad fp16-without-scaling precision.loss_scale dynamic -- "$tmp/ok.toml" --device cuda \
  --set model.width=32 --set precision.dtype=fp16
expect_bad gpu-head-size model.heads "head size 8" -- "$tmp/ok.toml" --device cuda \
  --set kernels.attention=fused
expect_bad gpu-cudnn-head-size model.heads "head size 20" -- "$tmp/ok.toml" --device cuda \
  --set kernels.attention=cudnn --set precision.dtype=bf16 --set model.width=40 --set model.heads=2
expect_bad gpu-cudnn-fp32 kernels.attention "bf16 or fp16" -- "$tmp/ok.toml" --device cuda \
  --set kernels.attention=cudnn

# An existing output dir with a previous run's weights: a bad key leaves them untouched.
before_failures=$failures
mkdir -p "$tmp/prev"
head -c 4096 /dev/urandom >"$tmp/prev/final.safetensors"
before=$(sha256sum <"$tmp/prev/final.safetensors")
rc=0
"$troupe" train "$tmp/unknown.toml" --set "output.dir=$tmp/prev" >"$tmp/prev.stdout" \
  2>"$tmp/prev.stderr" || rc=$?
[[ $rc -eq 2 ]] || fail "existing-output: exit code $rc, expected 2"
[[ $(wc -l <"$tmp/prev.stderr") -eq 1 ]] || fail "existing-output: stderr not one line"
grep -q colour "$tmp/prev.stderr" || fail "existing-output: stderr does not name colour"
[[ $(sha256sum <"$tmp/prev/final.safetensors") == "$before" ]] ||
  fail "existing-output: final.safetensors was modified"
[[ $(ls -A "$tmp/prev") == final.safetensors ]] ||
  fail "existing-output: files were added: $(ls -A "$tmp/prev")"
[[ $failures -eq $before_failures ]] && echo "ok: existing-output"

# The GPU benchmark where no GPU can train (a build without CUDA, or no device): exit 1 and one
# line saying why. Where a GPU is usable it runs (a tiny case) and must succeed.
before_failures=$failures
rc=0
"$troupe" bench train-step --device cuda --no-peer --batch 1 --seq 16 --layers 1 --steps 1 \
  --warmup 0 >"$tmp/gpu.stdout" 2>"$tmp/gpu.stderr" || rc=$?
if [[ $rc -ne 0 ]]; then
  [[ $rc -eq 1 ]] || fail "bench-no-gpu: exit code $rc, expected 1"
  [[ $(wc -l <"$tmp/gpu.stderr") -eq 1 ]] || fail "bench-no-gpu: stderr not one line"
  grep -q -- "--device cuda: " "$tmp/gpu.stderr" || fail "bench-no-gpu: stderr does not say why"
fi
[[ $failures -eq $before_failures ]] && echo "ok: bench-no-gpu (exit $rc: $(cat "$tmp/gpu.stderr"))"

# An unknown command: exit 2 and one line naming it.
before_failures=$failures
rc=0
"$troupe" frobnicate "$tmp/ok.toml" >"$tmp/unknown-command.stdout" 2>"$tmp/unknown-command.stderr" || rc=$?
[[ $rc -eq 2 ]] || fail "unknown-command: exit code $rc, expected 2"
[[ $(wc -l <"$tmp/unknown-command.stderr") -eq 1 ]] || fail "unknown-command: stderr not one line"
grep -q "unknown command 'frobnicate'" "$tmp/unknown-command.stderr" ||
  fail "unknown-command: stderr does not name the command"
[[ $failures -eq $before_failures ]] && echo "ok: unknown-command: $(cat "$tmp/unknown-command.stderr")"

# `troupe train --device cuda` where no GPU can train: exit 1, one line saying why, nothing
# written. Where a GPU is usable it trains the tiny recipe and must succeed.
before_failures=$failures
rc=0
"$troupe" train "$tmp/ok.toml" --device cuda --set model.width=32 --set steps=1 \
  --set "output.dir=$tmp/gpu-train-out" >"$tmp/gpu-train.stdout" 2>"$tmp/gpu-train.stderr" || rc=$?
if [[ $rc -ne 0 ]]; then
  [[ $rc -eq 1 ]] || fail "train-no-gpu: exit code $rc, expected 1"
  [[ $(wc -l <"$tmp/gpu-train.stderr") -eq 1 ]] || fail "train-no-gpu: stderr not one line"
  grep -q -- "--device cuda: " "$tmp/gpu-train.stderr" || fail "train-no-gpu: stderr does not say why"
  [[ ! -e $tmp/gpu-train-out ]] || fail "train-no-gpu: the output dir was created"
fi
[[ $failures -eq $before_failures ]] &&
  echo "ok: train-no-gpu (exit $rc: $(head -c 200 "$tmp/gpu-train.stderr"))"

if [[ $failures -ne 0 ]]; then
  echo "$failures failure(s)" >&2
  exit 1
fi
echo "all bad-input cases passed"
