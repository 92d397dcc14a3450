#!/usr/bin/env python3
"""TPOT per request class, per arm, from a kept live run (`scripts/live_vllm.sh --keep-logs DIR`):
each request's TPOT and the percentiles as live_bench.py reports them (request_tpot_ms, pct);
printed per arm (all replicates pooled): p50 and p99 over all requests, p50/p99 per class, and
the slowest 1% of requests with their class, prompt and output lengths.

  scripts/studies/live_tpot_classes.py DIR/runs/mixed/dp2 [ARM ...]   (default arms: every ARM_rN found)
"""
import glob
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "integration", "vllm"))
from live_bench import pct, request_tpot_ms  # noqa: E402  (the report's own definitions)


def arm_rows(base, arm):
    rows = []
    for path in sorted(glob.glob(os.path.join(base, f"{arm}_r*", "client.json"))):
        with open(path) as f:
            for r in json.load(f)["requests"]:
                tpot = request_tpot_ms(r)
                if tpot is not None:
                    rows.append((tpot, r["cls"], r["in"], r["out"]))
    return sorted(rows)


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    base = sys.argv[1]
    arms = sys.argv[2:] or sorted({re.sub(r"_r\d+$", "", os.path.basename(d))
                                   for d in glob.glob(os.path.join(base, "*_r*"))})
    for arm in arms:
        rows = arm_rows(base, arm)
        if not rows:
            continue
        tpots = [t for t, *_ in rows]
        by_cls = {}
        for t, c, _, _ in rows:
            by_cls.setdefault(c, []).append(t)
        print(f"{arm}: {len(rows)} requests, TPOT p50 {pct(tpots, 50):.1f} p99 {pct(tpots, 99):.1f} ms; "
              + ", ".join(f"{c} {pct(v, 50):.1f}/{pct(v, 99):.1f}" for c, v in sorted(by_cls.items())))
        slow = rows[-max(1, len(rows) // 100):]
        print("  slowest 1%: " + ", ".join(f"{t:.1f} ms {c} in {i} out {o}" for t, c, i, o in slow))


if __name__ == "__main__":
    main()
