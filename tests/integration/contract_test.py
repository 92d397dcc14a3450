#!/usr/bin/env python3
"""Contract tests of plugin ABI v2 with real processes (issue #17).

Usage: contract_test.py SUITE PLUGIN_SO [ABI_LAYOUT_V2]
  SUITE: layout | adapter | sglang | vllm | allgather | faults
  (layout: the adapter's ctypes mirror of the v2 structs against abi_layout_v2; adapter:
  DpBalanceV2 in one process - ids, bad arguments named, Piggyback with v2, v1 beside it)

Every rank is an OS process (torch.multiprocessing, spawn) that loads libdpbalance.so through
the Python adapter (DpBalanceV2) and exchanges over a real gloo group (torch.distributed, Debian's
python3-torch, which scripts/install_deps.sh installs). contract_engines.py reproduces each
engine's per-step sync (its docstring names the engine files, functions and commits read):
  sglang     SGLang's (dp, attn_tp, W) int64 gather with the record in extra columns and the
             fallback-row overwrite of inactive ranks; dp=2 x attn_tp=2 (4 processes)
  vllm       vLLM V2's (6, dp) int32 all-reduce, the record in a second gloo all-gather beside
             it; dp=3; a rank late within the timeout, a rank late past it, a disabled rank
  allgather  a plain all-gather (torch_allgather) as the step's only collective; dp=4
  faults     dp=4 over a plain all-gather: a rank whose init fails (and refuses the handshake,
             so its peers fail at once), v1 and v2 ranks mixed, a
             rank on another config, a callback that returns fewer bytes than asked, one that
             returns more than the receive buffer holds, a receive buffer too small
Cases: idle ranks, mixed steps (decode, idle, extend, no_verify), string ids, attn-TP members.

Checked on every step of every case, over the processes that have the plugin: one draft depth,
one padded size and one set of rank token totals (where known) on every process; each process's
own sum(1 + verify_len) + extra_tokens equals its entry; verify_budget is the sum of the lengths;
the lengths within [k_min, k_cap] (0 when verify is skipped); the padded size is the smallest
tier at or above the largest total; attn-TP members of a DP rank get the same lengths; the
engine's own sync agrees with our totals (vLLM: its all-reduced counts; SGLang: its gathered
rows); no plan call waits longer than DPB_TIMEOUT_MS plus MARGIN_MS (the maximum is printed);
every step not balanced comes back as a non-success result, and they are counted. Bad input
must produce a log line or error naming the rank and the value.

torch missing is a failure, not a skip: a skipped case would pass the ctest.
"""
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "integration", "adapters", "python"))
import dpbalance_plugin as dpb  # noqa: E402

TIMEOUT_MS = 1000
# Python, gloo and a loaded 2-core machine (several ctests at once) on top of the plugin's bound;
# the ASan build (a Debug plugin, python3 with the sanitizer runtime) sets CONTRACT_MARGIN_MS.
MARGIN_MS = int(os.environ.get("CONTRACT_MARGIN_MS", "500"))
STEPS = 100
CONFIG = (f"mode=goodput;k_max=7;default_k=3;log_every=0;timeout_ms={TIMEOUT_MS};"
          "log_level=warn;draft_us=300")
TIERS = [8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]


def spec(dp_rank, **kw):
    return dict(dp_rank=dp_rank, **kw)


def case(name, engine, dp, procs, steps=STEPS, attn_tp=1, schedule="mixed", config=CONFIG,
         tiers=TIERS, **kw):
    return dict(name=name, engine=engine, dp=dp, attn_tp=attn_tp, procs=procs, steps=steps,
                schedule=schedule, config=config, tiers=tiers, timeout_ms=TIMEOUT_MS,
                default_k=3, k_max=7, seed=f"{name}-17", **kw)


