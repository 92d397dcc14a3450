#!/usr/bin/env python3
"""dpbalance_sglang inside SGLang 0.5.23's own scheduler loops (issue #50).

Usage: sglang_loop_test.py CASE PLUGIN_SO      (CASE: see cases(); PLUGIN_SO: DPB_PLUGIN)

Two scheduler OS processes (DP attention, dp 2, attention TP 1, gloo) run SGLang's
`Scheduler.event_loop_overlap` (its default) or `event_loop_normal` with real requests, SGLang's
own batch formation, both MLP syncs, `batch.copy()`, `process_batch_result` and the speculative
worker's step logic; only what needs a GPU stands in, below the model forward
(sglang_loop_rank.py, "STAND-INS"; sglang_loop_NOTES.md). dpbalance is loaded the way SGLang
loads plugins (`load_plugins()`, the `sglang.srt.plugins` entry point of the installed package).

Checked on every case (the issue's seven defects, numbered as there):
  1. every plan made is reported, with its own plan_id, under either loop (the overlap loop
     reports SGLang's copy of the batch): reports == plans, nothing missing or outstanding;
  2. the iteration's prefill probe sync runs as shipped (SGLang's 11 columns, no plan): each
     decode iteration has one sync of 11 columns then one of 11 + 64, and plans == planning
     syncs;
  6. the loop is SGLang's: both processes run every iteration, every request finishes, and its
     output is the target's own greedy chain (lossless speculative decoding);
  no stale plan is applied (stale_dropped 0) and no exchange error.
Per case:
  3. dspark*: the plan's lengths are what DSpark verifies (`schedule_layout`'s lengths), with and
     without an SPS table, and each busy rank verifies the total every rank agreed for it;
     with the MoE-draft tier path, the agreed tier is the plan's on busy and idle ranks alike;
  4. eagle: SGLang's adaptive steps under attention DP with the refusal lifted by dpbalance: every
     rank runs the same depth at every iteration (SGLang as shipped splits them and gloo aborts:
     sglang_loop_NOTES.md), the depth is the plan's, and it changes during the run;
  5. nospec: the attention time reported is the target's attention layers as timed during the
     forward (within the stand-in's own timing of the same calls), not the step's wall time.
The figures (steps, plans, reports, fallbacks, the longest wait) are printed per case.

A missing SGLang, torch or package is a failure, never a skip.
"""
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

SGLANG_COLUMNS = 11   # MLPSyncBatchInfo._get_local_tensor's width at SGLang 0.5.23
RECORD_COLUMNS = 64   # dpbalance's 512-byte record as int64 columns


def long_requests():
    """Requests that keep both DP ranks decoding for 100+ iterations, arriving over the run (so
    prefill iterations interleave), rank 1 longer: near the end rank 0 idles while rank 1 still
    decodes. All finish before the run's last iterations."""
    plan = {0: [(40, 300, 0), (24, 220, 8), (60, 140, 40), (32, 90, 70)],
            1: [(48, 300, 0), (30, 240, 0), (36, 180, 5), (80, 140, 30), (20, 110, 60),
                (44, 80, 95)]}
    return [{"rid": f"dp{dp}-r{i}", "dp": dp, "prompt_len": p, "max_new_tokens": n, "at": at}
            for dp, rows in plan.items() for i, (p, n, at) in enumerate(rows)]


