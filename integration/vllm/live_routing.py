#!/usr/bin/env python3
"""The routing arms of the live vLLM benchmark (scripts/live_vllm.sh --routing): their figures
against vLLM's own routing, and the replay's prediction of the same stream.

  live_routing.py predict --runs-root R --workload W --dp N --replay BIN --model M --terms T
                          --json OUT        the stream through dpbalance-replay, one row per arm
  live_routing.py summarize --runs-root R --json FILE [--predicted P ...]
                                            adds `routing` to FILE (live_bench.py summarize's)

A routing arm is `live_bench.py run-arm --routing X --mode routing|routing_dpbalance --name
route_LABEL`: one closed loop of --concurrency requests, none pinned to a rank, on the stream
every arm of the run serves. LABEL is `vllm` (vLLM's DP load balancer), `rr` (request i on rank
i % dp), a strategy A-E (dpbalance's Router through the package's hook, DPB_MODE=off: vLLM's own
verify length), `E+dpbalance` (E with the plugin's verify balancing) or `vllm+static_best`
(vLLM as shipped at static_best's length). Each figure is per arm instance (live_bench's
summarize_arm and the helpers below), then the mean over replicates with its 95% Student-t
interval, and paired per replicate against the `vllm` arm of the same replicate (live_bench.paired):
the arms of a replicate ran back to back, so the machine's drift cancels. docs/live_vllm.md,
"Routing arms", says what each column means.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import live_bench as lb  # noqa: E402  (it takes _HERE off sys.path again: the installed package)

MODES = ("routing", "routing_dpbalance")
BASE = "vllm"  # every ratio is against this arm
ORDER = ("vllm", "rr", "A", "B", "C", "D", "E", "E+dpbalance", "vllm+static_best")
# Per instance (routing_run), as mean and interval over replicates; the first eight also
# against `vllm`, paired per replicate.
METRICS = ("latency_mean_ms", "latency_p50_ms", "tpot_p50_ms", "tpot_p99_ms", "goodput_tok_per_s",
           "wall_goodput_tok_per_s", "bubble_fraction", "ctx_imbalance", "route_age_steps_p50",
           "route_age_steps_p90", "route_age_ms_p50", "route_age_ms_p90")
RATIOS = METRICS[:8]
PREDICTED = ("latency_mean_ms", "latency_p50_ms", "goodput_tok_per_s", "ctx_imbalance",
             "bubble_fraction")
# The write-up this project started from: one DP8 instance, B's latency over A's.
SEED_B_OVER_A = {"dp": 8, "latency_mean": 1.115, "latency_p50": 1.104}
# Router flags the replay takes too (docs/flags.md "Router flags"; dpbalance-replay --help).
REPLAY_ROUTER_FLAGS = (("DPB_Z", "--z"), ("DPB_GROUPS", "--groups"),
                       ("DPB_GROUP_CHOICE", "--group_choice"),
                       ("DPB_SPLIT_PERCENTILE", "--split_percentile"),
                       ("DPB_SPLIT_WINDOW", "--split_window"))


def arm_label(client: dict) -> str:
    """The arm's label: its name without the `route_` prefix."""
    name = client["name"]
    return name[len("route_"):] if name.startswith("route_") else name


def request_latencies_ms(client: dict) -> list:
    """Per served request, its last token's time minus its send time (the closed loop's
    admission), ms; requests that received no token are left out (the arm's hangs count them)."""
    return [(r["end"] - r["t0"]) * 1e3 for r in client["requests"] if r.get("end") is not None]


def ctx_imbalance(steps) -> float | None:
    """Mean over steps of the largest rank's summed contexts (the worker rows' `ctx`: each
    scheduled request's context before the step) over the mean rank's; an idle rank (a dummy
    batch) holds 0. Steps with no context anywhere are left out; None when none is left."""
    vals = []
    for st in steps:
        sums = [sum(r.get("ctx") or []) for r in st]
        mean = sum(sums) / len(sums)
        if mean > 0:
            vals.append(max(sums) / mean)
    return statistics.mean(vals) if vals else None