def suites():
    """The cases of each suite; every process of a suite runs them in order."""
    sg = [spec(d, attn_tp_rank=t) for d in range(2) for t in range(2)]  # (dp_rank, attn_tp_rank)
    return {
        "sglang": (4, [
            # DP rank 0's attn-TP member 1 sees another context for one request at steps 80-82
            # (that DP rank falls back on both members, counted as tp_mismatches). DP rank 1's
            # rows are overwritten by the fallback row at steps 90-94 (inactive), whose record
            # columns carry the idle row: DP rank 0 keeps balancing (DP rank 1 at 0 tokens,
            # idle), DP rank 1's members run their defaults. At steps 60-62 DP rank 1's record
            # columns arrive as zeros (a rank without a working plugin): every rank falls back
            # for those steps (its total unknown to the others); all plan again after each.
            case("sglang_dp2_attn_tp2", "sglang", 2, sg, attn_tp=2,
                 inactive={s: (2, 3) for s in range(90, 95)},
                 zero_rows={s: (2, 3) for s in range(60, 63)},
                 tp_skew={s: 1 for s in range(80, 83)},
                 expect=dict(loose_steps=set(range(80, 83)), tp_mismatch_steps=range(80, 83),
                             fallback_steps={**{s: "all" for s in range(60, 63)},
                                             **{s: {2, 3} for s in range(90, 95)}})),
        ]),
        "vllm": (3, [
            case("vllm_dp3_mixed", "vllm", 3, [spec(d) for d in range(3)]),
            # Rank 2 late by 0.3 x the timeout at steps 20-24 (no fallback), by 1.5 x at step 50
            # (the record group times out; gloo then closes its connections, so every later
            # exchange fails at once, on every rank).
            case("vllm_dp3_late_rank", "vllm", 3,
                 [spec(0), spec(1), spec(2, late={**{s: 0.3 * TIMEOUT_MS / 1e3 for s in range(20, 25)},
                                                  50: 1.5 * TIMEOUT_MS / 1e3})],
                 steps=60, expect=dict(healthy_until=50, all_fail_from=50,
                                       log={p: [f"returned -1 on rank {p}"] for p in range(3)})),
            # Rank 1 runs without the plugin (DPB_PLUGIN=none) but keeps the engine's record
            # collective paired with a zero record; the others' handshake gets it and refuses.
            case("vllm_dp3_no_plugin_rank", "vllm", 3, [spec(0), spec(1, no_plugin=True), spec(2)],
                 steps=20, expect=dict(init_fails={0, 2},
                                       log={p: ["rank 1 runs summary version 0"] for p in (0, 2)})),
            # Rank 1's engine passes a negative context from step 10 on (bad input, named in its
            # log); after DPB_MAX_FAILURES=3 fallbacks it disables itself and keeps joining with
            # a zero record, which the others refuse: every rank ends on the defaults.
            case("vllm_dp3_disabled_rank", "vllm", 3,
                 [spec(0), spec(1, bad_ctx_from=10), spec(2)], steps=40,
                 config=CONFIG + ";max_failures=3",
                 expect=dict(healthy_until=10, all_fail_from=25,
                             log={1: ["ctx_tokens = -5"], 0: ["rank 1 is disabled"],
                                  2: ["rank 1 is disabled"]})),
        ]),
        "allgather": (4, [
            case("allgather_dp4_mixed", "plain", 4, [spec(d) for d in range(4)]),
            # Granularity "budget": the engine spreads verify_budget by its draft confidences;
            # its spread must be the plan's lengths (the plugin orders by the same confidences).
            case("allgather_dp4_budget", "plain", 4, [spec(d) for d in range(4)], steps=40,
                 granularity="budget"),
        ]),
        "faults": (4, [
            # Rank 2's flags are bad: its init fails, but it joins the handshake with a refusal
            # naming why, so its peers fail their init at once (well inside DPB_TIMEOUT_MS,
            # which they used to wait out), each log naming rank 2 and the flag.
            case("faults_init_fails", "plain", 4,
                 [spec(0), spec(1), spec(2, config=CONFIG + ";k_max=nine"), spec(3)], steps=20,
                 expect=dict(init_fails={0, 1, 2, 3}, init_within_timeout=True,
                             log={2: ["k_max", "nine"],
                                  **{p: ["rank 2 failed its init: rank 2: flag 'k_max'"]
                                     for p in (0, 1, 3)}})),
            case("faults_v1_and_v2_ranks", "plain", 4,
                 [spec(0), spec(1), spec(2, abi=1), spec(3, abi=1)], steps=20,
                 expect=dict(init_fails={0, 1, 2, 3},
                             log={0: ["rank 2 calls plugin ABI v1"],
                                  3: ["rank 0 calls plugin ABI v2"]})),
            case("faults_config_mismatch", "plain", 4,
                 [spec(0), spec(1), spec(2), spec(3, config=CONFIG + ";k_max=6")], steps=20,
                 expect=dict(init_fails={0, 1, 2, 3},
                             log={p: ["rank 3 runs summary version", "config hash"]
                                  for p in range(3)})),
            # Calls count from the handshake (call 0): call 11 is step 10's exchange.
            case("faults_short_callback", "plain", 4,
                 [spec(d, faults={11: "short"}) for d in range(4)], steps=30,
                 expect=dict(healthy_until=10, fallback_steps={10: "all"},
                             log={d: [f"wrote {4 * 512 - 8} bytes on rank {d}, expected 2048"]
                                  for d in range(4)})),
            case("faults_callback_overflows_recv", "plain", 4,
                 [spec(d, faults={11: "long"}) for d in range(4)], steps=30,
                 expect=dict(healthy_until=10, fallback_steps={10: "all"},
                             log={d: ["returned 2560 bytes, the receive buffer holds 2048"]
                                  for d in range(4)})),
            case("faults_recv_buffer_too_small", "plain", 4,
                 [spec(0, dp_size=3), spec(1), spec(2), spec(3)], steps=10,
                 expect=dict(init_fails={0, 1, 2, 3},
                             error={d: ["process 0", "1536"] for d in range(4)})),
        ]),
    }


