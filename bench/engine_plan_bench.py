#!/usr/bin/env python3
"""What the vLLM package's per-step path costs a step: `EnginePlan.exchange` + `after_step`
(dpbalance_vllm/engine_plan.py), the calls the scheduler makes around every forward, with the
real plugin library. One rank (DP1: the collective is the identity, so only the adapter and the
plugin are timed, not the exchange), a batch of N decode requests (contexts 300-4,000 tokens,
caps 7), every step reported with half the drafts accepted.

Rows: quiet mode on (the package default, DPB_QUIET_AFTER=8; the default guard is set wide,
DPB_MIN_PLAN_GAIN=0.5, so every plan keeps the default and most steps are quiet, as on the
live greedy stream) and off (every step plans), each with the step log (DPBALANCE_VLLM_STEP_LOG,
which the live harness turns on) and without it (a deployment's default).

Usage: bench/engine_plan_bench.py PLUGIN_SO [REQUESTS] [STEPS] [REPETITIONS]
Prints the median over REPETITIONS (default 5) of the mean time per step over STEPS steps
(default 2,000) after 40 warm-up steps, and the share of steps that were quiet.
"""
import os
import shutil
import statistics
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration", "vllm"))


def run(lib, n, steps, quiet, step_log):
    from dpbalance_vllm import engine_plan
    env = {"DPB_PLUGIN": lib, "DPB_LOG_LEVEL": "error", "DPB_LOG_EVERY": "0",
           "DPB_QUIET_AFTER": "8" if quiet else "0", "DPB_MIN_PLAN_GAIN": "0.5"}
    saved = dict(os.environ)
    os.environ.update(env)
    logdir = tempfile.mkdtemp(prefix="dpb-epb-") if step_log else None
    if logdir:
        os.environ["DPBALANCE_VLLM_STEP_LOG"] = logdir
    else:
        os.environ.pop("DPBALANCE_VLLM_STEP_LOG", None)
    plan = None
    try:
        cfg = types.SimpleNamespace(parallel_config=types.SimpleNamespace(
            data_parallel_size=1, data_parallel_rank=0))
        plan = engine_plan.EnginePlan(cfg, 7, "ngram")
        reqs = [(f"cmpl-{i:08x}-0", 300 + (i * 3701) % 3700, 7) for i in range(n)]

        def step(s):
            plan.begin_step()
            rows = [(r[0], r[1] + s, r[2]) for r in reqs]
            lens = plan.exchange(rows)
            plan.after_step(2000.0, None, [(r[0], k, k // 2, False) for r, k in zip(rows, lens)],
                            sum(1 + k for k in lens))
        for s in range(40):
            step(s)
        t0 = time.perf_counter()
        for s in range(40, 40 + steps):
            step(s)
        per_step = (time.perf_counter() - t0) / steps * 1e6
        return per_step, 1 - plan.exchanges / plan.steps
    finally:
        if plan is not None:
            plan.close()
        if logdir:
            shutil.rmtree(logdir, ignore_errors=True)
        os.environ.clear()
        os.environ.update(saved)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    lib = os.path.abspath(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 2000
    reps = int(sys.argv[4]) if len(sys.argv) > 4 else 5
    print(f"EnginePlan per step, {n} requests, median of {reps} x {steps} steps")
    print(f"{'quiet mode':>10} {'step log':>9} {'us/step':>9} {'quiet share':>12}")
    for quiet in (True, False):
        for step_log in (True, False):
            got = [run(lib, n, steps, quiet, step_log) for _ in range(reps)]
            us = statistics.median(g[0] for g in got)
            print(f"{'on' if quiet else 'off':>10} {'on' if step_log else 'off':>9} {us:9.1f} "
                  f"{got[0][1]:12.3f}")


if __name__ == "__main__":
    main()
