#!/usr/bin/env bash
# A job as separate processes equals the same job in one process: the parallel-equals-serial
# configurations of the actor engine run with one process per stage (torchrun-style variables),
# and with several stages per process, also with the update guard skipping and dynamic loss
# scaling; every step's loss, the validation losses and the final
# weights must be identical to the in-process run (tensor shards across processes included);
# likewise stages on device chunks of the host kind, whose payloads cross processes staged
# through host memory. Then failures: a killed rank (or tensor shard) is reported by
# rank 0 naming it within the heartbeat deadline and every process exits non-zero, one whose stage
# is stuck for good included (30 s after the failure); a process with
# the wrong job token or protocol version is refused and the job still completes.
# Usage: cli_multiprocess.sh TROUPE
set -euo pipefail
troupe=${1:?usage: cli_multiprocess.sh TROUPE}
py=/usr/bin/python3
tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT

words=(the quick brown fox jumps over lazy dog while a small model learns to count)
for i in $(seq 1 160); do
  echo "sentence $i: ${words[$((i % 15))]} ${words[$(((i * 7) % 15))]} ${words[$(((i * 3) % 15))]}."
done >"$tmp/corpus.txt"

cat >"$tmp/recipe.toml" <<TOML
seed = 11
steps = 5
eval_interval = 2
eval_batches = 4

[model]
vocab_size = 256
context = 16
layers = 4
heads = 2
width = 16

[data]
format = "text"
train = "$tmp/corpus.txt"
val_fraction = 0.2

[batch]
micro_batch = 2
seq_len = 16

[parallel]
pp = 1
dp = 1
micro_batches = 4

[optimizer]
warmup_steps = 2

[output]
dir = "$tmp/run"
TOML

# Rendezvous ports lie below Linux's ephemeral range (32768-60999), where no connection's local
# end or port-0 listener of a concurrent test can take one; each is checked free before use.
port=$((20000 + RANDOM % 12000))
next_port() {  # sets port to the next port a listener can bind now
  local tries
  for tries in $(seq 1 200); do
    port=$((port >= 32700 ? 20000 : port + 1))
    "$py" -c 'import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))' "$port" 2>/dev/null && return 0
  done
  echo "FAIL: no free TCP port in $tries tries" >&2
  exit 1
}
# run_job NAME WORLD ARGS...: WORLD processes of one job; fails unless all exit 0.
run_job() {
  local name=$1 world=$2
  shift 2
  next_port
  local r rc=0
  local job=()
  for ((r = world - 1; r >= 0; r--)); do
    RANK=$r WORLD_SIZE=$world LOCAL_RANK=$r LOCAL_WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 \
      MASTER_PORT=$port TROUPE_JOB_TOKEN=cli-$name \
      timeout 120 "$troupe" train "$tmp/recipe.toml" --set "output.dir=$tmp/$name" \
      --rendezvous-timeout 60 "$@" >"$tmp/$name.$r.log" 2>&1 &
    job+=($!)
  done
  pids+=("${job[@]}")
  for p in "${job[@]}"; do wait "$p" || rc=$?; done
  if [[ $rc -ne 0 ]]; then
    echo "FAIL: $name: a process exited $rc" >&2
    tail -n 5 "$tmp/$name".*.log >&2
    exit 1
  fi
}

compare() {  # compare A B: identical losses, validation losses and weights
  "$py" - "$tmp/$1" "$tmp/$2" <<'PY'
import json, sys
a, b = sys.argv[1], sys.argv[2]
def rows(d):
    return [json.loads(l) for l in open(d + "/metrics.jsonl")]
ra, rb = rows(a), rows(b)
assert len(ra) == len(rb) > 0, (len(ra), len(rb))
for x, y in zip(ra, rb):
    for k in ("loss", "grad_norm", "val_loss", "skipped", "loss_scale"):
        assert x.get(k) == y.get(k), f"step {x['step']}: {k} {x.get(k)} vs {y.get(k)}"
wa = open(a + "/final.safetensors", "rb").read()
wb = open(b + "/final.safetensors", "rb").read()
assert wa == wb, "final weights differ"
print(f"{b}: {len(rb)} steps identical to {a}")
PY
}