def route_staleness(rows) -> dict:
    """From the hook's route log (one row per request routed): how old the per-rank load
    records were when a request was routed, pooled over every row and rank (null: unknown,
    left out), in engine steps and ms (median and p90); the rows' count and who routed them."""
    steps = [x for r in rows for x in (r.get("age_steps") or []) if x is not None]
    ms = [x for r in rows for x in (r.get("age_ms") or []) if x is not None]
    by = {}
    for r in rows:
        by[r.get("by", "?")] = by.get(r.get("by", "?"), 0) + 1
    return {"route_age_steps_p50": lb.pct(steps, 50), "route_age_steps_p90": lb.pct(steps, 90),
            "route_age_ms_p50": lb.pct(ms, 50), "route_age_ms_p90": lb.pct(ms, 90),
            "routes": len(rows), "routed_by": by}


def routing_run(log_dir: str, dp: int, warmup: int) -> dict:
    """One routing arm instance's figures: live_bench's per-arm summary (steady and wall
    goodput, per-request TPOT, the bubble over the decode steps after `warmup` busy steps) with
    the request latency, the context imbalance over the same decode steps, and the route log's
    staleness."""
    client = json.load(open(os.path.join(log_dir, "client.json")))
    arm = lb.summarize_arm(log_dir, dp, warmup)
    lat = request_latencies_ms(client)
    _, _, steps = lb.decode_steps(log_dir, dp, warmup)
    out = {"label": arm_label(client), "name": arm["name"], "mode": arm["mode"],
           "routing": arm["routing"], "replicate": arm["replicate"], "k_spec": arm["k_spec"],
           "dp": dp, "requests": arm["requests"], "requests_done": arm["requests_done"],
           "hangs": arm["hangs"], "fallbacks": arm["fallbacks"], "steps": arm["steps"],
           "latency_mean_ms": statistics.mean(lat) if lat else None,
           "latency_p50_ms": lb.pct(lat, 50),
           "ctx_imbalance": ctx_imbalance(steps)}
    for key in ("tpot_p50_ms", "tpot_p99_ms", "goodput_tok_per_s", "wall_goodput_tok_per_s",
                "bubble_fraction"):
        out[key] = arm[key]
    out.update(route_staleness(lb.read_jsonl(os.path.join(log_dir, "route.jsonl"))))
    return out


def routing_summary(runs: list, predicted: dict | None = None) -> dict:
    """The `routing` entry of one workload and DP size: per arm label (ORDER), each METRICS
    figure as mean and 95% interval over its instances, each RATIOS figure against the `vllm`
    arm paired per replicate, and the replay's prediction beside (`predicted`: predict's JSON);
    the seed's check (B against A, paired) and E + verify balancing against vLLM's routing at
    static_best (goodput, TPOT p99, mean latency, paired)."""
    by_label = {}
    for r in runs:
        by_label.setdefault(r["label"], []).append(r)
    labels = [x for x in ORDER if x in by_label] + sorted(set(by_label) - set(ORDER))
    pred_rows = (predicted or {}).get("rows", {})
    base = by_label.get(BASE, [])
    arms = {}
    for label in labels:
        group = sorted(by_label[label], key=lambda r: r["replicate"])
        e = {"instances": len(group), "replicates": [r["replicate"] for r in group],
             "hangs": sum(r["hangs"] for r in group),
             "requests_done": sum(r["requests_done"] for r in group),
             "requests": sum(r["requests"] for r in group)}
        for key in METRICS:
            m, h = lb.mean_ci([r[key] for r in group])
            e[key] = {"mean": m, "ci95": h}
        if base and label != BASE:
            e["vs_vllm"] = {key: lb.paired(group, base, key) for key in RATIOS}
        if label in pred_rows:
            e["predicted"] = pred_rows[label]
        arms[label] = e
    out = {"workload": runs[0].get("workload"), "dp": runs[0]["dp"], "arms": arms,
           "per_instance": sorted(runs, key=lambda r: (r["replicate"], ORDER.index(r["label"])
                                                      if r["label"] in ORDER else len(ORDER)))}
    if "A" in by_label and "B" in by_label:
        check = {key: lb.paired(by_label["B"], by_label["A"], key)
                 for key in ("latency_mean_ms", "latency_p50_ms")}
        check["write_up"] = SEED_B_OVER_A
        if "A" in pred_rows and "B" in pred_rows:
            check["predicted"] = {key: pred_rows["B"][key] / pred_rows["A"][key]
                                  for key in ("latency_mean_ms", "latency_p50_ms")
                                  if pred_rows["A"].get(key)}
        out["b_over_a"] = check
    if "E+dpbalance" in by_label and "vllm+static_best" in by_label:
        ours, theirs = by_label["E+dpbalance"], by_label["vllm+static_best"]
        out["e_dpbalance_vs_vllm_static_best"] = {
            key: lb.paired(ours, theirs, key)
            for key in ("goodput_tok_per_s", "wall_goodput_tok_per_s", "tpot_p99_ms",
                        "latency_mean_ms")}
    if predicted:
        out["prediction"] = {k: v for k, v in predicted.items() if k != "rows"}
    return out


