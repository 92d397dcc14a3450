#!/usr/bin/env python3
"""Markdown tables for docs/results.md from the replay's JSON: one row per run of a comparison
(seed 1), with the mean goodput of seeds 1-3 and their range beside it when the seeds' JSON
(scripts/replay_seeds.py --json-out) is given.

Usage: scripts/results_tables.py REPLAY_JSON [SEEDS_JSON]
"""
import json
import sys


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    runs = json.load(open(sys.argv[1]))["runs"]
    seeds = json.load(open(sys.argv[2]))["rows"] if len(sys.argv) == 3 else {}
    head = ("| run | verify | k | depth | bubble | costR v2 | goodput tok/s (seed 1) | "
            "goodput, mean of 3 seeds (range) | step ms | TPOT p50 | TPOT p99 |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in runs:
        s = seeds.get(r["name"])
        mean = (f"{s['goodput_mean']:,.0f} ({min(s['goodput']):,.0f}–{max(s['goodput']):,.0f})"
                if s else "—")
        verify = r["verify_mode"] if r["routing"] != "ideal" else "—"
        print(f"| {r['name']} | {verify} | {r['k']} | {r['mean_draft_depth']:.2f} | "
              f"{r['bubble_fraction']:.4f} | {r['attention_cost_ratio_to_ideal_v2']:.4f} | "
              f"{r['goodput_tok_per_s']:,.0f} | {mean} | {r['mean_step_ms']:.1f} | "
              f"{r['tpot_p50_ms']:.1f} | {r['tpot_p99_ms']:.1f} |")


if __name__ == "__main__":
    main()
