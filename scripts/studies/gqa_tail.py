#!/usr/bin/env python3
"""Where a fit's tail (its largest out-of-fold errors) lies, and what the timings' own noise and
a held-out sample's size allow (docs/cost-model.md, "The gqa tail").

Usage: gqa_tail.py ROWS DUMP [HELD_OUT_ROWS]
  ROWS   the timing rows (integration/calibrate/data/attention_fa2_gqa.train.jsonl)
  DUMP   `dpbalance-calibrate --train ROWS --kernel fa2-gqa-h200 --cv 5 --dump DUMP` (per row:
         requests, query tokens, key tokens, max keys, query-key pairs, multi-query, measured
         us, out-of-fold predicted us)
  HELD_OUT_ROWS  rows in a held-out sample (default: 30% of all, 207 beside the 482 shared)

Prints: the out-of-fold p90; the share of each group of rows among the tail (the rows at or
above the p90); the noise floor, i.e. the p90 a perfect model would show against the median of
7 timed calls, from each row's min and max; the noise between configurations, which the 7 calls
of one row cannot show (rows the kernel's work orders, and one-request launches); and the spread
of the p90 of a held-out sample of that size drawn from the out-of-fold errors.
"""
import json
import math
import random
import sys

BLOCK_N = 64  # fa2-gqa-h200's key block (KernelGrid::block_n)
HEADS = 128   # query heads per KV head (KernelGrid::heads)
SLOTS = 264   # CTA slots: 132 SMs x 2 resident CTAs (KernelGrid::num_sms x ctas_per_sm)


def p90(values):
    v = sorted(values)
    return v[min(len(v) - 1, int(0.9 * (len(v) - 1) + 0.5))]  # SummarizeErrors' index


