"""One SGLang scheduler process of sglang_contract_test.py, running SGLang 0.5.23's own code.

Each process: publishes SGLang's ServerArgs (a model that is a config.json, DP attention,
tp_size = dp * attn_tp), builds SGLang's process groups with SGLang's own bootstrap on gloo
(`_init_parallel_groups`; the CPU platform comes from dpbalance_sglang's `sglang.srt.platforms`
entry point, DPBALANCE_SGLANG_CPU=1), runs SGLang's `load_plugins()` (which finds the installed
`sglang.srt.plugins` entry point and applies its hooks), then calls SGLang's
`prepare_mlp_sync_batch_raw` once per step with SGLang's own types: a ScheduleBatch of Req objects
(decode, extend or none), SGLang's SpeculativeAlgorithm, and its real gather over the TP group's
gloo CPU group. What stands in for SGLang: the ModelRunner, which cannot be built on this CPU
(docs/engines.md "SGLang" says what stops it): `ModelRunner.__new__` with the four attributes
`prepare_mlp_sync_batch_raw` reads (spec_algorithm, model_config, prefill_cuda_graph_runner,
decode_cuda_graph_runner), and `get_idle_batch`, which returns SGLang's ScheduleBatch with IDLE
mode (SGLang's own builds it from the memory pools a model runner makes).

The DSpark case also runs, on every step, DSpark's own budget and tier code with the plan
(dspark_planner.py: `compute_verify_token_budget`, `local_verify_tier_num_tokens`,
`graph_tier_fill_budget`, `DSparkVerifyPlanner._maybe_gather_dp_verify_tier` over SGLang's TP CPU
group, `DSparkVerifyPlanner._schedule_verify_lens` through the hooks, `RaggedVerifyLayout`), and
the hooked `DSparkWorkerV2._dp_verify_tier_num_tokens`.
"""
from __future__ import annotations

import datetime
import os
import random
import sys
import time
import traceback
from array import array

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

FIELDS = 11  # MLPSyncBatchInfo._get_local_tensor's width at SGLang 0.5.23


class Pool:
    """A DP rank's running requests as SGLang Req objects: string ids, contexts that grow by
    what is accepted, requests that finish and are replaced. Random from (seed, dp_rank, step)
    only, so the attention-TP members of a DP rank hold the same batch, as SGLang broadcasts it."""

    def __init__(self, seed, dp_rank, size):
        self.seed, self.dp_rank, self.size = seed, dp_rank, size
        self.rng = random.Random(f"{seed}/{dp_rank}/pool")
        self.next_id = 0
        self.reqs = []
        for _ in range(size):
            self.admit()

    def admit(self):
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        rid = f"{self.seed}-dp{self.dp_rank}-{self.next_id:05d}-{self.rng.getrandbits(40):010x}"
        self.next_id += 1
        prompt = array("i", [1] * (300 + self.rng.randint(0, 3000 * (1 + self.dp_rank % 2))))
        req = Req(rid, "", prompt, SamplingParams(max_new_tokens=self.rng.randint(6, 80)))
        self.reqs.append(req)

    def advance(self, lens, step):
        """Accepts drafts (random, the same on every member); returns accepted per request."""
        rng = random.Random(f"{self.seed}/{self.dp_rank}/{step}/accept")
        acc = []
        for req, k in zip(self.reqs, lens):
            a = sum(1 for _ in range(k) if rng.random() < 0.7)
            acc.append(a)
            req.output_ids.extend([7] * (1 + a))
        return acc

    def retire(self):
        done = [r for r in self.reqs if len(r.output_ids) >= r.sampling_params.max_new_tokens - 1]
        self.reqs = [r for r in self.reqs if r not in done]
        while len(self.reqs) < self.size:
            self.admit()