def cases():
    import sglang_loop_probe as probe

    def case(loop, spec, iterations, fixed_terms=False, **kw):
        c = probe.make_case(loop, spec, iterations)
        c["requests"] = long_requests()
        c["env"].update({"DPB_LOG_EVERY": "0", "DPB_LOG_LEVEL": "warn", "DPB_TIMEOUT_MS": "5000"})
        # The EAGLE swing tests how the agreed depth follows acceptance at known step costs (the
        # flags' H200 terms). Learnt online here, the terms would be this machine's CPU stand-ins'
        # (their draft forward per depth step), which move the best depth per machine: those
        # cases keep the flags; the others learn, and must learn the same terms on both ranks.
        if fixed_terms:
            c["env"]["DPB_LEARN_STEP_TERMS"] = "0"
        c["learn_terms"] = not fixed_terms
        if kw.get("topk"):
            c["env"]["DPBALANCE_SGLANG_DSPARK_TOPK"] = "1"
        c.update(kw)
        return c

    # Acceptance that changes mid-run (low on both ranks, then high): the best agreed EAGLE
    # depth moves with it, down to 1 while drafts are rejected, back up once they are accepted
    # (the TPOT guard, DPB_STEP_SLACK, keeps it from going past SGLang's starting depth 3).
    swing = [[0, {"0": 0.1, "1": 0.1}], [50, {"0": 0.95, "1": 0.9}]]
    short = [dict(r, max_new_tokens=min(r["max_new_tokens"], 50)) for r in long_requests()]
    return {
        "overlap_dspark": case("overlap", "dspark", 150, draft_moe=True, min_steps=100),
        # The plan's drafts per rank spent by DSpark's own top-k on the fresh confidence.
        "overlap_dspark_topk": case("overlap", "dspark", 150, draft_moe=True, min_steps=100,
                                    topk=True),
        "normal_dspark_sps": case("normal", "dspark_sps", 160, min_steps=100),
        "overlap_eagle": case("overlap", "eagle_adaptive", 160, accept_schedule=swing,
                              min_steps=100, fixed_terms=True),
        "normal_eagle": case("normal", "eagle_adaptive", 160, accept_schedule=swing,
                             min_steps=100, fixed_terms=True),
        "overlap_nospec": case("overlap", "none", 160, requests=short, min_steps=80),
        "normal_nospec": case("normal", "none", 160, requests=short, min_steps=80),
    }


def decode_iterations(rec):
    """Iterations whose batch on this rank was a decode batch."""
    return [it for it in rec["iterations"] if (it.get("batch") or {}).get("mode") == "DECODE"]


def check_common(c, got, f):
    """Defects 1, 2 and 6 on every case; returns the figures printed per case."""
    figures = {}
    for p, rec in sorted(got.items()):
        w = f"process {p}"
        f.check(rec["error"] is None, f"{w}: {rec['error']}")
        f.check(len(rec["iterations"]) == c["iterations"],
                f"{w}: {len(rec['iterations'])} of {c['iterations']} iterations")
        f.check(sorted(rec["finished"]) == sorted(rec["requests"]),
                f"{w}: finished {rec['finished']} of {rec['requests']}")
        bad = [r for r, d in rec["outputs"].items() if not d.get("matches_target")]
        f.check(not bad, f"{w}: outputs differ from the target's greedy chain: {bad}")
        s = rec["dpbalance"] or {}
        if not f.check(s.get("plugin") and s.get("init_error") is None,
                       f"{w}: dpbalance not running: {s}"):
            continue
        # 1: every plan reported, under its own id.
        f.check(s["reports"] == s["plans"] and s.get("outstanding") == 0 and
                s.get("missing_reports") == 0,
                f"{w}: plans {s['plans']}, reports {s['reports']}, outstanding "
                f"{s.get('outstanding')}, missing {s.get('missing_reports')}")
        f.check(s.get("stale_dropped") == 0 and s["exchange_errors"] == 0,
                f"{w}: stale plans {s.get('stale_dropped')}, exchange errors "
                f"{s['exchange_errors']}")
        # 2: the probe sync as shipped, the deciding sync with the record; one plan per
        # planning sync (the first sync carries the handshake and plans nothing).
        widths = [wd for it in rec["iterations"] for wd in it.get("gather_widths", [])]
        full = SGLANG_COLUMNS + RECORD_COLUMNS
        f.check(set(widths) <= {SGLANG_COLUMNS, full}, f"{w}: gathered widths {set(widths)}")
        f.check(widths.count(full) == s["plans"] + 1,
                f"{w}: {widths.count(full)} syncs carried the record, {s['plans']} plans")
        f.check(widths.count(SGLANG_COLUMNS) == s.get("probe_syncs"),
                f"{w}: {widths.count(SGLANG_COLUMNS)} syncs as shipped, {s.get('probe_syncs')} "
                f"probes")
        two = [it.get("gather_widths") for it in decode_iterations(rec)
               if len(it.get("gather_widths", [])) == 2]
        if c["spec"] != "none":  # speculation + DP: SGLang's probe sync, then ours
            f.check(two and all(x == [SGLANG_COLUMNS, full] for x in two),
                    f"{w}: decode iterations' syncs {two[:5]}")
        steps = len(decode_iterations(rec))
        f.check(steps >= c["min_steps"], f"{w}: {steps} decode steps, want >= {c['min_steps']}")
        t = s.get("step_terms") or {}
        f.check(t.get("online") is c.get("learn_terms", True) and t.get("resets") == 0,
                f"{w}: step terms {t} (learnt online: {c.get('learn_terms', True)})")
        results = s.get("results", {})
        figures[p] = {"decode_steps": steps, "plans": s["plans"], "reports": s["reports"],
                      "idle_reports": s.get("idle_reports"), "probe_syncs": s.get("probe_syncs"),
                      "fallbacks": sum(v for k, v in results.items() if k != "dpbSuccess"),
                      "max_wait_ms": round(s.get("max_wait_ms", -1), 1),
                      "max_plan_ms": round(s["max_plan_ms"], 1), "applied": s.get("applied")}
    # Every rank prices with the same terms (they decide the agreed depth).
    terms = [(rec["dpbalance"] or {}).get("step_terms") for _, rec in sorted(got.items())]
    keys = ("ffn_fixed_us", "ffn_per_token_us", "draft_us", "step_overhead_us", "rows")
    f.check(all(t and all(t.get(k) == terms[0].get(k) for k in keys) for t in terms),
            f"the processes' step terms differ: {terms}")
    if terms and terms[0]:
        figures["step_terms"] = {k: round(terms[0][k], 2) for k in keys}
    return figures