compare_close() {  # compare_close A B: B's losses within 1e-5 relative of A's (ZeRO vs DDP)
  "$py" - "$tmp/$1" "$tmp/$2" <<'PY'
import json, sys
a, b = sys.argv[1], sys.argv[2]
ra = [json.loads(l) for l in open(a + "/metrics.jsonl")]
rb = [json.loads(l) for l in open(b + "/metrics.jsonl")]
assert len(ra) == len(rb) > 0, (len(ra), len(rb))
for x, y in zip(ra, rb):
    assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(x["loss"]), f"step {x['step']}: {x['loss']} vs {y['loss']}"
print(f"{b}: {len(rb)} steps within 1e-5 of {a}")
PY
}

configs=(
  "pp2 2 --set parallel.pp=2"
  "pp2dp2 4 --set parallel.pp=2 --set parallel.dp=2"
  "pp4v2 4 --set parallel.pp=4 --set parallel.schedule=interleaved_1f1b --set parallel.virtual_stages=2 --set model.layers=8"
  "pp2dp2zb 4 --set parallel.pp=2 --set parallel.dp=2 --set parallel.schedule=zb_h1 --set batch.grad_accum=2"
  "dp4 4 --set parallel.dp=4"
  "pp4gpipe 4 --set parallel.pp=4 --set parallel.schedule=gpipe --set parallel.layer_split=[1,1,1,2] --set model.layers=5"
  "pp2dp2x2 2 --set parallel.pp=2 --set parallel.dp=2"
  "pp2dp2guard 4 --set parallel.pp=2 --set parallel.dp=2 --set parallel.zero=2 --set precision.loss_scale=dynamic --set precision.init_scale=1e40 --set precision.backoff_factor=1e-4 --set guard.window=2 --set guard.grad_norm_zscore=0.5"
  # Tensor shards across processes: each shard its own process; a rank's group within one
  # process and another's across two; shards sharing a process with DP and ZeRO across them.
  "tp2 2 --set parallel.tp=2"
  "pp2tp2 4 --set parallel.pp=2 --set parallel.tp=2"
  "pp3tp2 2 --set parallel.pp=3 --set parallel.tp=2 --set model.layers=3"
  "pp2dp2tp2z1 4 --set parallel.pp=2 --set parallel.dp=2 --set parallel.tp=2 --set parallel.zero=1"
  "dp2tp2z3zb 4 --set parallel.dp=2 --set parallel.tp=2 --set parallel.zero=3 --set parallel.schedule=zb_h1"
)
# same_as_one_process NAME WORLD ARGS...: the job in one process, then as WORLD processes (with
# multi_args added); both must give identical losses, validation losses and weights.
multi_args=()
same_as_one_process() {
  local name=$1 world=$2
  shift 2
  "$troupe" train "$tmp/recipe.toml" --set "output.dir=$tmp/$name-one" "$@" \
    >"$tmp/$name-one.log" 2>&1 || { echo "FAIL: in-process $name" >&2; cat "$tmp/$name-one.log" >&2; exit 1; }
  run_job "$name" "$world" "$@" "${multi_args[@]}"
  compare "$name-one" "$name"
}

for c in "${configs[@]}"; do
  read -r -a f <<<"$c"
  same_as_one_process "${f[@]}"
done
# The update guard ran across processes: the overflowing first step was skipped there too.
grep -q '"skipped":"non-finite gradient norm' "$tmp/pp2dp2guard/metrics.jsonl" || {
  echo "FAIL: the guard skipped nothing across processes" >&2; cat "$tmp/pp2dp2guard/metrics.jsonl" >&2; exit 1; }

