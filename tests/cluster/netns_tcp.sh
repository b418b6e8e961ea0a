#!/usr/bin/env bash
# Ranks on a real (virtual) network: 4 network namespaces, each with one veth link to a bridge
# that lives in a fifth namespace (so the host's own network and firewall are never touched),
# addresses 10.203.0.1-4/24. A UCX-only check (ucx_perftest, where installed) proves UCX over TCP
# crosses the links; then the small PP=2 x DP=2 recipe runs as 4 torchrun-style ranks
# (RANK, WORLD_SIZE, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, MASTER_ADDR, MASTER_PORT, TROUPE_JOB_TOKEN;
# UCX_TLS=tcp on the namespace's veth) and in one process: every step's loss must be identical,
# and every rank's link must have carried at least the activations it exchanged (RX and TX).
# Names carry this script's PID; namespaces, links and processes go away on every exit path.
# Exit 0 pass, 77 skip (not root, no iproute2, namespaces refused), 1 fail.
# Usage: netns_tcp.sh TROUPE
set -euo pipefail
cluster_name=netns_tcp
troupe=${1:?usage: netns_tcp.sh TROUPE}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=tests/cluster/cluster_util.sh
source "$here/cluster_util.sh"

[[ -x $troupe ]] || fail "not an executable: $troupe"
troupe=$(realpath "$troupe")
[[ $(id -u) -eq 0 ]] || skip "not root: creating network namespaces needs root"
command -v ip >/dev/null || skip "no ip command (iproute2)"

world=4
subnet=10.203.0
master_port=29500
prefix=troupe-tcp-$$
hub=$prefix-hub
rank_ns=()
for ((r = 0; r < world; r++)); do rank_ns+=("$prefix-r$r"); done

tmp=$(mktemp -d -t "$cluster_name.XXXXXX")
created_ns=()
cleanup() {
  local rc=$? ns pids
  trap - EXIT INT TERM HUP
  set +e # clean up all the way whatever fails
  stop_marked 10
  for ns in "${created_ns[@]}"; do
    pids=$(ip netns pids "$ns" 2>/dev/null)
    if [[ -n $pids ]]; then
      log "stopping processes left in $ns: $(tr '\n' ' ' <<<"$pids")" >&2
      # shellcheck disable=SC2086 # one PID per word
      stop_pids 5 $pids
    fi
  done
  if [[ -n $(marked_pids) ]]; then
    log "FAIL: processes left behind: $(marked_pids | tr '\n' ' ')" >&2
    rc=1
  fi
  # Deleting a rank's namespace deletes its veth pair; deleting the hub deletes the bridge.
  for ns in "${created_ns[@]}"; do
    ip netns del "$ns" 2>/dev/null || { log "FAIL: could not delete namespace $ns" >&2; rc=1; }
  done
  rm -rf "$tmp"
  case $rc in 0 | 77) ;; *) rc=1 ;; esac
  exit "$rc"
}
trap cleanup EXIT
trap 'log "FAIL: interrupted by a signal" >&2; exit 1' INT TERM HUP

# add_ns NAME: a namespace with loopback up; SKIP if the machine refuses namespaces.
add_ns() {
  local err
  if ! err=$(ip netns add "$1" 2>&1); then
    skip "cannot create network namespaces: ip netns add $1: $err"
  fi
  created_ns+=("$1")
  ip -n "$1" link set lo up
}

# The network: hub namespace with bridge br0; rank r's veth0 (10.203.0.(r+1)/24) is paired with
# port r<r> of the bridge. Both ends are created inside their namespaces, never in the host's.
add_ns "$hub"
ip -n "$hub" link add br0 type bridge
ip -n "$hub" link set br0 up
for ((r = 0; r < world; r++)); do
  ns=${rank_ns[r]}
  add_ns "$ns"
  ip link add veth0 netns "$ns" type veth peer name "r$r" netns "$hub" ||
    fail "cannot create a veth pair between $ns and $hub"
  ip -n "$hub" link set "r$r" master br0
  ip -n "$hub" link set "r$r" up
  ip -n "$ns" addr add "$subnet.$((r + 1))/24" dev veth0
  ip -n "$ns" link set veth0 up
done
log "network: ${rank_ns[*]} on bridge br0 in $hub, addresses $subnet.1-$world/24"

# veth_bytes NS: "RX TX" byte counters of veth0 in NS.
veth_bytes() {
  ip -n "$1" -j -s link show dev veth0 |
    /usr/bin/python3 -c 'import json, sys; s = json.load(sys.stdin)[0]["stats64"]; print(s["rx"]["bytes"], s["tx"]["bytes"])'
}

ucx_env=(UCX_TLS=tcp UCX_NET_DEVICES=veth0)