def mixed_schedule(dp_rank, step):
    """Mostly decode; DP rank 0 idle at steps 8-11, every rank idle at step 20, prefill (extend)
    on one rank at a time."""
    if step == 20:
        return "idle"
    if 8 <= step < 12 and dp_rank == 0:
        return "idle"
    if step % 7 == 3:
        return "extend" if dp_rank == (step // 7) % 2 else "decode"
    return "decode"


def make_batch(kind, pool, step):
    """SGLang's ScheduleBatch for this rank's step, as the scheduler has it before the sync."""
    import torch

    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    if kind == "idle":
        return None
    if kind == "decode":
        reqs = list(pool.reqs)
        b = ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.DECODE,
                          spec_algorithm=SpeculativeAlgorithm.DSPARK)
        b.seq_lens_cpu = torch.tensor([r.seqlen for r in reqs], dtype=torch.int64)
        return b
    ext = [64 + (step * 37 + pool.dp_rank * 11) % 300]
    b = ScheduleBatch(reqs=[pool.reqs[0]], forward_mode=ForwardMode.EXTEND,
                      spec_algorithm=SpeculativeAlgorithm.DSPARK)
    b.extend_lens, b.prefix_lens, b.extend_logprob_start_lens = ext, [0], [ext[0] - 1]
    b.extend_num_tokens = ext[0]
    return b


def setup_sglang(proc, world, port, case, model_dir):
    """SGLang's own start-up for one scheduler process, on gloo."""
    from sglang.srt.distributed import bootstrap
    from sglang.srt.runtime_context import SpawnRanks, get_context, publish
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path=model_dir, device="cpu", tp_size=world, dp_size=case["dp"],
                    enable_dp_attention=True, skip_tokenizer_init=True,
                    disable_cuda_graph=True, dist_timeout=120)
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=proc, dp_rank=None, gpu_id=None))
    # DSpark's configuration as SGLang resolves it on a GPU: its argument check refuses DSpark on
    # a CPU device (speculative_hook._handle_dspark), so the resolved leaves are set through
    # SGLang's own runtime-context override.
    get_context().override("sglang_contract_test", speculative_algorithm="DSPARK",
                           speculative_num_draft_tokens=case["width"])
    bootstrap._init_parallel_groups(backend="gloo", dist_init_method=f"tcp://127.0.0.1:{port}",
                                    server_args=sa, gpu_id=0)


