#!/usr/bin/env python3
"""Where a live run's whole-stream goodput goes: each arm's stream split at the steady window
that `live_bench.py summarize` measures goodput on (live_bench.steady_window), from the client
records `scripts/live_vllm.sh --keep-logs DIR` keeps (DIR/runs/WORKLOAD/dpN/ARM_rR/client.json).

Per arm (replicates averaged): the wall time; until the first token; the ramp (first token to
the steady window's start: the first batch's prefills); the steady window; the drain (the
window's end to the last token: the last admitted requests and the longest outputs); and the
output tokens and tokens per second of each phase.

  scripts/studies/live_phases.py DIR/runs/WORKLOAD/dpN [--json OUT]
"""
import argparse
import glob
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "integration", "vllm"))
import live_bench  # noqa: E402  (steady_window: the one definition of the steady state)

PHASES = ("ramp", "steady", "drain")


def phases(client):
    """{phase: (seconds, tokens)} plus wall and first-token seconds, or None without a window."""
    window = live_bench.steady_window(client)
    if window is None:
        return None
    start, end, steady_tokens = window
    stamps = [(t, n) for r in client["requests"] for t, n in r.get("stamps", [])]
    first = min(t for t, _ in stamps)
    last = max(t for t, _ in stamps)
    # The steady window's tokens are steady_window's own (a stamp on a boundary is inside it);
    # the ramp holds the stamps before it and the drain every other.
    ramp_tokens = sum(n for t, n in stamps if t < start)
    drain_tokens = sum(n for _, n in stamps) - ramp_tokens - steady_tokens
    return {"wall_s": client["wall_s"], "first_token_s": first,
            "ramp": (start - first, ramp_tokens), "steady": (end - start, steady_tokens),
            "drain": (last - end, drain_tokens)}


def arm_name(run_dir):
    return os.path.basename(run_dir.rstrip("/")).rsplit("_r", 1)[0]


def summarize(root):
    by_arm = {}
    for run_dir in sorted(glob.glob(os.path.join(root, "*_r*"))):
        path = os.path.join(run_dir, "client.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            p = phases(json.load(f))
        if p is not None:
            by_arm.setdefault(arm_name(run_dir), []).append(p)
    out = {}
    for arm, runs in by_arm.items():
        row = {"instances": len(runs),
               "wall_s": statistics.mean(r["wall_s"] for r in runs),
               "first_token_s": statistics.mean(r["first_token_s"] for r in runs)}
        for name in PHASES:
            secs = statistics.mean(r[name][0] for r in runs)
            toks = statistics.mean(r[name][1] for r in runs)
            row[name] = {"s": secs, "tokens": toks, "tok_per_s": toks / secs if secs > 0 else None}
        out[arm] = row
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root", help="DIR/runs/WORKLOAD/dpN of a kept live run")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    rows = summarize(a.root)
    if not rows:
        raise SystemExit(f"live_phases: no arm with a steady window under {a.root}")
    print(f"{'arm':12} {'n':>2} {'wall s':>7} {'1st s':>6} | " +
          " | ".join(f"{p + ' s':>8} {'tok':>6} {'tok/s':>6}" for p in PHASES))
    for arm, r in rows.items():
        cells = []
        for p in PHASES:
            rate = r[p]["tok_per_s"]
            cells.append(f"{r[p]['s']:8.1f} {r[p]['tokens']:6.0f} "
                         f"{rate if rate is not None else float('nan'):6.0f}")
        print(f"{arm:12} {r['instances']:2d} {r['wall_s']:7.1f} {r['first_token_s']:6.1f} | " +
              " | ".join(cells))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
