#!/usr/bin/env python3
"""Routing rows over acceptance seeds: how far apart A, D and E are against seed-to-seed noise.

Runs `dpbalance-replay --compare=false --routing R --k 1 --seed S` for seeds 1..N and prints,
per routing, every seed's row, then the mean and standard error of bubble, cost ratio (V2 and V1)
and goodput, and the paired difference of E against each other routing (same seed, same trace,
same acceptance draws), whose standard error is the one that decides "at least as good".

Usage: scripts/studies/routing_seeds.py REPLAY_BINARY [SEEDS] [extra replay flags...]
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

CONFIGS = [("A", ["--routing", "A"]), ("D z1.2", ["--routing", "D", "--z", "1.2"]),
           ("D z1.3", ["--routing", "D", "--z", "1.3"]), ("E", ["--routing", "E"])]
KEYS = [("bubble", "bubble_fraction"), ("costR v2", "attention_cost_ratio_to_ideal_v2"),
        ("costR v1", "attention_cost_ratio_to_ideal_v1"), ("goodput", "goodput_tok_per_s")]


def run(binary, args, seed, extra):
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        subprocess.run([binary, "--compare=false", "--k", "1", "--seed", str(seed), "--json", path,
                        *args, *extra], check=True, stdout=subprocess.DEVNULL)
        with open(path) as f:
            runs = [r for r in json.load(f)["runs"] if r["routing"] != "ideal"]
    finally:
        os.unlink(path)
    if len(runs) != 1:
        sys.exit(f"routing_seeds: expected one replay row for {args} seed {seed}, got {len(runs)}")
    return runs[0]


def cell(label, key, xs, signed=False):
    """'label mean ± standard error' of xs, goodput to 0.1 tok/s, the rest to 5 decimals."""
    m, e = statistics.mean(xs), statistics.stdev(xs) / len(xs) ** 0.5
    digits = 1 if key == "goodput_tok_per_s" else 5
    return f"{label} {m:{'+' if signed else ''}.{digits}f} ± {e:.{digits}f}"


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    binary = sys.argv[1]
    seeds = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    if seeds < 2:
        sys.exit(f"routing_seeds: SEEDS = {seeds} must be >= 2 (a standard error needs two)")
    extra = sys.argv[3:]
    rows = {name: [run(binary, args, s, extra) for s in range(1, seeds + 1)] for name, args in CONFIGS}

    print(f"{'run':8} {'seed':>4} " + " ".join(f"{k:>9}" for k, _ in KEYS))
    for name, rs in rows.items():
        for s, r in enumerate(rs, 1):
            print(f"{name:8} {s:4d} {r[KEYS[0][1]]:9.4f} {r[KEYS[1][1]]:9.4f} {r[KEYS[2][1]]:9.4f} "
                  f"{r[KEYS[3][1]]:9.1f}")
    print(f"\nmean ± standard error over seeds 1-{seeds}")
    for name, rs in rows.items():
        cells = [cell(label, key, [r[key] for r in rs]) for label, key in KEYS]
        print(f"mean {name:8} " + ", ".join(cells))
    print("\npaired difference, E minus the row (negative cost ratio or bubble: E is better)")
    for name, rs in rows.items():
        if name == "E":
            continue
        cells = [cell(label, key, [a[key] - b[key] for a, b in zip(rows["E"], rs)], signed=True)
                 for label, key in KEYS]
        print(f"E - {name:8} " + ", ".join(cells))


if __name__ == "__main__":
    main()
