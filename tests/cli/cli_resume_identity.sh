#!/usr/bin/env bash
# Resume identity with real `troupe train` runs on a tiny recipe (docs/checkpoints.md, "Resume"
# and "What a resume may change"):
#  - a changed model key is refused: exit 2, one line with the key and both values, nothing
#    written;
#  - a changed trajectory key is refused, then accepted with --allow-change and recorded in
#    metrics.jsonl (the first resumed step's line) and in the next checkpoint's trainer state;
#  - a mesh change that keeps the global batch reshards and is reported; a free key is accepted;
#  - a resume from an older checkpoint while a newer one exists is refused naming it, then with
#    --set-aside-newer the newer one is moved (not deleted), the later metrics lines are kept
#    aside, and the run ends bitwise with the weights of the run never interrupted;
#  - a resume at exactly `steps` ends at once with the checkpoint's weights as the final weights.
# Usage: cli_resume_identity.sh TROUPE
set -euo pipefail
troupe=${1:?usage: cli_resume_identity.sh TROUPE}
py=/usr/bin/python3
export OMP_WAIT_POLICY=passive
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() {
  echo "FAIL: $*" >&2
  exit 1
}
source "$(dirname "$0")/tiny_recipe.sh"
tiny_recipe "$tmp" "$tmp/base" 6
train() { timeout 120 "$troupe" train "$tmp/recipe.toml" --threads 1 --set checkpoint.every=3 "$@"; }

# The run never interrupted: checkpoints after steps 3 and 6, final weights.
train >"$tmp/base.log" 2>&1 || { cat "$tmp/base.log" >&2; fail "the base run"; }
[ -f "$tmp/base/checkpoints/step-00000003/manifest.json" ] || fail "no step-3 checkpoint"
[ -f "$tmp/base/checkpoints/step-00000006/manifest.json" ] || fail "no step-6 checkpoint"
copy() { rm -rf "$tmp/$1" && cp -r "$tmp/base" "$tmp/$1"; }
# refused NAME PATTERN ARGS...: exit 2, one line on stderr matching PATTERN, the run dir as it was.
refused() {
  local name=$1 pattern=$2 rc=0
  shift 2
  copy "$name"
  train --set "output.dir=$tmp/$name" "$@" >"$tmp/$name.out" 2>"$tmp/$name.err" || rc=$?
  [ "$rc" -eq 2 ] || { cat "$tmp/$name.out" "$tmp/$name.err" >&2; fail "$name: exit $rc, not 2"; }
  [ "$(wc -l <"$tmp/$name.err")" -eq 1 ] || { cat "$tmp/$name.err" >&2; fail "$name: not one line"; }
  grep -qF -- "$pattern" "$tmp/$name.err" || { cat "$tmp/$name.err" >&2; fail "$name: no '$pattern'"; }
  diff -r "$tmp/base" "$tmp/$name" >/dev/null || fail "$name: the refused resume changed the run"
  echo "ok: $name refused: $(cat "$tmp/$name.err")"
}

# 1. Model keys.
refused model "key model.heads: the checkpoint's model has 2, the recipe 4" \
  --resume --set model.heads=4 --set steps=9

# 2. Trajectory keys: refused, then allowed and recorded.
refused trajectory "optimizer.lr (0.001 -> 0.002)" --resume --set optimizer.lr=0.002 --set steps=9
copy allowed
train --set "output.dir=$tmp/allowed" --resume --set optimizer.lr=0.002 --set steps=9 \
  --allow-change optimizer.lr >"$tmp/allowed.log" 2>&1 || { cat "$tmp/allowed.log" >&2; fail "allowed change"; }
grep -qF "changed with --allow-change: optimizer.lr 0.001 -> 0.002" "$tmp/allowed.log" ||
  fail "the allowed change was not reported"
