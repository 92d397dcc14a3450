"""Hooks on sglang/srt/managers/scheduler.py (SGLang 0.5.23): the iteration, the forward, the
report. Both event loops (`event_loop_overlap`, SGLang's default, and `event_loop_normal`) and
PD decode's go through these three methods.

  Scheduler.get_next_batch_to_run  AROUND: marks one iteration, so that its first MLP sync is
                                   known as SGLang's prefill probe where SGLang runs one
                                   (`probe_first`, the condition get_next_batch_to_run uses)
  Scheduler.run_batch              AROUND: the batch's plan is the running one during its
                                   forward (the DSpark and EAGLE hooks apply it; a stale one is
                                   dropped) and its attention is timed
  Scheduler.process_batch_result   AFTER: the batch's accepted drafts per request
                                   (GenerationBatchResult.num_correct_drafts_per_req_cpu, or
                                   accept_lens minus the bonus) go to the plugin for the plan the
                                   batch carries (plan_id; the overlap loop passes the copy it
                                   queued, patch/schedule_batch.py keeps the plan on it)
"""
from __future__ import annotations

from .. import engine_step

TARGET = "sglang.srt.managers.scheduler.Scheduler"

SIGNATURES = {
    f"{TARGET}.get_next_batch_to_run": ("self", "running_batch", "last_batch"),
    f"{TARGET}.run_batch": ("self", "batch", "pp_proxy_tensors"),
    f"{TARGET}.process_batch_result": ("self", "batch", "result"),
}


def probe_first(scheduler) -> bool:
    """Whether this iteration's first MLP sync is SGLang's prefill probe: as in
    Scheduler.get_next_batch_to_run at 0.5.23 (`need_mlp_sync and not spec none and not
    SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION`), where a sync over the new prefill batch comes
    before the one over the decode batch. Every rank has the same configuration."""
    from sglang.srt.environ import envs

    spec = getattr(scheduler, "spec_algorithm", None)
    return (bool(getattr(scheduler, "require_mlp_sync", False)) and spec is not None and
            not spec.is_none() and not envs.SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION.get())


def around_get_next_batch_to_run(original, self, *args, **kwargs):
    token = engine_step.enter_iteration(probe_first(self))
    try:
        return original(self, *args, **kwargs)
    finally:
        engine_step.leave_iteration(token)


def around_run_batch(original, self, batch, *args, **kwargs):
    st = engine_step.state()
    token = st.begin_run(batch)  # sets the running plan first; its bookkeeping never raises
    try:
        return original(self, batch, *args, **kwargs)
    finally:
        st.end_run(token)


def after_process_batch_result(_ret, self, batch, result, *args, **kwargs):
    try:
        engine_step.state().report(batch, result)
    except Exception:  # noqa: BLE001 - a report of ours must never stop SGLang's scheduler
        engine_step.log.exception("dpbalance_sglang: report failed; SGLang goes on")


HOOKS = (
    (f"{TARGET}.get_next_batch_to_run", around_get_next_batch_to_run, "AROUND"),
    (f"{TARGET}.run_batch", around_run_batch, "AROUND"),
    (f"{TARGET}.process_batch_result", after_process_batch_result, "AFTER"),
)