class Failures:
    def __init__(self):
        self.items = []

    def check(self, ok, what):
        if not ok:
            self.items.append(what)
        return ok


def check_init(c, recs, logs, f):
    """Errors at init and what they name, and how long init and plan calls waited; returns
    (longest plan call, longest init) in ms."""
    name, exp = c["name"], c.get("expect", {})
    init_fails = exp.get("init_fails", set())
    for r in recs:
        p = r["proc"]
        should = p in init_fails or c["procs"][p].get("no_plugin")
        f.check((r["abi"] is None) == bool(should),
                f"{name}: process {p} init {'failed' if r['abi'] is None else 'succeeded'}: "
                f"{r['error']}")
        for sub in exp.get("error", {}).get(p, []):
            f.check(r["error"] is not None and sub in r["error"],
                    f"{name}: process {p}'s init error does not name '{sub}': {r['error']}")
        for sub in exp.get("log", {}).get(p, []):
            f.check(sub in logs[p] or (r["error"] and sub in r["error"]),
                    f"{name}: process {p}'s log does not name '{sub}':\n{logs[p][-2000:]}")
    max_ms = max([s["plan_ms"] for r in recs for s in r["steps"]] + [0.0])
    max_init = max(r["init_ms"] for r in recs)
    f.check(max_ms <= c["timeout_ms"] + MARGIN_MS,
            f"{name}: a plan call waited {max_ms:.0f} ms > DPB_TIMEOUT_MS {c['timeout_ms']} + "
            f"{MARGIN_MS}")
    f.check(max_init <= c["timeout_ms"] + MARGIN_MS,
            f"{name}: an init waited {max_init:.0f} ms > DPB_TIMEOUT_MS {c['timeout_ms']} + {MARGIN_MS}")
    if exp.get("init_within_timeout"):  # nobody waited the timeout out
        f.check(max_init < c["timeout_ms"],
                f"{name}: an init waited {max_init:.0f} ms, DPB_TIMEOUT_MS {c['timeout_ms']} or more")
    return max_ms, max_init


def check_agreement(c, where, rows, f):
    """One step's depth, padded size and every DP rank's total agree across the processes."""
    depths = {s["depth"] for _, s in rows}
    f.check(len(depths) == 1, f"{where}: draft depths differ: "
            + ", ".join(f"p{r['proc']}={s['depth']}({s['result']})" for r, s in rows))
    # The padded size is agreed by the processes whose exchange went through (every total
    # known); after a failed exchange the engine runs its own sync (the header).
    exchanged = [(r, s) for r, s in rows if all(t >= 0 for t in s["rank_tokens"])]
    padded = {s["padded"] for _, s in exchanged}
    f.check(len(padded) <= 1, f"{where}: padded sizes differ: "
            + ", ".join(f"p{r['proc']}={s['padded']}" for r, s in exchanged))
    for d in range(c["dp"]):
        known = {s["rank_tokens"][d] for _, s in rows if s["rank_tokens"][d] >= 0}
        f.check(len(known) <= 1, f"{where}: DP rank {d}'s token total differs: "
                + ", ".join(f"p{r['proc']}={s['rank_tokens'][d]}" for r, s in rows))
    # attn-TP members of one DP rank: the same plan.
    for d in range(c["dp"]):
        members = [s for r, s in rows if r["dp_rank"] == d]
        f.check(len({tuple(s["lens"]) for s in members}) <= 1,
                f"{where}: attn-TP members of DP rank {d} got different lengths: "
                + ", ".join(str(s["lens"]) for s in members))


