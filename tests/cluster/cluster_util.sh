# Shared helpers of the cluster tests (sourced, not run): prefixed messages and exit codes
# (0 pass, 77 skip, 1 fail), bounded waits and process reaping, the small PP=2 x DP=2 recipe
# both tests train, a clean environment for the in-process reference run, and the step-by-step
# loss comparison. Every wait here has a deadline.
# Usage: cluster_name=NAME; source cluster_util.sh
# shellcheck shell=bash
# shellcheck disable=SC2034 # the small_* settings are read by the scripts that source this
: "${cluster_name:?set cluster_name before sourcing cluster_util.sh}"

# The small recipe: 6 steps of a 2-layer GPT, 2 pipeline stages x 2 replicas, 4 micro-batches
# of B x T tokens per replica and step. Activations between the stages are T x B x W floats.
small_steps=6
small_pp=2
small_dp=2
small_micro_batches=4
small_batch=2
small_seq_len=32
small_width=32

log() {
  local line
  while IFS= read -r line; do printf '%s: %s\n' "$cluster_name" "$line"; done <<<"$*"
}

skip() {
  log "SKIP: $*"
  exit 77
}

fail() {
  log "FAIL: $*" >&2
  exit 1
}

# show_tail FILE [LINES]: the last lines of FILE, prefixed, on stderr (for failure reports).
show_tail() {
  [[ -f $1 ]] || return 0
  [[ -s $1 ]] || { log "--- $1 is empty" >&2; return 0; }
  log "--- last lines of $1:" >&2
  log "$(tail -n "${2:-25}" "$1")" >&2
}

# A random TCP port in [20000, 32768) nobody listens on now (a connection to it is refused):
# below Linux's ephemeral range, where no connection's local end can hold it.
free_tcp_port() {
  local port tries
  for tries in $(seq 1 50); do
    port=$((20000 + (RANDOM * 32768 + RANDOM) % 12768))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      echo "$port"
      return 0
    fi
  done
  fail "no free TCP port found in $tries tries"
}