def key_blocks(ctx):
    return -(-ctx // BLOCK_N)


def weighted_median(values, weights):
    pairs = sorted(zip(values, weights))
    half, acc = sum(weights) / 2, 0.0
    for v, w in pairs:
        acc += w
        if acc >= half:
            return v
    return pairs[-1][0]


def isotonic_l1(y):
    """The non-decreasing sequence nearest y in sum |f - y| (pool adjacent violators, medians)."""
    pools = []
    for v in y:
        pools.append([v])
        while len(pools) > 1 and sorted(pools[-2])[(len(pools[-2]) - 1) // 2] > \
                sorted(pools[-1])[(len(pools[-1]) - 1) // 2]:
            pools[-2:] = [pools[-2] + pools[-1]]
    out = []
    for pool in pools:
        out += [sorted(pool)[(len(pool) - 1) // 2]] * len(pool)
    return out


def between_configurations(rows):
    """Noise between configurations: what no model of the batch's shape can fit, from the rows.

    The verify path (some q > 1, q <= 8 < block_m) launches one CTA per (head, request), each
    streaming its request's key blocks, so more requests or more keys per request never make it
    faster. A pair where one row's batch dominates the other's (at least as many requests, the
    k-th longest at least as long for every k) but ran faster says the time is not a function of
    the batch alone. A one-request launch is 128 CTAs of the same work: its time is a function of
    the key blocks only, and the best non-decreasing such function, fitted to those very rows,
    bounds what any model of the shape can do on them."""
    verify = []
    for i, r in enumerate(rows):
        if max(r["q"]) > 1:
            verify.append((i, sorted((key_blocks(c) for c in r["ctx"]), reverse=True), r))
    pairs, violations = 0, []
    for ia, a, ra in verify:
        for ib, b, rb in verify:
            if ia == ib or a == b or len(b) < len(a) or any(x > y for x, y in zip(a, b)):
                continue
            pairs += 1
            if ra["attn_ms"] > rb["attn_ms"]:
                violations.append((ra["attn_ms"] / rb["attn_ms"] - 1, ia, ib, a, b, ra, rb))
    violations.sort(key=lambda v: -v[0])
    beyond = sum(1 for v in violations if v[5]["attn_ms_min"] > v[6]["attn_ms_max"])
    print(f"between configurations, verify path ({len(verify)} rows): {pairs} pairs where one "
          f"row's batch dominates the other's; in {len(violations)} the dominated one ran "
          f"longer, in {beyond} of them by more than both rows' 7-call ranges")
    for ratio, ia, ib, a, b, ra, rb in violations[:4]:
        print(f"  row {ia} ({len(a)} request(s), longest {a[0]} key blocks) took {ratio:.1%} longer "
              f"than row {ib} ({len(b)} request(s), longest {b[0]}): {1000 * ra['attn_ms']:.0f} us "
              f"(fastest call {1000 * ra['attn_ms_min']:.0f}) against {1000 * rb['attn_ms']:.0f} us "
              f"(slowest call {1000 * rb['attn_ms_max']:.0f})")
    one = sorted(((key_blocks(r["ctx"][0]), r) for _, _, r in verify if len(r["ctx"]) == 1),
                 key=lambda xr: (xr[0], xr[1]["attn_ms"]))
    if not one:
        return
    fit = isotonic_l1([math.log(r["attn_ms"]) for _, r in one])
    errs = [abs(math.exp(f) / r["attn_ms"] - 1) for f, (_, r) in zip(fit, one)]
    print(f"  one-request launches ({len(one)} rows): the best non-decreasing function of key "
          f"blocks, fitted to these rows: MAPE {sum(errs) / len(errs):.4f}, p90 {p90(errs):.4f}, "
          f"max {max(errs):.4f}")
    long_one = [(x, r) for x, r in one if x >= 100]
    if not long_one:
        return
    long_rows = [(x, 1000 * r["attn_ms"]) for x, r in long_one]
    best = None
    for c in range(0, 201):  # t = c + rate x; for each c the L1-relative rate is a weighted median
        rate = weighted_median([(t - c) / x for x, t in long_rows], [x / t for x, t in long_rows])
        e = [abs(c + rate * x - t) / t for x, t in long_rows]
        if best is None or sum(e) < sum(best[2]):
            best = (c, rate, e)
    c, rate, e = best
    spread = sorted((r["attn_ms_max"] - r["attn_ms_min"]) / r["attn_ms"] for _, r in long_one)
    print(f"  of them {len(long_rows)} with >= 100 key blocks, where a launch is a constant plus a "
          f"rate per block: the best such line ({c} us + {rate:.3f} us/block), fitted to them, "
          f"MAPE {sum(e) / len(e):.4f}, p90 {p90(e):.4f}, max {max(e):.4f}; their 7-call range is "
          f"{spread[len(spread) // 2]:.3f} of the median at the median row")


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    rows = [json.loads(line) for line in open(sys.argv[1])]
    dump = [line.split() for line in open(sys.argv[2])]
    if len(rows) != len(dump):
        sys.exit(f"{sys.argv[1]} has {len(rows)} rows, {sys.argv[2]} {len(dump)}")
    held_out = int(sys.argv[3]) if len(sys.argv) > 3 else round(len(rows) * 0.3 / 0.7)
    data = []
    for r, d in zip(rows, dump):
        measured, predicted = float(d[6]), float(d[7])
        if abs(measured - 1000 * r["attn_ms"]) > 1:
            sys.exit(f"row order differs: measured {measured} us against attn_ms {r['attn_ms']}")
        blocks = [key_blocks(c) for c in r["ctx"]]
        data.append(dict(ape=abs(predicted - measured) / measured, measured=measured,
                         signed=(predicted - measured) / measured,
                         requests=len(r["ctx"]), q=max(r["q"]), max_ctx=max(r["ctx"]),
                         waves=HEADS * len(blocks) / SLOTS, blocks_per_cta=sum(blocks) / len(blocks),
                         mode=r["mode"],
                         spread=(r["attn_ms_max"] - r["attn_ms_min"]) / r["attn_ms"]))
    ape = [x["ape"] for x in data]
    cut = p90(ape)
    tail = [x for x in data if x["ape"] >= cut]
    print(f"{len(data)} rows: out-of-fold MAPE {sum(ape) / len(ape):.4f}, p90 {cut:.4f}; "
          f"the tail (errors >= p90): {len(tail)} rows")
    groups = [
        ("measured", lambda x: "< 0.5 ms" if x["measured"] < 500 else "0.5-2 ms" if x["measured"] < 2000
         else "2-10 ms" if x["measured"] < 10000 else ">= 10 ms"),
        ("requests", lambda x: "1-4" if x["requests"] <= 4 else "5-16" if x["requests"] <= 16
         else "17-64" if x["requests"] <= 64 else "> 64"),
        ("kernel path", lambda x: "decode (every q = 1)" if x["q"] == 1 else "verify (some q > 1)"),
        ("longest context", lambda x: "< 4k" if x["max_ctx"] < 4096 else "4k-32k" if x["max_ctx"] < 32768
         else "32k-100k" if x["max_ctx"] < 100000 else ">= 100k"),
        ("mix", lambda x: x["mode"]),
        # The verify launch's waves (heads x requests CTAs over the slots) and key blocks per CTA.
        ("verify waves, key blocks per CTA", lambda x: "decode (every q = 1)" if x["q"] == 1 else
         ("< 1 wave" if x["waves"] <= 1 else "1-8 waves" if x["waves"] <= 8 else "> 8 waves") +
         (", < 32" if x["blocks_per_cta"] < 32 else ", 32-128" if x["blocks_per_cta"] < 128 else ", >= 128")),
    ]
    for name, key in groups:
        print(f"by {name}:")
        seen = {}
        for x in data:
            seen.setdefault(key(x), []).append(x)
        for k, xs in sorted(seen.items()):
            n_tail = sum(1 for x in xs if x["ape"] >= cut)
            signed = sorted(x["signed"] for x in xs)
            print(f"  {k:22} {len(xs):4} rows, MAPE {sum(x['ape'] for x in xs) / len(xs):.4f}, "
                  f"p90 {p90([x['ape'] for x in xs]):.4f}; {n_tail:3} in the tail "
                  f"({n_tail / len(xs):.0%} of them, {n_tail / len(tail):.0%} of the tail); "
                  f"median signed error {signed[len(signed) // 2]:+.4f}")
    # The noise floor. Each row is the median of 7 timed calls; its min and max give the spread.
    # For 7 normal draws the expected range is 2.704 sigma and the median's standard deviation
    # 0.4629 sigma (variance 0.2143 sigma^2), so a perfect model errs by |N(0, 0.171 x range)|.
    rng = random.Random(1)
    floors = sorted(p90([abs(rng.gauss(0, 0.4629 * x["spread"] / 2.704)) for x in data])
                    for _ in range(400))
    spreads = [x["spread"] for x in data]
    print(f"noise: range of the 7 calls / median: median {sorted(spreads)[len(spreads) // 2]:.4f}, "
          f"p90 {p90(spreads):.4f}")
    print(f"noise floor (a perfect model, normal noise): p90 {floors[200]:.4f} "
          f"(90% of draws {floors[20]:.4f}-{floors[380]:.4f}); bound without a noise model "
          f"(p90 of each row's half range): {p90([s / 2 for s in spreads]):.4f}")
    by_spread = sorted(data, key=lambda x: x["spread"])
    q = len(by_spread) // 4
    for i in range(4):
        part = by_spread[i * q:(i + 1) * q] if i < 3 else by_spread[3 * q:]
        print(f"  spread quartile {i + 1} ({part[0]['spread']:.3f}-{part[-1]['spread']:.3f}): "
              f"out-of-fold p90 {p90([x['ape'] for x in part]):.4f}")
    between_configurations(rows)
    # A held-out sample's p90, were its rows' errors drawn like the out-of-fold ones.
    draws = sorted(p90(rng.choices(ape, k=held_out)) for _ in range(4000))
    print(f"held-out sample of {held_out} rows, errors drawn from the out-of-fold ones: p90 "
          f"median {draws[2000]:.4f}, 90% of samples {draws[200]:.4f}-{draws[3800]:.4f}; "
          f"P(p90 <= 0.12) = {sum(1 for d in draws if d <= 0.12) / len(draws):.2f}, "
          f"P(p90 >= 0.131) = {sum(1 for d in draws if d >= 0.131) / len(draws):.2f}")


if __name__ == "__main__":
    main()
