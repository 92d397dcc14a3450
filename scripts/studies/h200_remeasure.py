#!/usr/bin/env python3
"""Re-times the shared gqa attention configurations on an H200, the way ../shared/data/h200 says
they were timed, to measure the noise a held-out row carries (the gqa p90, docs/cost-model.md).

The recipe of ../shared/data/h200/README.md: FlashAttention-2 varlen through
aten::_flash_attention_forward, bf16, causal, 128 query heads sharing 1 KV head, head dim 256,
q_i query rows and ctx_i keys per request, random inputs; 2 warm-up calls, then 7 timed calls
with CUDA events; attn_ms is their median (min and max kept). Every call's time is kept too.

Passes (each in its own shuffled order, so a row's neighbours differ from pass to pass):
  short-1, short-2: every row whose shared attn_ms is under --short_ms;
  long:             the other rows, once;
  short-3:          the short rows a third time.
One JSON line per timed row goes to --out as it is measured (flushed), so a run cut short keeps
what it measured: {"pass":..,"row":index in the input,"attn_ms":..,"attn_ms_min":..,
"attn_ms_max":..,"calls_ms":[..7]}.

  python3 scripts/studies/h200_remeasure.py --rows FILE.jsonl --out OUT.jsonl [--short_ms 20] [--seed 1]
                                    [--passes short-1,short-2,long,short-3]
  python3 scripts/studies/h200_remeasure.py --rows FILE.jsonl --out OUT.jsonl --dry   # no GPU: fake times

Analysis (here, no GPU): scripts/studies/h200_noise.py.
"""
import argparse
import json
import random
import statistics
import sys
import time

HEADS, KV_HEADS, HEAD_DIM = 128, 1, 256
WARMUP, TIMED = 2, 7


def load_rows(path):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            r = json.loads(line)
            if len(r["ctx"]) != len(r["q"]) or not r["ctx"]:
                sys.exit(f"h200_remeasure: {path}:{n}: ctx and q differ in length or are empty")
            if any(c < q or q < 1 for c, q in zip(r["ctx"], r["q"])):
                sys.exit(f"h200_remeasure: {path}:{n}: a request with q < 1 or ctx < q")
            rows.append(r)
    return rows


class GpuTimer:
    """One preallocated K/V pool (random bf16) sliced per row; a fresh random Q per row."""

    def __init__(self, rows):
        import torch
        self.torch = torch
        dev = torch.device("cuda")
        max_k = max(sum(r["ctx"]) for r in rows)
        max_q = max(sum(r["q"]) for r in rows)
        g = torch.Generator(device=dev).manual_seed(1)
        self.k = torch.randn(max_k, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g)
        self.v = torch.randn(max_k, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g)
        self.q = torch.randn(max_q, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g)
        self.dev = dev
        print(f"h200_remeasure: {torch.cuda.get_device_name()} torch {torch.__version__}, "
              f"K/V pool {max_k} keys, Q pool {max_q} rows", flush=True)

    def time_row(self, r):
        torch = self.torch
        ctx, q = r["ctx"], r["q"]
        cq = [0]
        ck = [0]
        for a, b in zip(q, ctx):
            cq.append(cq[-1] + a)
            ck.append(ck[-1] + b)
        cum_q = torch.tensor(cq, dtype=torch.int32, device=self.dev)
        cum_k = torch.tensor(ck, dtype=torch.int32, device=self.dev)
        qt, kt, vt = self.q[: cq[-1]], self.k[: ck[-1]], self.v[: ck[-1]]
        op = torch.ops.aten._flash_attention_forward

        def call():
            op(qt, kt, vt, cum_q, cum_k, max(q), max(ctx), 0.0, True, False)

        for _ in range(WARMUP):
            call()
        torch.cuda.synchronize()
        times = []
        for _ in range(TIMED):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            call()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return times


class DryTimer:
    """No GPU: times drawn around the shared median, to check the passes and the output."""

    def __init__(self, rows):
        self.rng = random.Random(7)

    def time_row(self, r):
        return [r["attn_ms"] * self.rng.uniform(0.95, 1.1) for _ in range(TIMED)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--short_ms", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--passes", default="short-1,short-2,long,short-3",
                    help="which passes to run, in this order")
    ap.add_argument("--dry", action="store_true")
    a = ap.parse_args()
    rows = load_rows(a.rows)
    short = [i for i, r in enumerate(rows) if r["attn_ms"] < a.short_ms]
    long_ = [i for i, r in enumerate(rows) if r["attn_ms"] >= a.short_ms]
    known = {"short-1": short, "short-2": short, "short-3": short, "long": long_}
    passes = a.passes.split(",")
    for name in passes:
        if name not in known:
            sys.exit(f"h200_remeasure: --passes names '{name}'; known: {', '.join(known)}")
    rng = random.Random(a.seed)
    timer = DryTimer(rows) if a.dry else GpuTimer(rows)
    start = time.time()
    with open(a.out, "w") as out:
        for name in passes:
            order = list(known[name])
            rng.shuffle(order)
            t0 = time.time()
            for i in order:
                calls = timer.time_row(rows[i])
                out.write(json.dumps({"pass": name, "row": i, "attn_ms": statistics.median(calls),
                                      "attn_ms_min": min(calls), "attn_ms_max": max(calls),
                                      "calls_ms": [round(c, 5) for c in calls]}) + "\n")
                out.flush()
            print(f"h200_remeasure: pass {name}: {len(order)} rows in {time.time() - t0:.1f} s",
                  flush=True)
    print(f"h200_remeasure: done in {time.time() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
