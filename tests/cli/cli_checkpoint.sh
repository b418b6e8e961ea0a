#!/usr/bin/env bash
# Checkpoints, resume and recovery with real processes, real signals and real files
# (docs/checkpoints.md):
#  - a job of 4 processes (PP=2 x DP=2, ZeRO-1) under `troupe launch --max-restarts`, with
#    processes killed (SIGKILL) at random times: warm-up, steady state, during checkpoint writes.
#    The launcher restarts it from its last committed checkpoint each time; its metrics and
#    final weights equal the run that was never killed, bitwise;
#  - a damaged newest checkpoint: `troupe ckpt verify` names the file and both checksums,
#    `troupe train --resume` says so, falls back to the previous one and still ends bitwise;
#  - processes that would resume different checkpoints: refused at the rendezvous, each naming
#    both, before any step;
#  - `troupe ckpt ls` and `export`; bad input (nothing to resume, a fresh run over another run's
#    checkpoints) is one line and exit 2; more restarts than allowed is exit 3 with a report;
#  - hangs: a stage stuck in an action (the watchdog names it) and a SIGSTOPped process (lost
#    after --peer-timeout); the launcher restarts the job and it ends bitwise as before.
# Usage: cli_checkpoint.sh TROUPE
set -euo pipefail
troupe=${1:?usage: cli_checkpoint.sh TROUPE}
py=/usr/bin/python3
tmp=$(mktemp -d)
killer=""
cleanup() {
  [ -n "$killer" ] && kill "$killer" 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  exit 1
}

words=(the quick brown fox jumps over lazy dog while a small model learns to count)
for i in $(seq 1 400); do
  echo "sentence $i: ${words[$((i % 15))]} ${words[$(((i * 7) % 15))]} ${words[$(((i * 3) % 15))]}."
done >"$tmp/corpus.txt"

cat >"$tmp/recipe.toml" <<TOML
seed = 5
steps = 200
eval_interval = 40
eval_batches = 2

[model]
vocab_size = 256
context = 32
layers = 4
heads = 2
width = 32

[data]
format = "text"
train = "$tmp/corpus.txt"
val_fraction = 0.1
order = "random"

[batch]
micro_batch = 2
seq_len = 32

[parallel]
pp = 2
dp = 2
zero = 1
micro_batches = 2

[checkpoint]
every = 7
keep = 2

[output]
dir = "$tmp/run"
TOML

common=(--threads 1 --peer-timeout 5)

# 1. The run that is never killed.
"$troupe" launch --nproc 4 -- train "$tmp/recipe.toml" "${common[@]}" --set "output.dir=$tmp/through" \
  >"$tmp/through.log" 2>&1 || { cat "$tmp/through.log" >&2; fail "the uninterrupted run"; }
"$troupe" ckpt ls "$tmp/through/checkpoints" >"$tmp/ls.out" || fail "ckpt ls"
grep -q "^step-00000196  step 196  ok  .*pp 2 x dp 2, zero 1" "$tmp/ls.out" || { cat "$tmp/ls.out" >&2; fail "ckpt ls: no step 196"; }
[ "$(wc -l <"$tmp/ls.out")" -eq 2 ] || fail "checkpoint.keep = 2 kept $(wc -l <"$tmp/ls.out")"
# Several processes write format 2: each stage its own part, no whole-model file.
for part in part-000-000 part-000-001 part-001-000 part-001-001; do
  [ -f "$tmp/through/checkpoints/step-00000196/$part.safetensors" ] || fail "no $part in step 196"
done
[ ! -e "$tmp/through/checkpoints/step-00000196/model.safetensors" ] || fail "a whole-model file"

# 2. The same job, killed at random times, restarted by the launcher.
"$troupe" launch --nproc 4 --max-restarts 8 --restart-window 600 --grace 2 -- \
  train "$tmp/recipe.toml" "${common[@]}" --set "output.dir=$tmp/killed" \
  >"$tmp/killed.log" 2>&1 &
