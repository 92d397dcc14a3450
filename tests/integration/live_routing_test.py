#!/usr/bin/env python3
"""integration/vllm/live_routing.py (and live_bench.py's --routing) without vLLM: made-up arm
logs whose figures are known: request latency (mean, nearest-rank median), the per-step context
imbalance (an idle rank holds 0, prefill steps left out), the route log's staleness, the ratios
against the vllm arm paired per replicate, B against A, the combined arms, the replay rows each
arm maps to, and how run-arm sets the routing hook's environment. The live run is
scripts/live_vllm.sh --routing.

  python3 tests/integration/live_routing_test.py
"""
import json
import math
import os
import sys
import tempfile
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from script_checks import ROOT, Checks, load_module  # noqa: E402

lr = load_module("live_routing", "integration", "vllm", "live_routing.py")
lb = lr.lb
checks = Checks()
check = checks.check
T_BEGIN = 1000.0


def near(a, b, tol=1e-9):
    return a is not None and abs(a - b) <= tol


# Four requests, concurrency 2, every time scaled by `f` (an arm f times slower): latencies
# 2000, 1600, 1400, 1900 ms x f (mean 1725 f, nearest-rank median 1600 f); TPOT 750, 1000, 1000,
# 1500 ms x f (p50 1000 f, p99 1500 f); steady window 0.6 f .. 2.1 f s holding 5 tokens.
REQS = [("req-0", 0.0, [0.5, 1.0, 2.0]), ("req-1", 0.0, [0.6, 1.6]),
        ("req-2", 1.6, [2.0, 3.0]), ("req-3", 2.1, [2.5, 4.0])]
# Per step, each rank's (kind, contexts, query tokens); max/mean of the ranks' summed contexts:
# 4000 vs 2000 -> 4/3; 1000 vs an idle rank -> 2; 1500 vs 1500 -> 1; the prefill step (a query
# of 100 tokens) is not a decode step. Mean over the decode steps: (4/3 + 2 + 1) / 3.
STEPS = [[("model", [1000, 3000], [4, 4]), ("model", [2000], [4])],
         [("model", [1000], [4]), ("dummy", [], [])],
         [("model", [1500], [4]), ("model", [1500], [4])],
         [("model", [1500, 10], [4, 100]), ("model", [1500], [4])]]
IMBALANCE = (4 / 3 + 2 + 1) / 3


def write_arm(root, label, rep, f, ages=(), mode="routing", env=None, k_spec=3):
    d = os.path.join(root, f"route_{label}_r{rep}")
    os.makedirs(d)
    reqs = [{"id": rid, "cls": "greedy", "rank": None, "in": 100, "out": len(st),
             "t0": T_BEGIN + t0 * f, "first": T_BEGIN + st[0] * f, "end": T_BEGIN + st[-1] * f,
             "stamps": [[t * f, 1] for t in st]} for rid, t0, st in REQS]
    client = {"name": f"route_{label}", "mode": mode, "replicate": rep, "k": k_spec,
              "k_spec": k_spec, "dp": 2, "concurrency": 2, "placement": "vllm",
              "routing": "vllm" if label.startswith("vllm") else label[0], "workload": "mixed",
              "seed": 1, "requests": reqs, "wall_s": 4.0 * f, "startup_s": 1.0, "hung": 0,
              "t_begin": T_BEGIN, "env": env or {}, "args": {"max_num_seqs": 16}}
    with open(os.path.join(d, "client.json"), "w") as out:
        json.dump(client, out)
    for r in range(2):
        with open(os.path.join(d, f"worker_dp{r}.jsonl"), "w") as out:
            for i, st in enumerate(STEPS):
                kind, ctx, q = st[r]
                out.write(json.dumps({"i": i, "kind": kind, "ctx": ctx, "q": q, "t": T_BEGIN + i,
                                      "att_us": 0.0 if kind == "dummy" else 100.0 * (r + 1),
                                      "fwd_us": 1000.0, "drafted": 0,
                                      "accepted": 0}) + "\n")
    if ages:
        with open(os.path.join(d, "route.jsonl"), "w") as out:
            for steps, ms, by in ages:
                out.write(json.dumps({"t": T_BEGIN, "id": "req-0", "rank": 0, "by": by, "in": 100,
                                      "out": 3, "loads": [[1, 100, 100, 103, 500000]] * 2,
                                      "age_steps": steps, "age_ms": ms}) + "\n")
    return d


