#!/usr/bin/env python3
"""scripts/studies/live_phases.py on a made-up kept run whose phases are worked out by hand.

DP 2, two requests in flight (one a rank, round robin), four requests. The steady window
(live_bench.steady_window) starts at the first token of the last of the first batch (1.5 s)
and ends when the first rank admitted its last request (3.0 s), so: ramp 1.0-1.5 s with 1 token,
steady 1.5-3.0 s with 5, drain 3.0-9.0 s with 11; two replicates of the arm, walls 10 and 12 s.

  python3 tests/integration/live_phases_test.py
"""
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from script_checks import Checks, load_module  # noqa: E402

live_phases = load_module("live_phases", "scripts", "studies", "live_phases.py")
checks = Checks()


def client(wall_s):
    def req(i, rank, t0, stamps):
        return {"id": f"req-{i}", "rank": rank, "t0": 100.0 + t0, "stamps": stamps}
    return {"t_begin": 100.0, "concurrency": 2, "dp": 2, "placement": "rr", "wall_s": wall_s,
            "requests": [req(0, 0, 0.0, [[1.0, 1], [2.0, 2], [6.0, 3]]),
                         req(1, 1, 0.0, [[1.5, 1], [3.0, 2]]),
                         req(2, 0, 3.0, [[4.0, 1], [8.0, 4]]),
                         req(3, 1, 4.0, [[5.0, 1], [9.0, 2]])]}


with tempfile.TemporaryDirectory() as root:
    for rep, wall in ((1, 10.0), (2, 12.0)):
        d = os.path.join(root, f"static_k3_r{rep}")
        os.makedirs(d)
        with open(os.path.join(d, "client.json"), "w") as f:
            json.dump(client(wall), f)
    os.makedirs(os.path.join(root, "dpbalance_r1"))  # no client record: left out
    rows = live_phases.summarize(root)
    checks.check("one arm, its replicates pooled, the arm without a record left out",
                 list(rows) == ["static_k3"] and rows["static_k3"]["instances"] == 2, rows.keys())
    r = rows["static_k3"]
    want = {"ramp": (0.5, 1), "steady": (1.5, 5), "drain": (6.0, 11)}
    for phase, (secs, toks) in want.items():
        checks.check(f"{phase}: {secs} s, {toks} tokens",
                     abs(r[phase]["s"] - secs) < 1e-9 and r[phase]["tokens"] == toks, r[phase])
    checks.check("every stamped token in exactly one phase",
                 sum(r[p]["tokens"] for p in ("ramp", "steady", "drain")) == 17)
    checks.check("wall and first token averaged over the replicates",
                 r["wall_s"] == 11.0 and r["first_token_s"] == 1.0, (r["wall_s"], r["first_token_s"]))
    checks.check("the steady phase is live_bench's steady window, tokens included",
                 abs(r["steady"]["tok_per_s"] - 5 / 1.5) < 1e-9, r["steady"]["tok_per_s"])
checks.finish()
