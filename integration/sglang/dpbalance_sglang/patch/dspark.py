"""Hooks on DSpark (SGLang 0.5.23, SGLANG_RAGGED_VERIFY_MODE=compact): each request's verify
length and the agreed verify tier come from the plan of the batch being run
(engine_step.RankState.usable: this rank's latest plan, exchanged).

  speculative/dspark_components/dspark_worker_v2.py
    DSparkWorkerV2._dp_verify_tier_num_tokens  AROUND: the agreed tier = the plan's padded_tokens
                                               (the smallest captured token tier at or above every
                                               DP rank's total; the same bytes on every rank),
                                               on busy and idle ranks alike
  speculative/dspark_components/dspark_planner.py
    DSparkVerifyPlanner.schedule_layout        AROUND: without an SPS table (SGLang's default)
                                               DSpark verifies every draft through a cached
                                               uniform layout and schedules nothing; with a plan
                                               the layout is built from the plan's lengths and
                                               tier instead, as with a table, so that busy ranks
                                               lay out the same tier the idle ranks run
    DSparkVerifyPlanner._schedule_verify_lens  AROUND: SGLang's own schedule runs (its top-k and
                                               its attention-TP broadcast, so SGLang's collectives
                                               stay paired), then its lengths are the plan's
                                               1 + verify_len (DSpark counts the anchor); where
                                               SGLang schedules none (no budget yet), the plan's.
                                               With DPBALANCE_SGLANG_DSPARK_TOPK=1 its budget is
                                               the plan's drafts for this rank instead, and its
                                               own top-k on the fresh confidence picks which
                                               requests verify them (the replay's "budget spent
                                               by the signal"): the rank's total, and so the
                                               agreed tier, stay the plan's

All only when the plan's exchange went through (every DP rank's total known), on every rank
alike; a rank that fell back then runs the plan's defaults (DPB_DEFAULT_K = the whole block:
DSpark's verify-all), whose total the others counted in the tier. Otherwise (no plugin
somewhere, an inactive slot, a failed exchange) SGLang's own lengths and tier on every rank.
Where SGLang gathers no tier (attention TP > 1, the normal loop, no DP attention) its tier stays,
and the plan's lengths fit under it (at most the block per request).
"""
from __future__ import annotations

from .. import engine_step

WORKER = "sglang.srt.speculative.dspark_components.dspark_worker_v2.DSparkWorkerV2"
PLANNER = "sglang.srt.speculative.dspark_components.dspark_planner.DSparkVerifyPlanner"

SIGNATURES = {
    f"{WORKER}._dp_verify_tier_num_tokens": ("self", "batch"),
    f"{PLANNER}.schedule_layout": ("self", "req_pool_indices", "prefix_lens", "device",
                                   "confidence", "budget", "global_num_reqs",
                                   "dp_tier_num_tokens"),
    f"{PLANNER}._schedule_verify_lens": ("self", "req_pool_indices", "prefix_lens", "device",
                                         "confidence", "budget"),
}


def _decode_plan():
    bp = engine_step.state().usable()
    return bp if bp is not None and bp.kind == "decode" else None


def around_tier(original, self, batch):
    tier = original(self, batch)
    st = engine_step.state()
    bp = st.usable()  # reads a context variable and the plan's bytes: nothing here can raise
    # A step where some rank prefills: padded_tokens counts prefill tokens, not a verify tier
    # (DSpark verifies nothing then, except under SGLang's prefill coordination, where its own
    # tier stays; the plan's lengths fit under it, at most the block per request).
    if tier is None or bp is None or bp.plan.any_rank_flags & engine_step.adapter.RANK_EXTEND:
        return tier
    st.applied("dspark_tier")
    return int(bp.plan.padded_tokens)


def around_schedule_layout(original, self, *args, **kwargs):
    """Verify-all (no SPS table): the plan's layout, not the cached uniform one."""
    if _decode_plan() is None or not getattr(self, "_is_verify_all", False) or \
            not self.is_compact_mode:
        return original(self, *args, **kwargs)
    engine_step.state().applied("dspark_verify_all_layout")
    self._is_verify_all = False
    try:
        return original(self, *args, **kwargs)
    finally:
        self._is_verify_all = True


def around_schedule_verify_lens(original, self, *args, **kwargs):
    bp = _decode_plan()
    pool = kwargs.get("req_pool_indices", args[0] if args else None)
    n = int(pool.shape[0]) if pool is not None else -1
    if bp is None or len(bp.plan.verify_len) != n:
        return original(self, *args, **kwargs)
    st = engine_step.state()
    if st.dspark_topk and kwargs.get("confidence") is not None and "budget" in kwargs:
        # One call (its broadcast stays paired): SGLang's top-k spends the plan's drafts.
        lens = original(self, *args, **dict(kwargs, budget=int(sum(bp.plan.verify_len))))
        if lens is not None:
            st.applied("dspark_topk_budget")
            st.note_run("sglang_lens", lens.detach().clone())  # read at the report, not here
            return lens
        # No budget planner: nothing scheduled, the plan's lengths below.
    else:
        lens = original(self, *args, **kwargs)
    import torch

    try:
        ours = torch.tensor([1 + k for k in bp.plan.verify_len], dtype=torch.int32)
        if lens is None:  # SGLang schedules nothing without a budget; the plan still applies
            device = kwargs.get("device", args[2] if len(args) > 2 else pool.device)
            lens = ours.to(device)
        else:
            lens.copy_(ours.to(device=lens.device, dtype=lens.dtype))
        st = engine_step.state()
        st.applied("dspark_lengths")
        st.note_run("lens", list(bp.plan.verify_len))  # the report claims these lengths
    except Exception:  # noqa: BLE001 - SGLang's own lengths on this rank then (never seen)
        engine_step.log.exception("dpbalance_sglang: the plan's lengths could not be written")
    return lens


HOOKS = (
    (f"{WORKER}._dp_verify_tier_num_tokens", around_tier, "AROUND"),
    (f"{PLANNER}.schedule_layout", around_schedule_layout, "AROUND"),
    (f"{PLANNER}._schedule_verify_lens", around_schedule_verify_lens, "AROUND"),
)