def check_lengths(w, s, d, tiers, f):
    """One process's lengths against its caps, floors, defaults and totals; returns whether the
    step fell back (a non-success result)."""
    if tiers and s["rank_flags"][d] & dpb.RANK_PLANNED:
        # A planned rank runs the agreed tier (plus its prefill): its own verify work stays
        # within it and padding rows make up the rest (the v2 header).
        f.check(s["own_total"] <= s["rank_tokens"][d],
                f"{w}: own total sum(1+verify_len)+extra = {s['own_total']} is above "
                f"its padded size {s['rank_tokens'][d]}")
    else:
        f.check(s["rank_tokens"][d] == s["own_total"],
                f"{w}: own total sum(1+verify_len)+extra = {s['own_total']}, rank_tokens "
                f"says {s['rank_tokens'][d]}")
    f.check(s["budget"] == sum(s["lens"]), f"{w}: verify_budget {s['budget']} != "
            f"sum(verify_len) {sum(s['lens'])}")
    for i, (k, lo, cap) in enumerate(zip(s["lens"], s["mins"], s["caps"])):
        hi = 0 if s["kind"] == "no_verify" else cap
        f.check(min(lo, hi) <= k <= hi, f"{w}: verify_len[{i}] = {k} outside "
                f"[{min(lo, hi)}, {hi}] ({s['kind']})")
    if s["result"] == dpb.SUCCESS:
        return False
    for i, (k, cap) in enumerate(zip(s["lens"], s["caps"])):
        want = 0 if s["kind"] == "no_verify" else min(3, cap)
        f.check(k <= want, f"{w}: result {s['result']} but verify_len[{i}] = {k} > "
                f"the default {want}")
    return True


def check_flags_and_engine(w, s, d, dp, tiers, f):
    """One process's rank flags and padded size, and the engine's own sync against them."""
    f.check(s["balanced"] or s["result"] != dpb.SUCCESS or s["kind"] in ("idle", "no_verify"),
            f"{w}: not balanced, yet dpbSuccess ({s['kind']})")
    flags = s["rank_flags"]
    for dd in range(dp):
        f.check((s["rank_tokens"][dd] < 0) == bool(flags[dd] & dpb.RANK_UNKNOWN),
                f"{w}: DP rank {dd} total {s['rank_tokens'][dd]} with flags {flags[dd]}")
    want_bit = {"idle": dpb.RANK_IDLE, "extend": dpb.RANK_EXTEND,
                "no_verify": dpb.RANK_NO_VERIFY}.get(s["kind"])
    if want_bit:
        f.check(flags[d] & want_bit, f"{w}: kind {s['kind']} but its own flags are {flags[d]}")
    any_flags = 0
    for x in flags:
        any_flags |= x
    f.check(s["any_flags"] == any_flags, f"{w}: any_rank_flags {s['any_flags']} != OR {any_flags}")
    if all(t >= 0 for t in s["rank_tokens"]):
        want = tier_of(tiers, max(s["rank_tokens"]))
        f.check(s["padded"] == want, f"{w}: padded {s['padded']}, the smallest tier >= "
                f"max{s['rank_tokens']} is {want}")
    if "engine_tokens" in s and s["result"] == dpb.SUCCESS:
        for dd in range(dp):
            if s["rank_tokens"][dd] >= 0:
                f.check(s["engine_tokens"][dd] == s["rank_tokens"][dd],
                        f"{w}: the engine's sync says DP rank {dd} runs {s['engine_tokens'][dd]} "
                        f"tokens, our result {s['rank_tokens'][dd]}")
        if max(s["engine_tokens"]) > 0:
            f.check(s["engine_padded"] == s["padded"],
                    f"{w}: engine padded {s['engine_padded']} != ours {s['padded']}")
    if "spread_lens" in s:
        f.check(s["spread_lens"] == s["lens"], f"{w}: the engine's spread of budget "
                f"{s['budget']} by confidence is {s['spread_lens']}, the plan {s['lens']}")


