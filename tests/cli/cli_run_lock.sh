#!/usr/bin/env bash
# One job per directory and writes past a file size limit, with real `troupe train` processes
# (docs/checkpoints.md, "One job per directory" and "Recovery"):
#  - two jobs on one output.dir: the second is refused with exit 2 and one line naming the
#    holder (host, pid, since when, lock file), while the first is held stopped (SIGSTOP) so
#    that it cannot end before them; the first then ends normally with a whole, complete
#    metrics.jsonl; the same for a shared checkpoint.dir under two output.dirs, for a resume
#    that would set the holder's newer checkpoints aside, and for a fresh run into a held
#    checkpoint.dir that already holds checkpoints;
#  - a job killed by SIGKILL leaves a stale lock that the next run takes over with a notice,
#    also the restart of `troupe launch --max-restarts`;
#  - under `ulimit -f` a run ends with exit 1 and one line naming the file it could not write,
#    its metrics lines whole and no checkpoint committed.
# Every process is bounded (killed past its bound). Usage: cli_run_lock.sh TROUPE
set -u
troupe=${1:?usage: cli_run_lock.sh TROUPE}
py=/usr/bin/python3
[[ -x $py ]] || { echo "SKIP: no $py"; exit 77; }
tmp=$(mktemp -d)
started=()
cleanup() {
  local p
  for p in "${started[@]}"; do kill -KILL "$p" 2>/dev/null; done
  rm -rf "$tmp"
}
trap cleanup EXIT
failures=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}
export OMP_WAIT_POLICY=passive
# shellcheck source=tests/cli/tiny_recipe.sh
source "$(dirname "$0")/tiny_recipe.sh"
tiny_recipe "$tmp" "$tmp/out" 4000

# wait_lines FILE N: until FILE has N lines (at most 30 s).
wait_lines() {
  local i
  for i in $(seq 1 600); do
    [[ -f $1 && $(wc -l <"$1") -ge $2 ]] && return 0
    sleep 0.05
  done
  return 1
}

# wait_bounded PID SECONDS: waits for a background job; sets rc (137 if killed past the bound).
wait_bounded() {
  local i
  for i in $(seq 1 $(($2 * 20))); do
    kill -0 "$1" 2>/dev/null || break
    sleep 0.05
  done
  kill -KILL "$1" 2>/dev/null
  rc=0
  wait "$1" || rc=$?
}

# whole_metrics FILE N: every line is a JSON object, and their steps are 1..N.
whole_metrics() {
  "$py" - "$1" "$2" <<'PY'
import json, sys
steps = [json.loads(line)["step"] for line in open(sys.argv[1])]
assert steps == list(range(1, int(sys.argv[2]) + 1)), (len(steps), steps[:3], steps[-3:])
PY
}

# 1. Two jobs on one output.dir, then on one checkpoint.dir.
before=$failures
"$troupe" train "$tmp/recipe.toml" --set checkpoint.every=100000 --set "checkpoint.dir=$tmp/ck" \
  >"$tmp/first.out" 2>"$tmp/first.err" &
first=$!
started+=("$first")
wait_lines "$tmp/out/metrics.jsonl" 1 || fail "race: the first job wrote no metrics"
kill -STOP "$first" # it holds its directories while the others try (and cannot end meanwhile)
rc=0
timeout -s KILL 60 "$troupe" train "$tmp/recipe.toml" >"$tmp/second.out" 2>"$tmp/second.err" || rc=$?
err=$(cat "$tmp/second.err")
[[ $rc -eq 2 ]] || fail "race: the second job's exit code $rc, expected 2 ($err)"
[[ $(wc -l <"$tmp/second.err") -eq 1 ]] || fail "race: stderr is not one line: [$err]"
[[ $err == "troupe train: key output.dir: $tmp/out is in use by another job (host $(hostname), pid $first, since "*"; lock file $tmp/out/.troupe.lock): wait for it to end, or choose another output.dir" ]] ||
  fail "race: [$err]"
rc=0
timeout -s KILL 60 "$troupe" train "$tmp/recipe.toml" --set "output.dir=$tmp/out2" \
  --set checkpoint.every=100000 --set "checkpoint.dir=$tmp/ck" >/dev/null 2>"$tmp/third.err" || rc=$?
