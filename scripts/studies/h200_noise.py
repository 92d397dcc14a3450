#!/usr/bin/env python3
"""The noise a gqa timing row carries, measured by timing the same configurations again on an
H200 (scripts/studies/h200_remeasure.py), and what it leaves of a held-out p90 (docs/cost-model.md).

Usage: h200_noise.py ROWS REMEASURED DUMP [--session2 FILE] [--denoised OUT]
  ROWS        the shared timing rows (integration/calibrate/data/attention_fa2_gqa.train.jsonl)
  REMEASURED  h200_remeasure.py's output for ROWS (docs/generated/h200_gqa_remeasure.jsonl)
  DUMP        `dpbalance-calibrate --train ROWS --kernel fa2-gqa-h200 --cv 5 --dump DUMP`
              (the last column: each row's out-of-fold prediction, in microseconds)
  FILE        a second session's short passes (h200_remeasure.py --passes short-1,short-2,short-3
              on another machine): its pass-to-pass and cross-session figures, and its passes
              join the truth of sections 2 and 3, each session's median offset divided out
  OUT         writes ROWS with each short row's attn_ms replaced by the mean of its shared and
              fresh timings (4, or 7 with a second session), for `dpbalance-calibrate --train OUT --cv 5 --dump DUMP2`
              (a fit and a CV judged against labels with a quarter of the noise variance);
              then `h200_noise.py ROWS REMEASURED DUMP2` scores those predictions too

Prints, with no model: the same configuration timed twice, shared row against each fresh pass and
pass against pass (the same session, minutes apart). Then the floor: the p90 a model that knew
each configuration's true mean time would show against one measured row, with a bootstrap
interval. Then our model's out-of-fold predictions against the shared rows and against the mean
of the fresh passes (a truth with less noise, measured independently of every fit).
"""
import argparse
import json
import math
import random
import statistics
import sys

PASSES_SHORT = ("short-1", "short-2", "short-3")
PASS_PAIRS = (("short-2", "short-1"), ("short-3", "short-1"), ("short-3", "short-2"))


def pct(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]  # SummarizeErrors' index for 0.9


def line(name, errors):
    a = [abs(e) for e in errors]
    return (f"{name:<46} n={len(a):3d}  MAPE {100 * statistics.mean(a):5.1f}%  p50 "
            f"{100 * pct(a, 0.5):5.1f}%  p90 {100 * pct(a, 0.9):5.1f}%  max {100 * max(a):5.1f}%"
            f"  median signed {100 * statistics.median(errors):+5.1f}%")


def boot_p90(errors, draws=2000, seed=1):
    rng = random.Random(seed)
    a = [abs(e) for e in errors]
    ps = sorted(pct([rng.choice(a) for _ in a], 0.9) for _ in range(draws))
    return ps[int(0.025 * draws)], ps[int(0.975 * draws)]


def load_passes(path):
    """h200_remeasure.py's output: {pass: {row: attn_ms}}."""
    passes = {}
    with open(path) as f:
        for line_ in f:
            r = json.loads(line_)
            passes.setdefault(r["pass"], {})[r["row"]] = r["attn_ms"]
    return passes


