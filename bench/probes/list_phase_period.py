#!/usr/bin/env python3
"""Does a head-major launch's list phase become periodic? (docs/cost-model.md, "Where the floor is")

A head-major verify launch lists the same R request works once per query head (128 heads), so
if the list phase's state repeated at some head boundary, the rest of the launch could be
skipped ahead exactly. This models the list phase as kernel_grid.cc does while every SM is full
(264 slots, each CTA holding a slot for 2 x (work + overhead)) and looks for the first head
boundary whose state -- the multiset of the slots' remaining times, which ignores which SM holds
what and so repeats at least as often as the real state -- was seen before.

Usage: python3 bench/probes/list_phase_period.py [R] [trials]   (defaults: 32 requests, 8 trials)
Prints, per random Mooncake-like batch (log-normal contexts, median 7,000 tokens, sigma 1.2, as
bench/planner_bench.cc; work = key blocks of 64), the
first (head, earlier head) pair with equal states, or None when none repeats within 128 heads.
"""
import heapq
import math
import random
import sys


def first_repeat(works, heads=128, sms=132, overhead=1):
    cost = [w + overhead for w in works] * heads
    r, n = len(works), len(works) * heads
    slots = [(2 * cost[i], i % sms) for i in range(min(n, 2 * sms))]
    heapq.heapify(slots)
    seen = {}
    for nxt in range(2 * sms, n):
        t, sm = heapq.heappop(slots)
        heapq.heappush(slots, (t + 2 * cost[nxt], sm))
        if (nxt + 1) % r == 0:
            state = tuple(sorted(x - t for x, _ in slots))
            head = (nxt + 1) // r
            if state in seen:
                return head, seen[state]
            seen[state] = head
    return None


def main():
    r = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    trials = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    rng = random.Random(1)
    for _ in range(trials):
        works = [-(-min(131072, int(rng.lognormvariate(math.log(7000), 1.2))) // 64) for _ in range(r)]
        print(r, first_repeat(works))


if __name__ == "__main__":
    main()
