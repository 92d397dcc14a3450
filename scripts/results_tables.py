#!/usr/bin/env python3
"""Markdown tables for docs/results.md from the replay's JSON, one row per run of a comparison.

One row per run (seed 1), with the mean goodput of seeds 1-3 and their range beside it when the seeds' JSON
(scripts/replay_seeds.py --json-out) is given.

Usage: scripts/results_tables.py REPLAY_JSON [SEEDS_JSON] [--plan] [--extra JSON LABEL]...
  --plan               adds the column "step over plan" (the JSON's step_over_plan)
  --extra JSON LABEL   appends JSON's runs (seed 1 only), each named "NAME, LABEL", and every
                       run named in --only if given
  --only NAME[,NAME]   with --extra: only these runs of the extra JSONs
"""
import json
import sys


def row(r, s, plan):
    mean = (f"{s['goodput_mean']:,.0f} ({min(s['goodput']):,.0f}–{max(s['goodput']):,.0f})"
            if s else "—")
    verify = r["verify_mode"] if r["routing"] != "ideal" else "—"
    line = (f"| {r['name']} | {verify} | {r['k']} | {r['mean_draft_depth']:.2f} | "
            f"{r['bubble_fraction']:.4f} | {r['attention_cost_ratio_to_ideal_v2']:.4f} | "
            f"{r['goodput_tok_per_s']:,.0f} | {mean} | {r['mean_step_ms']:.1f} | "
            f"{r['tpot_p50_ms']:.1f} | {r['tpot_p99_ms']:.1f} |")
    if plan:
        sop = r.get("step_over_plan", 0.0)
        line += f" {sop * 100:+.1f}% |" if r["verify_mode"] not in ("off", "static_best", "dspark", "dspark_fill") and \
            r["routing"] != "ideal" else " — |"
    return line


def main():
    args = sys.argv[1:]
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    plan = "--plan" in args
    args = [a for a in args if a != "--plan"]
    extras, only = [], None
    while "--extra" in args:
        i = args.index("--extra")
        extras.append((args[i + 1], args[i + 2]))
        del args[i:i + 3]
    if "--only" in args:
        i = args.index("--only")
        only = set(args[i + 1].split(","))
        del args[i:i + 2]
    if len(args) not in (1, 2):
        sys.exit(__doc__)
    runs = json.load(open(args[0]))["runs"]
    seeds = json.load(open(args[1]))["rows"] if len(args) == 2 else {}
    head = ("| run | verify | k | depth | bubble | costR v2 | goodput tok/s (seed 1) | "
            "goodput, mean of 3 seeds (range) | step ms | TPOT p50 | TPOT p99 |")
    if plan:
        head += " step over plan |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in runs:
        print(row(r, seeds.get(r["name"]), plan))
    for path, label in extras:
        for r in json.load(open(path))["runs"]:
            if r["routing"] == "ideal" or r["verify_mode"] in ("off", "static_best") or \
                    (only is not None and r["name"] not in only):
                continue
            r = dict(r, name=f"{r['name']}, {label}")
            print(row(r, None, plan))


if __name__ == "__main__":
    main()
