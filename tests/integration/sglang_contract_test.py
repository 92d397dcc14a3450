#!/usr/bin/env python3
"""Contract tests of dpbalance_sglang against SGLang 0.5.23's own code (issue #32).

Usage: sglang_contract_test.py CASE PLUGIN_SO
  CASE: gather | inactive | attn_tp2 | dspark | no_plugin | init_fails | late_rank | bad_input
        (one case per process tree: SGLang's HookRegistry.reset() does not undo applied hooks)

Run with the Python of a venv that holds the pinned SGLang (scripts/install_sglang.sh) and the
installed package (pip install integration/sglang: its entry points are how SGLang's
load_plugins() finds the hooks). Every SGLang scheduler process is an OS process
(sglang_contract_rank.py says what of SGLang each one runs); they gather over SGLang's own TP
group on gloo. PLUGIN_SO is the library the build made (DPB_PLUGIN).

Checked on every step, over the processes that run the plugin, by contract_test.check_case (the
contract of issue #17): one draft depth, one padded tier and one set of DP-rank totals on every
process; each process's lengths within their caps and adding up to its total; attention-TP
members alike; every non-balanced step a non-success result, counted. And on every process,
plugin or not: SGLang's own gathered fields are what the ranks put in (global_num_tokens per DP
rank; an inactive slot reads SGLang's fallback row), so SGLang serves as without us. The DSpark
case checks DSpark's own code taking the plan. The figures (steps, fallbacks, the longest wait)
are printed per case.

A missing SGLang, torch or package is a failure, never a skip.
"""
import json
import os
import socket
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TIMEOUT_MS = 1000
MARGIN_MS = int(os.environ.get("CONTRACT_MARGIN_MS", "500"))
TIERS = [8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
WIDTH = 8  # DSpark's block (speculative_num_draft_tokens): 7 drafts after the anchor
# DPB_DEFAULT_K is 3, not the block the package derives when it is unset: check_case holds a
# fallback step's lengths to a default of 3 (contract_test.py).
ENV = {"DPB_TIMEOUT_MS": str(TIMEOUT_MS), "DPB_LOG_EVERY": "0", "DPB_LOG_LEVEL": "warn",
       "DPB_TIERS": ",".join(map(str, TIERS)), "DPB_PADDED": "1", "DPB_MODE": "goodput",
       "DPB_K_MAX": str(WIDTH - 1), "DPB_DEFAULT_K": "3", "DPB_DRAFT_US": "0"}
MODEL = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 64,
         "intermediate_size": 128, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
         "rope_theta": 10000.0, "torch_dtype": "float32", "decoder_sparse_step": 1,
         "norm_topk_prob": False, "tie_word_embeddings": False, "bos_token_id": 1,
         "eos_token_id": 2}


def spec(dp_rank, **kw):
    return dict(dp_rank=dp_rank, **kw)


def case(name, dp, procs, steps=30, attn_tp=1, schedule="mixed", **kw):
    return dict(name=name, dp=dp, attn_tp=attn_tp, procs=procs, steps=steps, schedule=schedule,
                tiers=TIERS, timeout_ms=TIMEOUT_MS, default_k=3, k_max=WIDTH - 1,
                width=WIDTH, env=dict(ENV), seed=f"sglang-{name}", **kw)