# Stages on device chunks of the host kind (--test-chunks host: the GPU pipeline's protocol on
# the CPU engine's arithmetic) across processes: activations, gradients and the tied wte between
# processes, and (DP) the gradient buckets of the ring reducer, staged through host memory inside
# the messages; links between the ranks of one process; ZeRO-1/2's shards in host memory, their
# ring between processes. Identical to the one-process CPU run.
device_layouts=(
  "hpp2 2 --set parallel.pp=2"
  "hdp2 2 --set parallel.dp=2"
  "hpp2dp2 4 --set parallel.pp=2 --set parallel.dp=2"
  "hpp2dp2x2 2 --set parallel.pp=2 --set parallel.dp=2"
  "hpp4v2 2 --set parallel.pp=4 --set parallel.schedule=interleaved_1f1b --set parallel.virtual_stages=2 --set model.layers=8"
  "hpp2dp2zb 4 --set parallel.pp=2 --set parallel.dp=2 --set parallel.schedule=zb_h1 --set batch.grad_accum=2"
  "hdp2z1 2 --set parallel.dp=2 --set parallel.zero=1"
  "hpp2dp2z2 4 --set parallel.pp=2 --set parallel.dp=2 --set parallel.zero=2"
  "hpp2dp2z3 4 --set parallel.pp=2 --set parallel.dp=2 --set parallel.zero=3"
  "htp2 2 --set parallel.tp=2"
  "hpp2tp2 4 --set parallel.pp=2 --set parallel.tp=2 --set parallel.schedule=zb_h1"
  "hdp2tp2z2 4 --set parallel.dp=2 --set parallel.tp=2 --set parallel.zero=2"
)
multi_args=(--test-chunks host)
for c in "${device_layouts[@]}"; do
  read -r -a f <<<"$c"
  same_as_one_process "${f[@]}"
  grep -q "device stages: host chunks" "$tmp/${f[0]}.0.log" || {
    echo "FAIL: ${f[0]} ran no device stages" >&2; cat "$tmp/${f[0]}.0.log" >&2; exit 1; }
done
multi_args=()

# ZeRO through the devices' groups (parallel.zero_on_device) on those chunks: each replica's
# owned chunks travel as messages between processes (topology/zero_exchange.hpp), or meet in
# one process's group, in the order stage invariant S8 keeps (the group refuses another order);
# no host shard, no host copy: every rank's "buffers" 0 under ZeRO-1/2; under ZeRO-3 the buckets
# gathered at once, fewer than all, and no pooled host pages. Identical to the one-process CPU
# run with ZeRO's host shards (NAME WORLD REFERENCE ARGS...).
zero_device_layouts=(
  "hdp2z1d 2 hdp2z1 --set parallel.dp=2 --set parallel.zero=1"
  "hpp2dp2z2d 4 hpp2dp2z2 --set parallel.pp=2 --set parallel.dp=2 --set parallel.zero=2"
  "hpp2dp2z1zbd 4 hpp2dp2z1zb --set parallel.pp=2 --set parallel.dp=2 --set parallel.zero=1 --set parallel.schedule=zb_h1 --set batch.grad_accum=2"
  "hpp2dp2z1x2d 2 hpp2dp2z1x2 --set parallel.pp=2 --set parallel.dp=2 --set parallel.zero=1"
  "hdp2tp2z2d 4 hdp2tp2z2 --set parallel.dp=2 --set parallel.tp=2 --set parallel.zero=2"
  "hpp2dp2z3d 4 hpp2dp2z3 --set parallel.pp=2 --set parallel.dp=2 --set parallel.zero=3"
  "hdp2z3zbd 2 hdp2z3zb --set parallel.dp=2 --set parallel.zero=3 --set parallel.pp=2 --set parallel.schedule=zb_h1"
)
for c in "${zero_device_layouts[@]}"; do
  read -r -a f <<<"$c"
  name=${f[0]} world=${f[1]} ref=${f[2]}
  if [[ ! -d $tmp/$ref-one ]]; then
    "$troupe" train "$tmp/recipe.toml" --set "output.dir=$tmp/$ref-one" "${f[@]:3}" \
      >"$tmp/$ref-one.log" 2>&1 || { echo "FAIL: in-process $ref" >&2; cat "$tmp/$ref-one.log" >&2; exit 1; }
  fi
  run_job "$name" "$world" "${f[@]:3}" --set parallel.zero_on_device=true --test-chunks host
  compare "$ref-one" "$name"
  "$py" - "$tmp/$name/metrics.jsonl" <<'PY' || exit 1
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
mem = [m for r in rows if "memory" in r for m in r["memory"]]
zero3 = "z3" in sys.argv[1]
def wrong(m):
    if zero3:
        return not 0 < m["buffers"] < m["gradients"] or m["pooled"]
    return m["buffers"]
bad = [m for m in mem if wrong(m)]
if not mem or bad:
    sys.exit(f"FAIL: {sys.argv[1]}: memory {bad[:4]}: not ZeRO through the devices' groups")
PY
done

