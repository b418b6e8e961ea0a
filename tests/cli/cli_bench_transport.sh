#!/usr/bin/env bash
# `troupe bench transport --quick` runs end to end over shared memory beside ucx_perftest: every
# row has figures from both sides, each ucx_perftest run between two of ours, each row's ratio is
# the median of its pairs' ratios (the mean of ours around a peer run / it) and its verdict
# follows from that ratio and the goal, and the zero-copy checks held (no payload copy on
# send, every received frame decoded into views of the buffer UCX wrote). A tcp row sends a
# tensor never written, as ucx_perftest's tcp sender does, and still unwritten after the run;
# `--source written` writes it. A shared-memory row sends a written tensor: by default in the
# engine's payload storage, saying how much of its mapping was in huge pages; with `--source
# as-peer` in 4 KiB pages, as ucx_perftest's buffer is (none of its mapping in huge pages). A
# smoke test: no figure is compared with a speed, benchmarks assert nothing about time. Bad input: one line naming it, non-zero exit, no report.
# Usage: cli_bench_transport.sh TROUPE
set -euo pipefail
troupe=${1:?usage: cli_bench_transport.sh TROUPE}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! command -v ucx_perftest >/dev/null; then
  echo "SKIP: ucx_perftest (Debian's ucx-utils) is not installed"
  exit 77
fi

run() {  # run NAME ARGS...: the bench's JSON into $tmp/NAME.json
  local name=$1
  shift
  if ! timeout 120 "$troupe" bench transport --json "$@" >"$tmp/$name.json" 2>"$tmp/$name.err"; then
    echo "FAIL: bench transport $* exited non-zero" >&2
    tail -n 5 "$tmp/$name.err" >&2
    exit 1
  fi
}
run shm --quick --only shm
run pairs --quick --only shm,latency --repeats 2
run tcp --quick --only tcp,bandwidth,64KiB
run tcp_written --quick --only tcp,bandwidth,64KiB --source written
run as_peer --quick --only shm,bandwidth,64KiB --source as-peer
/usr/bin/python3 - "$tmp/shm.json" "$tmp/pairs.json" "$tmp/tcp.json" "$tmp/tcp_written.json" \
  "$tmp/as_peer.json" <<'PY'
import json, statistics, sys
shm, pairs, tcp, tcp_written, as_peer = (json.load(open(p)) for p in sys.argv[1:6])

def check_row(row, repeats):
    assert row["ours"] > 0 and row["peer"] > 0, row
    # ours, peer, ours, ..., peer, ours: each peer run against the mean of ours around it.
    assert len(row["ours_runs"]) == repeats + 1, row
    assert len(row["peer_runs"]) == len(row["ratios"]) == repeats, row
    ours = row["ours_runs"]
    for i, (peer, ratio) in enumerate(zip(row["peer_runs"], row["ratios"])):
        assert abs(ratio - (ours[i] + ours[i + 1]) / 2 / peer) < 1e-9 * ratio, row
    assert abs(row["ratio"] - statistics.median(row["ratios"])) < 1e-12, row
    runs = row["peer_runs"]
    assert len(row["peer_self_ratios"]) == len(runs) - 1, row
    for before, after, ratio in zip(runs, runs[1:], row["peer_self_ratios"]):
        assert abs(ratio - after / before) < 1e-9 * ratio, row
    assert abs(row["ours"] - statistics.median(row["ours_runs"])) < 1e-12, row
    assert abs(row["peer"] - statistics.median(row["peer_runs"])) < 1e-12, row
    wanted = row["ratio"] >= 0.9 if row["metric"] == "bandwidth" else row["ratio"] <= 2
    assert row["met"] == wanted, row

rows = shm["rows"]
assert [(r["metric"], r["payload_bytes"]) for r in rows] == [
    ("bandwidth", 64 << 10), ("bandwidth", 1 << 20), ("bandwidth", 16 << 20),
    ("latency", 8), ("latency-wait", 8)], rows
assert all(r["transports"] == "posix,cma,self" for r in rows), rows
for r in rows:
    check_row(r, 1)
    if r["metric"] == "bandwidth":
        assert r["frame_bytes"] > r["payload_bytes"], r  # the frame carries its header too