# --- the replay's prediction ------------------------------------------------------------------
def kv_capacity_tokens(found) -> int | None:
    """A rank's KV capacity as the ranks' load records gave it (the route log's loads[r][4]
    where age_steps[r] is known: before a rank's first record the hook counts on its own, with
    no capacity), the median over every such rank and route; None when no log has one."""
    caps = []
    for log_dir, _ in found:
        for r in lb.read_jsonl(os.path.join(log_dir, "route.jsonl")):
            caps += [load[4] for load, age in zip(r.get("loads") or [], r.get("age_steps") or [])
                     if age is not None and len(load) > 4 and load[4]]
    return int(statistics.median(caps)) if caps else None


def replay_rows(found, dp: int, model: str) -> dict:
    """Per arm label of `found`: the replay flags of its row. vLLM's own routing (`vllm`,
    `vllm+static_best`) is predicted by A, the strategy nearest its score (requests in flight
    and waiting; its KV-pressure term has no counterpart); `rr` has no replay row (the replay
    routes every request). A-E take the Router flags their arm ran with; E + verify balancing
    the plugin arm's settings (its default length, TPOT SLO, guard, own time charged, value
    deferral, quiet mode) as its recorded DPB_* environment says."""
    rows = {}
    for log_dir, c in found:
        label, env = arm_label(c), c.get("env", {})
        if label in rows or label == "rr":
            continue
        k = str(c["k_spec"])
        if label in ("vllm", "vllm+static_best"):
            rows[label] = {"as": "A", "flags": ["--routing", "A", "--verify", "off", "--k", k]}
        elif label in lb.ROUTER_STRATEGIES:
            flags = ["--routing", label, "--verify", "off", "--k", k]
            for var, flag in REPLAY_ROUTER_FLAGS:
                if var in env:
                    flags += [flag, env[var]]
            rows[label] = {"as": label, "flags": flags}
        elif label == "E+dpbalance":
            gain = float(env["DPB_MIN_PLAN_GAIN"]) if "DPB_MIN_PLAN_GAIN" in env \
                else lb.plugin_default_margin(model)
            own = lb.measured_own_us(found, dp, mode="routing_dpbalance") \
                if env.get("DPB_GUARD_MEASURED", "1") == "1" else None
            overhead = float(env.get("DPB_GUARD_OVERHEAD_US", 0)) + (own or 0.0)
            flags = ["--routing", "E", "--verify", "goodput",
                     "--k", env.get("DPB_DEFAULT_K", k),
                     "--tpot_slo_ms", env.get("DPB_TPOT_SLO_MS", "off"),
                     "--min_plan_gain", str(gain)]
            if env.get("DPB_VALUE_DEFERRAL") == "1":
                flags.append("--value_deferral=true")
            if overhead:
                flags += ["--guard_overhead_us", str(round(overhead, 1))]
            if int(env.get("DPB_QUIET_AFTER", 0)):
                flags += ["--quiet_after", env["DPB_QUIET_AFTER"]]
            for var, flag in REPLAY_ROUTER_FLAGS:
                if var in env:
                    flags += [flag, env[var]]
            rows[label] = {"as": "E + goodput", "flags": flags, "guard_measured_us": own}
    return rows


