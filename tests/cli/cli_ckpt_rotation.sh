#!/usr/bin/env bash
# Checkpoints that cannot be lost or mixed up, with real processes and real files
# (docs/checkpoints.md, "Commit" and "Resume"):
#  - a run with checkpoint.keep = 1 into a checkpoint.dir that holds a corrupt newer step
#    directory and a foreign one (another step's checkpoint under a later name): it ends, its
#    last checkpoint verifies and resumes, the two directories are still there, and the run's
#    log, `troupe ckpt ls` and `troupe ckpt verify` name them;
#  - a file dropped into a checkpoint that its manifest does not list: verify names it;
#  - the process killed by SIGKILL at points of a commit (TROUPE_TEST_CHECKPOINT_KILL): before
#    the manifest, just after it, and after rotation removed the older checkpoint; each time the
#    directory still resumes and the run ends.
# Usage: cli_ckpt_rotation.sh TROUPE
set -euo pipefail
troupe=${1:?usage: cli_ckpt_rotation.sh TROUPE}
tmp=$(mktemp -d)
trap '[ -n "${KEEP_TMP:-}" ] || rm -rf "$tmp"' EXIT
fail() {
  echo "FAIL: $*" >&2
  exit 1
}
# shellcheck source=tiny_recipe.sh
source "$(dirname "$0")/tiny_recipe.sh"
tiny_recipe "$tmp" "$tmp/run" 6
ck=$tmp/run/checkpoints
train() { timeout 120 "$troupe" train "$tmp/recipe.toml" --threads 1 --set checkpoint.every=2 --set checkpoint.keep=1 "$@"; }

# A first run: steps 2, 4, 6; keep = 1 leaves step 6.
train >"$tmp/first.log" 2>&1 || { cat "$tmp/first.log" >&2; fail "the first run"; }
[ "$(ls "$ck")" = "step-00000006" ] || fail "keep = 1 left: $(ls "$ck")"

# A corrupt newer checkpoint (a real one of step 20, a byte changed) and a foreign one (step
# 6's checkpoint under the name of step 30).
train --set output.dir="$tmp/other" --set steps=20 --set checkpoint.every=20 >"$tmp/other.log" 2>&1 ||
  { cat "$tmp/other.log" >&2; fail "the run of step 20"; }
cp -r "$tmp/other/checkpoints/step-00000020" "$ck/"
printf '\x55' | dd of="$ck/step-00000020/model.safetensors" bs=1 seek=3000 conv=notrunc status=none
cp -r "$ck/step-00000006" "$ck/step-00000030"

# Resumed to step 12 with keep = 1: checkpoints 8, 10, 12 each rotate; 20 and 30 stay.
train --set steps=12 --resume >"$tmp/resume.log" 2>&1 || { cat "$tmp/resume.log" >&2; fail "the resumed run"; }
grep -q "step-00000030 is unusable: .*its directory step-00000030" "$tmp/resume.log" ||
  { cat "$tmp/resume.log" >&2; fail "resume did not name the foreign directory"; }
grep -q "step-00000020 is unusable: .*model.safetensors: xxh64" "$tmp/resume.log" ||
  { cat "$tmp/resume.log" >&2; fail "resume did not name the corrupt directory"; }
grep -q "falling back to step-00000006" "$tmp/resume.log" || fail "no fallback to step 6"
for s in 20 30; do
  [ "$(grep -c "step-000000$s does not verify; it stays" "$tmp/resume.log")" -eq 1 ] ||
    { cat "$tmp/resume.log" >&2; fail "the run's log did not name step-000000$s once"; }
done
[ "$(ls "$ck" | tr '\n' ' ')" = "step-00000012 step-00000020 step-00000030 " ] ||
  fail "after rotation: $(ls "$ck" | tr '\n' ' ')"
"$troupe" ckpt verify "$ck/step-00000012" >/dev/null || fail "the last checkpoint does not verify"
"$troupe" ckpt ls "$ck" >"$tmp/ls.out" || fail "ckpt ls"
grep -q "^step-00000012  step 12  ok" "$tmp/ls.out" || { cat "$tmp/ls.out" >&2; fail "ckpt ls: step 12"; }
grep -q "^step-00000020  step 20  DAMAGED .*model.safetensors: xxh64" "$tmp/ls.out" ||
  { cat "$tmp/ls.out" >&2; fail "ckpt ls: step 20"; }
grep -q "^step-00000030  step 30  DAMAGED .*the manifest is of step 6" "$tmp/ls.out" ||
  { cat "$tmp/ls.out" >&2; fail "ckpt ls: step 30"; }
if "$troupe" ckpt verify "$ck" >"$tmp/verify.out" 2>&1; then fail "ckpt verify passed step 20 and 30"; fi
grep -q "step-00000012: ok" "$tmp/verify.out" || { cat "$tmp/verify.out" >&2; fail "ckpt verify: 12"; }
grep -q "step-00000020: .*model.safetensors: xxh64" "$tmp/verify.out" || fail "ckpt verify: 20"
grep -q "step-00000030: .*its directory step-00000030" "$tmp/verify.out" || fail "ckpt verify: 30"

# A file the manifest does not list, dropped in: named by verify, and the checkpoint passed over.
cp "$ck/step-00000012/model.safetensors" "$ck/step-00000012/extra.safetensors"
if "$troupe" ckpt verify "$ck/step-00000012" >"$tmp/extra.out" 2>&1; then fail "verify passed an unlisted file"; fi
grep -q "step-00000012/extra.safetensors: not listed in the manifest" "$tmp/extra.out" ||
  { cat "$tmp/extra.out" >&2; fail "verify did not name the unlisted file"; }
rm "$ck/step-00000012/extra.safetensors"

# Killed (SIGKILL) at points of the commit of step 14 (the first after resuming from 12): the
# directory resumes every time, from the newest checkpoint committed, and the run ends.
cp -r "$ck/step-00000012" "$tmp/step12"
for point in "before manifest" "committed" "removed step-00000012"; do
  rm -rf "$ck/step-00000012" "$ck/step-00000014" "$ck/step-00000016"
  cp -r "$tmp/step12" "$ck/step-00000012"
  rc=0
  TROUPE_TEST_CHECKPOINT_KILL="$point" train --set steps=16 --resume >"$tmp/kill.log" 2>&1 || rc=$?
  [ "$rc" -eq 137 ] || { cat "$tmp/kill.log" >&2; fail "killed at '$point': exit $rc, not 137"; }
  case $point in
    "before manifest") want=12 ;;  # step 14 is torn
    *) want=14 ;;
  esac
  train --set steps=16 --resume >"$tmp/end.log" 2>&1 ||
    { cat "$tmp/end.log" >&2; fail "killed at '$point': the resumed run"; }
  grep -q "resuming from .*step-000000$want" "$tmp/end.log" ||
    { cat "$tmp/end.log" >&2; fail "killed at '$point': not resumed from step $want"; }
  if [ "$want" = 12 ]; then  # the torn step 14 is replaced, and said so
    grep -q "troupe train: replacing .*step-00000014, torn" "$tmp/end.log" ||
      { cat "$tmp/end.log" >&2; fail "the torn step 14 was replaced silently"; }
  fi
  "$troupe" ckpt verify "$ck/step-00000016" >/dev/null || fail "killed at '$point': step 16"
  [ "$(ls "$ck" | tr '\n' ' ')" = "step-00000016 step-00000020 step-00000030 " ] ||
    fail "killed at '$point': left $(ls "$ck" | tr '\n' ' ')"
done
echo "cli_ckpt_rotation: ok"
