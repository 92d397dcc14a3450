#!/usr/bin/python3
"""Where the fitted cost model's remaining error is, and which features would remove it.

A numpy/scipy copy of dpbalance-calibrate's fit (the same feature family, non-negative least
squares on relative error with the same reweighting idea, 5-fold CV), used to try candidate
features before they go into the C++ family. Figures in docs/cost-model.md ("Where the
remaining error is") come from:

    /usr/bin/python3 scripts/studies/calibration_feature_study.py gqa
    /usr/bin/python3 scripts/studies/calibration_feature_study.py packed

Needs Debian's python3-numpy and python3-scipy. Takes seconds (gqa) to a minute (packed): the
scheduling simulations are plain Python.
"""
import heapq
import json
import pathlib
import sys

import numpy as np
from scipy.optimize import nnls

DATA = pathlib.Path(__file__).resolve().parents[2] / "integration/calibrate/data"
WAVE_WIDTHS = [1, 2, 4, 8, 16, 32, 64, 128]
KNEES = [16, 32, 64, 128, 256, 512]


def base_features(r):
    """The C++ family's terms (runtime/include/dpbalance/cost_model.h, CostTerm)."""
    c = np.array(r["ctx"], float)
    q = np.array(r["q"], float)
    K, C, mK = c.sum(), (q * c).sum(), c.max()
    f = [1, len(c), q.sum(), C, K, (q * c).max(), mK]
    f += [max(K / w, mK) for w in WAVE_WIDTHS]
    f += [max(C / w, mK) for w in WAVE_WIDTHS]
    f += [max(0, q.sum() - k) for k in KNEES]
    return f


def batch_waves(r):
    """Candidate: the longest request once per wave of w requests, max ctx x ceil(B / w)."""
    c = np.array(r["ctx"], float)
    return [c.max() * np.ceil(len(c) / w) for w in [1, 2, 4, 8, 16, 32]]


def makespan(ctx, slots, heads, per_block=0.0):
    """List scheduling of the attention grid in launch order (head-major, then request) over
    `slots` concurrent blocks; a block of request i lasts ctx_i (+ per_block) key steps."""
    free = [0.0] * slots
    for _ in range(heads):
        for c in ctx:
            t = heapq.heappop(free)
            heapq.heappush(free, t + c + per_block)
    return max(free)


def grid_schedule(r, heads=128):
    """Candidate: simulated makespans for a bank of slot counts (not expressible from sums)."""
    ctx = [float(x) for x in r["ctx"]]
    return [makespan(ctx, s, heads, pb) for s in (132, 264, 528) for pb in (0.0, 1024.0)]


def packed_schedule(r, heads=128, block_rows=64):
    """Candidate for heads packed as rows: request i is ceil(heads q_i / block_rows) blocks of
    ctx_i keys, launched request by request."""
    jobs = []
    for c, q in zip(r["ctx"], r["q"]):
        jobs += [float(c)] * -(-heads * q // block_rows)
    out = []
    for s in (132, 264, 528):
        free = [0.0] * s
        for j in jobs:
            t = heapq.heappop(free)
            heapq.heappush(free, t + j)
        out.append(max(free))
    return out


def design(rows, extras):
    X = []
    for r in rows:
        f = np.array(base_features(r) + [v for e in extras for v in e(r)], float)
        multi = 1.0 if max(r["q"]) > 1 else 0.0
        X.append(np.concatenate([f, f * multi, f * (1 - multi)]))  # base + per-path extras
    return np.array(X)


def fit(X, y, rounds=8):
    w = np.ones(len(y))
    for _ in range(rounds):
        A = X / y[:, None] * w[:, None]
        scale = A.std(0) + 1e-30
        coef, _ = nnls(A / scale, w)
        coef /= scale
        ape = np.abs(X @ coef - y) / y
        w = 1 / np.sqrt(np.maximum(ape, 0.01))  # towards absolute relative error
    return coef


def cross_validate(X, y, folds=5, seed=1):
    idx = np.random.default_rng(seed).permutation(len(y))
    pred = np.zeros(len(y))
    for part in np.array_split(idx, folds):
        train = np.setdiff1d(idx, part)
        pred[part] = X[part] @ fit(X[train], y[train])
    return np.abs(pred - y) / y


def main():
    variant = sys.argv[1] if len(sys.argv) > 1 else "gqa"
    path = DATA / f"attention_fa2_{variant}.train.jsonl"
    rows = [json.loads(line) for line in path.open()]
    y = np.array([r["attn_ms"] for r in rows]) * 1000
    multi = np.array([max(r["q"]) > 1 for r in rows])
    small = np.array([len(r["ctx"]) < 8 for r in rows])
    print(f"{variant}: {len(rows)} rows ({multi.sum()} multi-query, {(~multi).sum()} single)")
    for name, extras in [("family as in C++", []),
                         ("+ max ctx x ceil(B/w)", [batch_waves]),
                         ("+ simulated grid schedule", [grid_schedule]),
                         ("+ simulated packed schedule", [packed_schedule])]:
        ape = cross_validate(design(rows, extras), y)
        single = ape[~multi].mean() if (~multi).any() else float("nan")
        print(f"  {name:28s} 5-fold CV mape {ape.mean():.4f} p90 {np.percentile(ape, 90):.4f}"
              f" | multi {ape[multi].mean():.4f} single {single:.4f} | B<8 {ape[small].mean():.4f}")


if __name__ == "__main__":
    main()