launcher=$!
(
  RANDOM=$$
  for tenths in 3 10 14; do  # 0.3-1.0 s, then 1.0-1.7 s, then 1.4-2.1 s later
    # From the second kill on, once a checkpoint is committed (at most 60 s): on a slow machine
    # (a sanitizer build) every kill could otherwise come before the first one, and no restart
    # would have a checkpoint to resume from.
    if [ "$tenths" -gt 3 ]; then
      for _ in $(seq 1 600); do
        compgen -G "$tmp/killed/checkpoints/step-*/manifest.json" >/dev/null && break
        sleep 0.1
      done
    fi
    d=$((tenths + RANDOM % 8))
    sleep "$((d / 10)).$((d % 10))"
    victims=$(pgrep -P "$launcher" || true)
    [ -n "$victims" ] || continue
    victim=$(echo "$victims" | shuf -n 1)
    echo "killing $victim" >>"$tmp/kills.log"
    kill -9 "$victim" 2>/dev/null || true
  done
) &
killer=$!
wait "$launcher" || { cat "$tmp/killed.log" >&2; fail "the killed job did not recover (exit $?)"; }
wait "$killer" || true
killer=""
restarts=$(grep -c "restarting the job" "$tmp/killed.log" || true)
kills=$(grep -c killing "$tmp/kills.log" 2>/dev/null || true)
echo "killed $kills processes; the launcher restarted the job $restarts times"
[ "$restarts" -ge 1 ] || { cat "$tmp/killed.log" >&2; fail "nothing was restarted"; }
grep -q "resuming from" "$tmp/killed.log" || fail "no restart resumed from a checkpoint"

same_run() {  # same_run A B: every step's loss, norm and validation loss; the final weights
  "$py" - "$1/metrics.jsonl" "$2/metrics.jsonl" <<'PY' || fail "$2 differs from $1"
import json, sys
a, b = ([json.loads(l) for l in open(p)] for p in sys.argv[1:3])
assert [r["step"] for r in b] == list(range(1, len(a) + 1)), [r["step"] for r in b]
for x, y in zip(a, b):
    for k in ("loss", "grad_norm", "val_loss", "lr", "tokens"):
        assert x.get(k) == y.get(k), (x["step"], k, x.get(k), y.get(k))
print(f"{sys.argv[2]}: {len(b)} steps identical")
PY
  cmp "$1/final.safetensors" "$2/final.safetensors" || fail "$2: final weights differ"
}
same_run "$tmp/through" "$tmp/killed"

# 3. A damaged newest checkpoint: named, passed over, and the run still ends bitwise.
mkdir -p "$tmp/damaged"
cp -r "$tmp/through/checkpoints" "$tmp/damaged/"
newest="$tmp/damaged/checkpoints/step-00000196"
printf '\x55' | dd of="$newest/part-000-001.safetensors" bs=1 seek=4000 conv=notrunc status=none
if "$troupe" ckpt verify "$tmp/damaged/checkpoints" >"$tmp/verify.out" 2>&1; then
  fail "ckpt verify passed a damaged checkpoint"
fi
grep -q "step-00000196/part-000-001.safetensors: xxh64 [0-9a-f]*, the manifest says [0-9a-f]*" "$tmp/verify.out" ||
  { cat "$tmp/verify.out" >&2; fail "ckpt verify did not name the file and checksums"; }
grep -q "step-00000189: ok" "$tmp/verify.out" || fail "ckpt verify: step 189"
"$troupe" train "$tmp/recipe.toml" "${common[@]}" --set "output.dir=$tmp/damaged" --resume \
  >"$tmp/damaged.log" 2>&1 || { cat "$tmp/damaged.log" >&2; fail "resume past a damaged checkpoint"; }
grep -q "step-00000196 is unusable: .*part-000-001.safetensors: xxh64" "$tmp/damaged.log" ||
  { cat "$tmp/damaged.log" >&2; fail "resume did not say which checkpoint was unusable"; }
grep -q "falling back to step-00000189" "$tmp/damaged.log" || fail "no fallback line"
"$py" - "$tmp/through/metrics.jsonl" "$tmp/damaged/metrics.jsonl" <<'PY' || fail "damaged: metrics differ"
import json, sys
a, b = ([json.loads(l) for l in open(p)] for p in sys.argv[1:3])
b = {r["step"]: r for r in b}
for x in a[189:]:
    y = b[x["step"]]
    assert (x["loss"], x["grad_norm"]) == (y["loss"], y["grad_norm"]), x["step"]
PY
cmp "$tmp/through/final.safetensors" "$tmp/damaged/final.safetensors" || fail "damaged: final weights"

