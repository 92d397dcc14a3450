#!/usr/bin/env python3
"""What the Python adapter adds to a step: plan() and report() through ctypes, against the
plugin's own C plan on the same batch. One rank (DP1, an identity all-gather), goodput mode,
the V2 cost model; batches of 16, 64 and 256 requests with contexts drawn from 1k-60k tokens.
`Piggyback.step()` is plan() with the record riding on a 24-byte engine payload (an identity
collective standing in for the engine's sync). A second table times `Router.route()` (E, V2)
over 64 and 256 ranks of 32 requests each, against the router ABI's C `route` on the same loads.

Usage: bench/python_adapter_bench.py PLUGIN_SO [REPETITIONS]
Prints the median over REPETITIONS (default 5) of the mean time per call over 2,000 calls; the
last column is what the adapter costs a step beyond the C plan (report() includes the C report).
"""
import ctypes
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration",
                                "adapters", "python"))
import dpbalance_plugin as dpb  # noqa: E402

CALLS = 2000


def per_call_us(fn):
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    return (time.perf_counter() - t0) / CALLS * 1e6


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    flags = "mode=goodput;log_every=0;log_level=error"
    bal = dpb.DpBalance(1, 0, flags, allgather=lambda send, timeout_ms: send, library=sys.argv[1])
    pb = dpb.Piggyback(lambda payload: payload, 1)
    pb_bal = dpb.DpBalance(1, 0, flags, allgather=pb, library=sys.argv[1])
    payload = bytes(24)
    rng = random.Random(1)
    print(f"{'requests':>8} {'C plan us':>10} {'plan() us':>10} {'report() us':>12} "
          f"{'plan()-C+report() us':>21} {'Piggyback.step() us':>20}")
    for n in (16, 64, 256):
        reqs = [dpb.Request(i, rng.randint(1000, 60000), 0, 7) for i in range(n)]
        lens, _ = bal.plan(reqs)
        acc = [dpb.Accepted(r.request_id, k, k // 2) for r, k in zip(reqs, lens)]
        raw = lambda: bal._plugin.plan(bal._ctx, bal._reqs, n, -1, bal._lens,  # noqa: E731
                                       ctypes.byref(bal._depth))
        rows = {"raw": [], "plan": [], "report": [], "step": []}
        for _ in range(reps):
            rows["raw"].append(per_call_us(raw))
            rows["plan"].append(per_call_us(lambda: bal.plan(reqs)))
            rows["report"].append(per_call_us(lambda: bal.report(3000.0, 25000.0, acc)))
            rows["step"].append(per_call_us(lambda: pb.step(pb_bal, reqs, payload)))
        med = {k: statistics.median(v) for k, v in rows.items()}
        print(f"{n:8d} {med['raw']:10.1f} {med['plan']:10.1f} {med['report']:12.1f} "
              f"{med['plan'] - med['raw'] + med['report']:21.1f} {med['step']:20.1f}")
    bal.close()
    pb_bal.close()

    print(f"\n{'ranks':>8} {'C route us':>11} {'Router.route() us':>18}")
    for ranks in (64, 256):
        router = dpb.Router(ranks, "routing=E;log_level=error", library=sys.argv[1])
        loads = []
        for _ in range(ranks):
            ctx = [rng.randint(1000, 60000) for _ in range(32)]
            loads.append(dpb.RankLoad(32, sum(ctx), sum(ctx) + 32 * 300, 1 << 30, 0, max(ctx)))
        router.route(loads, 5000, 300)  # packs the loads into the router's array
        rank = ctypes.c_int32()
        raw = lambda: router._api.route(router._router, router._loads, ranks, 5000, 300,  # noqa: E731
                                        ctypes.byref(rank))
        c_us = statistics.median(per_call_us(raw) for _ in range(reps))
        py_us = statistics.median(per_call_us(lambda: router.route(loads, 5000, 300))
                                  for _ in range(reps))
        print(f"{ranks:8d} {c_us:11.1f} {py_us:18.1f}")
        router.close()


if __name__ == "__main__":
    main()
