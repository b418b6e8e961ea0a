#!/usr/bin/env bash
# examples/trainer_service (docs/embedding.md, "An HTTP service") on a tiny recipe, driven with
# curl: status and Prometheus metrics (checked by `promtool check metrics`), training in steps
# (waited for, with a time limit, and asynchronous then paused), a checkpoint `troupe ckpt verify`
# accepts, a schedule swap (a chunked body), bad requests answered with a 4xx or 501 and a
# one-line reason while the run stays as it was, stop; the final weights equal `troupe train`'s
# of the same recipe. Then SIGTERM on a second service ends its run cleanly, a port in use and a
# bad recipe key are one line and exit 2; a checkpoint with a stop at once are both answered
# (the checkpoint committed, or refused) and the service exits 0 with final weights; a second
# SIGTERM while a stop waits for a long step ends the process at once (143).
# SKIP (77) without the service (libcpp-httplib-dev), curl, promtool (Debian's prometheus) or
# python3.
# Usage: cli_trainer_service.sh TRAINER_SERVICE TROUPE
set -euo pipefail
service=${1:?usage: cli_trainer_service.sh TRAINER_SERVICE TROUPE}
troupe=${2:?usage: cli_trainer_service.sh TRAINER_SERVICE TROUPE}
skip() {
  echo "SKIP: $*"
  exit 77
}
[ -x "$service" ] || skip "trainer_service is not built (libcpp-httplib-dev missing)"
command -v curl >/dev/null || skip "no curl"
command -v promtool >/dev/null || skip "no promtool (Debian's prometheus package)"
command -v python3 >/dev/null || skip "no python3"

