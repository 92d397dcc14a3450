#!/usr/bin/env python3
"""Pool the replicates of several live runs of one configuration (`scripts/live_vllm.sh ...
--json FILE`, the same stream, DP and plugin anchor) into one summary, as if one run had made
them all: docs/live_vllm.md, "Mixed, 192 requests, anchored at static k = 1: ten replicates".

Why: a live run's per-replicate ratios spread by ~0.1 on this machine (its instances run minutes
apart on a VM whose speed drifts), so a 95% interval narrow enough to decide a 5% target takes
about ten replicates, more than one session's run. Each replicate stays paired as it ran (its
arms back to back on one machine); only the replicate numbers of the second and later files are
offset so that they stay distinct. static_best is then the best static arm over every pooled
replicate, and the summary is live_bench.py's own (workload_summary), without the A/B epochs
and the prediction, which stay per run.

Files that do not describe the same configuration are refused, naming the field and the file:
the workload, DP, seed and request count of every arm, the vLLM version, and the plugin arms'
anchor (DPB_DEFAULT_K) must agree. Runs with different cost-model calibrations (each run fits
its own from its first replicate) or TPOT SLOs (each run takes its anchor's p99 from its first
replicate) are pooled: that is how the configuration runs, and the JSON lists each file's.

  scripts/studies/live_pool.py --json OUT RUN1.json RUN2.json ... [--workload mixed] [--dp 2]

--across-streams: runs of different streams or anchors (not one configuration) are not pooled
into one run; instead each replicate's ratios are taken against its own run's static_best
(dpbalance / static_best steady and wall goodput, TPOT p99, as each run's summary pairs them),
and the mean of all of them gets a Student-t interval over every replicate: the spread of a
configuration class over streams, labelled so (docs/live_vllm.md, "Mixed ... five replicates").
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "integration", "vllm"))
from live_bench import (best_static_k, mean_ci, paired,  # noqa: E402  (the live summary's own arithmetic)
                        workload_summary)

SAME = ("workload", "dp", "seed", "requests")


def pool(docs, workload, dp):
    """docs: [(path, the live JSON)]. The pooled runs (replicates renumbered), per-source facts,
    and the pooled summary; ValueError naming the field and file when the runs differ."""
    pooled, sources, ref, offset = [], [], {}, 0
    for path, doc in docs:
        runs = [r for r in doc.get("runs", []) if r.get("workload") == workload
                and r.get("dp") == dp and r.get("mode") != "ab"]
        if not runs:
            raise ValueError(f"{path}: no arms of workload {workload} at DP {dp}")
        checks = [(k, r.get(k)) for r in runs for k in SAME]
        checks.append(("vllm_version", doc.get("vllm_version")))
        checks += [("default_k (the plugin arms' DPB_DEFAULT_K)", r.get("default_k"))
                   for r in runs if r.get("mode") in ("dpbalance", "dspark")]
        for key, value in checks:
            if ref.setdefault(key, (value, path))[0] != value:
                raise ValueError(f"{path}: {key} is {value!r}, but {ref[key][1]} has "
                                 f"{ref[key][0]!r}; these runs are not one configuration")
        reps = sorted({r["replicate"] for r in runs})
        for r in runs:
            pooled.append(dict(r, replicate=r["replicate"] + offset, source=path,
                               source_replicate=r["replicate"]))
        summary = next((s for s in doc.get("summary", []) if s.get("workload") == workload
                        and s.get("dp") == dp), {})
        slo = next((r.get("env", {}).get("DPB_TPOT_SLO_MS") for r in runs
                    if r.get("mode") == "dpbalance"), None)
        sources.append({"file": path, "command": doc.get("command"), "replicates": len(reps),
                        "replicate_offset": offset, "tpot_slo_ms": slo,
                        "static_best_k": summary.get("static_best_k"),
                        "goodput_ratio": summary.get("goodput_ratio"),
                        "goodput_ratio_per_replicate": summary.get("goodput_ratio_per_replicate")})
        offset += max(reps)
    return pooled, sources, workload_summary(pooled, [], None)


RATIO_KEYS = (("goodput", "goodput_tok_per_s"), ("wall_goodput", "wall_goodput_tok_per_s"),
              ("tpot_p99", "tpot_p99_ms"))


def across_streams(docs, workload, dp):
    """Per run: dpbalance / its own static_best per replicate (live_bench.paired); over all
    runs: the mean and 95% t interval of every replicate's ratio, per key of RATIO_KEYS."""
    per_run, out = [], {}
    for path, doc in docs:
        runs = [r for r in doc.get("runs", []) if r.get("workload") == workload
                and r.get("dp") == dp and r.get("mode") in ("static", "dpbalance")]
        static = {}
        for r in runs:
            if r["mode"] == "static":
                static.setdefault(r["k"], []).append(r)
        dpb = [r for r in runs if r["mode"] == "dpbalance"]
        if not static or not dpb:
            raise ValueError(f"{path}: no static and dpbalance arms of workload {workload} at "
                             f"DP {dp}")
        k = best_static_k(static)
        ratios = {name: paired(dpb, static[k], key)["per_replicate"] for name, key in RATIO_KEYS}
        per_run.append({"file": path, "command": doc.get("command"), "static_best_k": k,
                        **{name + "_per_replicate": v for name, v in ratios.items()}})
    for name, _ in RATIO_KEYS:
        xs = [x for run in per_run for x in run[name + "_per_replicate"]]
        m, h = mean_ci(xs)
        out[name + "_ratio"] = m
        out[name + "_ratio_ci95_low"] = m - h if h is not None else None
        out[name + "_ratio_ci95_high"] = m + h if h is not None else None
        out[name + "_replicates"] = len(xs)
    return per_run, out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="live_vllm.sh --json files of one configuration")
    ap.add_argument("--json", required=True, help="where the pooled summary goes")
    ap.add_argument("--workload", default="mixed")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--across-streams", action="store_true",
                    help="per-replicate ratios against each run's own static_best, pooled")
    a = ap.parse_args(argv)
    docs = []
    for path in a.inputs:
        try:
            with open(path) as f:
                docs.append((path, json.load(f)))
        except (OSError, ValueError) as e:
            sys.exit(f"live_pool: cannot read {path}: {e}")
    command = "scripts/studies/live_pool.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if a.across_streams:
        try:
            per_run, summary = across_streams(docs, a.workload, a.dp)
        except ValueError as e:
            sys.exit(f"live_pool: {e}")
        with open(a.json, "w") as f:
            json.dump({"command": command, "across_streams": per_run, "summary": summary}, f,
                      indent=1)
        for run in per_run:
            print(f"source {run['file']}: static_best k = {run['static_best_k']}, per replicate "
                  f"{[round(x, 3) for x in run['goodput_per_replicate']]}")
        print("across streams:", json.dumps(summary))
        return 0
    try:
        runs, sources, summary = pool(docs, a.workload, a.dp)
    except ValueError as e:
        sys.exit(f"live_pool: {e}")
    out = {"command": command, "sources": sources, "runs": runs, "summary": summary}
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    for s in sources:
        print(f"source {s['file']}: {s['replicates']} replicates (offset {s['replicate_offset']}), "
              f"its static_best k = {s['static_best_k']}, its ratio {s['goodput_ratio']}")
    print("pooled:", json.dumps({k: v for k, v in summary.items() if k != "arms"}))
    for name, arm in summary.get("arms", {}).items():
        print(f"  {name:>16}: {arm['instances']} instances, steady {arm['goodput_tok_per_s']:.1f} "
              f"tok/s, TPOT p99 {arm['tpot_p99_ms']:.1f} ms, bubble {arm['bubble_fraction']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