def cases():
    two = [spec(0), spec(1)]
    return {
        # The record in SGLang's row: idle ranks (DP rank 0 at steps 8-11, both at step 20),
        # prefill on one rank at a time; every step balanced or by design.
        "gather": case("sglang_gather_columns", 2, two),
        # SGLang's own inactive-slot mark (tp_group.active_ranks_cpu) on DP rank 1 at steps
        # 10-13: SGLang overwrites its row with the fallback row, so its record arrives as
        # zeros and every rank falls back for those steps; all plan again from step 14.
        "inactive": case("sglang_fallback_row", 2, two,
                         inactive={s: (1,) for s in range(10, 14)},
                         expect=dict(fallback_steps={s: "all" for s in range(10, 14)})),
        # dp 2 x attention TP 2 (4 processes in SGLang's TP group). DP rank 0's member 1 sees
        # another context at steps 12-14: that DP rank falls back on both members
        # (tp_mismatches), the others balance.
        "attn_tp2": case("sglang_attn_tp2", 2,
                         [spec(0), spec(0, tp_skew_steps=(12, 13, 14)), spec(1), spec(1)],
                         attn_tp=2, expect=dict(loose_steps=set(range(12, 15)),
                                                tp_mismatch_steps=range(12, 15))),
        # DSpark's budget and tier code on the plan, every step (sglang_contract_rank.DSparkCheck).
        "dspark": case("sglang_dspark", 2, two, dspark=True),
        # DP rank 1 without the plugin (DPB_PLUGIN=none): it joins SGLang's sync with an empty
        # record; rank 0's handshake refuses it; both run SGLang's own lengths.
        "no_plugin": case("sglang_no_plugin_rank", 2, [spec(0), spec(1, no_plugin=True)],
                          steps=15, expect=dict(init_fails={0},
                                                log={0: ["rank 1 runs summary version 0"]})),
        # DP rank 1's plugin refuses a wrong DPB_* value at init (named in its log) and sends
        # that refusal in the handshake (Balancer::Refuse), so rank 0's log names rank 1's flag
        # too, at once instead of after a timeout; SGLang serves on.
        "init_fails": case("sglang_init_fails", 2, [spec(0), spec(1, env={"DPB_K_MAX": "nine"})],
                           steps=15, expect=dict(init_fails={0, 1},
                                                 log={1: ["k_max", "nine"],
                                                      0: ["rank 1 failed its init", "k_max",
                                                          "nine"]})),
        # DP rank 1 late by 0.3 x DPB_TIMEOUT_MS at steps 5-9 and by 1.5 x at step 15. The others
        # wait in SGLang's own gather (as SGLang does without us); the record rides it, so no
        # rank falls back, and what the plan adds beyond SGLang's gather stays under the bound.
        "late_rank": case("sglang_late_rank", 2,
                          [spec(0), spec(1, late={**{s: 0.3 * TIMEOUT_MS / 1e3 for s in range(5, 10)},
                                                  15: 1.5 * TIMEOUT_MS / 1e3})],
                          steps=20, schedule="decode", late_step=15),
        # An SGLang version the hooks were not read at: one error line, no hook applied, SGLang's
        # own sync serves. (A wrong DPB_* value: init_fails; a row of the wrong width: below.)
        "bad_input": case("sglang_bad_input", 2, two, steps=1, fake_version="0.5.22"),
    }


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_procs(c, plugin):
    import torch.multiprocessing as mp

    import proc_results
    import sglang_contract_rank

    world = len(c["procs"])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    d = tempfile.mkdtemp(prefix="dpb-sglang-")
    model = os.path.join(d, "model")
    os.makedirs(model)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(MODEL, f)
    port = free_port()
    procs = [ctx.Process(target=sglang_contract_rank.process_main,
                         args=(p, world, port, c, plugin, model, d, q)) for p in range(world)]
    got, crashed = proc_results.collect(procs, q, world, key=lambda proc, name: proc)
    logs = {}
    for p in range(world):
        path = os.path.join(d, f"{c['name']}.{p}.log")
        logs[p] = open(path, errors="replace").read() if os.path.exists(path) else ""
    return got, crashed, logs, [p.exitcode for p in procs]


def check_sglang(c, recs, f):
    """SGLang's own fields on every process, plugin or not: each DP rank's gathered num_tokens is
    what that rank put in (0 for an inactive slot: SGLang's fallback row)."""
    by_step = {}
    for r in recs:
        for sg in r["sglang"]:
            by_step.setdefault(sg["step"], []).append((r, sg))
    for step, rows in sorted(by_step.items()):
        local = {}
        for r, sg in rows:
            local.setdefault(r["dp_rank"], sg["local_tokens"])
        want = [0 if d in c.get("inactive", {}).get(step, ()) else local[d]
                for d in range(c["dp"])]
        for r, sg in rows:
            if sg["global_num_tokens"] is None:  # SGLang returned no batch: nobody has work
                f.check(max(want) == 0, f"{c['name']} step {step}: no batch, yet tokens {want}")
                continue
            f.check(sg["global_num_tokens"] == want,
                    f"{c['name']} step {step} process {r['proc']}: SGLang gathered "
                    f"{sg['global_num_tokens']}, the ranks put in {want}")


