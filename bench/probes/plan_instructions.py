#!/usr/bin/env python3
"""Instructions per call of one rank's plan phases in dpbalance_planner_bench cases.

Counted by callgrind (Planner::Summarize, Decide and Assign, each inclusive of what it calls,
over its number of calls): a figure that does not move with the shared host's load, for judging a
planner change before and after. The bench's own times move by up to 1.8x between runs here;
they stay the figure the targets are stated in.

  bench/probes/plan_instructions.py BENCH_BINARY FILTER...
  e.g. bench/probes/plan_instructions.py build/release/bench/dpbalance_planner_bench \
         'Tiers/dp:64/reqs:64' 'BM_PlanOneRank/dp:64/reqs:64'
"""
import re
import subprocess
import sys
import tempfile

PHASES = ("Summarize", "Decide", "Assign")


def per_call(binary: str, bench_filter: str, phase: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/cg"
        subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
             "--collect-atstart=no", f"--toggle-collect=dpbalance::Planner::{phase}(*",
             binary, f"--benchmark_filter={bench_filter}", "--benchmark_min_time=0.1"],
            check=True, capture_output=True)
        text = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--tree=caller", out],
                              check=True, capture_output=True, text=True).stdout
    # A callee block lists its callers ("< ... (Nx)", each with the inclusive cost of its calls)
    # and then the function ("* ..."): only the calls from the bench's measured loop count.
    calls, total, block = 0, 0, []
    for line in text.splitlines():
        if "*  " in line and f"dpbalance::Planner::{phase}(" in line:
            for caller in block:
                m = re.search(r"\((\d+)x\)", caller)
                if "PlanRankZero" in caller and m:
                    calls += int(m.group(1))
                    total += int(caller.split()[0].replace(",", ""))
        block = block + [line] if "<" in line[:40] else []
    if calls == 0:
        raise SystemExit(f"{bench_filter}: no call of Planner::{phase} from PlanRankZero counted")
    return total / calls


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    binary = sys.argv[1]
    print(f"{'case':44s}" + "".join(f"{p:>12s}" for p in PHASES) + f"{'total':>12s}")
    for f in sys.argv[2:]:
        v = [per_call(binary, f, p) for p in PHASES]
        print(f"{f:44s}" + "".join(f"{x:12,.0f}" for x in v) + f"{sum(v):12,.0f}")


if __name__ == "__main__":
    main()
