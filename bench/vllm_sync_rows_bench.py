#!/usr/bin/env python3
"""What riding vLLM's DP sync adds to it: the sync as vLLM ships it against the sync carrying
the plugin's rows (dpbalance_vllm/dp_ride.py), timed back to back in the same processes.

vLLM's per-step DP sync (`vllm.v1.worker.dp_utils._run_ar`, vLLM 0.32.0) all-reduces a
(4, dp) int32 tensor over the DP group (gloo on CPU). Riding, `dp_ride._RidingDist.all_reduce`
appends CARRY_BYTES / 4 rows (this rank's record in its column, zeros elsewhere), all-reduces
the taller tensor, copies vLLM's rows back and keeps the gathered rows. Here DP ranks are
processes on one host with a gloo group, as in the live runs; each iteration aligns the ranks
on a barrier, then times one sync: plain (vLLM's) and riding in alternate iterations, the
riding one through dp_ride's own proxy with a record armed, in blocks of one kind (vLLM's syncs
all have one shape; alternating shapes sync by sync costs gloo more than either shape does). The bypass A/B of the live runs
(`scripts/live_vllm.sh --bypass-ab`) keeps the rows in its bypassed epochs (zeros: every rank's
sync has one shape), so this is the part of the plugin's cost it does not see.

  python bench/vllm_sync_rows_bench.py [--dp 2] [--iters 4000]   (a Python with torch)

Prints per rank the median time of each kind and the median of the paired differences
(a riding block minus the plain block before it) with a bootstrap 95% interval, in microseconds, and the
taller tensor all-reduced plainly (the bytes' share of the difference; the rest is the proxy's
tensor work).
"""
import argparse
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration", "vllm"))
sys.path.insert(0, os.path.join(HERE, "..", "integration", "adapters", "python"))


def carry_bytes() -> int:
    """engine_plan.CARRY_BYTES without importing the package (which wants vLLM): the payload
    struct and the plugin's record size from the adapter."""
    import struct
    import dpbalance_plugin as adapter
    return struct.Struct("<qiidi").size + adapter.RECORD_BYTES


def rank_main(rank, dp, iters, warm, port, out, block):
    import torch
    import torch.distributed as dist
    from dpbalance_vllm import dp_ride
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=dp)
    width = (carry_bytes() + 3) // 4
    st = dp_ride._State(width)
    riding = dp_ride._RidingDist(dist, st)
    record = bytes(random.Random(rank).randrange(256) for _ in range(width * 4))
    times = {"plain": [], "ride": [], "tall": []}  # per block: its median sync
    kinds = ("plain", "ride", "tall")
    for b in range(warm // block + iters // block):
        kind = kinds[b % 3]
        block_times = []
        for i in range(block):
            t = torch.zeros(4 + width if kind == "tall" else 4, dp, dtype=torch.int32)
            t[:4, rank] = 1 + i
            dist.barrier()
            t0 = time.perf_counter()
            if kind != "ride":
                dist.all_reduce(t)
            else:
                st.rank, st.armed = rank, record
                try:
                    riding.all_reduce(t)
                finally:
                    st.rank = -1
                st.gathered = None
            block_times.append((time.perf_counter() - t0) * 1e6)
            if int(t[0, 0]) != 1 + i or int(t[3, dp - 1]) != 1 + i:
                raise SystemExit(f"rank {rank}: vLLM's rows came back wrong in block {b}")
        if b >= warm // block:
            times[kind].append(statistics.median(block_times))
    dist.destroy_process_group()
    with open(out, "w") as f:
        f.write(repr((width, times)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--iters", type=int, default=6000)
    ap.add_argument("--warm", type=int, default=300)
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--block", type=int, default=100,
                    help="syncs of one kind in a row (vLLM's syncs all have one shape)")
    a = ap.parse_args()
    import tempfile
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"r{r}") for r in range(a.dp)]
        procs = [mp.get_context("spawn").Process(
            target=rank_main, args=(r, a.dp, a.iters, a.warm, a.port, outs[r], a.block))
            for r in range(a.dp)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            sys.exit("vllm_sync_rows_bench: a rank failed")
        results = [eval(open(o).read()) for o in outs]  # noqa: S307 - our own repr
    rng = random.Random(1)
    print(f"vLLM's DP sync: (4, {a.dp}) int32, riding (4 + {results[0][0]}, {a.dp}); blocks of "
          f"{a.block} syncs of one kind in turn, {a.iters // 3} of each kind per rank after "
          f"{a.warm} warm-up, gloo, one host; per kind the median of its blocks' medians")
    for r, (_, t) in enumerate(results):
        diffs = [ride - plain for plain, ride in zip(t["plain"], t["ride"])]
        boot = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(400))
        print(f"rank {r}: plain median {statistics.median(t['plain']):.1f} us, riding "
              f"{statistics.median(t['ride']):.1f} us; riding - plain (paired) median "
              f"{statistics.median(diffs):.1f} us (95% {boot[10]:.1f} .. {boot[389]:.1f}); the "
              f"taller tensor alone (no proxy) {statistics.median(t['tall']):.1f} us")


if __name__ == "__main__":
    main()
