#!/usr/bin/env bash
# `troupe trace summary|render` on a small hand-written trace: a two-stage 1F1B step (F 1 ms,
# B 2 ms; window 9 ms, busy 6 ms per stage, bubble 1/3) with a data-parallel all-reduce of 2 ms
# of which 1 ms is waited for (hidden 50%). Checks the figures in the text and JSON summaries,
# that render writes an SVG (and never the input), and that bad input exits 2 with one line on
# stderr naming the file. Then a real ZeRO-3 run's trace: reduce-scatter and all-gather spans,
# and their hidden share in the summary.
# Usage: cli_trace.sh TROUPE
set -u
troupe=${1:?usage: cli_trace.sh TROUPE}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0

fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

# span TID NAME START_MS DUR_MS [MICRO_BATCH [CATEGORY]]: one "X" event of step 0.
span() {
  local mb=${5:--1} cat=${6:-compute}
  local args="\"step\":0"
  [[ $mb -ge 0 ]] && args+=",\"micro_batch\":$mb,\"stage\":$(($1 - 1))"
  printf '{"ph":"X","cat":"%s","name":"%s","pid":1,"tid":%d,"ts":%s,"dur":%s,"args":{%s}},\n' \
    "$cat" "$2" "$1" "$(($3 * 1000))" "$(($4 * 1000))" "$args"
}

{
  cat <<'JSON'
{"traceEvents":[
{"ph":"M","name":"thread_name","pid":1,"tid":1,"args":{"name":"stage 0","role":"stage","rank":0,"replica":0}},
{"ph":"M","name":"thread_name","pid":1,"tid":2,"args":{"name":"stage 1","role":"stage","rank":1,"replica":0}},
{"ph":"M","name":"thread_name","pid":1,"tid":9,"args":{"name":"all-reduce","role":"collective","rank":-1,"replica":-1}},
JSON
  span 1 F 0 1 0
  span 1 F 1 1 1
  span 1 B 4 2 0
  span 1 B 7 2 1
  span 2 F 1 1 0
  span 2 B 2 2 0
  span 2 F 4 1 1
  span 2 B 5 2 1
  span 9 all-reduce 8 2 -1 collective
  span 1 dp 9 1 -1 wait
  span 2 dp 9 1 -1 wait
  cat <<'JSON'
{"ph":"i","cat":"step","name":"step 0 done","pid":1,"tid":1,"ts":10000,"s":"t","args":{"step":0}}
],
"displayTimeUnit":"ms",
"otherData":{"format":"troupe-trace","version":1,"schedule":"1f1b","ranks":2,"micro_batches":2,
  "virtual_stages":1,"replicas":1,"theory_bubble":0.3333333333333333,"plan":[]}}
JSON
} >"$tmp/trace.json"
cp "$tmp/trace.json" "$tmp/trace.orig"

# expect_ok NAME NEEDLE... -- ARGS...: exit 0 and every NEEDLE in stdout.
expect_ok() {
  local name=$1
  shift
  local needles=()
  while [[ $1 != -- ]]; do
    needles+=("$1")
    shift
  done
  shift
  local before=$failures rc=0
  "$troupe" trace "$@" >"$tmp/$name.stdout" 2>"$tmp/$name.stderr" || rc=$?
  [[ $rc -eq 0 ]] || fail "$name: exit code $rc (stderr: $(cat "$tmp/$name.stderr"))"
  local n
  for n in "${needles[@]}"; do
    grep -qF -- "$n" "$tmp/$name.stdout" || fail "$name: output lacks '$n': $(cat "$tmp/$name.stdout")"
  done
  [[ $failures -eq $before ]] && echo "ok: $name"
}

# expect_bad NAME NEEDLE -- ARGS...: exit 2, exactly one stderr line containing NEEDLE.
expect_bad() {
  local name=$1 needle=$2
  shift 3
  local before=$failures rc=0
  "$troupe" trace "$@" >"$tmp/$name.stdout" 2>"$tmp/$name.stderr" || rc=$?
  local err
  err=$(cat "$tmp/$name.stderr")
  [[ $rc -eq 2 ]] || fail "$name: exit code $rc, expected 2 (stderr: $err)"
  [[ $(wc -l <"$tmp/$name.stderr") -eq 1 ]] || fail "$name: stderr is not one line: [$err]"
  [[ $err == *"$needle"* ]] || fail "$name: stderr does not name '$needle': [$err]"
  [[ $failures -eq $before ]] && echo "ok: $name: $err"
}

expect_ok summary-text "bubble: measured 33.3% · theory 33.3% (schedule 1f1b, p=2, m=2, v=1)" \
  "pipeline window 9.000 ms per step" "dp communication: 2.00 ms, exposed 1.00 ms, hidden 50.0%" \
  -- summary "$tmp/trace.json"