def check_expected(c, step, where, rows, f):
    """The step's expected outcome: every process falls back ("all"), the listed processes fall
    back and the others succeed (a set), or, on a healthy step, every process succeeds."""
    exp = c.get("expect", {})
    fb = exp.get("fallback_steps", {}).get(step)
    if fb == "all" or (exp.get("all_fail_from") is not None and step >= exp["all_fail_from"]):
        f.check(all(s["result"] != dpb.SUCCESS for _, s in rows),
                f"{where}: expected every rank to fall back, results "
                + str([s["result"] for _, s in rows]))
    elif fb is not None:
        f.check(all((s["result"] != dpb.SUCCESS) == (r["proc"] in fb) for r, s in rows),
                f"{where}: expected processes {sorted(fb)} to fall back, the others to succeed: "
                + str([(r["proc"], s["result"]) for r, s in rows]))
    elif step < exp.get("healthy_until", c["steps"]) and step not in exp.get("loose_steps", ()):
        # A healthy step: every process succeeds (balanced or by design).
        f.check(all(s["result"] == dpb.SUCCESS for _, s in rows), f"{where}: a healthy step fell "
                "back: " + str([(r["proc"], s["result"]) for r, s in rows]))


def check_counts(c, planned, f):
    """Every fallback counted: the plugin's own figures account for every plan call, and every
    step it did not balance is one the engine was told about (a non-success result)."""
    name, exp = c["name"], c.get("expect", {})
    for r in planned:
        st, steps = r["stats"], r["steps"]
        w = f"{name} process {r['proc']}"
        n_bad = sum(1 for s in steps if s["result"] != dpb.SUCCESS)
        n_unbalanced = sum(1 for s in steps if not s["balanced"])
        f.check(st.get("steps") == len(steps), f"{w}: stats count {st.get('steps')} steps, "
                f"{len(steps)} plan calls")
        f.check(st.get("steps", 0) - st.get("balanced_steps", 0) == n_unbalanced == n_bad,
                f"{w}: stats: {st.get('steps')} steps - {st.get('balanced_steps')} balanced; "
                f"plan results: {n_unbalanced} not balanced, {n_bad} not dpbSuccess")
        f.check(st.get("fallbacks", 0) >= sum(1 for s in steps if s["result"] == dpb.FALLBACK),
                f"{w}: stats count {st.get('fallbacks')} fallbacks, fewer than the dpbFallback "
                f"results")
        f.check(st.get("missing_reports", 0) == 0, f"{w}: {st.get('missing_reports')} missing "
                f"reports, yet every plan was reported")
    tp = exp.get("tp_mismatch_steps")
    for r in planned if tp else ():
        if r["dp_rank"] == 0:
            f.check(r["stats"].get("tp_mismatches", 0) >= len(tp),
                    f"{name} process {r['proc']}: tp_mismatches "
                    f"{r['stats'].get('tp_mismatches')} < {len(tp)}")


def check_case(c, recs, logs, f):
    """The per-step contract over the processes that ran the plugin; returns summary figures."""
    name, dp, tiers = c["name"], c["dp"], c["tiers"] or []
    planned = [r for r in recs if r["abi"] is not None]
    max_ms, max_init = check_init(c, recs, logs, f)
    balanced = fallbacks = 0
    for step in range(c["steps"]):
        rows = [(r, r["steps"][step]) for r in planned]
        if not rows:
            continue
        where = f"{name} step {step}"
        check_agreement(c, where, rows, f)
        for r, s in rows:
            w = f"{where} process {r['proc']} (DP rank {r['dp_rank']})"
            if check_lengths(w, s, r["dp_rank"], tiers, f):
                fallbacks += 1
            else:
                balanced += s["balanced"]
            check_flags_and_engine(w, s, r["dp_rank"], dp, tiers, f)
        check_expected(c, step, where, rows, f)
    check_counts(c, planned, f)
    return dict(max_ms=max_ms, max_init=max_init, balanced=balanced, fallbacks=fallbacks,
                procs=len(recs), planned=len(planned))


