"""Hooks on SGLang's adaptive speculative steps (SGLang 0.5.23,
speculative/adaptive_spec_params.py): EAGLE / EAGLE3 / MTP depth agreed across attention-DP
ranks, within SGLang's captured step graphs.

  adaptive_unsupported_reason           AROUND: SGLang refuses --speculative-adaptive under
                                        attention DP ("adaptive tier decisions are not
                                        synchronized across DP ranks"); dpbalance's exchange is
                                        that synchronisation, so with the hooks registered
                                        (DPB_PLUGIN set, `none` included) the refusal is lifted on
                                        every process alike. SGLang's other checks still run (its
                                        own function, asked again as if DP were off)
  AdaptiveSpeculativeParams.get_steps_for_batch
                                        AROUND: under attention DP, the depth is the plan's agreed
                                        draft depth (the same bytes on every rank; one of the
                                        depths every batch size has a step graph for,
                                        spec_config.eagle_depths), else the depth SGLang runs now
                                        (the last agreed one); never SGLang's per-rank choice,
                                        which would split the ranks
  AdaptiveSpeculativeParams.on_verify_complete
                                        AROUND: under attention DP SGLang's per-rank EMA still
                                        learns but never switches the depth (it would, on one
                                        rank); the accepted drafts reach the plugin in the report

EAGLEWorkerV2.forward_batch_generation calls `activate_step_by_batch` on every decode and idle
batch before drafting, and AdaptiveController then swaps in the captured state of that depth
(`apply_runtime_state`): SGLang's own mechanism, fed by the plan.
"""
from __future__ import annotations

import os

from .. import engine_step

PARAMS = "sglang.srt.speculative.adaptive_spec_params"

SIGNATURES = {
    f"{PARAMS}.adaptive_unsupported_reason": ("server_args",),
    f"{PARAMS}.AdaptiveSpeculativeParams.get_steps_for_batch": ("self", "batch_size"),
    f"{PARAMS}.AdaptiveSpeculativeParams.on_verify_complete": (
        "self", "num_correct_drafts_per_req", "batch_size"),
    f"{PARAMS}._load_adaptive_config": ("cfg_path",),
}

DP_REASON = "attention DP is not supported"


def around_unsupported_reason(original, server_args):
    # Registered only with DPB_PLUGIN set (`none` included): every process of the instance
    # lifts the refusal alike, and get_steps_for_batch below keeps every rank on one depth
    # whether or not its plugin runs (a rank whose refusal stood would capture other graphs).
    reason = original(server_args)
    if reason is None or not reason.startswith(DP_REASON):
        return reason
    from sglang.srt.speculative import adaptive_spec_params as asp

    saved = asp.attn_dp_enabled_of
    asp.attn_dp_enabled_of = lambda _view: False  # SGLang's remaining checks, as without DP
    try:
        rest = original(server_args)
    finally:
        asp.attn_dp_enabled_of = saved
    if rest is None:
        engine_step.log.warning(
            "dpbalance_sglang: SGLang's adaptive speculative steps run under attention DP: "
            "dpbalance agrees one depth for every DP rank each step (DPB_PLUGIN=%s)",
            os.environ.get("DPB_PLUGIN"))
    return rest


def _under_dp() -> bool:
    from sglang.srt.runtime_context import get_parallel

    return bool(get_parallel().attn_dp_enabled)


def around_get_steps(original, self, batch_size):
    if not _under_dp():
        return original(self, batch_size)
    from sglang.srt.runtime_context import get_spec

    current = int(get_spec().speculative_num_steps)  # the state SGLang runs now, every rank's
    st = engine_step.state()
    bp = st.usable()
    depth = current
    if bp is not None and bp.plan.draft_depth in self.candidate_steps:
        depth = int(bp.plan.draft_depth)
        st.applied("eagle_depth")
        if depth != current:
            st.applied("eagle_depth_change")
    st.note_run("depth", depth)  # the report claims the depth that ran
    return depth


def around_on_verify_complete(original, self, *args, **kwargs):
    new_step = original(self, *args, **kwargs)
    return None if _under_dp() else new_step


HOOKS = (
    (f"{PARAMS}.adaptive_unsupported_reason", around_unsupported_reason, "AROUND"),
    (f"{PARAMS}.AdaptiveSpeculativeParams.get_steps_for_batch", around_get_steps, "AROUND"),
    (f"{PARAMS}.AdaptiveSpeculativeParams.on_verify_complete", around_on_verify_complete,
     "AROUND"),
)