def main():
    ap = argparse.ArgumentParser(usage="h200_noise.py ROWS REMEASURED DUMP [--session2 FILE] "
                                       "[--denoised OUT]", description=__doc__)
    ap.add_argument("rows")
    ap.add_argument("remeasured")
    ap.add_argument("dump")
    ap.add_argument("--session2")
    ap.add_argument("--denoised")
    args = ap.parse_args()
    denoised_out = args.denoised
    with open(args.rows) as f:
        rows = [json.loads(l) for l in f]
    fresh = load_passes(args.remeasured)
    fresh2 = load_passes(args.session2) if args.session2 else {}
    with open(args.dump) as f:
        oof = [float(l.split()[-1]) / 1000 for l in f]
    if len(oof) != len(rows):
        sys.exit(f"h200_noise: {args.dump} has {len(oof)} rows, {args.rows} {len(rows)}")
    shared = [r["attn_ms"] for r in rows]
    short = sorted(fresh["short-1"])
    long_ = sorted(fresh.get("long", {}))

    print("1. The same configuration timed again, no model (error = a / b - 1)")
    for p in PASSES_SHORT:
        print(line(f"short rows: {p} / shared", [fresh[p][i] / shared[i] - 1 for i in short]))
    for a, b in PASS_PAIRS:
        print(line(f"short rows: {a} / {b} (one session)", [fresh[a][i] / fresh[b][i] - 1 for i in short]))
    if fresh2:
        for a, b in PASS_PAIRS:
            print(line(f"short rows: session 2 {a} / {b}", [fresh2[a][i] / fresh2[b][i] - 1 for i in short]))
        m1 = {i: statistics.mean(fresh[p][i] for p in PASSES_SHORT) for i in short}
        m2 = {i: statistics.mean(fresh2[p][i] for p in PASSES_SHORT) for i in short}
        print(line("short rows: session 2 mean / session 1 mean", [m2[i] / m1[i] - 1 for i in short]))
    bias = statistics.median(fresh["long"][i] / shared[i] for i in long_)
    print(line("long rows: fresh / shared", [fresh["long"][i] / shared[i] - 1 for i in long_]))
    print(f"   (the long rows ran {100 * (bias - 1):+.1f}% slower in the fresh session; "
          "below they are compared after dividing that out)")

    print("\n2. The floor: a model that knew each configuration's true mean, against one row")
    # Short rows: the shared row against the mean of the fresh passes. The mean of n carries 1/n
    # of one row's noise variance, so the deviation is scaled by sqrt(1 / (1 + 1/n)).
    # Long rows: one fresh pass, bias divided out, scaled by sqrt(1/2) (two equal noises).
    # With a second session, its three passes join the mean (each session's median offset
    # against the shared rows divided out): six passes, scaled by sqrt(1 / (1 + 1/6)).
    sessions = [fresh] + ([fresh2] if fresh2 else [])
    offsets = [statistics.median(statistics.mean(f[p][i] for p in PASSES_SHORT) / shared[i]
                                 for i in short) for f in sessions]
    n_short = 3 * len(sessions)

    def short_truth(i):
        return statistics.mean(f[p][i] / o for f, o in zip(sessions, offsets) for p in PASSES_SHORT)

    if fresh2:
        print(f"   (short rows, each session's median offset against the shared rows: "
              f"{', '.join(f'{100 * (o - 1):+.1f}%' for o in offsets)}; divided out)")
    floor = {}
    for i in short:
        floor[i] = (shared[i] / short_truth(i) - 1) * math.sqrt(n_short / (n_short + 1))
    for i in long_:
        floor[i] = (shared[i] / (fresh["long"][i] / bias) - 1) * math.sqrt(1 / 2)
    e = [floor[i] for i in sorted(floor)]
    lo, hi = boot_p90(e)
    print(line("all rows: perfect model / one shared row", e) + f"  p90 95% CI {100 * lo:.1f}-{100 * hi:.1f}%")
    # The same within the fresh session alone: pass 1 against the mean of passes 2 and 3.
    e1 = [(fresh["short-1"][i] / statistics.mean((fresh["short-2"][i], fresh["short-3"][i])) - 1)
          * math.sqrt(2 / 3) for i in short]
    print(line("short rows, fresh session: perfect / one pass", e1))
    print(line("short rows, shared: perfect / one row", [floor[i] for i in short]))

    print("\n3. Our model's out-of-fold predictions (5-fold CV on the shared rows)")
    print(line("all rows: against the shared rows", [oof[i] / shared[i] - 1 for i in range(len(rows))]))
    truth = {i: short_truth(i) for i in short}
    truth.update({i: fresh["long"][i] / bias for i in long_})
    m = [oof[i] / truth[i] - 1 for i in sorted(truth)]
    lo, hi = boot_p90(m)
    print(line("all rows: against the fresh mean", m) + f"  p90 95% CI {100 * lo:.1f}-{100 * hi:.1f}%")
    print(line("short rows: against the shared rows", [oof[i] / shared[i] - 1 for i in short]))
    print(line("short rows: against the fresh mean", [oof[i] / truth[i] - 1 for i in short]))
    if denoised_out:
        with open(denoised_out, "w") as f:
            for i, r in enumerate(rows):
                if i in fresh["short-1"]:
                    r = dict(r, attn_ms=statistics.mean(
                        [shared[i]] + [f[p][i] for f in sessions for p in PASSES_SHORT]))
                f.write(json.dumps(r) + "\n")
        print(f"\nwrote {denoised_out}: {len(short)} short rows' attn_ms the mean of "
              f"{1 + n_short} timings")


if __name__ == "__main__":
    main()
