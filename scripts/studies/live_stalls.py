#!/usr/bin/env python3
"""Engine stalls in a kept live run (`scripts/live_vllm.sh --keep-logs DIR`), and the TPOT they
leave out: docs/live_vllm.md, "The TPOT tail is the machine's stalls".

A stall is a forward step of fewer than --max-tokens scheduled tokens (not a prompt's prefill)
that took longer than --min-ms on its rank (normal decode steps here take 20-40 ms). A stall on
one rank holds the other in the MoE collectives, so each stall is an interval of wall time,
[end - fwd, end], on whichever rank logged it; intervals of all ranks are merged. The first
--skip steps of each rank (the first prefills, before the stream's steady state) are left out.

Per arm (all replicates): instances, stalls, stall seconds, and TPOT p50/p99 as live_bench
reports them (request_tpot_ms, pct), then the same with each request's overlap with the stall
intervals taken out of its decode time ("stall-free"), and that over the requests decoded wholly
inside the steady window (live_bench.steady_window, the steady goodput's: no start-up prefill
burst). Then, per replicate, the TPOT p99 ratio of ARM to BASE each of those ways.

  scripts/studies/live_stalls.py DIR/runs/mixed/dp2 [--base static_k1] [--arm dpbalance]
                         [--min-ms 600] [--max-tokens 400] [--skip 3]
"""
import argparse
import glob
import json
import os
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "integration", "vllm"))
from live_bench import pct, read_jsonl, request_tpot_ms, steady_window  # noqa: E402  (the report's own)


def stall_intervals(inst, min_ms, max_tokens, skip):
    spans = []
    for path in sorted(glob.glob(os.path.join(inst, "worker_dp*.jsonl"))):
        for s in read_jsonl(path):
            if "fwd_us" not in s or s["i"] < skip:
                continue
            if s["fwd_us"] > min_ms * 1e3 and s["tokens"] < max_tokens:
                spans.append((s["t"] - s["fwd_us"] / 1e6, s["t"]))
    spans.sort()
    merged = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def overlap(a, b, spans):
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in spans)


def instance(inst, args):
    spans = stall_intervals(inst, args.min_ms, args.max_tokens, args.skip)
    with open(os.path.join(inst, "client.json")) as f:
        client = json.load(f)
    window = steady_window(client)
    raw, clean, steady = [], [], []
    for r in client["requests"]:
        t = request_tpot_ms(r)
        if t is None:
            continue
        raw.append(t)
        clean.append(t - overlap(r["first"], r["end"], spans) * 1e3 / (r["out"] - 1))
        # Decoded wholly inside the steady window (the steady goodput's): no start-up prefill burst.
        if window and window[0] <= r["first"] - client["t_begin"] and \
                r["end"] - client["t_begin"] <= window[1]:
            steady.append(clean[-1])
    return {"stalls": len(spans), "stall_s": sum(b - a for a, b in spans), "raw": raw,
            "clean": clean, "steady": steady}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base_dir")
    ap.add_argument("--base", default="static_k1")
    ap.add_argument("--arm", default="dpbalance")
    ap.add_argument("--min-ms", type=float, default=600)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--skip", type=int, default=3)
    args = ap.parse_args()
    insts = sorted(glob.glob(os.path.join(args.base_dir, "*_r*")))
    if not insts:
        sys.exit(f"live_stalls: no ARM_rN folders in {args.base_dir}")
    by_arm = {}
    for inst in insts:
        m = re.match(r"(.+)_r(\d+)$", os.path.basename(inst))
        if m and os.path.exists(os.path.join(inst, "client.json")):
            by_arm.setdefault(m.group(1), {})[int(m.group(2))] = instance(inst, args)
    print(f"stall: a step of < {args.max_tokens} tokens over {args.min_ms:.0f} ms on a rank "
          f"(steps before {args.skip} left out)")
    print(f"{'arm':<12} {'inst':>4} {'stalls':>6} {'stall s':>8}  {'TPOT p50/p99 ms':>16}  "
          f"{'stall-free p50/p99':>18}  {'steady, stall-free (n)':>24}")
    for arm, reps in sorted(by_arm.items()):
        raw = [t for v in reps.values() for t in v["raw"]]
        clean = [t for v in reps.values() for t in v["clean"]]
        steady = [t for v in reps.values() for t in v["steady"]]
        print(f"{arm:<12} {len(reps):>4} {sum(v['stalls'] for v in reps.values()):>6} "
              f"{sum(v['stall_s'] for v in reps.values()):>8.1f}  "
              f"{pct(raw, 50):>7.1f} / {pct(raw, 99):<6.1f}  {pct(clean, 50):>8.1f} / {pct(clean, 99):<6.1f}"
              + (f"  {pct(steady, 50):>9.1f} / {pct(steady, 99):<5.1f} ({len(steady)})" if steady else ""))
    a, b = by_arm.get(args.arm, {}), by_arm.get(args.base, {})
    both = sorted(set(a) & set(b))
    if both:
        r_raw = [pct(a[i]["raw"], 99) / pct(b[i]["raw"], 99) for i in both]
        r_clean = [pct(a[i]["clean"], 99) / pct(b[i]["clean"], 99) for i in both]
        print(f"\nTPOT p99, {args.arm} / {args.base}, per replicate:")
        print("  as measured: " + ", ".join(f"{x:.3f}" for x in r_raw)
              + f"; mean {statistics.mean(r_raw):.3f}")
        print("  stall-free:  " + ", ".join(f"{x:.3f}" for x in r_clean)
              + f"; mean {statistics.mean(r_clean):.3f}")
        r_steady = [pct(a[i]["steady"], 99) / pct(b[i]["steady"], 99) for i in both
                    if a[i]["steady"] and b[i]["steady"]]
        if r_steady:
            print("  steady requests, stall-free: " + ", ".join(f"{x:.3f}" for x in r_steady)
                  + f"; mean {statistics.mean(r_steady):.3f}")


if __name__ == "__main__":
    main()