def tier_of(tiers, tokens):
    for t in tiers:
        if t >= tokens:
            return t
    return tokens


def run_suite(name, plugin):
    try:
        import torch.multiprocessing as mp
    except ImportError as e:
        sys.exit(f"FAIL: torch is not installed for {sys.executable} ({e}): the contract tests "
                 f"need python3-torch (scripts/install_deps.sh installs it); not skipping")
    import contract_engines
    import proc_results
    world, cases = suites()[name]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "store")
        procs = [ctx.Process(target=contract_engines.process_main,
                             args=(p, world, store, plugin, cases, d, q)) for p in range(world)]
        want = world * len(cases)
        got, crashed = proc_results.collect(procs, q, want, key=lambda proc, cname: (proc, cname))
        if crashed or len(got) < want:
            for proc, tb in crashed:
                print(f"process {proc} crashed:\n{tb}")
            print(f"FAIL: {len(got)} of {want} case records arrived; exit codes "
                  f"{[p.exitcode for p in procs]}")
            return 1
        if os.environ.get("CONTRACT_DUMP"):  # every step of every process, for a look
            import json
            with open(os.environ["CONTRACT_DUMP"], "w") as out:
                json.dump({f"{c}/{p}": r for (p, c), r in got.items()}, out)
        f = Failures()
        print(f"suite {name}: {world} processes, gloo, DPB_TIMEOUT_MS={TIMEOUT_MS}, "
              f"margin {MARGIN_MS} ms")
        print(f"{'case':34} {'procs':>5} {'steps':>5} {'balanced':>8} {'non-success':>11} "
              f"{'max plan ms':>11} {'max init ms':>11}")
        worst_ms = worst_init = 0.0
        for c in cases:
            recs = [got[(p, c["name"])] for p in range(world) if got.get((p, c["name"]))]
            logs = {}
            for r in recs:
                path = os.path.join(d, f"{c['name']}.{r['proc']}.log")
                logs[r["proc"]] = open(path, errors="replace").read() if os.path.exists(path) else ""
            s = check_case(c, recs, logs, f)
            worst_ms, worst_init = max(worst_ms, s["max_ms"]), max(worst_init, s["max_init"])
            print(f"{c['name']:34} {s['procs']:>5} {c['steps']:>5} {s['balanced']:>8} "
                  f"{s['fallbacks']:>11} {s['max_ms']:>11.1f} {s['max_init']:>11.1f}")
            if os.environ.get("CONTRACT_SHOW_LOGS"):
                for p, text in sorted(logs.items()):
                    print(f"--- {c['name']} process {p} log ---\n{text[-3000:]}")
    print(f"suite {name}: {time.monotonic() - t0:.1f} s; longest plan call {worst_ms:.1f} ms, "
          f"longest init {worst_init:.1f} ms (bound: DPB_TIMEOUT_MS {TIMEOUT_MS} + {MARGIN_MS})")
    for item in f.items[:40]:
        print("FAIL:", item)
    if len(f.items) > 40:
        print(f"... and {len(f.items) - 40} more failures")
    print(f"{'FAILED' if f.items else 'PASSED'}: {len(f.items)} failed checks")
    return 1 if f.items else 0