with tempfile.TemporaryDirectory() as tmp:
    # One arm: every figure against the hand-computed one.
    ages = [([0, 2], [1.0, 30.0], "dpbalance"), ([1, None], [10.0, None], "dpbalance"),
            ([3, 5], [20.0, 40.0], "fallback")]
    one = lr.routing_run(write_arm(tmp, "B", 1, 2.0, ages), 2, 0)
    check("latency: last token - send, mean and nearest-rank median",
          near(one["latency_mean_ms"], 3450.0, 1e-6) and near(one["latency_p50_ms"], 3200.0, 1e-6),
          (one["latency_mean_ms"], one["latency_p50_ms"]))
    check("TPOT p50 / p99 of the arm", near(one["tpot_p50_ms"], 2000.0, 1e-6)
          and near(one["tpot_p99_ms"], 3000.0, 1e-6), (one["tpot_p50_ms"], one["tpot_p99_ms"]))
    check("steady goodput: 5 tokens over 1.5 f s", near(one["goodput_tok_per_s"], 5 / 3.0, 1e-9),
          one["goodput_tok_per_s"])
    check("context imbalance: max / mean rank context per decode step, an idle rank 0",
          near(one["ctx_imbalance"], IMBALANCE, 1e-12), one["ctx_imbalance"])
    check("bubble over the decode steps (attention 100 and 200 us; the idle rank 0)",
          near(one["bubble_fraction"], 1 - (150 + 50 + 150) / (200 + 100 + 200), 1e-12),
          one["bubble_fraction"])
    check("staleness: every rank's age pooled, nulls left out (steps 0,1,2,3,5; ms 1,10,20,30,40)",
          (one["route_age_steps_p50"], one["route_age_steps_p90"], one["route_age_ms_p50"],
           one["route_age_ms_p90"]) == (2, 5, 20.0, 40.0),
          (one["route_age_steps_p50"], one["route_age_steps_p90"]))
    check("who routed", one["routes"] == 3 and one["routed_by"] == {"dpbalance": 2, "fallback": 1},
          one["routed_by"])
    check("no route log: no staleness", lr.route_staleness([])["route_age_steps_p50"] is None)

    # Three replicates: vllm at f = 1.0, 1.2, 0.9; A as fast as vllm; B 1.10, 1.20, 1.00 x
    # slower; E+dpbalance 0.8 x vllm+static_best's time.
    root = os.path.join(tmp, "runs")
    os.makedirs(root)
    base_f = {1: 1.0, 2: 1.2, 3: 0.9}
    b_slow = {1: 1.10, 2: 1.20, 3: 1.00}
    runs = []
    for rep, f in base_f.items():
        for label, g in [("vllm", f), ("A", f), ("B", f * b_slow[rep]), ("E+dpbalance", f * 0.8),
                         ("vllm+static_best", f)]:
            mode = "routing_dpbalance" if label == "E+dpbalance" else "routing"
            runs.append(dict(lr.routing_run(write_arm(root, label, rep, g, ages, mode), 2, 0),
                             workload="mixed"))
    pred = {"rows": {"vllm": {"latency_mean_ms": 100.0, "latency_p50_ms": 90.0,
                              "goodput_tok_per_s": 50.0, "ctx_imbalance": 1.2},
                     "A": {"latency_mean_ms": 100.0, "latency_p50_ms": 90.0,
                           "goodput_tok_per_s": 50.0, "ctx_imbalance": 1.2},
                     "B": {"latency_mean_ms": 108.0, "latency_p50_ms": 99.0,
                           "goodput_tok_per_s": 45.0, "ctx_imbalance": 1.1}}}
    s = lr.routing_summary(runs, pred)
    check("arms in the table's order", list(s["arms"]) ==
          ["vllm", "A", "B", "E+dpbalance", "vllm+static_best"], list(s["arms"]))
    v = s["arms"]["vllm"]["latency_mean_ms"]
    sd = 1725 * math.sqrt(((1.0 - 31 / 30) ** 2 + (1.2 - 31 / 30) ** 2
                                          + (0.9 - 31 / 30) ** 2) / 2)
    check("mean over replicates with the t interval (2 degrees of freedom)",
          near(v["mean"], 1725 * 31 / 30, 1e-6)
          and near(v["ci95"], 4.303 * sd / math.sqrt(3), 1e-6),
          v)
    r = s["arms"]["B"]["vs_vllm"]["latency_mean_ms"]
    half = 4.303 * 0.1 / math.sqrt(3)
    check("B / vllm mean latency, paired per replicate",
          [round(x, 12) for x in r["per_replicate"]] == [1.1, 1.2, 1.0] and near(r["mean"], 1.1)
          and near(r["ci95"], half), r)
    g = s["arms"]["B"]["vs_vllm"]["goodput_tok_per_s"]["per_replicate"]
    check("B / vllm goodput per replicate is the inverse", all(near(x, 1 / b_slow[i + 1])
                                                              for i, x in enumerate(g)), g)
    c = s["arms"]["A"]["vs_vllm"]["ctx_imbalance"]
    check("A / vllm context imbalance (the same steps): 1 in every replicate",
          c["per_replicate"] == [1.0, 1.0, 1.0], c)
    check("no ratio of vllm against itself", "vs_vllm" not in s["arms"]["vllm"])
    b = s["b_over_a"]
    check("the seed's check: B / A latency paired, the write-up's figures and the replay's beside",
          near(b["latency_mean_ms"]["mean"], 1.1) and near(b["latency_p50_ms"]["mean"], 1.1)
          and b["write_up"]["latency_mean"] == 1.115
          and near(b["predicted"]["latency_mean_ms"], 1.08)
          and near(b["predicted"]["latency_p50_ms"], 1.1), b)
    e = s["e_dpbalance_vs_vllm_static_best"]["goodput_tok_per_s"]
    check("E+dpbalance / vllm+static_best goodput: 1 / 0.8 in every replicate",
          all(near(x, 1.25) for x in e["per_replicate"]) and near(e["ci95"], 0.0, 1e-9), e)
    check("the replay's row beside its arm", s["arms"]["B"]["predicted"]["ctx_imbalance"] == 1.1)
    lines = lr.table_lines(s)
    check("the table: a row per arm in each table, the seed's and the combined lines",
          sum(ln.startswith("| B |") for ln in lines) == 2
          and any(ln.startswith("B / A") for ln in lines)
          and any(ln.startswith("E+dpbalance / vllm+static_best") for ln in lines),
          f"{len(lines)} lines")

    # summarize: the routing entry added to an existing JSON, the verify figures kept.
    out = os.path.join(tmp, "live.json")
    with open(out, "w") as fh:
        json.dump({"runs": ["kept"]}, fh)
    with open(os.devnull, "w") as null:
        saved, sys.stdout = sys.stdout, null
        try:
            lr.cmd_summarize(SimpleNamespace(runs_root=root, json=out, predicted=[], warmup=0))
        finally:
            sys.stdout = saved
    res = json.load(open(out))
    check("summarize adds `routing` and keeps the rest", res["runs"] == ["kept"]
          and res["routing"][0]["dp"] == 2 and len(res["routing"][0]["per_instance"]) == 15,
          list(res))

    # The replay rows: vLLM's routing as A, a strategy with its Router flags, rr none, E with
    # verify balancing from its arm's recorded flags.
    model = os.path.join(tmp, "model.json")
    with open(model, "w") as fh:
        json.dump({"format": "dpbalance-cost-model", "cv_mape": 0.05}, fh)
    found = [(None, {"name": "route_vllm", "k_spec": 3, "env": {}}),
             (None, {"name": "route_rr", "k_spec": 3, "env": {}}),
             (None, {"name": "route_D", "k_spec": 3, "env": {"DPB_Z": "1.5", "DPB_GROUPS": "2"}}),
             (None, {"name": "route_E+dpbalance", "k_spec": 7,
                     "env": {"DPB_DEFAULT_K": "3", "DPB_TPOT_SLO_MS": "80.5",
                             "DPB_GUARD_MEASURED": "0", "DPB_VALUE_DEFERRAL": "0"}})]
    rows = lr.replay_rows(found, 2, model)
    check("replay rows: vllm as A at the arm's length, D with its Z and groups, no rr",
          rows["vllm"]["flags"] == ["--routing", "A", "--verify", "off", "--k", "3"]
          and rows["D"]["flags"][-4:] == ["--z", "1.5", "--groups", "2"] and "rr" not in rows,
          rows)
    check("replay rows: E+dpbalance plans at its default length, SLO and the model's margin",
          rows["E+dpbalance"]["flags"] == ["--routing", "E", "--verify", "goodput", "--k", "3",
                                           "--tpot_slo_ms", "80.5", "--min_plan_gain", "0.05"],
          rows["E+dpbalance"]["flags"])
    check("route log's KV capacity", lr.kv_capacity_tokens(
        [(os.path.join(root, "route_vllm_r1"), {})]) == 500000)