# UCX alone across the links: ucx_perftest server in rank 1's namespace, client in rank 0's.
if command -v ucx_perftest >/dev/null; then
  perf_port=$((master_port + 11))
  ip netns exec "${rank_ns[1]}" env "$cluster_mark" "${ucx_env[@]}" timeout -k 5 60 \
    ucx_perftest -p "$perf_port" >"$tmp/perftest_server.log" 2>&1 </dev/null &
  perf_server=$!
  deadline=$((SECONDS + 20))
  until [[ -n $(ip netns exec "${rank_ns[1]}" ss -Htln "sport = :$perf_port") ]]; do
    alive "$perf_server" || { show_tail "$tmp/perftest_server.log"; fail "ucx_perftest server exited"; }
    ((SECONDS < deadline)) || fail "ucx_perftest server not listening after 20 s"
    sleep 0.2
  done
  if ! run_bounded 60 "$tmp/perftest_client.log" ip netns exec "${rank_ns[0]}" env "${ucx_env[@]}" \
    ucx_perftest "$subnet.2" -p "$perf_port" -t tag_bw -s 262144 -n 50 -w 5; then
    show_tail "$tmp/perftest_client.log"
    show_tail "$tmp/perftest_server.log"
    fail "ucx_perftest over TCP from ${rank_ns[0]} to $subnet.2 failed"
  fi
  wait "$perf_server" || fail "ucx_perftest server exited $?"
  log "ucx_perftest tag_bw 256 KiB over UCX_TLS=tcp, $subnet.1 -> $subnet.2: $(awk '/^Final:/ {print $6 " MB/s"}' "$tmp/perftest_client.log")"
else
  log "ucx_perftest not installed (ucx-utils): no UCX-only check"
fi

# The small recipe as 4 ranks, one per namespace.
recipe=$(write_small_recipe "$tmp")
token=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
mapfile -t unset_args < <(clean_env_args)
declare -A before_rx before_tx rank_of_pid
for ((r = 0; r < world; r++)); do
  read -r "before_rx[$r]" "before_tx[$r]" < <(veth_bytes "${rank_ns[r]}")
done
rank_pids=()
for ((r = 0; r < world; r++)); do
  rank_cmd=(env "${unset_args[@]}" "$cluster_mark" "${ucx_env[@]}" "RANK=$r" "WORLD_SIZE=$world"
    LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 "MASTER_ADDR=$subnet.1" "MASTER_PORT=$master_port"
    "TROUPE_JOB_TOKEN=$token" timeout -k 10 300 "$troupe" train "$recipe" "${small_overrides[@]}"
    --set "output.dir=$tmp/netns_run")
  ((r > 0)) || log "rank 0 runs: ip netns exec ${rank_ns[0]} ${rank_cmd[*]:$((1 + ${#unset_args[@]}))}"
  ip netns exec "${rank_ns[r]}" "${rank_cmd[@]}" >"$tmp/rank$r.log" 2>&1 </dev/null &
  rank_pids+=("$!")
  rank_of_pid[$!]=$r
done

# Wait for all ranks (each bounded by its timeout); the first that fails stops the others.
failed=""
running=("${rank_pids[@]}")
while ((${#running[@]} > 0)); do
  rc=0
  done_pid=""
  wait -n -p done_pid "${running[@]}" || rc=$?
  [[ -n $done_pid ]] || fail "lost track of the rank processes"
  for i in "${!running[@]}"; do [[ ${running[i]} != "$done_pid" ]] || unset "running[i]"; done
  if ((rc != 0)); then
    failed="rank ${rank_of_pid[$done_pid]} exited $rc"
    ((rc != 124)) || failed+=" (timed out after 300 s)"
    stop_pids 10 "${rank_pids[@]}"
    break
  fi
done
if [[ -n $failed ]]; then
  for ((r = 0; r < world; r++)); do show_tail "$tmp/rank$r.log" 15; done
  fail "$failed"
fi

# Every rank's link carried at least the activations (or their gradients) it sent and received.
bytes_table="rank  namespace                 address       RX bytes     TX bytes  (each >= $small_activation_bytes)"
short=""
for ((r = 0; r < world; r++)); do
  read -r rx tx < <(veth_bytes "${rank_ns[r]}")
  rx=$((rx - before_rx[$r]))
  tx=$((tx - before_tx[$r]))
  bytes_table+=$'\n'$(printf '%4d  %-24s  %-12s %9d  %11d' "$r" "${rank_ns[r]}" "$subnet.$((r + 1))" "$rx" "$tx")
  ((rx >= small_activation_bytes && tx >= small_activation_bytes)) || short+=" rank $r"
done
log "traffic on veth0 during training (activations: $small_steps steps x $small_micro_batches micro-batches x $small_batch x $small_seq_len x $small_width x 4 bytes):"
log "$bytes_table"
[[ -z $short ]] || fail "less traffic than the activations on the links of:$short"

run_in_process "$troupe" "$recipe" "$tmp/serial_run" "$tmp/serial.log"
compare_losses "$tmp/netns_run/metrics.jsonl" "$tmp/serial_run/metrics.jsonl" "4 netns ranks"
log "PASS: $small_steps steps on 4 ranks in network namespaces over UCX/TCP match the in-process run"
