#!/usr/bin/env python3
"""Plots dpbalance-replay results: bubble fraction and goodput by strategy, one figure per trace.

Usage: scripts/plot_results.py docs/generated/replay_mooncake.json docs/results_mooncake.png [title]
Needs matplotlib (Debian: apt-get install python3-matplotlib; run with /usr/bin/python3).
"""
import json
import sys

if __name__ == "__main__" and sys.argv[1:2] in (["-h"], ["--help"]):
    print(__doc__)  # before importing matplotlib, which --help does not need
    sys.exit(0)

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst, title):
    runs = json.load(open(src))["runs"]
    names = [r["name"] for r in runs]
    bubble = [100 * r["bubble_fraction"] for r in runs]
    goodput = [r["goodput_tok_per_s"] / 1000 for r in runs]
    colors = []
    for r in runs:
        if r["routing"] == "ideal":
            colors.append("#888888")
        elif r["verify_mode"] in ("dspark", "dspark_fill"):
            colors.append("#e7298a")
        elif r["verify_mode"] in ("goodput", "oracle", "fill", "local"):
            colors.append("#d95f02" if r["verify_mode"] == "goodput" else "#fdb863")
        else:
            colors.append("#1b9e77" if r["routing"] == "E" else "#7570b3")
    ref = next(r for r in runs if r["name"] == "D z1.2")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 6), sharey=True)
    y = range(len(runs))
    ax1.barh(y, bubble, color=colors)
    ax1.set_xlabel("bubble fraction, % (1 - mean/max rank attention)")
    ax1.axvline(100 * ref["bubble_fraction"], color="k", lw=0.8, ls=":")
    ax2.barh(y, goodput, color=colors)
    ax2.set_xlabel("goodput, thousand tokens/s")
    lo = min(goodput) * 0.97
    ax2.set_xlim(lo, max(goodput) * 1.01)
    ax2.axvline(ref["goodput_tok_per_s"] / 1000, color="k", lw=0.8, ls=":")
    for i, (b, g) in enumerate(zip(bubble, goodput)):
        ax1.text(b, i, f" {b:.1f}", va="center", fontsize=8)
        ax2.text(g, i, f" {g:.1f}", va="center", fontsize=8)
    ax1.set_yticks(list(y))
    ax1.set_yticklabels([f"{n} (k={r['k']})" if r["verify_mode"] == "off" and r["routing"] != "ideal" else n
                         for n, r in zip(names, runs)])
    ax1.invert_yaxis()
    fig.suptitle(title + "\npurple: routing only (best static k), green: ours (E), orange: verify "
                 "balancing, pink: SGLang DSpark (token tiers), grey: ideal; dotted: D z1.2", fontsize=10)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else sys.argv[1])
