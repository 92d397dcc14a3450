#!/usr/bin/env python3
"""scripts/studies/live_steps.py on a made-up kept run whose answers are known: two arms, two ranks.

`static_k2_r1` and `static_k4_r1` verify 2 and 4 drafts for each of 3 requests every step
(uniform lengths), and their attention is exactly 1 us per (query x context) token pair plus
100 us per request, so the uniform-length fit reproduces it (error 0). `dpbalance_r1` (a plugin arm, with engine logs)
verifies lengths 0, 2 and 4 on the same contexts with the same attention law; its plans
predicted 90% of each rank's measured attention. Every figure the script prints for them is
checked against its value computed here by hand.

  python3 tests/integration/live_steps_test.py
"""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "studies", "live_steps.py")
failed = []


def check(name, got, want, tol=1e-6):
    ok = abs(got - want) <= tol * max(1.0, abs(want))
    print(f'{"PASS" if ok else "FAIL"} {name}: {got} (want {want})')
    if not ok:
        failed.append(name)


def attention(q, ctx):
    return sum(a * b for a, b in zip(q, ctx)) + 100.0 * len(q)


def write_arm(root, name, drafts, accepted, rank_ctx, plugin):
    d = os.path.join(root, name)
    os.makedirs(d)
    for rank, ctx0 in enumerate(rank_ctx):
        with open(os.path.join(d, f"worker_dp{rank}.jsonl"), "w") as w, \
                open(os.path.join(d, f"engine_dp{rank}.jsonl"), "w") as e:
            # A prefill step first (query > 8): not a decode step, left out.
            w.write(json.dumps({"kind": "model", "q": [100], "ctx": [0], "d": [0], "a": [0],
                                "att_us": 5000.0, "fwd_us": 9000.0, "t": 0.0}) + "\n")
            for step in range(10):
                ctx = [c + 10 * step for c in ctx0]
                q = [1 + k for k in drafts]
                att = attention(q, ctx)
                # Step indices: a step of another kind (not logged here) ran before step 5.
                w.write(json.dumps({"kind": "model", "q": q, "ctx": ctx, "d": drafts,
                                    "a": accepted, "att_us": att, "fwd_us": 2 * att,
                                    "t": 1.0 + 0.05 * step, "i": step + 1 + (step >= 5)}) + "\n")
                if plugin:
                    e.write(json.dumps({"x": step, "n": len(q), "extra": 0, "lens": drafts,
                                        "att_us": att, "pred_us": 0.9 * att,
                                        # steps 7-9 quiet (DPB_QUIET_AFTER): no exchange
                                        "xchg_us": 1000.0 + 100 * step if step < 7 else None})
                            + "\n")
        if not plugin:
            os.remove(os.path.join(d, f"engine_dp{rank}.jsonl"))


def main():
    with tempfile.TemporaryDirectory() as root:
        ctxs = [[1000, 2000, 3000], [4000, 5000, 6000]]
        write_arm(root, "static_k2_r1", [2, 2, 2], [1, 2, 0], ctxs, plugin=False)
        # A second static length: with one length only, query x context and context are the
        # same feature up to a factor, and the fit could not price a ragged batch.
        write_arm(root, "static_k4_r1", [4, 4, 4], [4, 0, 1], ctxs, plugin=False)
        write_arm(root, "dpbalance_r1", [0, 2, 4], [0, 2, 3], ctxs, plugin=True)
        out = os.path.join(root, "out.json")
        r = subprocess.run([sys.executable, SCRIPT, root, "--json", out], capture_output=True, text=True)
        print(r.stdout, r.stderr)
        if r.returncode != 0:
            print("FAIL live_steps.py exited", r.returncode)
            sys.exit(1)
        rep = json.load(open(out))
        s0 = rep["arms"]["static_k2"]["0"]
        d1 = rep["arms"]["dpbalance"]["1"]
        # The first decode step has no wall time before it (it follows a prefill): 9 remain.
        check("static steps", s0["steps"], 9)
        check("static wall ms per step", s0["wall_ms_median"], 50.0)
        check("static drafts per request", s0["drafts_per_request"], 2.0)
        check("static spread", s0["length_spread"], 0.0)
        check("static tokens per step", s0["tokens_per_step"], (1 + 2 + 0) + 3)
        check("static query tokens per step", s0["query_tokens_per_step"], 9.0)
        ctx1 = [[c + 10 * s for c in ctxs[1]] for s in range(1, 10)]
        want_att = sum(attention([1, 3, 5], c) for c in ctx1) / 9 / 1e3
        check("dpbalance rank 1 attention ms", d1["attention_ms"], want_att)
        check("dpbalance rank 1 forward ms", d1["forward_ms"], 2 * want_att)
        check("dpbalance spread", d1["length_spread"], 4.0)
        check("dpbalance drafts per request", d1["drafts_per_request"], 2.0)
        # Outside the forward: wall minus forward over the 8 steps right after another decode
        # step (steps 2-4 and 6-9: step 1 follows the prefill, step 5 a step not logged).
        pairs = [s for s in range(1, 10) if s != 5]
        want_out = sum(50.0 - 2 * attention([1, 3, 5], [c + 10 * s for c in ctxs[1]]) / 1e3
                       for s in pairs) / len(pairs)
        check("dpbalance rank 1 outside the forward, consecutive steps only",
              d1["outside_forward_ms"], want_out)
        check("dpbalance rank 1 exchange ms (every exchange)", d1["exchange_ms"], 1.30)
        check("dpbalance rank 1 share of steps that exchanged (7 of 10)", d1["exchanged_share"], 0.7)
        check("no exchange for a static arm", float("exchange_ms" in s0), 0.0)
        plan = rep["plans"]["dpbalance"]
        check("plan steps (both ranks, all 10)", plan["steps"], 10)
        check("plan predicted = 0.9 x measured, rank 0",
              plan["predicted_ms"][0], 0.9 * plan["measured_ms"][0])
        check("plan barrier is rank 1's", plan["measured_barrier_ms"], plan["measured_ms"][1])
        check("no plan rows for the static arm", float("static_k2" in rep["plans"]), 0.0)
        # Attention is linear in the fit's features, so the fit is exact on both arms.
        check("uniform fit on static", rep["uniform_fit_error"]["static_k2"], 0.0, tol=1e-6)
        check("uniform fit on ragged", rep["uniform_fit_error"]["dpbalance"], 0.0, tol=1e-6)
    if failed:
        print("FAILED:", ", ".join(failed))
        sys.exit(1)
    print("all passed")


if __name__ == "__main__":
    main()