# 3b. Processes that would resume different checkpoints (each sees a checkpoint.dir of its own,
# and rank 1's newest is damaged, so it falls back): the rendezvous refuses the job before any
# step, both processes naming both checkpoints; no checkpoint is written.
mkdir -p "$tmp/mismatch0" "$tmp/mismatch1"
cp -r "$tmp/through/checkpoints" "$tmp/mismatch0/"
cp -r "$tmp/through/checkpoints" "$tmp/mismatch1/"
printf '\x55' | dd of="$tmp/mismatch1/checkpoints/step-00000196/part-000-001.safetensors" bs=1 \
  seek=4000 conv=notrunc status=none
port=$((20000 + RANDOM % 12000))
for tries in $(seq 1 50); do
  "$py" -c 'import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))' "$port" 2>/dev/null && break
  port=$((port >= 32700 ? 20000 : port + 1))
done
pids=()
for r in 0 1; do
  RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    TROUPE_JOB_TOKEN=cli-mismatch timeout -k 5 120 "$troupe" train "$tmp/recipe.toml" \
    "${common[@]}" --set parallel.dp=1 --set parallel.micro_batches=4 \
    --set "output.dir=$tmp/mismatch$r" \
    --resume "$tmp/mismatch$r/checkpoints" >"$tmp/mismatch.$r.log" 2>&1 &
  pids+=($!)
done
for r in 0 1; do
  if wait "${pids[$r]}"; then fail "rank $r of a job resuming two checkpoints succeeded"; fi
done
line="rank 1 resumes step-00000189 (manifest xxh64 [0-9a-f]*), but rank 0 resumes step-00000196 (manifest xxh64 [0-9a-f]*): every process must resume the same checkpoint"
for r in 0 1; do
  grep -q "$line" "$tmp/mismatch.$r.log" ||
    { cat "$tmp/mismatch.$r.log" >&2; fail "rank $r did not name both checkpoints"; }
done
for r in 0 1; do
  [ "$(ls "$tmp/mismatch$r/checkpoints")" = "$(ls "$tmp/through/checkpoints")" ] ||
    fail "the refused job changed rank $r's checkpoints"
done
echo "3b: a job whose processes resume different checkpoints is refused, naming both"

# 4. Export: the weights of a checkpoint as a Hugging Face file; never over a file.
"$troupe" ckpt export "$tmp/through/checkpoints" "$tmp/exported.safetensors" >/dev/null || fail "export"
"$py" - "$tmp/exported.safetensors" <<'PY' || fail "export wrote no GPT-2 safetensors"
import json, struct, sys
b = open(sys.argv[1], "rb").read()
h = json.loads(b[8:8 + struct.unpack("<Q", b[:8])[0]])
assert "wte.weight" in h or "transformer.wte.weight" in h, list(h)[:5]
PY
if "$troupe" ckpt export "$tmp/through/checkpoints" "$tmp/exported.safetensors" 2>"$tmp/err"; then
  fail "export overwrote a file"
fi
# A step directory's parts, put together, and text from them.
"$troupe" ckpt export "$tmp/through/checkpoints/step-00000196" "$tmp/step196.safetensors" >/dev/null ||
  fail "export of a step"
cmp -s "$tmp/exported.safetensors" "$tmp/step196.safetensors" || fail "export: the root's newest is not step 196"
"$troupe" sample "$tmp/through/checkpoints" --prompt "The " --tokens 4 --temperature 0 \
  >"$tmp/sample.out" 2>"$tmp/sample.err" || { cat "$tmp/sample.err" >&2; fail "sample of parts"; }
[[ $(head -c 4 "$tmp/sample.out") == "The " ]] || fail "sample of parts: $(cat "$tmp/sample.out")"

# 5. Bad input: one line, exit 2.
expect_bad() {  # expect_bad WHAT PATTERN COMMAND...
  local what=$1 pattern=$2
  shift 2
  set +e
  "$@" >"$tmp/bad.out" 2>&1
  local rc=$?
  set -e
  [ "$rc" -eq 2 ] || { cat "$tmp/bad.out" >&2; fail "$what: exit $rc, expected 2"; }
  grep -q "$pattern" "$tmp/bad.out" || { cat "$tmp/bad.out" >&2; fail "$what: no '$pattern'"; }
  [ "$(wc -l <"$tmp/bad.out")" -eq 1 ] || { cat "$tmp/bad.out" >&2; fail "$what: more than one line"; }
}
expect_bad "a fresh run over checkpoints" "key checkpoint.dir.*--resume" \
  "$troupe" train "$tmp/recipe.toml" --set "output.dir=$tmp/through"