grep -E '^stage 0 +6\.000 +3\.000 +2 +1\.000 +2 +2\.000' "$tmp/summary-text.stdout" >/dev/null ||
  fail "summary-text: no busy/idle row for stage 0: $(cat "$tmp/summary-text.stdout")"
expect_ok summary-json '"measured_bubble": 0.33333' '"dp_hidden_fraction": 0.5' '"steps": 1' \
  -- summary "$tmp/trace.json" --json
expect_ok render "wrote $tmp/x.svg" -- render "$tmp/trace.json" -o "$tmp/x.svg" --width 600
if [[ -f $tmp/x.svg ]]; then
  [[ $(head -c 4 "$tmp/x.svg") == "<svg" ]] || fail "render: x.svg does not start with <svg"
  [[ $(tail -n 1 "$tmp/x.svg") == "</svg>" ]] || fail "render: x.svg does not end with </svg>"
  [[ $(grep -c 'class="compute"' "$tmp/x.svg") -eq 8 ]] || fail "render: not 8 compute boxes"
  [[ -e $tmp/x.svg.tmp ]] && fail "render: x.svg.tmp left behind"
else
  fail "render: x.svg was not written"
fi

expect_bad missing-file no-such-trace.json -- summary "$tmp/no-such-trace.json"
expect_bad missing-file-render no-such-trace.json -- render "$tmp/no-such-trace.json" -o "$tmp/y.svg"
[[ -e $tmp/y.svg ]] && fail "missing-file-render: y.svg was written"
printf '{"traceEvents": [' >"$tmp/broken.json"
expect_bad invalid-json broken.json -- summary "$tmp/broken.json"
expect_bad skip-everything trace.json -- summary "$tmp/trace.json" --skip-steps 1
expect_bad no-such-step "step 3" -- render "$tmp/trace.json" -o "$tmp/y.svg" --step 3
expect_bad overwrite-input trace.json -- render "$tmp/trace.json" -o "$tmp/trace.json"
expect_bad unwritable-output no-such-dir -- render "$tmp/trace.json" -o "$tmp/no-such-dir/x.svg"
cmp -s "$tmp/trace.json" "$tmp/trace.orig" || fail "the input trace was modified"

# A real ZeRO-3 run (PP=1 x DP=2, 2 layers, 3 steps): its trace has a reduce-scatter span per
# bucket, replica and step (4 buckets: head, 2 layers, embedding), all-gather spans for the
# gathers before each use, and the summary reports the hidden share of each.
printf 'the quick brown fox jumps over the lazy dog.\n%.0s' $(seq 1 200) >"$tmp/corpus.txt"
cat >"$tmp/z3.toml" <<TOML
seed = 3
steps = 3
eval_interval = 0
[model]
vocab_size = 256
context = 32
layers = 2
heads = 2
width = 32
[data]
format = "text"
train = "$tmp/corpus.txt"
val_fraction = 0.1
[batch]
micro_batch = 2
seq_len = 32
[parallel]
dp = 2
zero = 3
micro_batches = 2
[output]
dir = "$tmp/z3"
TOML
if timeout 120 "$troupe" train "$tmp/z3.toml" --trace "$tmp/z3.json" >"$tmp/z3.log" 2>&1; then
  "$troupe" trace summary "$tmp/z3.json" --json >"$tmp/z3.summary.json" 2>&1 ||
    fail "summary of a ZeRO-3 trace: $(cat "$tmp/z3.summary.json")"
  python3 - "$tmp/z3.summary.json" <<'PY' || fail "ZeRO-3 trace overlap"
import json, sys
rows = {o["name"]: o for o in json.load(open(sys.argv[1]))["overlap"]}
assert set(rows) == {"all-gather", "reduce-scatter"}, rows
assert rows["reduce-scatter"]["spans"] == 3 * 2 * 4, rows["reduce-scatter"]
assert rows["all-gather"]["spans"] > 0 and rows["all-gather"]["spans"] % 6 == 0, rows["all-gather"]
for r in rows.values():
    assert 0 <= r["hidden_fraction"] <= 1 and r["hidden_us"] <= r["total_us"], r
print("ZeRO-3 trace:", {k: (v["spans"], round(v["hidden_fraction"], 3)) for k, v in rows.items()})
PY
else
  fail "ZeRO-3 train with --trace: $(tail -n 3 "$tmp/z3.log")"
fi

if [[ $failures -ne 0 ]]; then
  echo "$failures failure(s)" >&2
  exit 1
fi
echo "all trace command cases passed"