def cmd_predict(a) -> int:
    """The replay's prediction of the routing arms: the served stream (each request's prompt and
    output length, in stream order, with its conditional acceptance per draft slot measured over
    every `routing` arm, which all verify at the same static length), the fitted CPU model as truth
    and planner model, the fitted step terms, one closed loop of the arms' --concurrency, a
    rank's batch cap at their --max-num-seqs, lag 0, 10% attention noise, --seeds seeds; one row
    per arm (replay_rows). Goodput and bubble as the verify arms' prediction takes them (until the
    stream is exhausted); latency and context imbalance with --drain, every request to its end,
    as the live figures take every request and every decode step."""
    found = [(d, c) for d, c in lb.collect(a.runs_root).get((a.workload, a.dp), [])
             if c.get("mode") in MODES]
    static = [(d, c) for d, c in found if c["mode"] == "routing"]
    if not static:
        raise SystemExit(f"live_routing: no routing arm of workload {a.workload} at DP {a.dp} "
                         f"under {a.runs_root}")
    client = static[0][1]
    counts = {}
    for log_dir, c in static:
        lb.merge_counts(counts, lb.request_counts(log_dir, a.dp, c["k_spec"]))
    reqs = sorted(client["requests"], key=lambda r: int(r["id"].split("-")[1]))
    served = [{"in": r["in"], "out": max(1, r["out"]),
               "rates": lb.conditional_rates(counts[r["id"]], per="slots")
               if r["id"] in counts else [0.0]} for r in reqs]
    terms = json.load(open(a.terms))
    cap = kv_capacity_tokens(found)
    args = client["args"]
    base = ["--dp", str(a.dp), "--max_batch", str(args["max_num_seqs"]),
            "--inflight", str(client["concurrency"]), "--truth", a.model, "--truth_layers", "1",
            "--planner_model", a.model, "--noise", str(a.noise),
            "--ffn_fixed_ms", str(terms["ffn_fixed_us"] / 1e3),
            "--ffn_per_token_ms", str(terms["ffn_per_token_us"] / 1e3),
            "--draft_ms", "0", "--stale_steps", "0", "--tiers", "none", "--k_max", "7"]
    if cap:
        base += ["--rank_capacity_tokens", str(cap)]
    out = {"workload": a.workload, "dp": a.dp, "model": a.model, "terms": terms,
           "seeds": a.seeds, "noise": a.noise, "requests": len(served),
           "inflight": client["concurrency"], "max_batch": args["max_num_seqs"],
           "rank_capacity_tokens": cap, "rows": {}}
    with tempfile.TemporaryDirectory(prefix="dpb-route-predict-") as tmp:
        trace = os.path.join(tmp, "served.jsonl")
        lb.write_trace(trace, served)
        for label, spec in replay_rows(found, a.dp, a.model).items():
            steady = lb._replay_mean(a.replay, trace, base + spec["flags"], a.seeds, tmp)
            drained = lb._replay_mean(a.replay, trace, base + spec["flags"] + ["--drain=true"],
                                      a.seeds, tmp)
            out["rows"][label] = {
                "as": spec["as"], "flags": spec["flags"],
                "goodput_tok_per_s": steady["goodput_tok_per_s"],
                "bubble_fraction": steady["bubble_fraction"],
                "latency_mean_ms": drained["latency_mean_ms"],
                "latency_p50_ms": drained["latency_p50_ms"],
                "ctx_imbalance": drained["ctx_imbalance"],
                **({"guard_measured_us": spec["guard_measured_us"]}
                   if "guard_measured_us" in spec else {})}
    rows = out["rows"]
    if BASE in rows:
        for label, row in rows.items():
            row["vs_vllm"] = {k: row[k] / rows[BASE][k] if rows[BASE][k] else None
                              for k in PREDICTED}
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    for label, row in rows.items():
        print(f"predict routing {a.workload} dp{a.dp} {label} (as {row['as']}): latency mean "
              f"{row['latency_mean_ms']:.0f} ms, p50 {row['latency_p50_ms']:.0f} ms, goodput "
              f"{row['goodput_tok_per_s']:.1f} tok/s, context imbalance {row['ctx_imbalance']:.3f}")
    return 0