def check_dspark(c, recs, f):
    """DSpark's budget and tier code taking the plan (sglang_contract_rank.DSparkCheck)."""
    from sglang.srt.speculative.ragged_verify import round_up_grid

    n_checked = 0
    differ = [0, 0, 0]  # steps whose lengths the plan changed; DSpark's own budget; the plan's
    padded_below = [0]  # steps whose tier is above the ranks' real tokens' grid point (padding)
    for r in recs:
        for sg in r["sglang"]:
            ds = sg.get("dspark")
            w = f"{c['name']} step {sg['step']} process {r['proc']}"
            if not f.check(ds is not None and not ds.get("no_plan"), f"{w}: no DSpark figures"):
                continue
            st = next(s for s in r["steps"] if s["step"] == sg["step"])
            if sg["global_num_tokens"] is None:  # every rank idle: SGLang runs no batch
                continue
            if ds["extend_in_batch"]:  # DSpark verifies nothing this step, on any rank
                f.check(ds["worker_tier"] is None and ds["sglang_tier_max"] is None,
                        f"{w}: a prefill step, yet a verify tier {ds['worker_tier']}")
                continue
            if not st["exchanged"]:
                f.check(ds["worker_tier"] == ds["sglang_tier_max"],
                        f"{w}: exchange failed, yet the tier {ds['worker_tier']} is not SGLang's "
                        f"{ds['sglang_tier_max']}")
                continue
            f.check(ds["worker_tier"] == ds["plan_padded"],
                    f"{w}: DSparkWorkerV2._dp_verify_tier_num_tokens gave {ds['worker_tier']}, "
                    f"the plan's tier {ds['plan_padded']}")
            # SGLang's own tier collective gathers each rank's real tokens (its verify lengths
            # and prefill): the plan's tier must hold them. Since summary record v5 a rank may
            # pad part of the agreed tier rather than fill it with drafts dearer than padding,
            # so the ranks' real tokens can round to a lower grid point than the tier they run.
            tmax = ds["sglang_tier_max"]
            if tmax is not None:
                f.check(round_up_grid(tmax, TIERS) <= ds["plan_padded"],
                        f"{w}: SGLang's tier collective agrees {tmax} (grid "
                        f"{round_up_grid(tmax, TIERS)}), above the plan's tier {ds['plan_padded']}")
                padded_below[0] += round_up_grid(tmax, TIERS) < ds["plan_padded"]
            if sg["kind"] != "decode":
                continue
            n_checked += 1
            differ[0] += ds["dspark_own_lens"] != ds["plan_lens"]
            differ[1] += sum(ds["dspark_own_lens"]) - len(ds["plan_lens"])
            differ[2] += st["budget"]
            f.check(ds["verify_lens"] == ds["plan_lens"],
                    f"{w}: DSpark scheduled {ds['verify_lens']}, the plan {ds['plan_lens']}")
            f.check(ds["plan_tier_local"] == st["own_total"],
                    f"{w}: local_verify_tier_num_tokens(plan budget) = {ds['plan_tier_local']}, "
                    f"the plan's total {st['own_total']}")
            f.check(ds["fill_budget"] >= st["budget"],
                    f"{w}: graph_tier_fill_budget {ds['fill_budget']} < the plan's budget "
                    f"{st['budget']}")
            f.check(ds["layout_total"] <= ds["layout_tokens"] and
                    ds["layout_tokens"] == ds["plan_padded"],
                    f"{w}: RaggedVerifyLayout holds {ds['layout_total']} tokens in "
                    f"{ds['layout_tokens']}, the plan's tier {ds['plan_padded']}")
    f.check(n_checked >= c["steps"], f"{c['name']}: only {n_checked} decode steps checked")
    f.check(differ[0] > 0, f"{c['name']}: the plan never changed DSpark's own lengths")
    return (f"{n_checked} decode steps; the plan's lengths differ from DSpark's own top-k on "
            f"{differ[0]}; verify tokens above the anchors: DSpark's own budget {differ[1]}, "
            f"the plan's {differ[2]}; the tier above the ranks' real tokens (padding) on "
            f"{padded_below[0]} process-steps")


def check_bad_input(c, got, logs, f):
    """The mismatched version, and a row of the wrong width through the parser."""
    want = [3, 4]  # Pool sizes 3 + dp_rank in check_as_shipped
    for p, r in got.items():
        f.check(r["targets"] == [] and not r["wrapped"],
                f"process {p}: hooks applied on a mismatched SGLang: {r['targets']}")
        f.check(r["global_num_tokens"] == want and not r["has_plan"],
                f"process {p}: SGLang's sync gave {r['global_num_tokens']}, want {want}")
        f.check("written for SGLang >= 0.5.23, < 0.6, found SGLang 0.5.22" in logs[p] and
                "SGLang runs as shipped" in logs[p],
                f"process {p}'s log does not name the versions:\n{logs[p][-1500:]}")
    # A row of the wrong width: SGLang's real 11-column rows, gathered without our columns.
    import torch

    from dpbalance_sglang import engine_step
    from sglang.srt.managers.scheduler_components.dp_attn import MLPSyncBatchInfo

    info = MLPSyncBatchInfo(num_dp_ranks=2, tp_size=1, cp_size=1, num_tokens=3,
                            num_tokens_for_logprob=3, can_run_decode_cuda_graph=False,
                            can_run_draft_cuda_graph=True, can_run_prefill_cuda_graph=False,
                            is_extend_in_batch=False, local_can_run_tbo=False, local_forward_mode=2)
    rows = torch.stack([info._get_local_tensor("cpu"), info._get_fallback_tensor("cpu")]).view(2, 1, -1)
    try:
        engine_step.records_from_gathered(rows, 2, 1, rows.shape[-1])
        f.check(False, "a gathered row without record columns was accepted")
    except ValueError as e:
        f.check("(2, 1, 11)" in str(e) and "(2, 1, 75)" in str(e),
                f"the wrong-width error does not name both shapes: {e}")
    print("bad_input: mismatched version -> no hooks, SGLang's sync serves; "
          "11-column rows -> refused naming (2, 1, 11) vs (2, 1, 75)")