def check_layout(layout):
    """The adapter's ctypes mirror of the v2 structs against the compiler's layout, field by
    field, and the constants it spells out."""
    import ctypes
    mirror = {"dpbInitArgs_v2_t": dpb._InitArgsV2, "dpbRequest_v2_t": dpb._RequestV2,
              "dpbStep_v2_t": dpb._StepV2, "dpbPlanResult_v2_t": dpb._PlanResultV2,
              "dpbAccepted_v2_t": dpb._AcceptedV2, "dpbReport_v2_t": dpb._ReportV2,
              "dpbStats_v2_t": dpb._StatsV2, "dpbalancePlugin_v2_t": dpb._PluginV2}
    consts = {"DPB_PLUGIN_ABI_VERSION_2": dpb.ABI_VERSION_2,
              "dpbStepDecode": dpb.STEP_KINDS["decode"], "dpbStepIdle": dpb.STEP_KINDS["idle"],
              "dpbStepExtend": dpb.STEP_KINDS["extend"],
              "dpbStepNoVerify": dpb.STEP_KINDS["no_verify"],
              "dpbGranularityRequest": dpb.GRANULARITIES["request"],
              "dpbGranularityBudget": dpb.GRANULARITIES["budget"],
              "DPB_RANK_PLANNED": dpb.RANK_PLANNED, "DPB_RANK_EXTEND": dpb.RANK_EXTEND,
              "DPB_RANK_NO_VERIFY": dpb.RANK_NO_VERIFY, "DPB_RANK_IDLE": dpb.RANK_IDLE,
              "DPB_RANK_UNKNOWN": dpb.RANK_UNKNOWN}
    f = Failures()
    seen = {n: [] for n in mirror}
    seen_consts = set()
    out = subprocess.run([layout], check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        kind, field, a, b = line.split()
        if kind == "enum":
            seen_consts.add(field)
            f.check(consts.get(field) == int(a), f"{field} = {a} in C, {consts.get(field)} in the adapter")
            continue
        cls = mirror[kind]
        if field == "sizeof":
            f.check(ctypes.sizeof(cls) == int(b), f"sizeof({kind}) = {b} in C, "
                    f"{ctypes.sizeof(cls)} in the adapter")
            continue
        seen[kind].append(field)
        fd = getattr(cls, field)
        f.check((fd.offset, fd.size) == (int(a), int(b)),
                f"{kind}.{field}: C offset/size {a}/{b}, adapter {fd.offset}/{fd.size}")
    for n, cls in mirror.items():
        f.check(seen[n] == [x[0] for x in cls._fields_], f"{n}: fields {seen[n]} in C, "
                f"{[x[0] for x in cls._fields_]} in the adapter")
    f.check(seen_consts == set(consts), f"constants checked {sorted(seen_consts)}")
    # The packers the adapter fills the arrays with agree with the ctypes records.
    req = dpb._RequestV2()
    dpb._REQUEST_V2_PACK.pack_into(memoryview(req).cast("B"), 0, 0x1234, 5, -7, 1, 6, 0, 3)
    f.check((req.id, req.id_bytes, req.ctx_tokens, req.k_min, req.k_cap, req.num_confidence) ==
            (0x1234, 5, -7, 1, 6, 3), "the v2 request packer writes other fields than ctypes reads")
    acc = dpb._AcceptedV2()
    dpb._ACCEPTED_V2_PACK.pack_into(memoryview(acc).cast("B"), 0, 0x99, 4, 3, 2, 1)
    f.check((acc.id, acc.id_bytes, acc.verify_len, acc.accepted, acc.finished) == (0x99, 4, 3, 2, 1),
            "the v2 accepted packer writes other fields than ctypes reads")
    for item in f.items:
        print("FAIL:", item)
    print(f"{'FAILED' if f.items else 'PASSED'}: v2 layout, {len(out.splitlines())} lines checked")
    return 1 if f.items else 0


def check_adapter(plugin):
    """DpBalanceV2 in one process (dp 1 and an identity all-gather; no torch): ids as str or
    bytes plan alike, bad arguments raise naming the field, Piggyback passes v2's step kinds on
    and returns its PlanResult, the v1 API beside it is unchanged."""
    f = Failures()
    ident = lambda send, _t: send  # noqa: E731 (a group of one)
    cfg = "k_max=7;default_k=3;log_every=0;log_level=off"

    def raises(exc, text, fn):
        try:
            fn()
        except exc as e:
            f.check(text in str(e), f"{exc.__name__} '{e}' does not name '{text}'")
            return
        f.check(False, f"no {exc.__name__} naming '{text}'")

    reqs = [dpb.Request(f"req-{i}", 1000 + 100 * i, k_cap=5) for i in range(4)]
    breqs = [r._replace(request_id=r.request_id.encode()) for r in reqs]
    a = dpb.DpBalance.load(1, 0, cfg, allgather=ident, library=plugin, abi=2, token_tiers=[8, 16, 32])
    b = dpb.DpBalanceV2(1, 0, cfg, allgather=ident, library=plugin, token_tiers=[8, 16, 32])
    f.check(isinstance(a, dpb.DpBalanceV2), f"load(abi=2) gave {type(a)}")
    for step in range(5):
        ra, rb = a.plan(reqs), b.plan(breqs)
        f.check(ra == rb, f"step {step}: str ids {ra} and bytes ids {rb} plan differently")
        f.check(ra.result == dpb.SUCCESS and ra.rank_tokens == [4 + sum(ra.verify_len)],
                f"step {step}: {ra}")
        acc = [dpb.Accepted(r.request_id, k, min(k, 1), False) for r, k in zip(reqs, ra.verify_len)]
        f.check(a.report(500.0, 9000.0, acc) == dpb.SUCCESS, f"report: {a.last_result}")
        b.report(500.0, 9000.0, [x._replace(request_id=x.request_id.encode()) for x in acc])
    st = a.stats()
    f.check(st.get("steps") == 5 and "tp_mismatches" in st and "max_exchange_ms" in st, f"stats {st}")
    ni = a.plan([], kind="no_verify", extra_tokens=40)
    f.check(ni.rank_tokens == [40] and ni.padded_tokens == 40 and ni.verify_len == [],
            f"no_verify with 40 prefill tokens: {ni}")
    raises(TypeError, "requests[1].request_id = 7", lambda: a.plan([reqs[0], reqs[1]._replace(request_id=7)]))
    raises(TypeError, "requests[0].k_cap = 2.5", lambda: a.plan([reqs[0]._replace(k_cap=2.5)]))
    raises(ValueError, "'verify'", lambda: a.plan(reqs, kind="verify"))
    raises(TypeError, "extra_tokens = 1.5", lambda: a.plan(reqs, extra_tokens=1.5))
    raises(ValueError, "attn_tp_rank = 2", lambda: dpb.DpBalanceV2(1, 0, cfg, ident, plugin, attn_tp_size=2, attn_tp_rank=2))
    raises(ValueError, "'tokens'", lambda: dpb.DpBalanceV2(1, 0, cfg, ident, plugin, granularity="tokens"))
    raises(TypeError, "need abi=2", lambda: dpb.DpBalance.load(1, 0, cfg, ident, plugin, attn_tp_size=1))
    raises(dpb.DpBalanceError, "k_max=nine", lambda: dpb.DpBalanceV2(1, 0, "k_max=nine", ident, plugin))
    # An id the plugin refuses (empty) is bad input: the defaults, a non-success result.
    bad = a.plan([reqs[0]._replace(request_id="")])
    f.check(bad.result != dpb.SUCCESS and bad.verify_len == [3], f"an empty id: {bad}")
    # Piggyback over a group of one, v2: the payload comes back, the PlanResult with it.
    pb = dpb.Piggyback(lambda payload: payload, 1)
    c = dpb.DpBalanceV2(1, 0, cfg, allgather=pb, library=plugin)
    r = pb.step(c, reqs, b"engine-row", kind="extend", extra_tokens=100)
    f.check(r.payloads == [b"engine-row"] and r.plan is not None and
            r.plan.rank_tokens == [100 + 4 + sum(r.verify_len)], f"piggyback v2: {r}")
    raises(TypeError, "need ABI v2", lambda: pb.step(dpb.DpBalance(1, 0, cfg, ident, plugin), reqs,
                                                     b"x", kind="decode"))
    # v1 beside it, unchanged: integer ids.
    v1 = dpb.DpBalance(1, 0, cfg, allgather=ident, library=plugin)
    lens, depth = v1.plan([dpb.Request(i, 1000, k_cap=5) for i in range(3)])
    f.check(len(lens) == 3 and v1.last_result == dpb.SUCCESS, f"v1: {lens} {depth} {v1.last_result}")
    for x in (a, b, c, v1):
        x.close()
    for item in f.items:
        print("FAIL:", item)
    print(f"{'FAILED' if f.items else 'PASSED'}: v2 adapter in one process")
    return 1 if f.items else 0


def main():
    if len(sys.argv) < 3:
        sys.exit("usage: contract_test.py SUITE PLUGIN_SO [ABI_LAYOUT_V2]")
    suite, plugin = sys.argv[1], os.path.abspath(sys.argv[2])
    if suite == "layout":
        return check_layout(os.path.abspath(sys.argv[3]))
    if suite == "adapter":
        return check_adapter(plugin)
    if suite not in suites():
        sys.exit(f"unknown suite {suite!r}: layout, adapter, {', '.join(suites())}")
    return run_suite(suite, plugin)


if __name__ == "__main__":
    sys.exit(main())