# ZeRO-1/2/3 at DP=2 and DP=4, with PP=1 and PP=2, over 20 steps across processes: each is
# identical to the same job in one process, and within 1e-5 of DDP across processes. DP=3 splits
# no bucket evenly (uneven owned ranges, nothing padded).
zero_layouts=(
  "dp3 3 --set parallel.dp=3"
  "dp2 2 --set parallel.dp=2"
  "dp4 4 --set parallel.dp=4"
  "pp2dp2 4 --set parallel.pp=2 --set parallel.dp=2"
  "pp2dp4 8 --set parallel.pp=2 --set parallel.dp=4 --set parallel.schedule=zb_h1"
)
for c in "${zero_layouts[@]}"; do
  read -r -a f <<<"$c"
  layout=${f[0]} world=${f[1]}
  for z in 0 1 2 3; do
    name=z$z$layout-20
    same_as_one_process "$name" "$world" "${f[@]:2}" --set steps=20 --set parallel.zero=$z \
      --set parallel.zero_prefetch=$((z == 3 ? 1 + world % 3 : 1))
    [[ $z -eq 0 ]] || compare_close "z0$layout-20" "$name"
  done
done

# A killed rank: rank 0 names it within the heartbeat deadline; every process exits non-zero.
# The deadline is 5 s, not 2: meson runs tests side by side, and with four ranks and another
# test's processes on 2 cores a live rank's heartbeats can go unheard for 2 s, so rank 0 would
# name that rank before the killed one.
next_port
job=()
for r in 3 2 1 0; do
  RANK=$r WORLD_SIZE=4 LOCAL_RANK=$r LOCAL_WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    TROUPE_JOB_TOKEN=cli-kill timeout 120 "$troupe" train "$tmp/recipe.toml" \
    --set "output.dir=$tmp/kill" --set parallel.pp=2 --set parallel.dp=2 --set steps=1000000 \
    --set eval_interval=0 --peer-timeout 5 >"$tmp/kill.$r.log" 2>&1 &
  job+=($!)
done
pids+=("${job[@]}")
victim=${job[1]}  # `timeout` of rank 2; the troupe process is its child
for _ in $(seq 1 300); do
  [[ -f $tmp/kill/metrics.jsonl && $(wc -l <"$tmp/kill/metrics.jsonl") -ge 3 ]] && break
  sleep 0.2
done
kill -9 "$(pgrep -P "$victim")"
codes=()
for p in "${job[@]}"; do
  rc=0
  wait "$p" || rc=$?
  codes+=("$rc")
done
echo "exit codes (ranks 3 2 1 0): ${codes[*]}"
for rc in "${codes[@]}"; do
  [[ $rc -ne 0 && $rc -ne 124 ]] || { echo "FAIL: a process exited $rc after rank 2 was killed" >&2; tail -n 3 "$tmp"/kill.*.log >&2; exit 1; }
done
# The survivors end by reporting the loss, not by crashing (UCX aborts print a backtrace).
for r in 0 1 3; do
  ! grep -q "backtrace" "$tmp/kill.$r.log" || {
    echo "FAIL: rank $r crashed after rank 2 was killed" >&2; cat "$tmp/kill.$r.log" >&2; exit 1; }
done
# Missed heartbeats name it; so does UCX when rank 0 was fetching one of its frames over cma.
# On failure every rank's log is printed: which rank went quiet, and when, is the diagnosis.
grep -Eq "rank 2 \(.*\) lost: (no heartbeat|UCX error: endpoint error)" "$tmp/kill.0.log" || {
  echo "FAIL: rank 0 did not name the lost rank" >&2
  for r in 0 1 2 3; do echo "--- rank $r" >&2; cat "$tmp/kill.$r.log" >&2; done
  exit 1; }
grep -q "job ended: .*rank 2" "$tmp/kill.1.log" || {
  echo "FAIL: rank 1 did not report the end" >&2; cat "$tmp/kill.1.log" >&2; exit 1; }
grep "error" "$tmp/kill.0.log"

# A killed tensor shard: its peer in the other process, waiting in a collective, does not hang;
# rank 0 names the lost shard and both exit non-zero.
next_port
job=()
for r in 1 0; do
  RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    TROUPE_JOB_TOKEN=cli-tpkill timeout 120 "$troupe" train "$tmp/recipe.toml" \
    --set "output.dir=$tmp/tpkill" --set parallel.tp=2 --set steps=1000000 \
    --set eval_interval=0 --peer-timeout 5 >"$tmp/tpkill.$r.log" 2>&1 &
  job+=($!)