[[ $rc -eq 2 ]] || fail "race: the third job's exit code $rc, expected 2"
grep -q "^troupe train: key checkpoint.dir: $tmp/ck is in use by another job (host .*, pid $first, since .*; lock file $tmp/ck/.troupe.lock)" \
  "$tmp/third.err" || fail "race: shared checkpoint.dir: [$(cat "$tmp/third.err")]"
[[ ! -e $tmp/out2/metrics.jsonl ]] || fail "race: the refused job wrote metrics"
kill -CONT "$first"
wait_bounded "$first" 120
[[ $rc -eq 0 ]] || fail "race: the first job's exit code $rc ($(cat "$tmp/first.err"))"
whole_metrics "$tmp/out/metrics.jsonl" 4000 || fail "race: the first job's metrics.jsonl"
[[ ! -s $tmp/out/.troupe.lock && ! -s $tmp/ck/.troupe.lock ]] || fail "race: locks not released"
[[ $failures -eq $before ]] && echo "ok: a second job is refused: $err"

# A resume that would set newer checkpoints aside in a checkpoint.dir another job holds: refused
# before it moves any.
before=$failures
"$troupe" train "$tmp/recipe.toml" --set "output.dir=$tmp/p" --set checkpoint.every=20 \
  --set steps=1000 --set "checkpoint.dir=$tmp/ck2" >/dev/null 2>"$tmp/p.err" &
holder=$!
started+=("$holder")
for _ in $(seq 1 600); do # two committed: the oldest has a newer one to set aside
  [[ $(find "$tmp/ck2" -name manifest.json 2>/dev/null | wc -l) -ge 2 ]] && break
  sleep 0.05
done
kill -STOP "$holder"
oldest=$(find "$tmp/ck2" -name manifest.json | sort | head -n 1)
rc=0
timeout -s KILL 60 "$troupe" train "$tmp/recipe.toml" --set "output.dir=$tmp/q" \
  --set "checkpoint.dir=$tmp/ck2" --set checkpoint.every=20 --set steps=1000 \
  --resume "$(dirname "$oldest")" --set-aside-newer >/dev/null 2>"$tmp/q.err" || rc=$?
ls "$tmp/ck2" >"$tmp/ck2.list"
# A fresh run into the same checkpoint.dir: refused naming the job that holds it (not only that
# the directory holds checkpoints).
rc=0
timeout -s KILL 60 "$troupe" train "$tmp/recipe.toml" --set "output.dir=$tmp/r" \
  --set "checkpoint.dir=$tmp/ck2" --set checkpoint.every=20 >/dev/null 2>"$tmp/r.err" || rc=$?
kill -CONT "$holder"
[[ $rc -eq 2 ]] || fail "fresh over held checkpoints: exit code $rc, expected 2"
[[ $(wc -l <"$tmp/r.err") -eq 1 ]] &&
  grep -q "^troupe train: key checkpoint.dir: $tmp/ck2 is in use by another job (host .*, pid $holder," \
    "$tmp/r.err" || fail "fresh over held checkpoints: [$(cat "$tmp/r.err")]"
[[ $rc -eq 2 ]] || fail "set aside: exit code $rc, expected 2 ($(cat "$tmp/q.err"))"
grep -q "^troupe train: key checkpoint.dir: $tmp/ck2 is in use by another job (host .*, pid $holder," \
  "$tmp/q.err" || fail "set aside: [$(cat "$tmp/q.err")]"
! grep -q set-aside "$tmp/ck2.list" || fail "set aside: checkpoints were moved: $(cat "$tmp/ck2.list")"
wait_bounded "$holder" 120
[[ $rc -eq 0 ]] || fail "set aside: the holder's exit code $rc ($(cat "$tmp/p.err"))"
[[ $failures -eq $before ]] && echo "ok: --set-aside-newer in a held checkpoint.dir is refused"

# 2. A job killed by SIGKILL: the next run takes its stale lock over.
before=$failures
"$troupe" train "$tmp/recipe.toml" --set "output.dir=$tmp/killed" >/dev/null 2>&1 &
victim=$!
started+=("$victim")
wait_lines "$tmp/killed/metrics.jsonl" 1 || fail "kill: no metrics"
kill -KILL "$victim"
wait_bounded "$victim" 10
grep -q "\"pid\":$victim" "$tmp/killed/.troupe.lock" || fail "kill: no record of the killed job"
rc=0
timeout -s KILL 60 "$troupe" train "$tmp/recipe.toml" --set "output.dir=$tmp/killed" \
  --set steps=20 >"$tmp/next.out" 2>&1 || rc=$?
