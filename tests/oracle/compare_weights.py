#!/usr/bin/env python3
"""Compare two safetensors files tensor by tensor (for example troupe's final weights with the
PyTorch reference's expected_final.safetensors).

    python compare_weights.py EXPECTED GOT [--init INIT] [--atol 1e-5] [--rtol 1e-5] [--update-rtol 1e-3]

Names are matched with any `transformer.` prefix removed, so `transformer.h.0.ln_1.weight` and
`h.0.ln_1.weight` are the same tensor. A tensor in GOT that is larger than the expected one in
some dimensions (a padded vocabulary: wte [256, C] against [250, C]) is cut to the expected shape;
the largest magnitude in the cut-off part is reported. A tensor passes when
|got - expected| <= atol + rtol * |expected| everywhere and, with --init (the weights both runs
started from), when ||got - expected|| / ||expected - init|| <= update-rtol, i.e. the difference is
small next to how far training moved the tensor. Tensors of GOT that EXPECTED lacks (a tied
`lm_head.weight`) are listed, not compared. Exit 0 on a match, 1 on a mismatch or a missing tensor.

Loss-only comparisons over a few steps are weak (on random tokens, dropping weight decay changes
the losses by ~3e-6 relative), while the final weights show it clearly (5e-5 absolute against a
fp32 noise level near 1e-6).
"""

import argparse
import sys

import numpy as np
from safetensors.numpy import load_file


def canonical(name):
    return name.replace("transformer.", "")


def load(path):
    tensors = load_file(path)
    out = {}
    for name, t in tensors.items():
        key = canonical(name)
        if key in out:
            raise SystemExit(f"compare_weights: {path}: {name} appears twice after removing prefixes")
        out[key] = (name, t)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("expected")
    ap.add_argument("got")
    ap.add_argument("--init", help="the weights both runs started from (enables --update-rtol)")
    ap.add_argument("--atol", type=float, default=1e-5)
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--update-rtol", type=float, default=1e-3)
    args = ap.parse_args()

    expected, got = load(args.expected), load(args.got)
    init = load(args.init) if args.init else None

    ok = True
    print(f"{'tensor':42s} {'shape':>14s} {'max abs diff':>12s} {'|d|/|upd|':>10s} {'pad max':>9s}")
    for key, (name, e) in expected.items():
        if key not in got:
            print(f"{name:42s} missing from {args.got}")
            ok = False
            continue
        g = got[key][1]
        if e.dtype.kind in "iu" or g.dtype.kind in "iu":
            e64, g64 = e.astype(np.int64), g.astype(np.int64)
        else:
            e64, g64 = e.astype(np.float64), g.astype(np.float64)
        pad = ""
        if g64.shape != e64.shape:
            if g64.ndim != e64.ndim or any(gd < ed for gd, ed in zip(g64.shape, e64.shape)):
                print(f"{name:42s} shape {list(g64.shape)} differs from expected {list(e64.shape)}")
                ok = False
                continue
            cut = g64.copy()
            cut[tuple(slice(0, ed) for ed in e64.shape)] = 0
            pad = f"{np.abs(cut).max():9.2e}"
            g64 = g64[tuple(slice(0, ed) for ed in e64.shape)]
        d = np.abs(g64 - e64)
        bad = not np.all(d <= args.atol + args.rtol * np.abs(e64))
        upd = ""
        if init is not None and key in init:
            moved = np.linalg.norm(e64 - init[key][1].astype(np.float64))
            ratio = np.linalg.norm(g64 - e64) / moved if moved > 0 else (0.0 if not d.any() else np.inf)
            upd = f"{ratio:10.2e}"
            bad |= not ratio <= args.update_rtol
        ok &= not bad
        print(f"{name:42s} {str(list(e64.shape)):>14s} {d.max() if d.size else 0.0:12.3e} {upd:>10s} {pad:>9s}"
              f"{'  MISMATCH' if bad else ''}")
    extra = sorted(got[k][0] for k in got.keys() - expected.keys())
    if extra:
        print(f"not compared (only in {args.got}): {', '.join(extra)}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