"$py" - "$tmp/allowed" <<'PY' || fail "the allowed change was not recorded"
import json, sys
run = sys.argv[1]
want = [{"step": 6, "key": "optimizer.lr", "from": "0.001", "to": "0.002"}]
lines = [json.loads(l) for l in open(run + "/metrics.jsonl")]
assert [l["step"] for l in lines] == list(range(1, 10)), [l["step"] for l in lines]
assert lines[6].get("recipe_changes") == want, lines[6]
assert all("recipe_changes" not in l for i, l in enumerate(lines) if i != 6)
state = json.load(open(run + "/checkpoints/step-00000009/trainer_state.json"))
assert state["recipe_changes"] == want, state.get("recipe_changes")
PY
echo "ok: optimizer.lr allowed, recorded in metrics.jsonl and step-00000009/trainer_state.json"

# 3. A mesh change keeping the global batch (twice the replicas, half the micro-batches each).
copy mesh
train --set "output.dir=$tmp/mesh" --resume --set parallel.dp=2 --set parallel.micro_batches=1 \
  --set steps=7 >"$tmp/mesh.log" 2>&1 || { cat "$tmp/mesh.log" >&2; fail "the mesh change"; }
grep -qF "resharding: parallel.dp 1 -> 2" "$tmp/mesh.log" || fail "parallel.dp not reported"
grep -qF "resharding: parallel.micro_batches 2 -> 1" "$tmp/mesh.log" ||
  fail "parallel.micro_batches not reported"
refused global_batch "global_batch (64 -> 128 tokens per step)" --resume --set parallel.dp=2 \
  --set steps=7
echo "ok: mesh change resharded and reported"

# 4. A free key.
copy free
train --set "output.dir=$tmp/free" --resume --set checkpoint.keep=5 --set steps=7 \
  >"$tmp/free.log" 2>&1 || { cat "$tmp/free.log" >&2; fail "a free key refused"; }
echo "ok: free key accepted"

# 5. An older checkpoint while a newer one exists: refused, then set aside.
refused older "holds checkpoints newer than step-00000003 (step-00000006)" \
  --resume "$tmp/older/checkpoints/step-00000003"
train --set "output.dir=$tmp/older" --resume "$tmp/older/checkpoints/step-00000003" \
  --set-aside-newer >"$tmp/older.log" 2>&1 || { cat "$tmp/older.log" >&2; fail "--set-aside-newer"; }
aside=$(echo "$tmp"/older/checkpoints/set-aside-00000003-*)
[ -f "$aside/step-00000006/manifest.json" ] || fail "step-00000006 was not moved aside"
cmp -s "$aside/step-00000006/model.safetensors" "$tmp/base/checkpoints/step-00000006/model.safetensors" ||
  fail "the set-aside checkpoint differs"
"$troupe" ckpt verify "$aside/step-00000006" >/dev/null || fail "the set-aside checkpoint does not verify"
kept=$(echo "$tmp"/older/metrics.jsonl.set-aside-00000003-*)
"$py" - "$kept" "$tmp/base/metrics.jsonl" "$tmp/older/metrics.jsonl" <<'PY' || fail "metrics lines lost"
import json, sys
kept, base, now = ([json.loads(l) for l in open(f)] for f in sys.argv[1:])
assert kept == base[3:], "the kept-aside lines are not steps 4-6 of the first run"
assert [l["step"] for l in now] == list(range(1, 7))
assert [l["loss"] for l in now] == [l["loss"] for l in base], "resumed losses differ"
PY
cmp -s "$tmp/older/final.safetensors" "$tmp/base/final.safetensors" ||
  fail "final weights after the set-aside resume differ from the run never interrupted"
echo "ok: older resume refused, then newer set aside; metrics kept aside; final weights bitwise"

# 6. At exactly `steps`: the checkpoint's weights are the final weights.
copy done
train --set "output.dir=$tmp/done" --resume --set output.weights=again.safetensors \
  >"$tmp/done.log" 2>&1 || { cat "$tmp/done.log" >&2; fail "resume at the end"; }
grep -qF "all 6 steps are done" "$tmp/done.log" || fail "resume at the end said nothing"
cmp -s "$tmp/done/again.safetensors" "$tmp/base/final.safetensors" ||
  fail "the final weights at the end differ from the run's"
echo "ok: resume at the end wrote the final weights"
echo "PASS"
