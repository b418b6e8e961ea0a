#!/usr/bin/env bash
# `troupe bench zero --quick --json` runs end to end (dp = 2, DDP, ZeRO-2 and ZeRO-3): every row
# has figures: a step time, the actors' memory report and one peak RSS per process of the
# `troupe launch` run. A smoke test: no figure is compared with a goal, benchmarks assert
# nothing.
# Usage: cli_bench_zero.sh TROUPE
set -euo pipefail
troupe=${1:?usage: cli_bench_zero.sh TROUPE}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if ! timeout 240 "$troupe" bench zero --quick --json --zero-levels 0,2,3 >"$tmp/out.json" \
  2>"$tmp/err.txt"; then
  echo "FAIL: bench zero exited non-zero" >&2
  tail -n 5 "$tmp/err.txt" >&2
  exit 1
fi
/usr/bin/python3 - "$tmp/out.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
cases = report["cases"]
assert [(c["dp"], c["zero"]) for c in cases] == [(2, 0), (2, 2), (2, 3)], cases
for c in cases:
    assert "error" not in c, c
    assert c["step_ms"] > 0 and c["memory"]["model_state"] > 0, c
    assert len(c.get("peak_rss_bytes", [])) == 2, c
    assert all(b > c["memory"]["model_state"] for b in c["peak_rss_bytes"]), c
assert cases[1]["step_time_vs_ddp"] > 0, cases[1]
print("bench zero --quick: %d rows, peak RSS per rank %s" %
      (len(cases), [c.get("peak_rss_bytes") for c in cases]))
PY
