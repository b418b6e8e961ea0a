#!/usr/bin/env bash
# `troupe launch`: bad arguments exit 2 with one line on stderr; every rank gets the documented
# environment (one fresh token shared by all ranks, or the caller's); a rank that fails makes the
# launcher return its exit code and name it, after the others are stopped (SIGTERM after
# --grace, SIGKILL 5 s later for one that ignores SIGTERM); SIGTERM, SIGHUP and SIGINT sent to
# the launcher reach every child. Children are /bin/sh scripts run through the hidden --program
# option; two cases run this troupe binary itself. Every wait is bounded (timeout(1) kills a
# launcher that outlives its bound), and no child may outlive its launcher. Restarts stop at
# --max-total-restarts (default 10 x --max-restarts) even where no two failures share a
# --restart-window, and a child ended by a signal is named by the signal and its meaning.
# Usage: cli_launch.sh TROUPE
set -u
troupe=${1:?usage: cli_launch.sh TROUPE}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0

fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

# run_bounded SECONDS NAME ARGS...: runs `troupe launch ARGS` with stdout/stderr in
# $tmp/NAME.{stdout,stderr}; sets rc (a launcher past its bound is killed: rc 137).
run_bounded() {
  local bound=$1 name=$2
  shift 2
  rc=0
  timeout -s KILL "$bound" "$troupe" launch "$@" >"$tmp/$name.stdout" 2>"$tmp/$name.stderr" || rc=$?
}

# expect_bad NAME NEEDLE -- ARGS...: exit 2, exactly one stderr line containing NEEDLE.
expect_bad() {
  local name=$1 needle=$2
  shift 3
  local before=$failures
  run_bounded 20 "$name" "$@"
  local err
  err=$(cat "$tmp/$name.stderr")
  [[ $rc -eq 2 ]] || fail "$name: exit code $rc, expected 2 (stderr: $err)"
  [[ $(wc -l <"$tmp/$name.stderr") -eq 1 ]] || fail "$name: stderr is not one line: [$err]"
  [[ $err == *"$needle"* ]] || fail "$name: stderr does not name '$needle': [$err]"
  [[ $failures -eq $before ]] && echo "ok: $name: $err"
}

# no_leftovers NAME: every pid written to $tmp/NAME.pid.* is gone.
no_leftovers() {
  local f
  for f in "$tmp/$1".pid.*; do
    [[ -e $f ]] || continue
    if kill -0 "$(cat "$f")" 2>/dev/null; then
      fail "$1: child $(cat "$f") ($f) outlived the launcher"
      kill -KILL "$(cat "$f")" 2>/dev/null
    fi
  done
}

# wait_for_files COUNT GLOB: until COUNT files match (at most 20 s).
wait_for_files() {
  local i
  for i in $(seq 1 200); do
    # shellcheck disable=SC2086
    [[ $(ls $2 2>/dev/null | wc -l) -ge $1 ]] && return 0
    sleep 0.1
  done
  return 1
}

expect_bad no-nproc "--nproc N is required" -- -- train x.toml
expect_bad nproc-zero "--nproc 0" -- --nproc 0 -- train x.toml
expect_bad nproc-negative "--nproc -3" -- --nproc -3 -- train x.toml
expect_bad no-command "no command" -- --nproc 2
expect_bad no-command-after-dashes "no command" -- --nproc 2 --
expect_bad port-range "--port 70000" -- --nproc 2 --port 70000 -- train x.toml
expect_bad grace-negative "--grace -1" -- --nproc 2 --grace -1 -- train x.toml
expect_bad total-restarts-negative "--max-total-restarts -1" -- --nproc 1 --max-restarts 1 \
  --max-total-restarts -1 -- train x.toml
expect_bad option-without-dashes "--set" -- --nproc 2 train x.toml --set steps=1

# Every rank's environment.
before=$failures
run_bounded 30 env --nproc 3 --program /bin/sh -- -c \
  'echo "$TROUPE_LAUNCHER $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT" >"$0/env.$RANK"; echo "$TROUPE_JOB_TOKEN" >"$0/token.$RANK"' \
  "$tmp"
[[ $rc -eq 0 ]] || fail "env: exit code $rc (stderr: $(cat "$tmp/env.stderr"))"
port=$(cut -d' ' -f7 "$tmp/env.0" 2>/dev/null)
for r in 0 1 2; do
  [[ $(cat "$tmp/env.$r" 2>/dev/null) == "troupe $r 3 $r 3 127.0.0.1 $port" ]] ||
    fail "env: rank $r saw [$(cat "$tmp/env.$r" 2>/dev/null)]"
