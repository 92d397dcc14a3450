"""Hooks on sglang/srt/managers/scheduler_components/dp_attn.py (SGLang 0.5.23): the record in
SGLang's MLP-sync row (engine_step.py says why extra columns and not a second gather).

  prepare_mlp_sync_batch_raw           AROUND: makes this rank's batch and model runner visible
                                       to the sync inside it; puts the sync's plan (or None) on
                                       the batch it returns (the idle batch it makes included)
  MLPSyncBatchInfo.all_gather          AROUND: plan, with SGLang's gather as the exchange (the
                                       iteration's prefill probe runs as shipped)
  MLPSyncBatchInfo._get_local_tensor   AFTER: appends the record (64 int64) while a gather runs
  MLPSyncBatchInfo._get_fallback_tensor AFTER: appends 64 zeros then (an inactive slot's record)

Outside our gather (`finalize_local` at one DP rank, the probe) the rows stay SGLang's.
"""
from __future__ import annotations

from .. import engine_step

MODULE = "sglang.srt.managers.scheduler_components.dp_attn"

# Parameter names read at 0.5.23; register_all checks them before registering.
SIGNATURES = {
    f"{MODULE}.prepare_mlp_sync_batch_raw": (
        "local_batch", "model_runner", "get_idle_batch", "disable_cuda_graph",
        "require_mlp_tp_gather", "disable_overlap_schedule", "offload_tags",
        "draft_require_mlp_tp_gather", "dwdp", "sync_wait_carry"),
    f"{MODULE}.MLPSyncBatchInfo.all_gather": ("self", "device", "group", "use_all_reduce"),
    f"{MODULE}.MLPSyncBatchInfo._get_local_tensor": ("self", "device", "dtype"),
    f"{MODULE}.MLPSyncBatchInfo._get_fallback_tensor": ("self", "device", "dtype"),
}


def around_prepare(original, *args, **kwargs):
    batch = args[0] if args else kwargs.get("local_batch")
    model_runner = args[1] if len(args) > 1 else kwargs.get("model_runner")
    token = engine_step.enter_step(batch, model_runner)
    try:
        out = original(*args, **kwargs)
    finally:
        engine_step.leave_step(token)
    st = engine_step.state()
    plan = st.take_latest()
    if plan is not None and out is None:  # every rank idle: SGLang runs nothing this step
        try:
            st.report_plan(plan)
        except Exception:  # noqa: BLE001 - a report of ours must never stop SGLang's scheduler
            engine_step.log.exception("dpbalance_sglang: report failed; SGLang goes on")
    elif out is not None:
        # Always set, None too: SGLang keeps its running batch across iterations, and an older
        # plan left on it must not look like this step's.
        out.dpb_plan = plan
        inner = getattr(out, "inner_idle_batch", None)  # a prebuilt batch runs its idle batch
        if inner is not None:
            inner.dpb_plan = plan
    return out


def around_all_gather(original, self, device, group, use_all_reduce=False):
    engine_step.state().sync(original, self, device, group, use_all_reduce)


def after_local_tensor(result, *args, **kwargs):
    pending = engine_step.state().pending
    if pending is None:
        return None
    import torch

    return torch.cat([result, pending.to(device=result.device, dtype=result.dtype)])


def after_fallback_tensor(result, *args, **kwargs):
    if engine_step.state().pending is None:
        return None
    import torch

    return torch.cat([result, torch.zeros(engine_step.RECORD_COLUMNS, device=result.device,
                                          dtype=result.dtype)])


HOOKS = (
    (f"{MODULE}.prepare_mlp_sync_batch_raw", around_prepare, "AROUND"),
    (f"{MODULE}.MLPSyncBatchInfo.all_gather", around_all_gather, "AROUND"),
    (f"{MODULE}.MLPSyncBatchInfo._get_local_tensor", after_local_tensor, "AFTER"),
    (f"{MODULE}.MLPSyncBatchInfo._get_fallback_tensor", after_fallback_tensor, "AFTER"),
)