def topk_reference(confidence, budget, gamma):
    """SGLang's top-k rule read by hand (sglang/kernels/ops/speculative/dspark/dspark_schedule.py,
    `schedule_verify_lens_topk_from_survival`, 98984213ca90b9d0f5ad2099efcda7c469ab4e49; its
    limits from SGLang's own DSparkScheduleConfig): a draft's survival is the running product of
    its request's confidences; of the drafts in the verify window whose survival is at least
    survival_eps, the `budget` largest, ties to the earlier position, then the earlier request;
    each request verifies min_verify_len plus its drafts taken, within [max(min, 1), max len]."""
    from sglang.srt.speculative.dspark_components.dspark_planner import DSparkScheduleConfig

    cfg = DSparkScheduleConfig(gamma=gamma)
    lo, hi = cfg.min_verify_len, cfg.resolved_max_verify_len()
    import torch

    # The running product in float32, as SGLang's survival is (compute_sort_survival).
    survival = torch.cumprod(torch.tensor(confidence, dtype=torch.float32), dim=1).tolist()
    drafts = [(x, j, i) for i, row in enumerate(survival) for j, x in enumerate(row[:hi])]
    drafts.sort(key=lambda t: (-t[0], t[1], t[2]))
    taken = [0] * len(confidence)
    for surv, j, i in drafts[:budget]:
        taken[i] += surv >= cfg.survival_eps
    return [min(max(lo + t, max(lo, 1)), hi) for t in taken]


def layouts(rec):
    """(iteration, layout record) of every DSpark verify layout this rank built."""
    return [(it["iter"], d) for it in rec["iterations"] for d in it.get("dspark_layout", [])]


