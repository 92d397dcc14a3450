#!/usr/bin/env python3
"""integration/vllm/live_bench.py without vLLM: the stream every arm serves, vLLM's per-request
acceptance counts read back from the step log, the paired ratios and their intervals, the
steady-state window. The live run itself is tests/integration/live_vllm_test.sh (.ci/run).

  python3 tests/integration/live_bench_test.py
"""
import contextlib
import io
import json
import math
import os
import sys
import tempfile
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from script_checks import ROOT, Checks, load_module  # noqa: E402

lb = load_module("live_bench", "integration", "vllm", "live_bench.py")
checks = Checks()
check = checks.check


def stream_args(model, **kw):
    a = dict(trace=os.path.join(ROOT, "integration/replay/data/mooncake_conversation.jsonl"),
             model=model, workload="mixed", mix="", seed=1, requests=600, offset=0, dp=2,
             placement="rr", block=24, shared_prefix=1, in_scale=0.4, out_scale=1.0,
             max_in=6000, max_out=320, min_out=64, long_every=0, long_in=4000)
    a.update(kw)
    return SimpleNamespace(**a)


with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "model")
    lb.write_model(model, "decode")
    cfg = json.load(open(os.path.join(model, "config.json")))
    check("decode shape: GQA 8/2 heads of 64 in 4 layers, hidden = heads x head_dim",
          (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"])
          == (8, 2, 4) and cfg["hidden_size"] == cfg["num_attention_heads"] * cfg["head_dim"])

    # The stream: the same for every arm of a seed, another for another seed.
    r1 = lb.make_requests(stream_args(model))
    r2 = lb.make_requests(stream_args(model))
    r3 = lb.make_requests(stream_args(model, seed=2))
    check("same seed, same stream (prompts, classes, sampling seeds)", r1 == r2)
    check("another seed, another stream", [r["cls"] for r in r1] != [r["cls"] for r in r3])
    check("every request its own sampling seed", len({r["seed"] for r in r1}) == len(r1))
    check("request i on DP rank i % dp", all(r["rank"] == i % 2 for i, r in enumerate(r1)))
    shares = {c[0]: c[1] for c in lb.MIXES["mixed"]}
    got = {c: sum(r["cls"] == c for r in r1) / len(r1) for c in shares}
    check("class shares within 0.06 of the mix's (600 requests)",
          all(abs(got[c] - shares[c]) < 0.06 for c in shares),
          {c: round(v, 3) for c, v in got.items()})
    check("greedy class is temperature 0, sampled classes have top_k and top_p < 1",
          all((r["temperature"] == 0.0) == (r["cls"] == "greedy") for r in r1)
          and all(r["top_p"] < 1.0 and r["top_k"] > 0 for r in r1 if r["cls"] != "greedy"))
    vocab = cfg["vocab_size"]
    check("prompts are token ids in 3..vocab-1, within the length caps",
          all(3 <= t < vocab for r in r1 for t in r["prompt"])
          and all(24 <= len(r["prompt"]) <= 6000 and 64 <= r["n_out"] <= 320 for r in r1))
    rep = [r for r in r1 if r["cls"] == "top2"][0]["prompt"]
    check("a repeat prompt repeats its 24-token block (but its own last 16 tokens)",
          rep[:24] == rep[24:48])
    g = lb.make_requests(stream_args(model, workload="greedy"))
    check("greedy workload: every request greedy", all(r["temperature"] == 0.0 for r in g))

    # vLLM's per-request counts from the worker's step log (rid, d = drafts verified,
    # a = accepted; a = -1 is a prefill).
    logs = os.path.join(tmp, "logs")
    os.makedirs(logs)
    rows = [{"i": 0, "rid": ["req-7-ab12"], "d": [0], "a": [-1]},
            {"i": 1, "rid": ["req-7-ab12"], "d": [3], "a": [1]},
            {"i": 2, "rid": ["req-7-ab12"], "d": [3], "a": [3]},
            {"i": 3, "rid": ["req-7-ab12"], "d": [2], "a": [0]},
            {"i": 4, "rid": ["req-7-ab12"], "d": [1], "a": [1]}]  # the drafter offered 1 of 3
    with open(os.path.join(logs, "worker_dp0.jsonl"), "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    open(os.path.join(logs, "worker_dp1.jsonl"), "w").close()
    c = lb.request_counts(logs, 2, k_slots=3)
    check("vLLM's suffixed id maps back to the bench's", list(c) == ["req-7"], list(c))
    c = c["req-7"]
    check("tried / accepted per draft position (prefill row skipped)",
          c["tried"][1:4] == [4, 2, 1] and c["acc"][1:4] == [3, 1, 1] and c["steps"] == 4
          and c["drafted"] == 9 and c["accepted"] == 5, c)
    check("draft slots of a static k = 3 arm count offered-or-not positions",
          c["slots"][1:4] == [4, 3, 1], c["slots"])
    # Offered: d of the 4 steps at k = 3 was 3, 3, 2, 1: at least 1 in 4, 2 in 3, 3 in 2.
    check("offered counts per position of a static k = 3 arm",
          c["off_n"][1:5] == [4, 4, 4, 0] and c["off"][1:5] == [4, 3, 2, 0], c["off"])
    off = lb.offered_rates(c, k_max=5, min_obs=1)
    check("offered chances s_j measured to k = 3, then by the last step's ratio (2/3)",
          off == [1.0, 0.75, 0.5, 0.3333, 0.2222], off)
    few = lb.offered_rates(c, k_max=3, min_obs=5)
    check("too few steps at every position: every draft offered", few == [1.0, 1.0, 1.0], few)
    rates = lb.conditional_rates(c, k_max=4, per="tried", min_obs=1)
    check("conditional rates a_j = acc_j / tried_j, the last carried on",
          rates == [0.75, 0.5, 1.0, 1.0], rates)
    rates3 = lb.conditional_rates(c, k_max=3, per="tried", min_obs=3)
    check("a position with too few observations takes the rate before it",
          rates3 == [0.75] * 3, rates3)
    check("histogram: 1.0 in the last bin, 0.1 in the second",
          lb.acceptance_histogram([0.0, 0.1, 0.95, 1.0]) == [1, 1, 0, 0, 0, 0, 0, 0, 0, 2])

# Paired ratios: per replicate present in both arms, mean and 95% Student-t interval.
num = [{"replicate": 1, "g": 110.0}, {"replicate": 2, "g": 100.0}, {"replicate": 3, "g": 120.0},
       {"replicate": 4, "g": 90.0}]
den = [{"replicate": 1, "g": 100.0}, {"replicate": 2, "g": 100.0}, {"replicate": 3, "g": 100.0}]
p = lb.paired(num, den, "g")
half = 4.303 * 0.1 / math.sqrt(3)
check("paired ratio: replicates in both arms only, t interval with 2 degrees of freedom",
      p["per_replicate"] == [1.1, 1.0, 1.2] and abs(p["mean"] - 1.1) < 1e-12
      and abs(p["ci95"] - half) < 1e-9 and abs(p["low"] - (1.1 - half)) < 1e-9, p)
check("one replicate: no interval", lb.paired(num[:1], den, "g")["low"] is None)

# The summary's ratio against no speculation: paired per replicate that ran both arms, beside
# static_best (over k >= 1 only: a nospec arm never becomes static_best).
def arm_run(mode, k, rep, g):
    return {"mode": mode, "k": k, "replicate": rep, "workload": "mixed", "dp": 2,
            "goodput_tok_per_s": g, "wall_goodput_tok_per_s": g, "decode_goodput_tok_per_s": g,
            "bubble_fraction": 0.1, "tpot_p50_ms": 30.0, "tpot_p99_ms": 50.0, "hangs": 0}


runs = ([arm_run("nospec", 0, r, 900.0) for r in (1, 2, 3)]
        + [arm_run("static", 1, r, 800.0) for r in (1, 2, 3)]
        + [arm_run("dpbalance", 7, r, g) for r, g in ((1, 990.0), (2, 900.0), (3, 810.0))])
s = lb.workload_summary(runs, [], {})
check("summary: static_best over k >= 1 even when no speculation serves more",
      s["static_best_k"] == 1 and abs(s["goodput_ratio"] - 1.125) < 1e-12, s)
check("summary: dpbalance against no speculation, paired per replicate",
      [round(x, 12) for x in s["goodput_ratio_vs_nospec_per_replicate"]] == [1.1, 1.0, 0.9]
      and abs(s["goodput_ratio_vs_nospec"] - 1.0) < 1e-12
      and abs(s["goodput_ratio_vs_nospec_ci95_low"] - (1.0 - 4.303 * 0.1 / math.sqrt(3))) < 1e-9
      and abs(s["nospec_goodput_ratio"] - 1.125) < 1e-12, s)
check("summary: no nospec arm, no such ratio",
      "goodput_ratio_vs_nospec" not in lb.workload_summary(runs[3:], [], {}))

# The steady window: from the first token of the last of the first batch's requests to the
# first rank's last admission.
client = {"t_begin": 100.0, "concurrency": 2, "dp": 2, "placement": "rr", "requests": [
    {"id": "req-0", "rank": 0, "t0": 100.0, "stamps": [[1.0, 1], [2.0, 1], [6.0, 1]]},
    {"id": "req-1", "rank": 1, "t0": 100.0, "stamps": [[1.5, 1], [3.0, 1]]},
    {"id": "req-2", "rank": 0, "t0": 104.0, "stamps": [[5.0, 1], [7.0, 1]]},
    {"id": "req-3", "rank": 1, "t0": 105.0, "stamps": [[5.5, 2], [8.0, 1]]}]}
w = lb.steady_window(client)
check("steady window and its tokens", w == (1.5, 4.0, 3), w)

# The TPOT split: the first batch (each rank's first concurrency / dp requests in the order sent,
# whatever order the client recorded them in) against every later request; TPOT = (end - first)
# / (out - 1), a request of one token has none.
timed = {"t_begin": 0.0, "concurrency": 2, "dp": 2, "placement": "rr", "requests": [
    {"id": "req-2", "rank": 0, "first": 4.0, "end": 5.0, "out": 11},    # later: 100 ms
    {"id": "req-0", "rank": 0, "first": 1.0, "end": 3.0, "out": 11},    # first batch: 200 ms
    {"id": "req-10", "rank": 1, "first": 6.0, "end": 6.5, "out": 11},   # later: 50 ms
    {"id": "req-1", "rank": 1, "first": 1.0, "end": 4.0, "out": 11},    # first batch: 300 ms
    {"id": "req-3", "rank": 1, "first": 5.0, "end": 5.0, "out": 1}]}    # later, no TPOT
first, later = lb.tpot_split(timed)
check("TPOT split: the first batch and the later requests",
      (sorted(round(t, 6) for t in first), sorted(round(t, 6) for t in later))
      == ([200.0, 300.0], [50.0, 100.0]), (first, later))

# The plugin's default margin for a model file (flags.cc's rule), which the live run's CPU arms
# and the prediction's H200 rows each take from their own model.
with tempfile.TemporaryDirectory() as d:
    for name, body, want in [("none", {}, 0.02), ("small", {"cv_mape": 0.01}, 0.02),
                             ("large", {"cv_mape": 0.148}, 0.148)]:
        path = os.path.join(d, name + ".json")
        with open(path, "w") as f:
            json.dump(dict(body, format="dpbalance-cost-model"), f)
        got = lb.plugin_default_margin(path)
        check(f"default margin, model file with {body or 'no cv_mape'}", abs(got - want) < 1e-12,
              got)

# best-static: the static arm of the best mean goodput, or the length --k names (the harness's
# --anchor-k); a length with no static arm is an error naming it.
arms = {"d1": {"goodput_tok_per_s": 700.0, "tpot_p99_ms": 40.0},
        "d3": {"goodput_tok_per_s": 800.0, "tpot_p99_ms": 50.0}}
found = {("mixed", 2): [("d1", {"mode": "static", "k_spec": 1}),
                        ("d3", {"mode": "static", "k_spec": 3}),
                        ("dp", {"mode": "dpbalance", "k_spec": 3})]}
saved = (lb.collect, lb.summarize_arm)
lb.collect, lb.summarize_arm = (lambda root: found), (lambda d, dp, w: arms[d])
try:
    for k, want in [(None, "3 50.0"), (1, "1 40.0")]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            lb.cmd_best_static(SimpleNamespace(runs_root="R", workload="mixed", dp=2, warmup=50, k=k))
        check(f"best-static --k {k}", out.getvalue().strip() == want, out.getvalue())
    try:
        lb.cmd_best_static(SimpleNamespace(runs_root="R", workload="mixed", dp=2, warmup=50, k=5))
        check("best-static --k 5 without such an arm is refused", False, "no error")
    except SystemExit as e:
        check("best-static --k 5 without such an arm is refused", "--k 5" in str(e), str(e))
finally:
    lb.collect, lb.summarize_arm = saved

# --guard-measured: the overhead the predicted dpbalance row charges is, per dpbalance replicate,
# the largest over ranks of the rank's mean plan_us, averaged over replicates; static arms,
# steps without plan_us and quiet steps (no xchg_us: no exchange, as the plugin's own mean
# leaves them out) do not count; no dpbalance log with plan_us gives None.
with tempfile.TemporaryDirectory() as tmp:
    def arm(name, mode, per_rank):
        d = os.path.join(tmp, name)
        os.makedirs(d)
        for r, xs in enumerate(per_rank):
            with open(os.path.join(d, f"engine_dp{r}.jsonl"), "w") as f:
                for x in xs:  # a negative time: a quiet step of that plan call, no exchange
                    f.write(json.dumps({"x": 0, "plan_us": abs(x) if x else x,
                                        "xchg_us": None if x is not None and x < 0
                                        else 800.0}) + "\n")
        return (d, {"mode": mode})
    found = [arm("s1", "static", [[9000.0], [9000.0]]),
             arm("p1", "dpbalance", [[1000.0, 2000.0, None, -30.0], [1200.0, 1400.0, -20.0]]),
             # 1500 vs 1300
             arm("p2", "dpbalance", [[500.0], [900.0]])]                          # 900
    got = lb.measured_own_us(found, 2)
    check("measured own time: mean over replicates of the largest rank mean", got == 1200.0, got)
    check("measured own time: none logged", lb.measured_own_us(found[:1], 2) is None)

# The bypass A/B (--bypass-ab): each planned epoch pairs with the bypassed one after it; the
# wall goodput ratio is tokens over rank 0's report-to-report time; a prompt step (and the step
# after it) leaves the decode ratio; a step logged in the wrong arm is counted.
with tempfile.TemporaryDirectory() as tmp:
    epoch, n = 4, 200
    for r in range(2):
        with open(os.path.join(tmp, f"engine_dp{r}.jsonl"), "w") as f:
            t = 100.0
            for x in range(n):
                off = (x // epoch) % 2 == 1
                prompt = x == 98  # a planned step with prompt tokens, 10x as long
                t += (0.100 if off else 0.102) * (10 if prompt else 1)
                f.write(json.dumps({"x": x, "n": 4, "accepted": 20 if off else 21, "t": t,
                                    "extra": 500 if prompt else 0,
                                    "result": "bypass" if off else "dpbSuccess",
                                    "changed": not off and x % 2 == 0,
                                    "plan_us": None if off else 150.0}) + "\n")
            f.write(json.dumps({"final": {}}) + "\n")
    b = lb.bypass_summary(tmp, 2, epoch, 10)
    want_decode = (50 / 0.102) / (48 / 0.100)
    check("bypass A/B: complete pairs after the warm-up only", b["pairs"] == 23, b["pairs"])
    check("bypass A/B: decode goodput ratio, prompt step and the one after it left out",
          abs(b["decode_goodput_ratio"] - want_decode) < 1e-9, b)
    check("bypass A/B: the wall ratio counts the prompt step's time",
          b["goodput_ratio"] < want_decode - 0.01, b["goodput_ratio"])
    check("bypass A/B: per-step means and the planned steps' changed share",
          abs(b["on_step_ms"] - (102 + 918 / 92)) < 1e-6 and abs(b["off_step_ms"] - 100) < 1e-6
          and b["on_tokens_per_step"] == 50 and b["off_tokens_per_step"] == 48
          and b["on_changed"] == 0.5 and b["on_plan_us_median"] == 150.0, b)
    check("bypass A/B: a jackknife interval over blocks of pairs",
          b.get("decode_goodput_ratio_ci95") is not None
          and b["decode_goodput_ratio_ci95"] < 1e-9, b.get("decode_goodput_ratio_ci95"))
    check("bypass A/B: every step in its arm", b["mislabelled_steps"] == 0)
    check("bypass A/B: the epoch read back from the step log", lb.bypass_epoch_of(tmp) == epoch)
    check("bypass A/B: a wrong epoch length is seen",
          lb.bypass_summary(tmp, 2, 8, 10)["mislabelled_steps"] > 0)
    check("bypass A/B: no batch adjustment where the batch never varies",
          "adjusted_decode_goodput_ratio" not in b, b.get("adjusted_decode_goodput_ratio"))

# The batch-adjusted ratio: step time and tokens depend on the batch (requests, context) and the
# arm; the regression recovers the arm's own effects (+1 ms, -2 tokens) where the raw pairing is
# thrown off by the batch's drift.
with tempfile.TemporaryDirectory() as tmp:
    import random
    rng = random.Random(3)
    epoch, n = 4, 400
    batch = [(rng.randint(4, 12), rng.randint(4, 12), rng.uniform(5e3, 6e4), rng.uniform(5e3, 6e4))
             for _ in range(n)]
    logs = [[], []]
    t = 0.0
    for x in range(n):
        on = (x // epoch) % 2 == 0
        n0, n1, c0, c1 = batch[x]
        dt = 40 + 2.0 * n0 + 1.5 * n1 + 0.3 * c0 / 1e3 + 0.2 * c1 / 1e3 + (1.0 if on else 0.0)
        tok = [int(6 * n0 - (2 if on else 0)), int(6 * n1)]
        t += (dt + rng.gauss(0, 0.3)) / 1e3
        for r, (nr, cr) in enumerate(((n0, c0), (n1, c1))):
            logs[r].append({"x": x, "n": nr, "accepted": tok[r] - nr, "t": t, "extra": 0,
                            "ctx": [cr], "result": "dpbSuccess" if on else "bypass",
                            "changed": False, "plan_us": 100.0 if on else None})
    for r in range(2):
        with open(os.path.join(tmp, f"engine_dp{r}.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in logs[r])
    b = lb.bypass_summary(tmp, 2, epoch, 10)
    check("bypass A/B adjusted: the arm's time effect (+1 ms)",
          abs(b["adjusted_decode_step_ms_effect"] - 1.0) < 0.15, b.get("adjusted_decode_step_ms_effect"))
    check("bypass A/B adjusted: the arm's token effect (-2)",
          abs(b["adjusted_decode_tokens_effect"] + 2.0) < 0.6, b.get("adjusted_decode_tokens_effect"))
    want = ((b["off_decode_tokens_per_step_mean"] - 2.0) / (b["off_decode_step_ms_mean"] + 1.0)) / (
        b["off_decode_tokens_per_step_mean"] / b["off_decode_step_ms_mean"])
    check("bypass A/B adjusted: the ratio at the bypassed steps' means",
          abs(b["adjusted_decode_goodput_ratio"] - want) < 0.005
          and b["adjusted_decode_goodput_ratio_ci95"] < 0.01,
          (b["adjusted_decode_goodput_ratio"], want, b.get("adjusted_decode_goodput_ratio_ci95")))
    check("bypass A/B adjusted: tighter than the raw pairing",
          b["adjusted_decode_goodput_ratio_ci95"] < b["decode_goodput_ratio_ci95"],
          (b["adjusted_decode_goodput_ratio_ci95"], b["decode_goodput_ratio_ci95"]))
    s = lb.workload_summary([arm_run("static", 3, 1, 10.0)], [], None, [b, b])
    check("bypass A/B: pooled over instances in the workload summary",
          s["bypass"]["instances"] == 2
          and abs(s["bypass"]["adjusted_decode_goodput_ratio"]
                  - b["adjusted_decode_goodput_ratio"]) < 1e-9, s.get("bypass"))
    check("bypass A/B: a resolution line", any("bypass A/B" in x for x in lb.resolution_lines(s)))

checks.finish()