tmp=$(mktemp -d)
pids=()
cleanup() {  # a failure leaves no server behind
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 1' INT TERM  # (a timeout's SIGTERM still runs cleanup)
fail() {
  echo "FAIL: $*" >&2
  for f in "$tmp"/*.err; do [ -f "$f" ] && { echo "--- $f" >&2; tail -20 "$f" >&2; }; done
  exit 1
}

# shellcheck source=tests/cli/tiny_recipe.sh
source "$(dirname "${BASH_SOURCE[0]}")/tiny_recipe.sh"
tiny_recipe "$tmp" "$tmp/service" 12

# start NAME ARGS...: the service in the background; sets pid and base once it listens (30 s).
start() {
  local name=$1
  shift
  "$service" "$tmp/recipe.toml" "$@" >"$tmp/$name.out" 2>"$tmp/$name.err" &
  pid=$!
  pids+=("$pid")
  local port=""
  for _ in $(seq 1 300); do
    [ -f "$tmp/$name.out" ] &&  # (not there yet: the shell had not opened it)
      port=$(sed -n 's/^listening on 127\.0\.0\.1:\([0-9][0-9]*\)$/\1/p' "$tmp/$name.out")
    [ -n "$port" ] && break
    kill -0 "$pid" 2>/dev/null || fail "$name exited before listening"
    sleep 0.1
  done
  [ -n "$port" ] || fail "$name did not print 'listening on 127.0.0.1:PORT' within 30 s"
  base="http://127.0.0.1:$port"
}
# wait_exit PID SECONDS: sets rc to its exit code (fails if it still runs after SECONDS).
wait_exit() {
  for _ in $(seq 1 $(($2 * 10))); do
    kill -0 "$1" 2>/dev/null || break
    sleep 0.1
  done
  kill -0 "$1" 2>/dev/null && fail "pid $1 still running after $2 s"
  rc=0
  wait "$1" || rc=$?
}
# http METHOD PATH [BODY]: the status code; the body in $tmp/body, the headers in $tmp/headers.
# With $te set, the body goes with that Transfer-Encoding (curl frames it in chunks).
http() {
  local args=(-sS --max-time "${max_time:-60}" -o "$tmp/body" -D "$tmp/headers" -w '%{http_code}'
    -X "$1")
  [ $# -ge 3 ] && args+=(-H 'Content-Type: application/json' --data-binary "$3")
  [ -n "${te-}" ] && args+=(-H "Transfer-Encoding: $te")
  curl "${args[@]}" "$base$2" || echo "curl-failed"
}
# expect CODE METHOD PATH [BODY]: fails unless the answer has that code.
expect() {
  local code=$1
  shift
  local got
  got=$(http "$@")
  [ "$got" = "$code" ] || fail "$1 $2 ${3-}: HTTP $got, expected $code: $(cat "$tmp/body")"
}
# field EXPR: a Python expression on the last body's JSON, `d` (a tuple: its items, spaced).
field() {
  python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
v = eval(sys.argv[2])
print(" ".join(map(str, v)) if isinstance(v, tuple) else v)' "$tmp/body" "$1"
}
# metric NAME_AND_LABELS: its value in the last body (the /metrics text).
metric() {
  awk -v m="$1" '$1 == m { print $2; found = 1 } END { if (!found) print "missing" }' "$tmp/body"
}
check_metrics() {  # the last body through Prometheus' own parser and linter
  promtool check metrics <"$tmp/body" >"$tmp/promtool.out" 2>&1 ||
    fail "promtool check metrics: $(cat "$tmp/promtool.out")"
  grep -qi '^content-type: text/plain; version=0.0.4' "$tmp/headers" ||
    fail "/metrics content type: $(grep -i content-type "$tmp/headers")"
}
# bad CODE METHOD PATH [BODY]: a refusal with that code and a one-line JSON reason.
bad() {
  expect "$@"
  [ "$(wc -l <"$tmp/body")" -eq 1 ] || fail "$2 $3 ${4-}: not one line: $(cat "$tmp/body")"
  local reason
  reason=$(field 'd["error"]') || fail "$2 $3 ${4-}: no error field: $(cat "$tmp/body")"
  [ -n "$reason" ] || fail "$2 $3 ${4-}: empty reason"
}

# Bad input: one line, exit 2, nothing listening.
set +e
"$service" "$tmp/recipe.toml" --set optimizer.lr=-1 >"$tmp/bad.out" 2>"$tmp/bad.txt"
rc=$?
set -e
[ "$rc" -eq 2 ] || fail "bad recipe key: exit $rc"
grep -q "optimizer.lr" "$tmp/bad.txt" && [ "$(wc -l <"$tmp/bad.txt")" -eq 1 ] ||
  fail "bad recipe key: $(cat "$tmp/bad.txt")"
[ ! -s "$tmp/bad.out" ] || fail "bad recipe key: printed $(cat "$tmp/bad.out")"

start a
expect 200 GET /status
[ "$(field 'd["state"], d["step"], d["total_steps"], d["last_step"]')" = "paused 0 12 None" ] ||
  fail "initial status: $(cat "$tmp/body")"
expect 200 GET /metrics
check_metrics
[ "$(metric troupe_step)" = 0 ] && [ "$(metric 'troupe_state{state="paused"}')" = 1 ] ||
  fail "initial metrics: $(cat "$tmp/body")"
[ "$(curl -sS --max-time 10 -o /dev/null -w '%{http_code}' -I "$base/status")" = 200 ] ||
  fail "HEAD /status"

# Training, waited for.
expect 200 POST /train '{"steps": 1, "wait": true}'
[ "$(field 'd["state"], d["step"], d["last_step"]["step"]')" = "paused 1 1" ] ||
  fail "train 1: $(cat "$tmp/body")"
loss1=$(field 'd["last_step"]["loss"]')
expect 200 POST /train '{"steps": 2, "wait": true}'
[ "$(field 'd["state"], d["step"]')" = "paused 3" ] || fail "train 2 more: $(cat "$tmp/body")"
loss3=$(field 'd["last_loss"]')
expect 200 GET /metrics
check_metrics
[ "$(metric troupe_step)" = 3 ] || fail "troupe_step after 3 steps: $(metric troupe_step)"
[ "$(metric troupe_tokens_total)" = 192 ] || fail "troupe_tokens_total: $(metric troupe_tokens_total)"
python3 -c "import sys; sys.exit(abs(float('$(metric troupe_loss)') - $loss3) > 1e-9)" ||
  fail "troupe_loss $(metric troupe_loss) is not the status' $loss3"
for m in troupe_learning_rate troupe_grad_norm troupe_tokens_per_second; do
  python3 -c "import sys; sys.exit(not float('$(metric $m)') > 0)" || fail "$m: $(metric $m)"
done
for rank in 0 1; do
  for kind in parameters gradients optimizer; do
    v=$(metric "troupe_memory_bytes{replica=\"0\",rank=\"$rank\",kind=\"$kind\"}")
    [ "$v" != missing ] && [ "$v" -gt 0 ] || fail "rank $rank $kind memory: $v"
  done
done

# Bad requests: a 4xx with a one-line reason each, and the run exactly as it was.
expect 200 GET /status
cp "$tmp/body" "$tmp/status.before"
bad 400 POST /train '{"steps":'
bad 400 POST /train '{"steps": 0}'
bad 400 POST /train '{"steps": -2}'
bad 400 POST /train '{"steps": 1.5}'
bad 400 POST /train '{"steps": "2"}'
bad 400 POST /train '{"steps": 99999999999999999999}'
bad 400 POST /train '{}'
bad 400 POST /train ''
bad 400 POST /train '[1]'
bad 400 POST /train '{"steps": 1, "wiat": true}'
bad 400 POST /train '{"steps": 1, "wait": "yes"}'
bad 400 POST /train '{"steps": 1, "wait": true, "timeout_s": 0}'
bad 400 POST /train '{"steps": 1, "wait": true, "timeout_s": 3601}'
bad 400 POST /train '{"steps": 1, "wait": true, "timeout_s": "5"}'
bad 400 POST /train '{"steps": 1, "timeout_s": 5}'
bad 400 POST /schedule '{"name": "no_such_schedule"}'
bad 400 POST /schedule '{"name": 3}'
bad 400 POST /schedule '{}'
bad 400 POST /pause '{"now": true}'
bad 400 POST /checkpoint 'x'
bad 405 GET /train
grep -qi '^allow: POST' "$tmp/headers" || fail "405 without Allow: $(cat "$tmp/headers")"
bad 405 POST /status '{}'
bad 405 DELETE /metrics
bad 405 PUT /stop '{}'
bad 404 GET /nope
bad 404 GET /
bad 404 POST /status/ '{}'
head -c 100000 /dev/zero | tr '\0' ' ' >"$tmp/big"
code=$(curl -sS --max-time 30 -o "$tmp/body" -w '%{http_code}' -X POST \
  --data-binary @"$tmp/big" "$base/train")
[ "$code" = 413 ] || fail "a 100 kB body: HTTP $code"
# A chunked body is read (the reason quotes it); one in codings the service cannot decode, or
# whose end cannot be found, is refused and the connection closed.
te=Chunked bad 400 POST /schedule '{"name": 3}'
[ "$(field 'd["error"]')" = "\"name\" must be a schedule's name, not 3" ] ||
  fail "a chunked body: $(cat "$tmp/body")"
te="gzip, chunked" bad 501 POST /train '{"steps": 1}'
grep -qi '^connection: close' "$tmp/headers" || fail "501 without Connection: close"
te=gzip bad 400 POST /train '{"steps": 1}'
grep -qi '^connection: close' "$tmp/headers" || fail "gzip body without Connection: close"
expect 200 GET /status
cmp -s "$tmp/body" "$tmp/status.before" ||
  fail "bad requests changed the status: $(cat "$tmp/status.before") -> $(cat "$tmp/body")"

# A schedule swap (a chunked body); training in the background, paused; a checkpoint of the
# steps done.
te=chunked expect 200 POST /schedule '{"name": "gpipe"}'
[ "$(field 'd["schedule"]')" = gpipe ] || fail "a chunked schedule swap: $(cat "$tmp/body")"
expect 200 POST /schedule '{"name": "gpipe"}'
expect 202 POST /train '{"steps": 4}'
# (running, unless a loaded machine stalled this request's status query until the 4 were done)
[ "$(field 'd["state"] == "running" or d["step"] == 7')" = True ] ||
  fail "async train: $(cat "$tmp/body")"
expect 200 POST /pause
paused=$(field 'd["step"]')
[ "$(field 'd["state"]')" = paused ] && [ "$paused" -gt 3 ] && [ "$paused" -le 7 ] ||
  fail "pause: $(cat "$tmp/body")"
expect 200 POST /checkpoint
[ "$(field 'd["step"]')" = "$paused" ] || fail "checkpoint step: $(cat "$tmp/body")"
checkpoint=$(field 'd["path"]')
"$troupe" ckpt verify "$checkpoint" >/dev/null || fail "the checkpoint $checkpoint does not verify"

# One more step waited for at most 1 ms: 200 once it was done, else 202 with the status then
# (running, or paused if the step ended meanwhile).
code=$(http POST /train '{"steps": 1, "wait": true, "timeout_s": 0.001}')
case "$code:$(field 'd["state"]')" in
  202:running | 202:paused | 200:paused) ;;
  *) fail "train with a 1 ms wait: HTTP $code: $(cat "$tmp/body")" ;;
esac
expect 200 POST /pause
[ "$(field 'd["state"], d["step"]')" = "paused $((paused + 1))" ] ||
  fail "pause after a 1 ms wait: $(cat "$tmp/body")"

# To the recipe's end; then training is refused, the status stays.
max_time=120 expect 200 POST /train '{"steps": 100, "wait": true}'
[ "$(field 'd["state"], d["step"]')" = "finished 12" ] || fail "train to the end: $(cat "$tmp/body")"
last_loss=$(field 'd["last_loss"]')
python3 -c "import sys; sys.exit(not $last_loss < $loss1)" ||
  fail "the loss did not fall: step 1 $loss1, step 12 $last_loss"
expect 200 GET /metrics
check_metrics
[ "$(metric troupe_step)" = 12 ] && [ "$(metric 'troupe_state{state="finished"}')" = 1 ] &&
  [ "$(metric troupe_tokens_total)" = 768 ] || fail "final metrics: $(cat "$tmp/body")"
bad 409 POST /train '{"steps": 1}'
bad 409 POST /checkpoint

# Stop: the final status, then the process ends, 0.
max_time=120 expect 200 POST /stop
[ "$(field 'd["state"], d["step"]')" = "finished 12" ] || fail "stop: $(cat "$tmp/body")"
wait_exit "$pid" 30
[ "$rc" -eq 0 ] || fail "the service exited $rc after /stop"
[ -s "$tmp/service/final.safetensors" ] || fail "no final weights"
# The same recipe as one command: pauses, a checkpoint and a schedule swap change no number.
"$troupe" train "$tmp/recipe.toml" --set "output.dir=$tmp/cli" >/dev/null 2>&1 || fail "troupe train"
cmp -s "$tmp/service/final.safetensors" "$tmp/cli/final.safetensors" ||
  fail "final weights differ from troupe train's"

# A second service: a port in use is refused; SIGTERM while it trains ends the run cleanly.
start b --set "output.dir=$tmp/b"
set +e
"$service" "$tmp/recipe.toml" --port "${base##*:}" --set "output.dir=$tmp/c" >"$tmp/c.out" 2>"$tmp/c.txt"
rc=$?
set -e
[ "$rc" -eq 2 ] && grep -q "cannot listen on 127.0.0.1:${base##*:}" "$tmp/c.txt" &&
  [ "$(wc -l <"$tmp/c.txt")" -eq 1 ] || fail "a port in use: exit $rc, $(cat "$tmp/c.txt")"
expect 200 POST /train '{"steps": 2, "wait": true}'
expect 202 POST /train '{"steps": 100}'
kill -TERM "$pid"
wait_exit "$pid" 60
[ "$rc" -eq 0 ] || fail "the service exited $rc after SIGTERM"
grep -q "SIGTERM" "$tmp/b.err" || fail "no word of SIGTERM: $(cat "$tmp/b.err")"
[ -s "$tmp/b/final.safetensors" ] || fail "no final weights after SIGTERM"

# A checkpoint and at once a stop (after 0, 5 and 50 ms): both answered; the checkpoint
# committed (it verifies) or refused with an error, never left waiting; the service exits 0 with
# final weights.
delays=(0 0.005 0.05)
for round in 0 1 2; do
  start "d$round" --set "output.dir=$tmp/d$round"
  expect 200 POST /train '{"steps": 2, "wait": true}'
  curl -sS --max-time 60 -o "$tmp/ckpt.body" -w '%{http_code}' -X POST "$base/checkpoint" \
    >"$tmp/ckpt.code" 2>"$tmp/ckpt.err" &
  ckpt=$!
  sleep "${delays[$round]}"
  max_time=60 expect 200 POST /stop
  [ "$(field 'd["state"], d["step"]')" = "finished 2" ] ||
    fail "round $round: stop after a checkpoint: $(cat "$tmp/body")"
  wait "$ckpt" || fail "round $round: /checkpoint not answered in 60 s: $(cat "$tmp/ckpt.err")"
  cp "$tmp/ckpt.body" "$tmp/body"
  case "$(cat "$tmp/ckpt.code")" in
    200)
      [ "$(field 'd["step"]')" = 2 ] || fail "round $round: checkpoint step: $(cat "$tmp/body")"
      "$troupe" ckpt verify "$(field 'd["path"]')" >/dev/null ||
        fail "round $round: the checkpoint $(field 'd["path"]') does not verify"
      ;;
    409 | 500 | 503)
      [ "$(wc -l <"$tmp/body")" -eq 1 ] && [ -n "$(field 'd["error"]')" ] ||
        fail "round $round: checkpoint refusal: $(cat "$tmp/body")"
      ;;
    *) fail "round $round: /checkpoint: HTTP $(cat "$tmp/ckpt.code"): $(cat "$tmp/body")" ;;
  esac
  echo "checkpoint with a stop, round $round: HTTP $(cat "$tmp/ckpt.code")"
  wait_exit "$pid" 60
  [ "$rc" -eq 0 ] || fail "round $round: the service exited $rc after a checkpoint and a stop"
  [ -s "$tmp/d$round/final.safetensors" ] || fail "round $round: no final weights"
done

# A second SIGTERM while a stop waits for the step in flight (steps of seconds: a wider model,
# longer windows, one thread per stage) ends the process at once: 143, no final weights. The
# second is sent once the service has said it is stopping: two signals sent before its watch
# thread takes the first would arrive as one.
start e --set "output.dir=$tmp/e" --set model.width=256 --set model.layers=4 --set model.heads=4 \
  --set model.context=128 --set batch.seq_len=128 --set batch.micro_batch=16 \
  --set parallel.micro_batches=4 --threads 1
expect 202 POST /train '{"steps": 100}'
for _ in $(seq 1 600); do  # a step has just begun: right after the first one ends
  expect 200 GET /status
  [ "$(field 'd["step"]')" -ge 1 ] && break
  sleep 0.05
done
[ "$(field 'd["step"]')" -ge 1 ] || fail "no step done in 30 s"
kill -TERM "$pid"
for _ in $(seq 1 250); do
  grep -q "SIGTERM: stopping after the step in flight" "$tmp/e.err" && break
  sleep 0.02
done
grep -q "SIGTERM: stopping after the step in flight" "$tmp/e.err" ||
  fail "no word of the first SIGTERM in 5 s"
kill -TERM "$pid"
wait_exit "$pid" 5
[ "$rc" -eq 143 ] || fail "a second SIGTERM while stopping: exit $rc"
grep -q "SIGTERM again while stopping" "$tmp/e.err" || fail "no word of the second SIGTERM"
[ ! -e "$tmp/e/final.safetensors" ] || fail "final weights after a second SIGTERM"

echo "trainer service: 12 steps over HTTP (waited, with a time limit, async, paused), checkpoint," \
  "schedule swap (chunked body); /metrics passes promtool; 31 bad requests refused with the run" \
  "unchanged (2 more after its end); stop and SIGTERM exit 0; weights equal troupe train's;" \
  "a checkpoint with a concurrent stop answered twice; a second SIGTERM exits 143 at once"
