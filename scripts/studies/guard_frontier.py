#!/usr/bin/env python3
"""The TPOT guard against the goodput target: verify balancing and the oracle at several step
slacks (the planner's TPOT guard, DPB_STEP_SLACK), on D and E routing, over acceptance seeds.

Each seed's baseline is D z1.2 at static k = 1 (the best static k on both bundled traces); every
row runs with that seed's baseline TPOT p99 as its TPOT SLO and is divided by that seed's
baseline goodput and TPOT p99. The "none" rows run with no step guard and no SLO: the oracle's
is the most any verify-length plan reaches per step with true acceptance, at any TPOT. Prints mean ± standard error over seeds, and the worst seed's
TPOT p99 ratio (the targets: goodput >= 1.03x, TPOT p99 <= 1.05x, docs/results.md).

Usage: scripts/studies/guard_frontier.py REPLAY_BINARY [SEEDS] [extra replay flags...]
"""
import statistics
import sys

from routing_seeds import run  # one replay row as JSON: --compare=false --k 1 --seed S

SLACKS = ["0.03", "0.05", "0.07", "0.1", "none"]  # none: no step guard and no TPOT SLO (the ceiling)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    binary = sys.argv[1]
    seeds = range(1, (int(sys.argv[2]) if len(sys.argv) > 2 else 5) + 1)
    if len(seeds) < 2:
        sys.exit("guard_frontier: SEEDS must be >= 2 (a standard error needs two)")
    extra = sys.argv[3:]
    base = {s: run(binary, ["--routing", "D", "--z", "1.2"], s, extra) for s in seeds}
    print(f"{'routing':7} {'verify':8} {'slack':>5}  {'goodput x':>17}  {'TPOT p99 x':>17}  {'worst p99 x':>11}")
    for routing in ("D", "E"):
        for verify in ("goodput", "oracle"):
            for slack in SLACKS:
                good, p99 = [], []
                for s in seeds:
                    slo = base[s]["tpot_p99_ms"]
                    guard = (["--step_slack", "-1", "--tpot_slo_ms", "off"] if slack == "none" else
                             ["--step_slack", slack, "--tpot_slo_ms", f"{slo:.6f}"])
                    r = run(binary, ["--routing", routing, "--verify", verify] + guard, s, extra)
                    good.append(r["goodput_tok_per_s"] / base[s]["goodput_tok_per_s"])
                    p99.append(r["tpot_p99_ms"] / slo)
                se = lambda xs: statistics.stdev(xs) / len(xs) ** 0.5  # noqa: E731
                print(f"{routing:7} {verify:8} {slack:>5}  {statistics.mean(good):.4f} ± {se(good):.4f}"
                      f"  {statistics.mean(p99):.4f} ± {se(p99):.4f}  {max(p99):11.4f}", flush=True)


if __name__ == "__main__":
    main()