done
[[ $port =~ ^[0-9]+$ && $port -ge 1 && $port -le 65535 ]] || fail "env: MASTER_PORT '$port'"
token=$(cat "$tmp/token.0" 2>/dev/null)
[[ $token =~ ^[0-9a-f]{64}$ ]] || fail "env: token '$token' is not 64 hex digits"
for r in 1 2; do
  [[ $(cat "$tmp/token.$r" 2>/dev/null) == "$token" ]] || fail "env: rank $r has another token"
done
[[ $failures -eq $before ]] && echo "ok: env"

# --port, --addr and the caller's token pass through; a second job gets a fresh token.
before=$failures
TROUPE_JOB_TOKEN=caller-token run_bounded 30 env2 --nproc 2 --port 29517 --addr 127.0.0.2 \
  --program /bin/sh -- -c 'echo "$MASTER_ADDR $MASTER_PORT $TROUPE_JOB_TOKEN" >"$0/env2.$RANK"' "$tmp"
[[ $rc -eq 0 ]] || fail "env2: exit code $rc"
for r in 0 1; do
  [[ $(cat "$tmp/env2.$r" 2>/dev/null) == "127.0.0.2 29517 caller-token" ]] ||
    fail "env2: rank $r saw [$(cat "$tmp/env2.$r" 2>/dev/null)]"
done
run_bounded 30 env3 --nproc 1 --program /bin/sh -- -c 'echo "$TROUPE_JOB_TOKEN" >"$0/token3"' "$tmp"
[[ -s $tmp/token3 && $(cat "$tmp/token3") != "$token" ]] || fail "env3: the token was reused"
[[ $failures -eq $before ]] && echo "ok: port, addr and token pass through"

# One rank fails: its code comes back and it is named; the others are stopped after --grace.
before=$failures
run_bounded 40 fail --nproc 3 --grace 1 --program /bin/sh -- -c \
  'echo $$ >"$0/fail.pid.$RANK"; if [ "$RANK" = 1 ]; then exit 3; fi; exec sleep 30' "$tmp"
[[ $rc -eq 3 ]] || fail "fail: exit code $rc, expected 3"
[[ $(cat "$tmp/fail.stderr") == "troupe launch: rank 1 of 3 failed first (exit code 3)" ]] ||
  fail "fail: stderr [$(cat "$tmp/fail.stderr")]"
no_leftovers fail
[[ $failures -eq $before ]] && echo "ok: a failing rank: $(cat "$tmp/fail.stderr")"

# A rank that ignores SIGTERM is killed 5 s after it.
before=$failures
run_bounded 40 stubborn --nproc 2 --grace 0 --program /bin/sh -- -c \
  'echo $$ >"$0/stubborn.pid.$RANK"; if [ "$RANK" = 0 ]; then sleep 0.5; exit 5; fi; trap "" TERM; sleep 30' \
  "$tmp"
[[ $rc -eq 5 ]] || fail "stubborn: exit code $rc, expected 5"
grep -q "rank 0 of 2 failed first (exit code 5)" "$tmp/stubborn.stderr" ||
  fail "stubborn: stderr [$(cat "$tmp/stubborn.stderr")]"
no_leftovers stubborn
[[ $failures -eq $before ]] && echo "ok: SIGKILL after an ignored SIGTERM"

# A signal to the launcher reaches every child (each child traps it and reports).
for sig in TERM HUP INT; do
  before=$failures
  rm -f "$tmp"/sig.*
  # timeout(1) bounds the launcher; it replaces the SIGINT that bash ignores in background
  # commands by its own handler, so the launcher starts with the default disposition.
  timeout -s KILL 20 "$troupe" launch --nproc 2 --program /bin/sh -- -c \
    'trap "echo \$RANK >\"$0/sig.got.\$RANK\"; exit 7" '"$sig"'; echo $$ >"$0/sig.pid.$RANK"; while :; do sleep 0.1; done' \
    "$tmp" 2>"$tmp/sig.stderr" &
  bounded=$!
  if wait_for_files 2 "$tmp/sig.pid.*"; then
    launcher=$(cut -d' ' -f4 "/proc/$(cat "$tmp/sig.pid.0")/stat") # rank 0's parent
    kill -"$sig" "$launcher"
  else
    fail "$sig: the children did not start"
  fi
  rc=0
  wait "$bounded" || rc=$?
  [[ $rc -eq 7 ]] || fail "$sig: launcher exit code $rc, expected 7"
  for r in 0 1; do
    [[ -e $tmp/sig.got.$r ]] || fail "$sig: rank $r did not receive SIG$sig"
  done
  no_leftovers sig
  [[ $failures -eq $before ]] && echo "ok: SIG$sig reaches every child"
