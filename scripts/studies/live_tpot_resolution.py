#!/usr/bin/env python3
"""How well does a kept live run (`scripts/live_vllm.sh --keep-logs DIR`) resolve TPOT p99, and
what are the slowest requests made of?

Per arm instance: TPOT p99 as live_bench reports it (request_tpot_ms, pct) with a bootstrap 95%
interval over its requests (2,000 resamples), the interval's half-width relative to the p99, and
the requests one instance would need for a half-width of --target (the half-width falls as
1/sqrt(requests)). Per replicate, ARM / BASE p99 with a bootstrap interval of the ratio.

Then the slowest 1% of ARM's and BASE's requests (all replicates): class, output tokens, drafts
verified per decode step (the worker logs' per-request `d`), and the share of the request's
decode time spent in gaps between its tokens longer than 3x the instance's median gap (stalls:
a step that held every request, not one request's verify length).

  scripts/studies/live_tpot_resolution.py DIR/runs/mixed/dp2 [--arm dpbalance] [--base static_k3]
                                          (--base: default static_best, live_bench's pick)
                                          [--target 0.05] [--json FILE]
"""
import argparse
import glob
import json
import os
import random
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "integration", "vllm"))
from live_bench import (base_id, best_static_k, pct, read_jsonl, request_tpot_ms,  # noqa: E402
                        summarize_arm)  # (the report's own definitions)

RESAMPLES = 2000


def instances(root, arm):
    out = {}
    for d in glob.glob(os.path.join(root, f"{arm}_r*")):
        m = re.search(r"_r(\d+)$", d)
        if m and os.path.exists(os.path.join(d, "client.json")):
            out[int(m.group(1))] = d
    return dict(sorted(out.items()))


def boot_p99(tpot, rng):
    n = len(tpot)
    return [pct([tpot[rng.randrange(n)] for _ in range(n)], 99) for _ in range(RESAMPLES)]


def interval(xs):
    xs = sorted(xs)
    return xs[int(0.025 * len(xs))], xs[int(0.975 * len(xs)) - 1]


def tail_rows(d, frac=0.01):
    """The slowest `frac` of an instance's requests: class, tokens, drafts per decode step, and
    the share of decode time in gaps over 3x the instance's median token gap."""
    client = json.load(open(os.path.join(d, "client.json")))
    reqs = [r for r in client["requests"] if request_tpot_ms(r) is not None]
    gaps = [b[0] - a[0] for r in reqs for a, b in zip(r["stamps"], r["stamps"][1:])]
    med = statistics.median(gaps) if gaps else 0.0
    drafts = {}
    for k in range(int(client.get("dp", 2))):
        for row in read_jsonl(os.path.join(d, f"worker_dp{k}.jsonl")):
            for rid, dd, a in zip(row.get("rid") or [], row.get("d") or [], row.get("a") or []):
                if a >= 0:
                    e = drafts.setdefault(base_id(rid), [0, 0])
                    e[0] += dd
                    e[1] += 1
    reqs.sort(key=request_tpot_ms, reverse=True)
    out = []
    for r in reqs[:max(1, round(frac * len(reqs)))]:
        g = [b[0] - a[0] for a, b in zip(r["stamps"], r["stamps"][1:])]
        total = sum(g)
        stall = sum(x for x in g if x > 3 * med)
        e = drafts.get(str(r["id"]))
        out.append({"id": r["id"], "cls": r.get("cls"), "out": r["out"],
                    "tpot_ms": round(request_tpot_ms(r), 1),
                    "drafts_per_step": round(e[0] / e[1], 2) if e and e[1] else None,
                    "stall_share": round(stall / total, 3) if total else None,
                    "median_gap_ms": round(med * 1e3, 1)})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root")
    ap.add_argument("--arm", default="dpbalance")
    ap.add_argument("--base", default="")
    ap.add_argument("--target", type=float, default=0.05)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    rng = random.Random(0)
    if not a.base:  # static_best, as live_bench's summary picks it
        by_k = {}
        for d in glob.glob(os.path.join(a.root, "static_k*_r*")):
            dp = json.load(open(os.path.join(d, "client.json")))["dp"]
            by_k.setdefault(re.search(r"static_k(\d+)_r", d).group(1), []).append(
                summarize_arm(d, dp, 0))
        a.base = "static_k" + best_static_k(by_k)
    report = {"root": a.root, "arm": a.arm, "base": a.base, "target": a.target, "instances": {},
              "ratios": {}, "tail": {}}
    boots = {}
    for arm in (a.base, a.arm):
        for rep, d in instances(a.root, arm).items():
            client = json.load(open(os.path.join(d, "client.json")))
            tpot = [t for t in map(request_tpot_ms, client["requests"]) if t is not None]
            p99 = pct(tpot, 99)
            b = boot_p99(tpot, rng)
            boots[(arm, rep)] = b
            lo, hi = interval(b)
            half = (hi - lo) / 2 / p99
            report["instances"][f"{arm}_r{rep}"] = {
                "requests": len(tpot), "tpot_p99_ms": round(p99, 2),
                "ci95": [round(lo, 2), round(hi, 2)], "relative_half_width": round(half, 3),
                "requests_for_target": int(len(tpot) * (half / a.target) ** 2) + 1}
    for rep in instances(a.root, a.arm):
        if (a.base, rep) not in boots:
            continue
        ba, bb = boots[(a.arm, rep)], boots[(a.base, rep)]
        r = [x / y for x, y in zip(ba, bb)]
        point = report["instances"][f"{a.arm}_r{rep}"]["tpot_p99_ms"] / \
            report["instances"][f"{a.base}_r{rep}"]["tpot_p99_ms"]
        report["ratios"][str(rep)] = {"ratio": round(point, 3),
                                      "ci95": [round(x, 3) for x in interval(r)]}
    for arm in (a.base, a.arm):
        report["tail"][arm] = [row for d in instances(a.root, arm).values() for row in tail_rows(d)]
    for name, v in report["instances"].items():
        print(f"{name}: {v['requests']} requests, TPOT p99 {v['tpot_p99_ms']} ms, 95% "
              f"{v['ci95'][0]}-{v['ci95'][1]} (±{100 * v['relative_half_width']:.0f}%); "
              f"±{100 * a.target:.0f}% needs ~{v['requests_for_target']} requests")
    for rep, v in report["ratios"].items():
        print(f"replicate {rep}: {a.arm} / {a.base} TPOT p99 {v['ratio']} (95% {v['ci95'][0]}-{v['ci95'][1]})")
    for arm, rows in report["tail"].items():
        print(f"{arm}: slowest 1% of requests per instance")
        for row in rows:
            print("  " + json.dumps(row))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