# run-arm's --routing: --placement is its older form; the hook's environment is set before the
# engine starts, A-E only with the plugin on; vllm never inherits a strategy.
a = SimpleNamespace(routing=None, placement="vllm")
lb.resolve_routing(a)
check("--placement vllm alone is --routing vllm", (a.routing, a.placement) == ("vllm", "vllm"))
a = SimpleNamespace(routing="D", placement=None)
lb.resolve_routing(a)
check("--routing D places as one closed loop", a.placement == "vllm")
a = SimpleNamespace(routing=None, placement=None)
lb.resolve_routing(a)
check("neither: rr", (a.routing, a.placement) == ("rr", "rr"))
try:
    lb.resolve_routing(SimpleNamespace(routing="B", placement="rr"))
    check("--placement rr with --routing B is refused", False, "no error")
except SystemExit as err:
    check("--placement rr with --routing B is refused", "contradicts" in str(err), str(err))
with tempfile.TemporaryDirectory() as d:
    stale = os.path.join(d, "route.jsonl")
    open(stale, "w").write("{}\n")
    env = {"DPB_PLUGIN": "dpbalance", "DPB_ROUTING": "B"}
    lb.set_routing_env("E", d, env)
    check("A-E: DPB_ROUTING and a fresh route log", env["DPB_ROUTING"] == "E"
          and env["DPBALANCE_VLLM_ROUTE_LOG"] == stale and not os.path.exists(stale), env)
    env = {"DPB_PLUGIN": "dpbalance", "DPB_ROUTING": "B"}
    lb.set_routing_env("vllm", d, env)
    check("vllm: no strategy inherited, the route log still written",
          "DPB_ROUTING" not in env and env["DPBALANCE_VLLM_ROUTE_LOG"] == stale, env)
    env = {"DPB_ROUTING": "B"}
    lb.set_routing_env("rr", d, env)
    check("rr: pinned, no strategy and no route log", env == {}, env)
    try:
        lb.set_routing_env("C", d, {"DPB_PLUGIN": "none"})
        check("C without the plugin on is refused", False, "no error")
    except SystemExit as err:
        check("C without the plugin on is refused", "DPB_PLUGIN=dpbalance" in str(err), str(err))
    model_dir = os.path.join(d, "model")
    lb.write_model(model_dir, "decode")
    stream = dict(trace=os.path.join(ROOT, "integration/replay/data/mooncake_conversation.jsonl"),
                  model=model_dir, workload="mixed", mix="", seed=1, requests=20, offset=0, dp=2,
                  block=24, shared_prefix=1, in_scale=0.4, out_scale=1.0, max_in=2000,
                  max_out=320, min_out=64, long_every=5, long_in=6000)
    routed = lb.make_requests(SimpleNamespace(placement="vllm", **stream))
    pinned = lb.make_requests(SimpleNamespace(placement="rr", **stream))
    check("a routed stream carries no rank; otherwise the same requests",
          all(r["rank"] is None for r in routed)
          and [dict(r, rank=None) for r in pinned] == routed)
    check("the routing stream: every 5th prompt 6000 tokens, the others at most 2000",
          all((len(r["prompt"]) == 6000) == (i % 5 == 0) and len(r["prompt"]) <= 6000
              for i, r in enumerate(routed)))

checks.finish()
