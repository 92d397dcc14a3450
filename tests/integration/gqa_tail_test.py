#!/usr/bin/env python3
"""scripts/studies/gqa_tail.py's fitting helpers against brute force, and its between-configurations
pass on made-up rows whose answer is known.

- `isotonic_l1` (pool adjacent violators with medians) against every non-decreasing sequence of
  the data's own values (an L1 optimum takes them), on random short sequences: same cost.
- `weighted_median` against the minimiser of sum w |v - m| over the values.
- `between_configurations` on four verify rows: one dominated batch that ran longer (beyond both
  rows' 7-call ranges), one that ran shorter; it must count one violation, one beyond the ranges.

  python3 tests/integration/gqa_tail_test.py
"""
import contextlib
import io
import itertools
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from script_checks import Checks, load_module  # noqa: E402

gqa_tail = load_module("gqa_tail", "scripts", "studies", "gqa_tail.py")
checks = Checks()
check = checks.check


def brute_isotonic_cost(y):
    values = sorted(set(y))
    best = None
    for f in itertools.combinations_with_replacement(values, len(y)):  # non-decreasing
        cost = sum(abs(a - b) for a, b in zip(f, y))
        best = cost if best is None else min(best, cost)
    return best


rng = random.Random(7)
worst = 0.0
for trial in range(300):
    y = [rng.choice([0.0, 1.0, 2.5, 3.0, 4.0, rng.random() * 5]) for _ in range(rng.randint(1, 6))]
    f = gqa_tail.isotonic_l1(y)
    monotone = all(a <= b for a, b in zip(f, f[1:]))
    cost = sum(abs(a - b) for a, b in zip(f, y))
    if not monotone:
        worst = float("inf")
    worst = max(worst, cost - brute_isotonic_cost(y))
check("isotonic_l1 is non-decreasing and as good as brute force (300 sequences)", worst <= 1e-9,
      f"(largest excess {worst})")

worst = 0.0
for trial in range(300):
    n = rng.randint(1, 7)
    v = [rng.random() for _ in range(n)]
    w = [rng.random() + 0.01 for _ in range(n)]
    m = gqa_tail.weighted_median(v, w)
    cost = lambda c: sum(wi * abs(vi - c) for vi, wi in zip(v, w))
    worst = max(worst, cost(m) - min(cost(c) for c in v))
check("weighted_median minimises the weighted absolute deviation (300 cases)", worst <= 1e-12,
      f"(largest excess {worst})")


def row(ctx, ms, lo, hi):
    return {"ctx": ctx, "q": [2] * len(ctx), "attn_ms": ms, "attn_ms_min": lo, "attn_ms_max": hi}


# Row 1 dominates row 0 (longer request) yet ran faster, beyond both ranges; row 3 dominates
# row 2 and ran longer (no violation); rows 0 and 2 are incomparable (row 2 has two requests).
rows = [row([64 * 600], 1.5, 1.45, 1.55), row([64 * 700], 1.3, 1.25, 1.35),
        row([64 * 100, 64 * 50], 0.4, 0.39, 0.41), row([64 * 100, 64 * 60], 0.5, 0.49, 0.51)]
out = io.StringIO()
with contextlib.redirect_stdout(out):
    gqa_tail.between_configurations(rows)
text = out.getvalue()
check("between_configurations counts the one violation, beyond both ranges",
      "in 1 the dominated one ran longer, in 1 of them by more than" in text, text.splitlines()[0])
check("between_configurations finds both dominance pairs (row 3's longest equals row 2's)",
      "(4 rows): 2 pairs where" in text)
check("between_configurations names the rows of the violation",
      "row 0 (1 request(s), longest 600 key blocks) took 15.4% longer than row 1" in text)

checks.finish()