done

# A child that fails every 0.6 s with a 0.3 s window: the window never holds two failures, the
# total cap ends the launcher with exit 3 and the report.
before=$failures
run_bounded 60 total --nproc 1 --max-restarts 1 --restart-window 0.3 --max-total-restarts 3 \
  --program /bin/sh -- -c 'sleep 0.6; exit 1'
[[ $rc -eq 3 ]] || fail "total: exit code $rc, expected 3 (stderr: $(cat "$tmp/total.stderr"))"
[[ $(grep -c "restarting the job" "$tmp/total.stderr") -eq 3 ]] ||
  fail "total: not restarted 3 times: [$(cat "$tmp/total.stderr")]"
grep -q "giving up: the job failed 4 times in all, more than --max-total-restarts 3 allows. Failures: attempt 1 at .*attempt 4 at [0-9.]* s: rank 0 exit code 1;" \
  "$tmp/total.stderr" || fail "total: no report: [$(cat "$tmp/total.stderr")]"
[[ $failures -eq $before ]] && echo "ok: --max-total-restarts ends endless restarts"

# The default total cap is 10 x --max-restarts.
before=$failures
run_bounded 30 total-default --nproc 1 --max-restarts 2 --program /bin/sh -- -c \
  'test "$TROUPE_RESTART_COUNT" != 0'
[[ $rc -eq 0 ]] || fail "total-default: exit code $rc (stderr: $(cat "$tmp/total-default.stderr"))"
grep -q "restarting the job (restart 1 of at most 20; 1 of at most 2 within 3600 s)" \
  "$tmp/total-default.stderr" || fail "total-default: [$(cat "$tmp/total-default.stderr")]"
[[ $failures -eq $before ]] && echo "ok: the default --max-total-restarts"

# A child ended by a signal: its name and meaning, in the launcher's line and in its report.
before=$failures
run_bounded 40 xfsz --nproc 2 --grace 0 --program /bin/sh -- -c \
  'echo $$ >"$0/xfsz.pid.$RANK"; if [ "$RANK" = 1 ]; then kill -XFSZ $$; fi; exec sleep 30' "$tmp"
[[ $rc -eq 153 ]] || fail "xfsz: exit code $rc, expected 153"
[[ $(cat "$tmp/xfsz.stderr") == "troupe launch: rank 1 of 2 failed first (killed by SIGXFSZ (File size limit exceeded), exit code 153)" ]] ||
  fail "xfsz: stderr [$(cat "$tmp/xfsz.stderr")]"
no_leftovers xfsz
run_bounded 40 killed --nproc 1 --max-restarts 1 --max-total-restarts 0 --program /bin/sh -- \
  -c 'kill -KILL $$'
[[ $rc -eq 3 ]] || fail "killed: exit code $rc, expected 3"
grep -q "attempt 1 at [0-9.]* s: rank 0 killed by SIGKILL (Killed), exit code 137;" \
  "$tmp/killed.stderr" || fail "killed: report [$(cat "$tmp/killed.stderr")]"
[[ $failures -eq $before ]] && echo "ok: signals by name: $(cat "$tmp/xfsz.stderr")"

# This troupe binary itself: a command that fails in every rank, and one that succeeds.
before=$failures
run_bounded 60 train-missing --nproc 3 --grace 5 -- train "$tmp/no-such-recipe.toml"
[[ $rc -eq 2 ]] || fail "train-missing: exit code $rc, expected 2"
grep -Eq '^troupe launch: rank [0-2] of 3 failed first \(exit code 2\)$' "$tmp/train-missing.stderr" ||
  fail "train-missing: no line naming the rank: [$(cat "$tmp/train-missing.stderr")]"
[[ $(grep -c 'no-such-recipe.toml' "$tmp/train-missing.stderr") -eq 3 ]] ||
  fail "train-missing: not every rank reported the recipe: [$(cat "$tmp/train-missing.stderr")]"
run_bounded 60 help --nproc 2 -- --help
[[ $rc -eq 0 ]] || fail "help: exit code $rc"
[[ $(grep -c '^Usage:' "$tmp/help.stdout") -eq 2 ]] || fail "help: not two usage texts"
[[ $failures -eq $before ]] && echo "ok: troupe subcommands as ranks"

if [[ $failures -ne 0 ]]; then
  echo "$failures failure(s)" >&2
  exit 1
fi
echo "all launch cases passed"