# process_state PID: the one-letter state of a process (R, S, Z, ...), empty if it is gone.
process_state() {
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
  stat=${stat##*) }
  echo "${stat%% *}"
}

# alive PID...: true if any of the processes still runs. Zombies count as gone; those that are
# our children are reaped on the way.
alive() {
  local pid state any=1
  for pid in "$@"; do
    state=$(process_state "$pid")
    if [[ $state == Z ]]; then
      wait "$pid" 2>/dev/null || true
    elif [[ -n $state ]]; then
      any=0
    fi
  done
  return "$any"
}

# stop_pids GRACE_SECONDS PID...: SIGTERM, then SIGKILL whatever is left after the grace period;
# reaps those that are our children. Never waits longer than GRACE_SECONDS + 5 s.
stop_pids() {
  local grace=$1 pid deadline
  shift
  (($# > 0)) || return 0
  kill -TERM "$@" 2>/dev/null || true
  deadline=$((SECONDS + grace))
  while alive "$@" && ((SECONDS < deadline)); do sleep 0.2; done
  if alive "$@"; then
    kill -KILL "$@" 2>/dev/null || true
    deadline=$((SECONDS + 5))
    while alive "$@" && ((SECONDS < deadline)); do sleep 0.1; done
  fi
  for pid in "$@"; do
    wait "$pid" 2>/dev/null || true
  done
}

# Every process a test starts carries this variable in its environment (and passes it on to
# what it starts: srun to its tasks, slurmd to slurmstepd), so that stop_marked finds them all,
# by id, whatever they were reparented to.
cluster_mark="TROUPE_CLUSTER_TEST_MARK=$cluster_name-$$-$RANDOM$RANDOM"

# marked_pids: the processes carrying cluster_mark.
marked_pids() {
  local dir text
  for dir in /proc/[0-9]*; do
    [[ ${dir#/proc/} == "$$" ]] && continue
    text=$(tr '\0' '\n' 2>/dev/null <"$dir/environ") || continue
    [[ $'\n'$text$'\n' == *$'\n'"$cluster_mark"$'\n'* ]] && echo "${dir#/proc/}"
  done
  return 0
}

# stop_marked GRACE_SECONDS [EXCEPT_PID...]: stops every marked process but the exceptions.
stop_marked() {
  local grace=$1 pid except
  shift
  local -a pids=()
  for pid in $(marked_pids); do
    for except in "$@"; do [[ $pid == "$except" ]] && continue 2; done
    pids+=("$pid")
  done
  stop_pids "$grace" "${pids[@]}"
}

# run_bounded SECONDS LOG CMD...: runs CMD (marked) in the background with a timeout, output to
# LOG, and waits for it such that a signal to this script interrupts the wait (the EXIT trap
# then cleans up). Returns CMD's status (124 on timeout).
run_bounded() {
  local seconds=$1 out=$2 pid rc=0
  shift 2
  env "$cluster_mark" timeout -k 10 "$seconds" "$@" >"$out" 2>&1 </dev/null &
  pid=$!
  wait "$pid" || rc=$?
  return "$rc"
}

# clean_env_args: `env` arguments that drop every variable a launcher could have set (Slurm's,
# torchrun's, ours, UCX's), for the in-process reference run.
clean_env_args() {
  local name
  for name in $(compgen -e); do
    case $name in
      SLURM_* | SLURMD_* | SRUN_* | UCX_* | TROUPE_JOB_TOKEN | RANK | WORLD_SIZE | LOCAL_RANK | \
        LOCAL_WORLD_SIZE | GROUP_RANK | ROLE_RANK | MASTER_ADDR | MASTER_PORT)
        printf -- '-u\n%s\n' "$name"
        ;;
    esac
  done
}

# write_small_recipe DIR: a generated corpus and the small recipe in DIR; prints the recipe path.
# The recipe says pp = 2 and leaves dp at its default: the runs pass small_overrides.
write_small_recipe() {
  local dir=$1 i
  local words=(the quick brown fox jumps over lazy dog while a small model learns to count)
  for i in $(seq 1 300); do
    echo "sentence $i: ${words[$((i % 15))]} ${words[$(((i * 7) % 15))]} ${words[$(((i * 3) % 15))]}."
  done >"$dir/corpus.txt"
  cat >"$dir/recipe.toml" <<TOML
seed = 7
steps = 10
eval_interval = 0

[model]
vocab_size = 256
context = $small_seq_len
layers = 2
heads = 2
width = $small_width

[data]
format = "text"
train = "$dir/corpus.txt"
val_fraction = 0.1

[batch]
micro_batch = $small_batch
seq_len = $small_seq_len

[parallel]
pp = $small_pp
schedule = "1f1b"
micro_batches = $small_micro_batches

[optimizer]
warmup_steps = 2
TOML
  echo "$dir/recipe.toml"
}

# The overrides every run of the small recipe gets (plus its own output.dir). One BLAS/OpenMP
# thread per stage in every run: by default a rank alone in its process (a namespace "host")
# would take all the cores, and OpenBLAS's results can depend on its thread count (on an AMD
# EPYC with the ZEN kernels a 64x256x32 sgemm differed in the last bits between 1 and 2 threads,
# so losses differed from the in-process run, where 4 stages share the cores).
small_overrides=(--set "parallel.dp=$small_dp" --set "steps=$small_steps" --threads 1)

# Bytes of activations one pipeline rank sends (and receives, as gradients) over a whole run,
# assuming fp32 on the wire: steps x micro-batches x B x T x W x 4.
small_activation_bytes=$((small_steps * small_micro_batches * small_batch * small_seq_len * small_width * 4))

# run_in_process TROUPE RECIPE OUT_DIR LOG: the reference run, one process, no launcher variables.
run_in_process() {
  local troupe=$1 recipe=$2 out=$3 logfile=$4 rc=0
  local -a unset_args
  mapfile -t unset_args < <(clean_env_args)
  run_bounded 300 "$logfile" env "${unset_args[@]}" "$troupe" train "$recipe" \
    "${small_overrides[@]}" --set "output.dir=$out" || rc=$?
  if ((rc != 0)); then
    show_tail "$logfile"
    fail "in-process reference run exited $rc"
  fi
}

# compare_losses PARALLEL_JSONL SERIAL_JSONL LABEL: both files have exactly small_steps lines,
# steps 1..N in order; prints the two loss columns and fails unless every loss is identical.
compare_losses() {
  local table rc=0
  table=$(/usr/bin/python3 - "$1" "$2" "$3" "$small_steps" 2>&1 <<'PY'
import json, sys
par_path, ser_path, label, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
def read(path):
    try:
        rows = [json.loads(line) for line in open(path).read().splitlines()]
    except (OSError, ValueError) as e:
        print(f"cannot read metrics {path}: {e}")
        sys.exit(2)
    if [r.get("step") for r in rows] != list(range(1, steps + 1)):
        print(f"{path}: steps {[r.get('step') for r in rows]}, expected 1..{steps}")
        sys.exit(2)
    return [r["loss"] for r in rows]
par, ser = read(par_path), read(ser_path)
print(f"{'step':>4}  {label + ' loss':>24}  {'in-process loss':>24}")
bad = 0
for n, (a, b) in enumerate(zip(par, ser), 1):
    same = a == b
    bad += not same
    print(f"{n:>4}  {a!r:>24}  {b!r:>24}{'' if same else '  DIFFERENT'}")
if bad:
    print(f"{bad} of {steps} losses differ")
    sys.exit(1)
PY
  ) || rc=$?
  log "$table"
  ((rc != 2)) || fail "$3 run did not write the expected metrics"
  ((rc == 0)) || fail "$3 losses are not identical to the in-process run's"
}