def case_and_plugin(script, names):
    """(case name, absolute PLUGIN_SO) from argv, after checking that SGLang, torch and the
    installed package import (the sglang ctests' usage; a missing one fails, never skips)."""
    if len(sys.argv) != 3 or sys.argv[1] not in names:
        sys.exit(f"usage: {script} {{{'|'.join(names)}}} PLUGIN_SO")
    try:
        import dpbalance_sglang  # noqa: F401
        import sglang  # noqa: F401
        import torch  # noqa: F401
    except ImportError as e:
        sys.exit(f"FAIL: {e} in {sys.executable}: run with the SGLang venv that "
                 f"tests/integration/sglang_env.sh makes (integration/sglang installed beside "
                 f"the pinned SGLang); not skipping")
    return sys.argv[1], os.path.abspath(sys.argv[2])


def all_arrived(got, crashed, logs, codes, world) -> bool:
    """Whether every process sent its record; else prints what crashed and the logs' tails."""
    if not crashed and len(got) >= world:
        return True
    for proc, tb in crashed:
        print(f"process {proc} crashed:\n{tb}")
    for p, text in logs.items():
        print(f"--- process {p} log (tail) ---\n{text[-3000:]}")
    print(f"FAIL: {len(got)} of {world} records arrived; exit codes {codes}")
    return False


def main():
    name, plugin = case_and_plugin("sglang_contract_test.py", cases())
    import sglang

    from contract_test import Failures, check_case

    c = cases()[name]
    t0 = time.monotonic()
    got, crashed, logs, codes = run_procs(c, plugin)
    f = Failures()
    world = len(c["procs"])
    if not all_arrived(got, crashed, logs, codes, world):
        return 1
    print(f"case {c['name']}: SGLang {sglang.__version__}, {world} scheduler processes "
          f"(dp {c['dp']} x attn_tp {c['attn_tp']}), gloo, DPB_TIMEOUT_MS={TIMEOUT_MS}")
    if name == "bad_input":
        check_bad_input(c, got, logs, f)
    else:
        recs = [got[p] for p in range(world)]
        s = check_case(c, [r for r in recs], logs, f)
        check_sglang(c, recs, f)
        if c.get("dspark"):
            print(f"DSpark's code took the plan: {check_dspark(c, recs, f)}")
        gather = max(sg["gather_ms"] for r in recs for sg in r["sglang"])
        sync = max(sg["sync_ms"] for r in recs for sg in r["sglang"])
        if c.get("late_step") is not None:
            waited = [sg["gather_ms"] for r in recs for sg in r["sglang"]
                      if sg["step"] == c["late_step"] and r["proc"] == 0]
            f.check(waited and waited[0] >= 1.3 * TIMEOUT_MS,
                    f"process 0 waited {waited} ms in SGLang's gather at the late step")
        print(f"{'case':24} {'procs':>5} {'steps':>5} {'balanced':>8} {'fallbacks':>9} "
              f"{'added ms':>8} {'sglang gather ms':>16} {'sync ms':>8} {'init ms':>8}")
        print(f"{c['name']:24} {s['procs']:>5} {c['steps']:>5} {s['balanced']:>8} "
              f"{s['fallbacks']:>9} {s['max_ms']:>8.1f} {gather:>16.1f} {sync:>8.1f} "
              f"{s['max_init']:>8.1f}")
        for r in recs:
            print(f"  process {r['proc']} (DP rank {r['dp_rank']}): {json.dumps(r['summary'])}")
        if os.environ.get("CONTRACT_SHOW_LOGS"):
            for p, text in logs.items():
                print(f"--- process {p} log ---\n{text[-3000:]}")
    print(f"{c['name']}: {time.monotonic() - t0:.1f} s")
    for item in f.items[:40]:
        print("FAIL:", item)
    print(f"{'FAILED' if f.items else 'PASSED'}: {len(f.items)} failed checks")
    return 1 if f.items else 0


if __name__ == "__main__":
    sys.exit(main())