[[ $rc -eq 0 ]] || fail "kill: the next run's exit code $rc ($(cat "$tmp/next.out"))"
[[ $(grep -c "taking over the stale lock $tmp/killed/.troupe.lock (host $(hostname), pid $victim, since .*): process $victim is gone" "$tmp/next.out") -eq 1 ]] ||
  fail "kill: no takeover notice: [$(grep -v '^step' "$tmp/next.out")]"
whole_metrics "$tmp/killed/metrics.jsonl" 20 || fail "kill: the next run's metrics.jsonl"
[[ $failures -eq $before ]] && echo "ok: a stale lock is taken over"

# 3. troupe launch --max-restarts: the restarted job takes its killed predecessor's lock.
before=$failures
"$troupe" launch --nproc 1 --max-restarts 1 --grace 0 -- train "$tmp/recipe.toml" \
  --set "output.dir=$tmp/restarted" --set steps=2000 >"$tmp/launch.out" 2>&1 &
launcher=$!
started+=("$launcher")
wait_lines "$tmp/restarted/metrics.jsonl" 1 || fail "restart: no metrics"
kill -KILL "$(pgrep -P "$launcher" | head -n 1)"
wait_bounded "$launcher" 120
[[ $rc -eq 0 ]] || fail "restart: the launcher's exit code $rc ($(grep -v '^step' "$tmp/launch.out"))"
grep -q "killed by SIGKILL (Killed)" "$tmp/launch.out" || fail "restart: the kill is not named"
grep -q "taking over the stale lock $tmp/restarted/.troupe.lock" "$tmp/launch.out" ||
  fail "restart: no takeover: [$(grep -v '^step' "$tmp/launch.out")]"
whole_metrics "$tmp/restarted/metrics.jsonl" 2000 || fail "restart: metrics.jsonl"
[[ $failures -eq $before ]] && echo "ok: a restarted job takes its predecessor's lock"

# 4. A file size limit: the metrics file, then a checkpoint file, is the one named.
before=$failures
rc=0
(ulimit -f 20 && exec timeout -s KILL 60 "$troupe" train "$tmp/recipe.toml" \
  --set "output.dir=$tmp/big" --set steps=400) >/dev/null 2>"$tmp/big.err" || rc=$?
[[ $rc -eq 1 ]] || fail "ulimit: exit code $rc, expected 1"
[[ $(cat "$tmp/big.err") == "troupe train: error: $tmp/big/metrics.jsonl: write failed: File too large" ]] ||
  fail "ulimit: stderr [$(cat "$tmp/big.err")]"
"$py" -c 'import json, sys; [json.loads(l) for l in open(sys.argv[1])]' "$tmp/big/metrics.jsonl" ||
  fail "ulimit: a metrics line is not whole"
rc=0
(ulimit -f 40 && exec timeout -s KILL 60 "$troupe" train "$tmp/recipe.toml" \
  --set "output.dir=$tmp/bigck" --set steps=60 --set checkpoint.every=50) >/dev/null \
  2>"$tmp/bigck.err" || rc=$?
[[ $rc -eq 1 ]] || fail "ulimit checkpoint: exit code $rc, expected 1"
if [[ $(wc -l <"$tmp/bigck.err") -ne 1 ]] ||
  ! grep -q "^troupe train: error: .*$tmp/bigck/checkpoints/step-00000050/[a-z_]*\.safetensors[.a-z]*: write failed: File too large$" "$tmp/bigck.err"; then
  fail "ulimit checkpoint: stderr [$(cat "$tmp/bigck.err")]"
fi
[[ -z $(find "$tmp/bigck/checkpoints" -name manifest.json) ]] || fail "ulimit: a checkpoint was committed"
[[ $failures -eq $before ]] && echo "ok: ulimit -f: $(cat "$tmp/big.err"); $(cat "$tmp/bigck.err")"

if [[ $failures -ne 0 ]]; then
  echo "$failures failure(s)" >&2
  exit 1
fi
echo "all run lock cases passed"