def model_runner_for(alg):
    """What prepare_mlp_sync_batch_raw reads of SGLang's ModelRunner (see the module docstring)."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    mr = ModelRunner.__new__(ModelRunner)
    mr.spec_algorithm = alg
    mr.model_config = None
    mr.prefill_cuda_graph_runner = None
    mr.decode_cuda_graph_runner = None
    return mr


def idle_batch():
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return ScheduleBatch(reqs=[], forward_mode=ForwardMode.IDLE,
                         spec_algorithm=SpeculativeAlgorithm.DSPARK)


class DSparkCheck:
    """DSpark's budget and tier code (dspark_planner.py, dspark_worker_v2.py) taking the plan."""

    def __init__(self, width, tiers):
        import torch

        from sglang.srt.layers.dp_attention import get_dp_tp_group
        from sglang.srt.speculative.dspark_components.dspark_planner import (
            DSparkScheduleConfig, DSparkVerifyPlanner, HostConfidenceBudgetPlanner)
        from sglang.srt.speculative.dspark_components.dspark_sps import SpsCostTable
        from sglang.srt.speculative.dspark_components.dspark_worker_v2 import DSparkWorkerV2
        from sglang.srt.speculative.ragged_verify import RaggedVerifyMode
        from sglang.srt.speculative.spec_tp_sync import SpecTpSync

        self.torch, self.width, self.tiers = torch, width, tiers
        self.cfg = DSparkScheduleConfig(gamma=width - 1)
        # A profiled steps-per-second table (SGLang's type): throughput falls as tokens grow.
        self.sps = SpsCostTable(sample_batch_tokens=[1, 64, 256, 1024],
                                sample_steps_per_sec=[90.0, 80.0, 60.0, 30.0],
                                max_batch_tokens=1024)
        # The planner and worker as their __init__ leaves them in compact mode under DP
        # attention (attention TP 1, overlap scheduler): the fields the methods below read.
        # __init__ itself needs the draft model with its confidence head, which needs a GPU.
        p = DSparkVerifyPlanner.__new__(DSparkVerifyPlanner)
        p._dp_tier_gather_enabled = True
        p._ragged_verify_mode = RaggedVerifyMode.COMPACT
        p._schedule_cfg = self.cfg
        p._budget_planner = HostConfidenceBudgetPlanner.__new__(HostConfidenceBudgetPlanner)
        p._tp_sync = SpecTpSync(get_dp_tp_group())
        self.planner = p
        w = DSparkWorkerV2.__new__(DSparkWorkerV2)
        w._draft_is_moe = True
        w._verify_planner = p
        self.worker = w

    def step(self, batch, bp, own_total, step, seed):
        """DSpark's code on this step with the plan, inside the batch's run (as
        Scheduler.run_batch runs the worker: the plan is the running one); returns the figures
        checked by the driver."""
        from dpbalance_sglang import engine_step

        st = engine_step.state()
        token = st.begin_run(batch)
        try:
            return self._step(batch, bp, own_total, step, seed)
        finally:
            st.end_run(token)

    def _step(self, batch, bp, own_total, step, seed):
        from sglang.srt.speculative.dspark_components import dspark_planner as dp
        from sglang.srt.speculative.ragged_verify import RaggedVerifyLayout, round_up_grid

        torch = self.torch
        out = {}
        n = batch.batch_size() if batch is not None and batch.forward_mode.is_decode() else 0
        # SGLang's own tier collective (one int64 per process over the TP CPU group), then its
        # agreement rule (the max), against the plan's padded tier.
        holder = batch if batch is not None else idle_batch()
        # SGLang's synced flag: some rank prefills, so every rank takes DSpark's prefill path
        # (forward_batch_generation) and the tier collective is skipped on every rank.
        ext = bool(holder.is_extend_in_batch)
        out["extend_in_batch"] = ext
        if ext:
            n = 0
        local_tier = own_total if n else 0
        dp.DSparkVerifyPlanner._maybe_gather_dp_verify_tier(
            self.planner, batch=holder, local_tier_num_tokens=local_tier)
        agreed = dp.dp_global_verify_tier_num_tokens(
            global_tier_num_tokens=holder.global_spec_verify_tier_num_tokens)
        out["sglang_tier_max"] = agreed
        saved = holder.global_num_tokens
        holder.global_num_tokens = saved if saved is not None else [0]
        out["worker_tier"] = self.worker._dp_verify_tier_num_tokens(holder)  # hooked
        if agreed is not None:
            out["grid_tier"] = round_up_grid(agreed, self.tiers)
        if not n:
            return out
        rng = random.Random(f"{seed}/{step}/{batch.reqs[0].rid}/conf")
        conf = torch.tensor([[rng.uniform(0.2, 0.95) for _ in range(self.width - 1)]
                             for _ in range(n)], dtype=torch.float32)
        survival = torch.cumprod(conf, dim=1)
        own_budget = dp.compute_verify_token_budget(history_survival_probs=survival,
                                                    sps_table=self.sps, cfg=self.cfg).budget
        out["dspark_budget"] = int(own_budget)
        out["dspark_tier"] = dp.local_verify_tier_num_tokens(
            bs=n, verify_token_budget=int(own_budget), verify_num_draft_tokens=self.width,
            min_verify_len=1)
        plan = bp.plan
        out["plan_tier_local"] = dp.local_verify_tier_num_tokens(
            bs=n, verify_token_budget=plan.verify_budget, verify_num_draft_tokens=self.width,
            min_verify_len=1)
        out["fill_budget"] = dp.graph_tier_fill_budget(
            graph_num_tokens=plan.padded_tokens, bs=n, verify_num_draft_tokens=self.width,
            min_verify_len=1)

        def decode(_self, _batch):  # the part of _forward_decode that schedules the lengths
            return self.planner._schedule_verify_lens(
                req_pool_indices=torch.arange(n), prefix_lens=batch.seq_lens_cpu,
                device="cpu", confidence=conf, budget=int(own_budget))

        from sglang.kernels.ops.speculative.dspark.dspark_schedule import ScheduleVerifyLensTopk

        out["dspark_own_lens"] = [int(x) for x in ScheduleVerifyLensTopk.execute(
            confidence=conf, budget=int(own_budget), cfg=self.cfg).tolist()]
        lens = decode(self.worker, batch)
        out["verify_lens"] = [int(x) for x in lens.tolist()]
        # schedule_layout's floor: the agreed tier, at most the DP-global request count x width.
        global_reqs = max(batch.global_num_tokens)
        tier = out["worker_tier"] if out["worker_tier"] is not None else global_reqs * self.width
        layout = RaggedVerifyLayout.from_verify_lens(
            verify_lens_cpu=out["verify_lens"], device="cpu", grid=self.tiers,
            graph_num_tokens_floor=min(tier, global_reqs * self.width))
        out["layout_tokens"] = int(layout.graph_num_tokens)
        out["layout_total"] = int(sum(out["verify_lens"]))
        return out