assert shm["payload_copies_on_send"] == 0 and shm["payload_copies_after_receive"] == 0, shm
# The tensor is in the write state of ucx_perftest's send buffer: written over shared memory (by
# default in the engine's payload storage, with --source as-peer in 4 KiB pages, none of them
# huge); over tcp never written, and still unwritten (nothing resident) after every run;
# --source written writes it there too.
assert shm["source"] == "engine", shm
assert all(r["tensor"] == "engine" for r in rows if r["metric"] == "bandwidth"), rows
assert all("tensor" not in r for r in rows if r["metric"] != "bandwidth"), rows
assert "unwritten_tensor_resident_bytes" not in shm, shm
assert list(shm["tensor_huge_page_bytes"]) == ["engine"], shm
assert shm["tensor_huge_page_bytes"]["engine"]["fewest"] >= 0, shm
assert as_peer["source"] == "as-peer", as_peer
assert [(r["transports"], r["tensor"]) for r in as_peer["rows"]] == [("posix,cma,self", "written")]
assert as_peer["tensor_huge_page_bytes"] == {"written": {"fewest": 0, "most": 0}}, as_peer
assert [(r["transports"], r["tensor"]) for r in tcp["rows"]] == [("tcp", "unwritten")], tcp
assert tcp["unwritten_tensor_resident_bytes"] == 0, tcp
assert tcp_written["source"] == "written", tcp_written
assert [r["tensor"] for r in tcp_written["rows"]] == ["written"], tcp_written
assert "unwritten_tensor_resident_bytes" not in tcp_written, tcp_written
for report in (tcp, tcp_written, as_peer):
    check_row(report["rows"][0], 1)
    assert report["payload_copies_on_send"] == 0 == report["payload_copies_after_receive"], report
assert "posix" in shm["transport_info"]["posix,cma,self"], shm["transport_info"]
assert [r["metric"] for r in pairs["rows"]] == ["latency"], pairs
check_row(pairs["rows"][0], 2)
print("bench transport --quick: %s" % ", ".join(
    "%s %s %.2fx" % (r["metric"], r["payload_bytes"], r["ratio"]) for r in rows))
PY

# The text report: its whole header (no line cut short), and each row's ratio with its pairs'
# lowest and highest ratio.
timeout 120 "$troupe" bench transport --quick --only shm,latency >"$tmp/text.out" 2>"$tmp/text.err" ||
  { echo "FAIL: bench transport (text report) exited non-zero" >&2; exit 1; }
for want in "^transport::ucx_transport vs ucx_perftest" "^figures: " "^bandwidth frames: .*frame size$" \
  "^tensor: in the write state of ucx_perftest's send buffer, from our own allocator \(--source engine\): .*zero page\)$" \
  "^latency: one-way = half a round trip of an 8-byte frame, median \(mean\)$" \
  "^latency +8 B +posix,cma,self +- .* [0-9.]+x +[0-9.]+-[0-9.]+x +<= 2x peer +(met|NOT MET)$"; do
  grep -Eq "$want" "$tmp/text.out" ||
    { echo "FAIL: text report: no line matching '$want'" >&2; cat "$tmp/text.out" >&2; exit 1; }
done

# Bad input: one line naming the word at fault, exit 1, nothing on stdout.
rc=0
timeout 60 "$troupe" bench transport --quick --only shm,bogus >"$tmp/bad.out" 2>"$tmp/bad.err" || rc=$?
[[ $rc -eq 1 ]] || { echo "FAIL: --only bogus: exit $rc, expected 1" >&2; exit 1; }
[[ $(wc -l <"$tmp/bad.err") -eq 1 ]] || { echo "FAIL: --only bogus: stderr not one line" >&2; exit 1; }
grep -q "'bogus'" "$tmp/bad.err" || { echo "FAIL: --only bogus: stderr does not name it" >&2; exit 1; }
[[ ! -s "$tmp/bad.out" ]] || { echo "FAIL: --only bogus: wrote a report" >&2; exit 1; }
rc=0
timeout 60 "$troupe" bench transport --quick --only tcp --source bogus >"$tmp/bad.out" 2>"$tmp/bad.err" || rc=$?
[[ $rc -ne 0 ]] || { echo "FAIL: --source bogus: exit 0" >&2; exit 1; }
[[ $(wc -l <"$tmp/bad.err") -eq 1 ]] || { echo "FAIL: --source bogus: stderr not one line" >&2; exit 1; }
grep -q -- "--source" "$tmp/bad.err" || { echo "FAIL: --source bogus: stderr does not name it" >&2; exit 1; }
[[ ! -s "$tmp/bad.out" ]] || { echo "FAIL: --source bogus: wrote a report" >&2; exit 1; }
echo "PASS"