# --- the table -------------------------------------------------------------------------------
def _pm(v: dict, nd: int) -> str:
    """'mean ± half-width' of a {mean, ci95} entry ('-' where there is no mean)."""
    if v["mean"] is None:
        return "-"
    return lb.fmt(v["mean"], nd) + (f" ± {v['ci95']:.{nd}f}" if v["ci95"] is not None else "")


def _ratio(v: dict | None) -> str:
    """A paired ratio as 'mean (low–high)'; 'mean' alone with one replicate."""
    if not v or v["mean"] is None:
        return "-"
    if v["low"] is None:
        return f"{v['mean']:.3f}"
    return f"{v['mean']:.3f} ({v['low']:.3f}–{v['high']:.3f})"


def table_lines(s: dict) -> list:
    """The printed tables of one `routing` entry: the figures per arm with the replay's beside,
    the ratios against `vllm` with the replay's beside, the seed's check, the combined arms."""
    arms = s["arms"]
    out = [f"routing {s['workload']}/dp{s['dp']}: per arm, mean ± 95% half-interval over "
           "replicates; replay: its prediction of the same stream",
           "| arm | n | latency mean ms | latency P50 ms | TPOT p50 ms | TPOT p99 ms "
           "| goodput tok/s | bubble | ctx imbalance | route age steps p50 / p90 "
           "| replay: latency mean / P50 ms | replay: goodput | replay: ctx imbalance |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, e in arms.items():
        p = e.get("predicted")
        age = f"{lb.fmt(e['route_age_steps_p50']['mean'], 2)} / " \
              f"{lb.fmt(e['route_age_steps_p90']['mean'], 2)}"
        rp = (f"{p['latency_mean_ms']:.0f} / {p['latency_p50_ms']:.0f} | "
              f"{p['goodput_tok_per_s']:.1f} | {p['ctx_imbalance']:.3f}") if p else "- | - | -"
        out.append(f"| {label} | {e['instances']} | {_pm(e['latency_mean_ms'], 0)} | "
                   f"{_pm(e['latency_p50_ms'], 0)} | {_pm(e['tpot_p50_ms'], 1)} | "
                   f"{_pm(e['tpot_p99_ms'], 1)} | {_pm(e['goodput_tok_per_s'], 1)} | "
                   f"{_pm(e['bubble_fraction'], 3)} | {_pm(e['ctx_imbalance'], 3)} | {age} | "
                   f"{rp} |")
    out += ["", f"routing {s['workload']}/dp{s['dp']}: against vllm, paired per replicate, mean "
            "(95% interval); replay: its rows' ratio to its vllm row (A)",
            "| arm | latency mean | latency P50 | TPOT p50 | TPOT p99 | goodput | bubble "
            "| ctx imbalance | replay: latency mean | replay: P50 | replay: goodput "
            "| replay: ctx imbalance |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, e in arms.items():
        if "vs_vllm" not in e:
            continue
        v = e["vs_vllm"]
        pv = (e.get("predicted") or {}).get("vs_vllm") or {}
        rp = " | ".join(lb.fmt(pv.get(k)) for k in ("latency_mean_ms", "latency_p50_ms",
                                                     "goodput_tok_per_s", "ctx_imbalance"))
        out.append(f"| {label} | " + " | ".join(_ratio(v[k]) for k in
                                                ("latency_mean_ms", "latency_p50_ms",
                                                 "tpot_p50_ms", "tpot_p99_ms",
                                                 "goodput_tok_per_s", "bubble_fraction",
                                                 "ctx_imbalance")) + f" | {rp} |")
    if "b_over_a" in s:
        c = s["b_over_a"]
        pred = c.get("predicted", {})
        out.append(f"B / A (the write-up: mean {SEED_B_OVER_A['latency_mean']}, P50 "
                   f"{SEED_B_OVER_A['latency_p50']} at DP{SEED_B_OVER_A['dp']}): mean latency "
                   f"{_ratio(c['latency_mean_ms'])}, P50 {_ratio(c['latency_p50_ms'])}; replay "
                   f"{lb.fmt(pred.get('latency_mean_ms'))}, {lb.fmt(pred.get('latency_p50_ms'))}")
    if "e_dpbalance_vs_vllm_static_best" in s:
        c = s["e_dpbalance_vs_vllm_static_best"]
        out.append(f"E+dpbalance / vllm+static_best: steady goodput "
                   f"{_ratio(c['goodput_tok_per_s'])}, wall goodput "
                   f"{_ratio(c['wall_goodput_tok_per_s'])}, TPOT p99 {_ratio(c['tpot_p99_ms'])}, "
                   f"mean latency {_ratio(c['latency_mean_ms'])}")
    return out


def cmd_summarize(a) -> int:
    """Adds `routing` (one routing_summary per workload and DP size with routing arms) to --json
    (created when missing) and prints the tables."""
    predicted = {}
    for path in a.predicted:
        p = json.load(open(path))
        predicted[(p["workload"], p["dp"])] = p
    entries = []
    for (workload, dp), arms in lb.collect(a.runs_root).items():
        runs = []
        for log_dir, client in arms:
            if client.get("mode") in MODES:
                runs.append(dict(routing_run(log_dir, dp, a.warmup), workload=workload))
        if runs:
            entries.append(routing_summary(runs, predicted.get((workload, dp))))
    if not entries:
        raise SystemExit(f"live_routing: no routing arm under {a.runs_root}")
    res = json.load(open(a.json)) if os.path.exists(a.json) and os.path.getsize(a.json) else {}
    res["routing"] = entries
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)
    for s in entries:
        print("\n".join(table_lines(s)))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("predict")
    pr.add_argument("--runs-root", required=True)
    pr.add_argument("--workload", default="mixed")
    pr.add_argument("--dp", type=int, default=2)
    pr.add_argument("--replay", required=True, help="the dpbalance-replay binary")
    pr.add_argument("--model", required=True, help="the fitted CPU attention model (JSON)")
    pr.add_argument("--terms", required=True, help="live_bench.py calibrate --terms output")
    pr.add_argument("--seeds", type=int, default=3)
    pr.add_argument("--noise", type=float, default=0.1,
                    help="the truth's per-step log-normal noise on attention (as live_bench.py "
                         "predict)")
    pr.add_argument("--json", required=True)
    s = sub.add_parser("summarize")
    s.add_argument("--runs-root", required=True)
    s.add_argument("--json", required=True, help="live_bench.py summarize's JSON: gets `routing`")
    s.add_argument("--predicted", action="append", default=[], help="predict's JSON (repeat)")
    s.add_argument("--warmup", type=int, default=50,
                   help="busy steps skipped at the start of each arm (as live_bench.py summarize)")
    a = p.parse_args(argv)
    return cmd_predict(a) if a.cmd == "predict" else cmd_summarize(a)


if __name__ == "__main__":
    sys.exit(main())