def run_case(proc, world, case, plugin, logdir):
    """Runs one case in this process (SGLang already set up); returns its record."""
    import torch

    from dpbalance_sglang import engine_step
    from dpbalance_sglang.patch import scheduler as sched_hooks
    from sglang.srt.managers.scheduler_components import dp_attn
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    par = get_parallel()
    spec = case["procs"][proc]
    dp_rank, attn_tp = par.attn_dp_rank, par.attn_tp_size
    width = case["width"]
    mr = model_runner_for(SpeculativeAlgorithm.DSPARK)
    pool = Pool(case["seed"], dp_rank, 5 + 2 * dp_rank)
    st = engine_step.state()
    dsc = DSparkCheck(width, case["tiers"]) if case.get("dspark") else None
    out = {"case": case["name"], "proc": proc, "dp_rank": dp_rank, "attn_tp_rank": par.attn_tp_rank,
           "steps": [], "error": None, "stats": {}, "sglang": []}

    def sync(batch):
        return dp_attn.prepare_mlp_sync_batch_raw(
            batch, model_runner=mr, get_idle_batch=idle_batch, disable_cuda_graph=True,
            require_mlp_tp_gather=True, disable_overlap_schedule=False, offload_tags=set(),
            draft_require_mlp_tp_gather=None, dwdp=False, sync_wait_carry=None)

    # The first sync carries the plugin's handshake (an idle step for SGLang). Its figure is
    # what the handshake added beyond SGLang's own gather (the ranks arrive as they start).
    t0 = time.monotonic()
    sync(None)
    out["init_ms"] = max(0.0, (time.monotonic() - t0) * 1e3 - st.n.last_gather_ms)
    out["error"] = st.init_error
    out["abi"] = 2 if st.dpb is not None else None
    for step in range(case["steps"]):
        kind = mixed_schedule(dp_rank, step) if case["schedule"] == "mixed" else "decode"
        batch = make_batch(kind, pool, step)
        if batch is not None and spec.get("tp_skew_steps") and step in spec["tp_skew_steps"]:
            batch.reqs[0].output_ids.append(7)  # this member sees another context
        inactive = case.get("inactive", {}).get(step, ())
        active = par.tp_group.active_ranks_cpu
        active.fill_(1)
        for g in inactive:  # SGLang's own inactive-slot mark (elastic EP), on every process
            active[g] = 0
        late = spec.get("late", {}).get(step, 0.0)
        if late:
            time.sleep(late)
        local_tokens = (batch.batch_size() if kind == "decode" else
                        batch.extend_num_tokens) if batch is not None else 0
        t = time.monotonic()
        ran = sync(batch)
        sync_ms = (time.monotonic() - t) * 1e3
        bp = st.last_sync_plan  # also when SGLang returns no batch (every rank idle)
        sg = {"step": step, "kind": kind, "local_tokens": local_tokens,
              "global_num_tokens": list(ran.global_num_tokens) if ran is not None else None,
              "sync_ms": sync_ms, "gather_ms": st.n.last_gather_ms,
              "mode": int(ran.forward_mode.value) if ran is not None else None}
        if skew := (spec.get("tp_skew_steps") and step in spec["tp_skew_steps"]):
            batch.reqs[0].output_ids.pop()
        reqs = list(batch.reqs) if kind == "decode" else []
        if bp is not None:
            p = bp.plan
            lens = list(p.verify_len)
            caps = [max(0, min(width - 1, r.sampling_params.max_new_tokens - len(r.output_ids) - 1))
                    for r in reqs]
            extra = batch.extend_num_tokens if kind == "extend" else 0
            rec = {"step": step, "kind": kind, "n": len(reqs), "extra": extra,
                   "plan_ms": max(0.0, sync_ms - st.n.last_gather_ms), "caps": caps,
                   "mins": [0] * len(reqs), "lens": lens,
                   "own_total": sum(1 + k for k in lens) + extra,
                   "result": p.result, "balanced": p.balanced, "depth": p.draft_depth,
                   "budget": p.verify_budget, "padded": p.padded_tokens,
                   "rank_tokens": list(p.rank_tokens), "rank_flags": list(p.rank_flags),
                   "any_flags": p.any_rank_flags, "exchanged": bp.exchanged}
            out["steps"].append(rec)
            if dsc is not None:
                sg["dspark"] = dsc.step(ran, bp, rec["own_total"], step, case["seed"])
                sg["dspark"]["plan_padded"] = p.padded_tokens
                sg["dspark"]["plan_lens"] = [1 + k for k in lens] if kind == "decode" else []
        elif dsc is not None:
            sg["dspark"] = {"no_plan": True}
        out["sglang"].append(sg)
        # The step ran: accept, then SGLang's result processing reports it (the hook's body).
        lens = list(bp.plan.verify_len) if bp is not None and kind == "decode" else \
            [width - 1] * len(reqs)
        if kind == "decode":
            acc = pool.advance(lens, step)
            result = GenerationBatchResult(num_correct_drafts_per_req_cpu=acc)
        else:
            result = GenerationBatchResult()
        if ran is not None:
            sched_hooks.after_process_batch_result(None, None, ran, result)
        if kind == "decode":
            pool.retire()
    summary = st.summary()
    out["stats"] = summary.get("stats", {})
    out["summary"] = {k: v for k, v in summary.items() if k != "stats"}
    return out


