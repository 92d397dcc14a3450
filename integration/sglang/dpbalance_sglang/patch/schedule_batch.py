"""Hook on sglang/srt/managers/schedule_batch.py (SGLang 0.5.23): the plan survives the copy.

  ScheduleBatch.copy   AFTER: the copy carries the batch's plan (`dpb_plan`)

`event_loop_overlap` (scheduler.py) and PD decode's `event_loop_overlap_disagg_decode`
(disaggregation/decode.py) queue `batch.copy()` with the forward's result and process that copy
an iteration later; `copy()` builds a new ScheduleBatch from the fields result processing reads,
so an attribute of ours is lost there unless carried.
"""
from __future__ import annotations

TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.copy"

SIGNATURES = {TARGET: ("self",)}


def after_copy(result, self, *args, **kwargs):
    plan = getattr(self, "dpb_plan", None)
    if plan is not None and result is not None:
        result.dpb_plan = plan
    return None


HOOKS = ((TARGET, after_copy, "AFTER"),)