def check_dspark(c, got, f):
    """3: DSpark verifies the plan's lengths, each busy rank the total every rank agreed for it,
    and (MoE-draft path) the agreed tier is the plan's on busy and idle ranks."""
    width = None
    changed, checked, topk_moved = 0, 0, 0
    tiers = {}  # iteration -> {rank: dp tier it laid out with}
    for p, rec in sorted(got.items()):
        r = rec["dp_rank"]
        for i, d in layouts(rec):
            plan = d.get("plan")
            lens = d.get("verify_lens")
            if plan is None or lens is None or plan["kind"] != "decode":
                continue
            checked += 1
            width = max(width or 0, max(lens))
            want = [1 + k for k in plan["lens"]]
            if c.get("topk"):
                # SGLang's top-k ran on the plan's budget and its lengths are what DSpark lays
                # out; the brute-force reading of its rule (topk_reference) gives the same.
                topk = d.get("topk")
                if not f.check(topk is not None, f"process {p} iteration {i}: no top-k ran"):
                    continue
                f.check(topk["budget"] == sum(plan["lens"]),
                        f"process {p} iteration {i}: top-k budget {topk['budget']}, the plan's "
                        f"drafts {sum(plan['lens'])}")
                f.check(topk["lens"] == lens, f"process {p} iteration {i}: top-k {topk['lens']}, "
                                              f"laid out {lens}")
                ref = topk_reference(topk["confidence"], topk["budget"], c.get("gamma", 4))
                f.check(ref == lens, f"process {p} iteration {i}: SGLang's rule read by hand "
                                     f"gives {ref}, DSpark verifies {lens}")
                f.check(sum(lens) <= plan["rank_tokens"][r],
                        f"process {p} iteration {i}: verifies {sum(lens)} tokens, more than "
                        f"the {plan['rank_tokens'][r]} every rank agreed for DP rank {r}")
                topk_moved += lens != want
            else:
                f.check(lens == want, f"process {p} iteration {i}: DSpark verifies {lens}, the "
                                      f"plan {want}")
                f.check(sum(lens) == plan["rank_tokens"][r],
                        f"process {p} iteration {i}: verifies {sum(lens)} tokens, every rank "
                        f"agreed {plan['rank_tokens'][r]} for DP rank {r}")
            changed += lens != [1 + (c.get("gamma", 4))] * len(lens)
            tiers.setdefault(i, {})[r] = (d.get("dp_tier_num_tokens"), plan["padded"])
        for it in rec["iterations"]:
            for d in it.get("dspark_idle_layout", []):
                if d.get("plan") is not None:
                    tiers.setdefault(it["iter"], {})[r] = (d.get("dp_tier_num_tokens"),
                                                           d["plan"]["padded"])
    f.check(checked >= c["min_steps"], f"only {checked} planned DSpark layouts checked")
    f.check(changed > 0, "the plan never changed DSpark's verify-all lengths")
    if c.get("topk"):
        # The confidence must move drafts between requests, or the test shows nothing.
        f.check(topk_moved > 0, "the top-k always verified the plan's own lengths")
        for p, rec in sorted(got.items()):
            s = rec["dpbalance"] or {}
            f.check(s.get("dspark_topk") and s.get("applied", {}).get("dspark_topk_budget", 0)
                    >= checked // 4, f"process {p}: top-k hand-offs {s.get('applied')}")
    if c.get("draft_moe"):
        both = {i: t for i, t in tiers.items() if len(t) == 2}
        for i, t in sorted(both.items()):
            # One tier on every rank; the plan's wherever SGLang agrees one at all (its gather
            # gives none while some rank has no budget yet: a request's first decode step).
            f.check(len({v[0] for v in t.values()}) == 1 and
                    all(a is None or a == b for a, b in t.values()),
                    f"iteration {i}: tier laid out / the plan's per rank {t}")
        f.check(len(both) >= c["min_steps"] // 2, f"only {len(both)} iterations with both tiers")
    return {"layouts_checked": checked, "lengths_changed_by_the_plan": changed,
            "topk_moved_from_the_plan": topk_moved,
            "tier_iterations": len([t for t in tiers.values() if len(t) == 2])}


def check_eagle(c, got, f):
    """4: one depth on every rank every iteration, the plan's, changing during the run."""
    import sglang_loop_probe as probe

    verdict = probe.compare_ranks(got)
    f.check(verdict.startswith("draft depth: the same"), verdict)
    depths, plan_mismatch = {}, []
    for p, rec in sorted(got.items()):
        seq = []
        for it in rec["iterations"]:
            for sp in it.get("spec") or []:
                if sp["mode"] in ("DECODE", "IDLE"):
                    seq.append(sp["steps"])
        depths[p] = seq
        for it in rec["iterations"]:
            ev = [e for e in it["events"] if e[0] == "activate_step_by_batch"]
            for e in ev:
                if e[1]["steps_after"] is None:
                    plan_mismatch.append((p, it["iter"]))
    changes = {p: sum(1 for a, b in zip(s, s[1:]) if a != b) for p, s in depths.items()}
    f.check(all(v >= 2 for v in changes.values()), f"the depth did not go down and up: {changes}")
    f.check(not plan_mismatch, f"activate_step_by_batch without a depth: {plan_mismatch[:5]}")
    for p, rec in got.items():
        s = rec["dpbalance"] or {}
        f.check((s.get("applied") or {}).get("eagle_depth", 0) > 0,
                f"process {p}: the plan's depth was never applied")
        f.check((rec.get("adaptive") or {}).get("controller") == "AdaptiveController",
                f"process {p}: SGLang's adaptive controller did not run: {rec.get('adaptive')}")
    return {"depths_run": {p: sorted(set(s)) for p, s in depths.items()},
            "depth_changes": changes}


def check_attention(c, got, f):
    """5: the reported attention is the timed attention layers, not the step's wall time."""
    out = {}
    for p, rec in sorted(got.items()):
        s = rec["dpbalance"] or {}
        timed = rec["stand_in_calls"]["attention_us"]
        # What the plugin itself received in each report (its inspection ABI), one per plan.
        got_us = {}
        for it in rec["iterations"]:
            for e in it["events"]:
                if e[0] == "process_batch_result" and "plugin_report" in e[1]:
                    r = e[1]["plugin_report"]
                    got_us[r["plan_id"]] = r["attention_us"]
        reported = sum(got_us.values())
        wall_us = sum(it["seconds"] for it in rec["iterations"]) * 1e6
        f.check(s.get("timed_layers", 0) > 0, f"process {p}: no attention layer bound")
        f.check(len(got_us) >= c["min_steps"],
                f"process {p}: the plugin's last report was read on {len(got_us)} steps")
        f.check(0.5 * timed <= reported <= 1.05 * timed + 1000,
                f"process {p}: reported attention {reported:.0f} us, the layers ran {timed:.0f} us")
        f.check(reported < 0.5 * wall_us,
                f"process {p}: reported attention {reported:.0f} us of {wall_us:.0f} us wall")
        out[p] = {"reported_attention_ms": round(reported / 1e3, 1),
                  "layers_timed_ms": round(timed / 1e3, 1), "loop_wall_ms": round(wall_us / 1e3, 1)}
    return out


def main():
    from sglang_contract_test import all_arrived, case_and_plugin

    name, plugin = case_and_plugin("sglang_loop_test.py", cases())
    import sglang
    import sglang_loop_probe as probe
    from contract_test import Failures

    c = cases()[name]
    c["name"] = f"sglang_loop_{name}"
    c["env"]["DPB_PLUGIN"] = plugin
    os.environ.pop("DPB_PLUGIN", None)
    t0 = time.monotonic()
    got, crashed, logs, codes, wall, outdir = probe.run_procs(c)
    f = Failures()
    if not all_arrived(got, crashed, logs, codes, 2):
        return 1
    print(f"case {c['name']}: SGLang {sglang.__version__}, {c['loop']} loop, spec {c['spec']}, "
          f"{c['iterations']} iterations, 2 scheduler processes (dp 2), gloo; wall {wall:.1f} s")
    figures = {"per_process": check_common(c, got, f)}
    if c["spec"].startswith("dspark"):
        figures["dspark"] = check_dspark(c, got, f)
    if c["spec"].startswith("eagle"):
        figures["eagle"] = check_eagle(c, got, f)
    if c["spec"] == "none":
        figures["attention"] = check_attention(c, got, f)
    print(json.dumps(figures, indent=1))
    print(f"{c['name']}: {time.monotonic() - t0:.1f} s")
    for item in f.items[:40]:
        print("FAIL:", item)
    if f.items:
        for p, text in logs.items():
            print(f"--- process {p} log (tail) ---\n{text[-2000:]}")
    print(f"{'FAILED' if f.items else 'PASSED'}: {len(f.items)} failed checks")
    return 1 if f.items else 0


if __name__ == "__main__":
    sys.exit(main())