done
pids+=("${job[@]}")
for _ in $(seq 1 300); do
  [[ -f $tmp/tpkill/metrics.jsonl && $(wc -l <"$tmp/tpkill/metrics.jsonl") -ge 3 ]] && break
  sleep 0.2
done
kill -9 "$(pgrep -P "${job[0]}")"  # rank 1's troupe process
rc=0
wait "${job[1]}" || rc=$?
[[ $rc -ne 0 && $rc -ne 124 ]] || {
  echo "FAIL: rank 0 exited $rc after tensor shard 1 was killed" >&2; cat "$tmp/tpkill.0.log" >&2; exit 1; }
grep -Eq "tp 1 stopped.*rank 1 \(.*\) lost|rank 1 \(.*\) lost" "$tmp/tpkill.0.log" || {
  echo "FAIL: rank 0 did not name the lost shard's rank" >&2; cat "$tmp/tpkill.0.log" >&2; exit 1; }
grep "error" "$tmp/tpkill.0.log"

# A process whose stage is stuck for good (--test-stall: a thread that never returns, as one
# waiting on its device for a peer process that died) still ends when its job fails: 30 s after
# the failure it says so and exits 1, rather than waiting on the stuck thread.
next_port
job=()
for r in 1 0; do
  RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    TROUPE_JOB_TOKEN=cli-stuck timeout 120 "$troupe" train "$tmp/recipe.toml" \
    --set "output.dir=$tmp/stuck" --set parallel.pp=2 --set steps=1000000 --set eval_interval=0 \
    --peer-timeout 5 --test-stall 1:3 >"$tmp/stuck.$r.log" 2>&1 &
  job+=($!)
done
pids+=("${job[@]}")
for _ in $(seq 1 300); do  # steps 1 and 2 done: step 3's first action of rank 1 never ends
  [[ -f $tmp/stuck/metrics.jsonl && $(wc -l <"$tmp/stuck/metrics.jsonl") -ge 2 ]] && break
  sleep 0.2
done
sleep 1
kill -9 "$(pgrep -P "${job[1]}")"  # rank 0's troupe process
rc=0
wait "${job[0]}" || rc=$?
[[ $rc -eq 1 ]] || {
  echo "FAIL: the stuck rank 1 exited $rc after rank 0 was killed" >&2; cat "$tmp/stuck.1.log" >&2; exit 1; }
grep -q "rank 1: error: .*rank 0 (.*) lost.*; the teardown did not finish in 30 s" \
  "$tmp/stuck.1.log" || {
  echo "FAIL: the stuck rank 1 did not say why it ended" >&2; cat "$tmp/stuck.1.log" >&2; exit 1; }
grep "the teardown did not finish" "$tmp/stuck.1.log"

# A process with the wrong job token is refused with the reason; the job is not disturbed.
next_port
start_rank() {  # start_rank RANK TOKEN LOG
  RANK=$1 WORLD_SIZE=2 LOCAL_RANK=$1 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    TROUPE_JOB_TOKEN=$2 timeout 120 "$troupe" train "$tmp/recipe.toml" --set "output.dir=$tmp/tok" \
    --set parallel.pp=2 --rendezvous-timeout 60 >"$3" 2>&1
}
start_rank 0 right "$tmp/tok.0.log" &
rank0=$!
pids+=("$rank0")
rc=0
start_rank 1 wrong "$tmp/bad.log" || rc=$?
[[ $rc -ne 0 ]] || { echo "FAIL: a process with the wrong token joined" >&2; exit 1; }
grep -q "refused.*token" "$tmp/bad.log" || { echo "FAIL: refusal does not name the token" >&2; cat "$tmp/bad.log" >&2; exit 1; }
head -n 1 "$tmp/bad.log"
start_rank 1 right "$tmp/tok.1.log" || { echo "FAIL: rank 1 after the refusal" >&2; cat "$tmp/tok.1.log" >&2; exit 1; }
wait "$rank0" || { echo "FAIL: rank 0 after the refusal" >&2; cat "$tmp/tok.0.log" >&2; exit 1; }
compare pp2-one tok
echo "cli_multiprocess: ok"