expect_bad "nothing to resume" "cannot resume" \
  "$troupe" train "$tmp/recipe.toml" --set "output.dir=$tmp/empty" --resume
expect_bad "steps fewer than the checkpoint has done" "nothing to run" \
  "$troupe" train "$tmp/recipe.toml" --set "output.dir=$tmp/through" --set steps=150 --resume

# 6. More failures than --max-restarts allows within the window: exit 3 and a report.
set +e
"$troupe" launch --nproc 2 --max-restarts 2 --restart-window 60 --grace 0 --program /bin/sh -- \
  -c 'exit 1' >"$tmp/giveup.out" 2>&1
rc=$?
set -e
[ "$rc" -eq 3 ] || { cat "$tmp/giveup.out" >&2; fail "restarts exhausted: exit $rc, expected 3"; }
[ "$(grep -c "restarting the job" "$tmp/giveup.out")" -eq 2 ] || fail "not restarted twice"
grep -q "giving up: the job failed 3 times within 60 s.*attempt 3" "$tmp/giveup.out" ||
  { cat "$tmp/giveup.out" >&2; fail "no report"; }
# 7. Hangs, in a 2-process pipeline: a stage stuck in one action (--test-stall) is reported by
#    the watchdog naming it, its action and micro-batch, and its process ends; a process stopped
#    by SIGSTOP is lost after --peer-timeout. Either way the launcher restarts the job, which ends
#    as the run that never hung.
small=(--set parallel.dp=1 --set parallel.zero=0 --set steps=40 --set checkpoint.every=4
  --set watchdog.action_timeout=2)
"$troupe" launch --nproc 2 -- train "$tmp/recipe.toml" "${common[@]}" "${small[@]}" \
  --set "output.dir=$tmp/small" >"$tmp/small.log" 2>&1 || { cat "$tmp/small.log" >&2; fail "small run"; }
"$troupe" launch --nproc 2 --max-restarts 2 --grace 1 -- train "$tmp/recipe.toml" "${common[@]}" \
  "${small[@]}" --set "output.dir=$tmp/stuck" --test-stall 1:10 >"$tmp/stuck.log" 2>&1 ||
  { cat "$tmp/stuck.log" >&2; fail "the stuck job did not recover"; }
grep -q "rank 1: error: watchdog: stage rank 1 replica 0 has been in [FB] of micro-batch [0-9] (virtual stage 1, step 10) for [0-9.]* s (watchdog.action_timeout 2.0 s); its last actions: " "$tmp/stuck.log" ||
  { cat "$tmp/stuck.log" >&2; fail "no watchdog report naming the stage, action and micro-batch"; }
grep -q "restarting the job" "$tmp/stuck.log" || fail "the stuck job was not restarted"
same_run "$tmp/small" "$tmp/stuck"
"$troupe" launch --nproc 2 --max-restarts 2 --grace 1 -- train "$tmp/recipe.toml" --threads 1 \
  --peer-timeout 2 "${small[@]}" --set "output.dir=$tmp/stopped" >"$tmp/stopped.log" 2>&1 &
launcher=$!
for _ in $(seq 1 200); do  # rank 1 is stopped once the job is past step 12
  [ "$(wc -l <"$tmp/stopped/metrics.jsonl" 2>/dev/null || echo 0)" -ge 12 ] && break
  sleep 0.05
done
[ "$(wc -l <"$tmp/stopped/metrics.jsonl")" -lt 40 ] || fail "the job ended before it could be stopped"
kill -STOP "$(pgrep -P "$launcher" | tail -n 1)"
wait "$launcher" || { cat "$tmp/stopped.log" >&2; fail "the job with a stopped process did not recover"; }
grep -q "rank 1 (.*) lost: no heartbeat" "$tmp/stopped.log" || { cat "$tmp/stopped.log" >&2; fail "no lost-rank report"; }
grep -q "restarting the job" "$tmp/stopped.log" || fail "the stopped job was not restarted"
same_run "$tmp/small" "$tmp/stopped"

echo "checkpoints: recovery from $kills kills bitwise; fallback past a damaged checkpoint; ckpt ls, verify, export; bad input; a stuck stage and a stopped process recovered"
