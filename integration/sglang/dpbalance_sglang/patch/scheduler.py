"""Hook on sglang/srt/managers/scheduler.py (SGLang 0.5.23): the report.

  Scheduler.process_batch_result   AFTER: the batch's accepted drafts per request
                                   (GenerationBatchResult.num_correct_drafts_per_req_cpu, or
                                   accept_lens minus the bonus) go to the plugin for the plan the
                                   batch ran (plan_id), idle and prefill batches with none.
"""
from __future__ import annotations

from .. import engine_step

TARGET = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"

SIGNATURES = {TARGET: ("self", "batch", "result")}


def after_process_batch_result(_ret, self, batch, result, *args, **kwargs):
    try:
        engine_step.state().report(batch, result)
    except Exception:  # noqa: BLE001 - a report of ours must never stop SGLang's scheduler
        engine_step.log.exception("dpbalance_sglang: report failed; SGLang goes on")


HOOKS = ((TARGET, after_process_batch_result, "AFTER"),)
