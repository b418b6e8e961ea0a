#!/usr/bin/env python3
"""Compare troupe's per-step metrics with the PyTorch reference.

    python compare_losses.py EXPECTED_JSON METRICS_JSONL [--rtol 1e-4] [--lr-rtol 1e-6] [--norm-rtol 1e-3]

EXPECTED_JSON is hf_reference.py's expected.json ({"losses", "grad_norms", "lrs"}); METRICS_JSONL
has one JSON object per line with `step` (0- or 1-based; lines are sorted by it), `loss` and
optionally `lr` and `grad_norm`. Lines without `loss` (for example validation records) are
ignored. Exit 0 when every compared value is within its relative tolerance, 1 otherwise (also when
the number of steps differs), 2 on unreadable input. Standard library only.
"""

import argparse
import json
import math
import sys


def load_metrics(path):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"compare_losses: {path}:{n}: not JSON: {e}")
            if not isinstance(obj, dict) or "loss" not in obj:
                continue
            if "step" not in obj:
                raise SystemExit(f"compare_losses: {path}:{n}: no `step` field")
            rows.append(obj)
    rows.sort(key=lambda o: o["step"])
    steps = [o["step"] for o in rows]
    if len(set(steps)) != len(steps):
        raise SystemExit(f"compare_losses: {path}: repeated step numbers")
    return rows


def rel_err(expected, got):
    if not (isinstance(got, (int, float)) and math.isfinite(got)):
        return math.inf
    if expected == got:
        return 0.0
    return abs(got - expected) / max(abs(expected), 1e-30)


def compare(label, expected, got, rtol):
    """Print a table and return (ok, worst rel err, worst index)."""
    print(f"{label} (rtol {rtol:g})")
    print(f"  {'step':>4}  {'expected':>16}  {'got':>16}  {'rel err':>10}")
    worst, worst_i, ok = 0.0, None, True
    for i, (e, g) in enumerate(zip(expected, got)):
        r = rel_err(e, g)
        bad = not r <= rtol
        ok &= not bad
        if worst_i is None or r > worst:
            worst, worst_i = r, i
        gs = f"{g:16.9g}" if isinstance(g, (int, float)) else f"{g!s:>16}"
        print(f"  {i:4d}  {e:16.9g}  {gs}  {r:10.3e}{'  MISMATCH' if bad else ''}")
    if worst_i is not None:
        print(f"  worst: step {worst_i}, rel err {worst:.3e} -> {'ok' if ok else 'FAIL'}")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("expected", help="expected.json from hf_reference.py")
    ap.add_argument("metrics", help="troupe's metrics JSONL")
    ap.add_argument("--rtol", type=float, default=1e-4, help="loss relative tolerance (default 1e-4)")
    ap.add_argument("--lr-rtol", type=float, default=1e-6, help="lr relative tolerance (default 1e-6)")
    ap.add_argument("--norm-rtol", type=float, default=1e-3, help="grad_norm relative tolerance (default 1e-3)")
    args = ap.parse_args()

    try:
        with open(args.expected) as f:
            expected = json.load(f)
        rows = load_metrics(args.metrics)
    except OSError as e:
        print(f"compare_losses: {e}", file=sys.stderr)
        return 2

    exp_losses = expected["losses"]
    ok = True
    if len(rows) != len(exp_losses):
        print(f"step count differs: expected {len(exp_losses)}, got {len(rows)}")
        ok = False
    n = min(len(rows), len(exp_losses))

    ok &= compare("loss", exp_losses[:n], [o["loss"] for o in rows[:n]], args.rtol)
    for key, exp_key, rtol in (("lr", "lrs", args.lr_rtol), ("grad_norm", "grad_norms", args.norm_rtol)):
        if exp_key not in expected:
            continue
        if not all(key in o for o in rows[:n]):
            print(f"{key}: not in every metrics line, not compared")
            continue
        ok &= compare(key, expected[exp_key][:n], [o[key] for o in rows[:n]], rtol)

    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
