#!/usr/bin/env python3
"""A kept live vLLM run's replay prediction made again from its logs, with today's
dpbalance-calibrate and replay: what the prediction says once the fit or the replay changes,
without serving the stream again. Every live figure (the arms' goodput, TPOT, bubble) is
re-summarized from the same logs, so only the `predicted_*` fields can move.

It repeats `scripts/live_vllm.sh`'s last steps for each workload in JSON: timing rows from the
replicate-1 arms live_vllm.sh calibrates on (nospec_r1 when it ran, every static_k*_r1),
`dpbalance-calibrate --cv 5`, `live_bench.py predict` with the run's own prediction settings
(static_best, TPOT SLO, guard, quiet mode, deferral: read back from JSON) and `live_bench.py
summarize`. The run's step terms (DIR/WORKLOAD-terms.json) are kept as they were.

  scripts/studies/live_repredict.py DIR JSON --out OUT
    DIR: the run's --keep-logs directory; JSON: the run's --json; needs build/release
    (dpbalance-calibrate, dpbalance-replay) and the vLLM venv's python (live_bench imports).
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LB = os.path.join(ROOT, "integration", "vllm", "live_bench.py")
CAL = os.path.join(ROOT, "build", "release", "integration", "dpbalance-calibrate")
REPLAY = os.path.join(ROOT, "build", "release", "integration", "dpbalance-replay")


def run(cmd):
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout


def repredict(keep, key, old, tmp):
    """The prediction of one workload (key "WORKLOAD/dpN") from the kept logs; its JSON path."""
    workload, dp = key.split("/dp")
    arms = os.path.join(keep, "runs", workload, f"dp{dp}")
    cal_dirs = sorted(glob.glob(os.path.join(arms, "nospec_r1"))) + \
        sorted(glob.glob(os.path.join(arms, "static_k*_r1")))
    if not cal_dirs:
        raise SystemExit(f"live_repredict: no replicate-1 static arm under {arms}")
    rows, model = os.path.join(tmp, f"{workload}-rows.jsonl"), os.path.join(tmp, f"{workload}-model.json")
    run([sys.executable, LB, "calibrate", *sum((["--log-dir", d] for d in cal_dirs), []),
         "--dp", dp, "--rows", rows, "--terms", os.path.join(tmp, f"{workload}-terms-unused.json")])
    print(run([CAL, "--train", rows, "--out", model, "--cv", "5"]), end="")
    gain = run([sys.executable, LB, "default-margin", model]).strip()
    out = os.path.join(tmp, f"{workload}-predicted.json")
    cmd = [sys.executable, LB, "predict", "--runs-root", os.path.join(keep, "runs"),
           "--workload", workload, "--dp", dp, "--replay", REPLAY, "--model", model,
           "--terms", os.path.join(keep, f"{workload}-terms.json"),
           "--static-best-k", str(old["static_best_k"]), "--tpot-slo-ms", str(old["slo_ms"]),
           "--min-plan-gain", gain, "--guard-overhead-us", str(old["guard_overhead_us"]),
           "--quiet-after", str(old["quiet_after"]), "--seeds", str(old["seeds"]),
           "--noise", str(old["noise"]), "--h200-model",
           os.path.join(ROOT, "docs", "generated", "model_packed.json"), "--json", out]
    if old.get("guard_measured_us") is not None:
        cmd.append("--guard-measured")
    if old.get("value_deferral"):
        cmd.append("--value-deferral")
    if old.get("h200_min_plan_gain") is not None:
        cmd += ["--h200-min-plan-gain", str(old["h200_min_plan_gain"])]
    print(run(cmd), end="")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("keep", help="the run's --keep-logs directory")
    ap.add_argument("json", help="the run's --json summary")
    ap.add_argument("--out", required=True, help="the re-summarized JSON")
    a = ap.parse_args()
    with open(a.json) as f:
        old = json.load(f)
    with tempfile.TemporaryDirectory(prefix="dpb-repredict-") as tmp:
        merged = {"workloads": {}}
        for key, prev in old["prediction"]["workloads"].items():
            with open(repredict(a.keep, key, prev, tmp)) as f:
                merged["workloads"][key] = json.load(f)
        pred = os.path.join(tmp, "predicted.json")
        with open(pred, "w") as f:
            json.dump(merged, f, indent=1)
        command = (f"{old['command']}; prediction re-made from the kept logs: "
                   f"scripts/studies/live_repredict.py DIR JSON")
        run([sys.executable, LB, "summarize", "--json", a.out, "--runs-root",
             os.path.join(a.keep, "runs"), "--predicted", pred, "--command", command])
    for key, now in merged["workloads"].items():
        print(f"{key}: predicted {old['prediction']['workloads'][key]['goodput_ratio']:.3f} "
              f"before, {now['goodput_ratio']:.3f} now")
    return 0


if __name__ == "__main__":
    sys.exit(main())
