#!/usr/bin/env python3
"""The headline table of docs/results.md section 0: ours against the engines' best, per setup.

Every row planned with production knowledge (the knowledge-parity rule), from
scripts/replay_seeds.py's --json-out files.

Per setup: our planner on SGLang DSpark's engine ("D z1.2 + goodput (tiers)") over the engines'
best (the best, by mean goodput over the seeds, of every DSpark row and static_best on the same
tiers) and over the best of SGLang's shipped tables alone (the ctx-SPS row, our context-aware
model inside DSpark's rule, left out); TPOT p99 over the engines' best row's; our planner without
tiers over D z1.2 at its best static k; the ceiling, the same planner with the truth's model and
true acceptance on the same tiers ("D z1.2 oracle (tiers)"), over the engines' best. Means ±
standard deviations over the seeds.

Usage: scripts/parity_table.py LABEL=SEEDS_JSON [LABEL=SEEDS_JSON ...]
       scripts/parity_table.py --confidence REPLAY_JSON...   comparisons (--json files, any seeds),
           by the draft-confidence signal's quality: its AUC, DSpark's rows, ours, the ratio
"""
import json
import statistics
import sys

OURS_TIERS = "D z1.2 + goodput (tiers)"
OURS = "D z1.2 + goodput"
STATIC = "D z1.2"
STATIC_TIERS = "D z1.2 static_best tiers"
CONTEXT = "D z1.2 dspark_fill ctx-SPS"
ORACLE_TIERS = "D z1.2 oracle (tiers)"


def ratio(rows, num, den, key="goodput"):
    xs = [a / b for a, b in zip(rows[num][key], rows[den][key])]
    return statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def confidence(paths):
    """One line per confidence setting, over every run given at it (the seeds): the signal's noise
    and AUC, the engines' rows' and ours' goodput (means over the seeds), and ours over the
    engines' best (the row with the best mean; the ratio's mean ± sd over the seeds)."""
    by_sigma = {}
    for path in paths:
        with open(path) as f:
            runs = {r["name"]: r for r in json.load(f)["runs"]}
        by_sigma.setdefault(runs[OURS_TIERS].get("confidence_sigma"), []).append(runs)
    seeds = sorted({len(v) for v in by_sigma.values()})
    print(f"| confidence noise (AUC) | static_best | dspark | dspark_fill | dspark_fill ctx-SPS | "
          f"ours (tiers) | ours / the engines' best (its row), {'/'.join(map(str, seeds))} seeds |")
    print("|---|---:|---:|---:|---:|---:|---|")
    # No signal first, then from useless to perfect.
    for sigma in sorted(by_sigma, key=lambda x: (x is not None, -(x or 0))):
        group = by_sigma[sigma]
        g = {n: statistics.mean(r[n]["goodput_tok_per_s"] for r in group) for n in group[0]}
        auc = [r["D z1.2 dspark_fill"].get("confidence_auc") for r in group]
        label = "none (the estimators')" if sigma is None else \
            f"{sigma:g} ({statistics.mean(a for a in auc if a is not None):.3f})"
        engine = [n for n in group[0] if "dspark" in n or n == STATIC_TIERS]
        best = max(engine, key=lambda n: g[n])
        xs = [r[OURS_TIERS]["goodput_tok_per_s"] / r[best]["goodput_tok_per_s"] for r in group]
        sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
        print(f"| {label} | {g[STATIC_TIERS]:,.0f} | {g['D z1.2 dspark']:,.0f} | "
              f"{g['D z1.2 dspark_fill']:,.0f} | {g[CONTEXT]:,.0f} | {g[OURS_TIERS]:,.0f} | "
              f"{statistics.mean(xs):.3f}x ± {sd:.3f} ({best.replace('D z1.2 ', '')}) |")


def main():
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        return
    if sys.argv[1:2] == ["--confidence"]:
        confidence(sys.argv[2:])
        return
    print("| trace, truth (planner model) | ours / the engines' best (its row) | ours / SGLang's "
          "shipped tables' best | TPOT p99, ours / best row | ours / static_best (tiers) | "
          "untiered: ours / best static k | ceiling: oracle (tiers) / the engines' best |")
    print("|---|---|---|---|---|---|---|")
    for arg in sys.argv[1:]:
        label, path = arg.split("=", 1)
        with open(path) as f:
            data = json.load(f)
        rows = data["rows"]
        engine = [n for n in rows if "dspark" in n or n == STATIC_TIERS]
        best = max(engine, key=lambda n: rows[n]["goodput_mean"])
        shipped = max((n for n in engine if n != CONTEXT), key=lambda n: rows[n]["goodput_mean"])
        g, gs = ratio(rows, OURS_TIERS, best)
        s, ss = ratio(rows, OURS_TIERS, shipped)
        st, sts = ratio(rows, OURS_TIERS, STATIC_TIERS)
        u, us = ratio(rows, OURS, STATIC)
        c, cs = ratio(rows, ORACLE_TIERS, best)
        # replay_seeds keeps TPOT p99's mean over the seeds only: the ratio of the means.
        tp = rows[OURS_TIERS]["tpot_p99_mean"] / rows[best]["tpot_p99_mean"]
        print(f"| {label} | {g:.3f}x ± {gs:.3f} ({best}) | {s:.3f}x ± {ss:.3f} ({shipped}) | "
              f"{tp:.2f}x | {st:.3f}x ± {sts:.3f} | {u:.3f}x ± {us:.3f} | {c:.3f}x ± {cs:.3f} |")


if __name__ == "__main__":
    main()
