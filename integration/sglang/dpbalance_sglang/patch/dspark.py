"""Hooks on DSpark (SGLang 0.5.23, SGLANG_RAGGED_VERIFY_MODE=compact): each request's verify
length and the agreed verify tier come from the plan made at this step's MLP sync.

  speculative/dspark_components/dspark_worker_v2.py
    DSparkWorkerV2._forward_decode             AROUND: the batch's plan is the current one while
                                               its decode step is laid out
    DSparkWorkerV2._dp_verify_tier_num_tokens  AROUND: the agreed tier = the plan's padded_tokens
                                               (the smallest captured token tier at or above every
                                               DP rank's total; the same bytes on every rank)
  speculative/dspark_components/dspark_planner.py
    DSparkVerifyPlanner._schedule_verify_lens  AROUND: SGLang's own schedule runs (its top-k and
                                               its attention-TP broadcast, so SGLang's collectives
                                               stay paired), then its lengths are overwritten with
                                               1 + the plan's verify_len (DSpark counts the anchor)

Both replace SGLang's values only when the plan's exchange went through (every DP rank's total
known), on every rank alike; a rank that fell back then runs the plan's defaults (DPB_DEFAULT_K =
the whole block: DSpark's verify-all), whose total the others counted in the tier. Otherwise
(no plugin somewhere, an inactive slot, a failed exchange) SGLang's own lengths and tier, on
every rank alike. Where SGLang gathers no tier (attention TP > 1, no DP attention) its tier
stays, and the plan's lengths fit under it (at most the block per request).
"""
from __future__ import annotations

import contextvars
from typing import Optional

from .. import engine_step

WORKER = "sglang.srt.speculative.dspark_components.dspark_worker_v2.DSparkWorkerV2"
PLANNER = "sglang.srt.speculative.dspark_components.dspark_planner.DSparkVerifyPlanner"

SIGNATURES = {
    f"{WORKER}._forward_decode": ("self", "batch", "on_publish", "grammar_barrier",
                                  "coordination_plan"),
    f"{WORKER}._dp_verify_tier_num_tokens": ("self", "batch"),
    f"{PLANNER}._schedule_verify_lens": ("self", "req_pool_indices", "prefix_lens", "device",
                                         "confidence", "budget"),
}

_CURRENT: contextvars.ContextVar[Optional[engine_step.BatchPlan]] = contextvars.ContextVar(
    "dpbalance_sglang_dspark_plan", default=None)


def usable_plan(batch) -> Optional[engine_step.BatchPlan]:
    bp = getattr(batch, "dpb_plan", None)
    return bp if bp is not None and bp.exchanged else None


def around_forward_decode(original, self, batch, *args, **kwargs):
    token = _CURRENT.set(usable_plan(batch))
    try:
        return original(self, batch, *args, **kwargs)
    finally:
        _CURRENT.reset(token)


def around_tier(original, self, batch):
    tier = original(self, batch)
    bp = usable_plan(batch)
    # A step where some rank prefills: padded_tokens counts prefill tokens, not a verify tier
    # (DSpark verifies nothing then, except under SGLang's prefill coordination, where its own
    # tier stays; the plan's lengths fit under it, at most the block per request).
    if tier is None or bp is None or bp.plan.any_rank_flags & engine_step.adapter.RANK_EXTEND:
        return tier
    return int(bp.plan.padded_tokens)


def around_schedule_verify_lens(original, self, *args, **kwargs):
    lens = original(self, *args, **kwargs)
    bp = _CURRENT.get()
    if lens is None or bp is None or bp.kind != "decode" or \
            len(bp.plan.verify_len) != int(lens.shape[0]):
        return lens
    import torch

    try:
        ours = torch.tensor([1 + k for k in bp.plan.verify_len], dtype=lens.dtype)
        lens.copy_(ours.to(lens.device))
    except Exception:  # noqa: BLE001 - SGLang's own lengths on this rank then (never seen)
        engine_step.log.exception("dpbalance_sglang: the plan's lengths could not be written")
    return lens


HOOKS = (
    (f"{WORKER}._forward_decode", around_forward_decode, "AROUND"),
    (f"{WORKER}._dp_verify_tier_num_tokens", around_tier, "AROUND"),
    (f"{PLANNER}._schedule_verify_lens", around_schedule_verify_lens, "AROUND"),
)