def process_main(proc, world, port, case, plugin, model_dir, logdir, q):
    """One scheduler process: its environment, SGLang's start-up, load_plugins, the case."""
    try:
        spec = case["procs"][proc]
        os.environ["DPBALANCE_SGLANG_CPU"] = "1"
        os.environ["SGLANG_PLUGINS"] = "dpbalance"
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["DPB_PLUGIN"] = "none" if spec.get("no_plugin") else plugin
        for k, v in {**case.get("env", {}), **spec.get("env", {})}.items():
            os.environ[k] = v
        log_path = os.path.join(logdir, f"{case['name']}.{proc}.log")
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 2)  # the plugin's spdlog sink and Python's logging: the driver reads them
        os.close(fd)
        import logging

        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(name)s %(levelname)s %(message)s")
        if case.get("fake_version"):
            import sglang

            sglang.__version__ = case["fake_version"]  # an SGLang this package was not read at
        setup_sglang(proc, world, port, case, model_dir)
        from sglang.srt.plugins import load_plugins

        load_plugins()
        if case.get("fake_version"):
            q.put((proc, case["name"], check_as_shipped(proc, case)))
            return
        rec = run_case(proc, world, case, plugin, logdir)
        q.put((proc, case["name"], rec))
        import torch.distributed as dist

        dist.barrier()
    except BaseException:  # the driver reports it; the process must not hang the suite
        q.put((proc, "__crash__", traceback.format_exc()))
        raise


def check_as_shipped(proc, case):
    """With a mismatched SGLang version: no hook applied, and SGLang's own sync still serves."""
    from sglang.srt.managers.scheduler_components import dp_attn
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    par = get_parallel()
    targets = sorted(t for t in HookRegistry._hooks if "dp_attn" in t or "dspark" in t)
    wrapped = hasattr(dp_attn.MLPSyncBatchInfo.all_gather, "__wrapped__")
    pool = Pool(case["seed"], par.attn_dp_rank, 3 + par.attn_dp_rank)
    batch = make_batch("decode", pool, 0)
    ran = dp_attn.prepare_mlp_sync_batch_raw(
        batch, model_runner=model_runner_for(SpeculativeAlgorithm.DSPARK),
        get_idle_batch=idle_batch, disable_cuda_graph=True, require_mlp_tp_gather=True,
        disable_overlap_schedule=False, offload_tags=set())
    return {"proc": proc, "targets": targets, "wrapped": wrapped,
            "global_num_tokens": list(ran.global_num_tokens), "local": batch.batch_size(),
            "dp_rank": par.attn_dp_rank, "has_plan": hasattr(ran, "dpb_plan")}
