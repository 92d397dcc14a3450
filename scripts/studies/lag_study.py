#!/usr/bin/env python3
"""What one step of lag costs the planner, and which part of planning on the predicted state wins
it back (docs/results.md, "Lag").

For each truth and planner row, runs `dpbalance-replay --compare=false` at lag 0, at lag 1 with
every prediction (lag.h), with none, and with all but one part (context, cap, gain, slo), over
seeds 1..N, and prints the mean goodput and its change against lag 0, with each row's waste
(query tokens that could emit nothing), planned-vs-run step time and emitted-vs-expected tokens.

Usage: scripts/studies/lag_study.py REPLAY_BINARY SEEDS
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

H200 = ["--truth", "docs/generated/model_packed.json", "--truth_layers", "61"]
# (name, flags): the planner rows of the comparison as it runs them: the DSpark section's row on
# tiers with the block draft at its static_best k and no TPOT SLO; the MTP section's row at D
# z1.2's best static k under the auto SLO (that static run's TPOT p99).
ROWS = [
    ("Mooncake V2, D + goodput (tiers, block draft)",
     ["--verify", "goodput", "--padded=true", "--draft", "block", "--k", "2", "--tpot_slo_ms=off"]),
    ("Mooncake V2, D + goodput (MTP draft)", ["--verify", "goodput", "--k", "1"]),
    ("H200 packed, D + goodput (tiers, block draft)",
     H200 + ["--verify", "goodput", "--padded=true", "--draft", "block", "--k", "5", "--tpot_slo_ms=off"]),
    ("H200 packed, D + goodput (MTP draft)", H200 + ["--verify", "goodput", "--k", "5"]),
]
CONFIGS = [
    ("lag 0", ["--stale_steps", "0"]),
    ("lag 1, predicted", ["--stale_steps", "1", "--lag_predict", "all"]),
    ("lag 1, as seen", ["--stale_steps", "1", "--lag_predict", "none"]),
    ("lag 1, all but context", ["--stale_steps", "1", "--lag_predict", "cap,gain,slo"]),
    ("lag 1, all but cap", ["--stale_steps", "1", "--lag_predict", "context,gain,slo"]),
    ("lag 1, all but gain", ["--stale_steps", "1", "--lag_predict", "context,cap,slo"]),
    ("lag 1, all but slo", ["--stale_steps", "1", "--lag_predict", "context,cap,gain"]),
]


def run(binary, flags, seed):
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        subprocess.run([binary, "--compare=false", "--routing", "D", "--seed", str(seed),
                        "--json", path, *flags], check=True, stdout=subprocess.DEVNULL)
        with open(path) as f:
            return [r for r in json.load(f)["runs"] if r["routing"] != "ideal"][0]
    finally:
        os.unlink(path)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    binary, seeds = sys.argv[1], int(sys.argv[2])
    for name, row_flags in ROWS:
        print(f"== {name} ({' '.join(row_flags)}), seeds 1..{seeds}")
        print(f"  {'config':26} {'goodput':>9} {'vs lag 0':>9} {'min':>9} {'max':>9} {'wasted':>7} "
              f"{'step/plan':>9} {'tok/plan':>8} {'tpot99':>7}")
        base = None
        for label, flags in CONFIGS:
            rs = [run(binary, row_flags + flags, s) for s in range(1, seeds + 1)]
            g = [r["goodput_tok_per_s"] for r in rs]
            mean = statistics.mean(g)
            base = base or mean
            print(f"  {label:26} {mean:9.1f} {100 * (mean / base - 1):+8.2f}% {min(g):9.1f} {max(g):9.1f} "
                  f"{statistics.mean(r['wasted_token_fraction'] for r in rs):7.4f} "
                  f"{statistics.mean(r['step_over_plan'] for r in rs):+9.4f} "
                  f"{statistics.mean(r['tokens_over_plan'] for r in rs):+8.4f} "
                  f"{statistics.mean(r['tpot_p99_ms'] for r in rs):7.2f}", flush=True)


if __name__ == "__main__":
    main()
