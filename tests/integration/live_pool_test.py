#!/usr/bin/env python3
"""scripts/studies/live_pool.py on made-up live JSONs whose pooled answer is known: replicates
keep their pairing and get distinct numbers, static_best is taken over the pool, and runs of another
configuration (anchor, stream) are refused naming the field and the file.

  python3 tests/integration/live_pool_test.py
"""
import contextlib
import io
import json
import math
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from script_checks import Checks, load_module  # noqa: E402

lp = load_module("live_pool", "scripts", "studies", "live_pool.py")
checks = Checks()
check = checks.check


def arm(mode, k, rep, g, default_k=None, requests=192):
    return {"mode": mode, "k": k, "replicate": rep, "workload": "mixed", "dp": 2, "seed": 1,
            "requests": requests, "default_k": default_k, "goodput_tok_per_s": g,
            "wall_goodput_tok_per_s": g, "decode_goodput_tok_per_s": g, "bubble_fraction": 0.1,
            "tpot_p50_ms": 30.0, "tpot_p99_ms": 50.0, "hangs": 0,
            "env": {"DPB_TPOT_SLO_MS": "54.1"} if mode == "dpbalance" else {}}


def doc(reps, k1, k3, dpb, default_k=1, requests=192):
    runs = []
    for r, a, b, c in zip(reps, k1, k3, dpb):
        runs += [arm("static", 1, r, a, requests=requests), arm("static", 3, r, b),
                 arm("dpbalance", 7, r, c, default_k), arm("ab", 7, r, 1.0, default_k)]
    return {"vllm_version": "0.32.0", "command": "live_vllm.sh", "runs": runs,
            "summary": [{"workload": "mixed", "dp": 2, "static_best_k": 3, "goodput_ratio": 1.0}]}


# Run A: k = 3 wins its two replicates; run B: k = 1 wins its two by more. Pooled, k = 1 wins
# (mean 850 against 825), and dpbalance pairs with k = 1 in each of the four replicates.
a = doc([1, 2], [800, 800], [810, 810], [880, 800])
b = doc([1, 2], [900, 900], [840, 840], [990, 900])
runs, sources, s = lp.pool([("A.json", a), ("B.json", b)], "mixed", 2)
check("replicates renumbered: A keeps 1-2, B becomes 3-4; A/B epochs left out",
      sorted({r["replicate"] for r in runs}) == [1, 2, 3, 4]
      and all(r["mode"] != "ab" for r in runs)
      and [x["replicate_offset"] for x in sources] == [0, 2], [x["replicate_offset"] for x in sources])
per = [round(x, 12) for x in s["goodput_ratio_per_replicate"]]
check("static_best over the pool, and the paired ratios per pooled replicate",
      s["static_best_k"] == 1 and per == [1.1, 1.0, 1.1, 1.0], (s["static_best_k"], per))
sd = math.sqrt(sum((x - 1.05) ** 2 for x in per) / 3)
check("pooled interval: t with 3 degrees of freedom",
      abs(s["goodput_ratio"] - 1.05) < 1e-12
      and abs(s["goodput_ratio_ci95_low"] - (1.05 - 3.182 * sd / 2)) < 2e-3, s["goodput_ratio_ci95_low"])

# --across-streams: each run's replicates against its own static_best (A: k = 3, 880/810 and
# 800/810; B: k = 1, 990/900 and 900/900), then one t interval over all four, whatever the
# anchors (B's differs here and is not refused).
per_run, s2 = lp.across_streams([("A.json", a), ("B.json", doc([1, 2], [900, 900], [840, 840],
                                                                [990, 900], default_k=3))],
                                "mixed", 2)
want = [880 / 810, 800 / 810, 1.1, 1.0]
got = [x for run in per_run for x in run["goodput_per_replicate"]]
check("across streams: each run against its own static_best",
      [run["static_best_k"] for run in per_run] == [3, 1]
      and all(abs(x - y) < 1e-12 for x, y in zip(got, want)), got)
m = sum(want) / 4
sd = math.sqrt(sum((x - m) ** 2 for x in want) / 3)
check("across streams: the mean and a t interval over every replicate (3 d.f.)",
      abs(s2["goodput_ratio"] - m) < 1e-12 and s2["goodput_replicates"] == 4
      and abs(s2["goodput_ratio_ci95_low"] - (m - 3.182 * sd / 2)) < 2e-3, s2)

for name, other, field in [("anchor", doc([1], [800], [810], [880], default_k=3), "default_k"),
                           ("request count", doc([1], [800], [810], [880], requests=96),
                            "requests")]:
    try:
        lp.pool([("A.json", a), ("C.json", other)], "mixed", 2)
        check(f"another {name} is refused", False, "pooled")
    except ValueError as e:
        check(f"another {name} is refused, naming the field and the file",
              field in str(e) and "C.json" in str(e), str(e))

with tempfile.TemporaryDirectory() as d:
    paths = []
    for name, body in [("A.json", a), ("B.json", b)]:
        paths.append(os.path.join(d, name))
        with open(paths[-1], "w") as f:
            json.dump(body, f)
    out = os.path.join(d, "pooled.json")
    with contextlib.redirect_stdout(io.StringIO()):
        rc = lp.main(["--json", out] + paths)
    got = json.load(open(out))
    check("main writes the pooled JSON with its sources",
          rc == 0 and len(got["sources"]) == 2 and got["summary"]["static_best_k"] == 1, rc)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            lp.main(["--json", out, os.path.join(d, "missing.json")])
        check("a missing file is refused", False, "no error")
    except SystemExit as e:
        check("a missing file is refused, naming it", "missing.json" in str(e), str(e))

checks.finish()
