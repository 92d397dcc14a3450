"""What SGLang's speculative configuration decides for the plugin (read at SGLang 0.5.23).

SGLang's configuration fixes what the plan may change, per algorithm:
  - DSpark (`SGLANG_RAGGED_VERIFY_MODE=compact`): a verify length per request within its block
    (`speculative_num_draft_tokens`, the anchor included) and a per-rank token tier from the
    decode runner's captured grid; the draft length is DSpark's own (no draft cost for us).
  - EAGLE / EAGLE3 / MTP (topk 1): one width for every rank, `speculative_num_steps`, the draft
    depth of a captured step graph (granularity `instance`). With `--speculative-adaptive` the
    depths are SGLang's candidate steps that have step graphs for every batch size
    (`AdaptiveSpeculativeParams`: a step is captured for the batch sizes whose slot lists it;
    with CUDA graphs off every candidate runs eagerly); without it the one configured depth.
The flags derived here go in the plugin's config string only where `DPB_*` leaves them unset
(docs/flags.md).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Optional

log = logging.getLogger("sglang.srt.plugins.dpbalance")

MAX_DEPTH = 8  # DPB_K_MAX's range (docs/flags.md)


def _env_set(name: str) -> bool:
    """Whether DPB_<name> is given (the plugin parses it and names a bad value)."""
    return bool(os.environ.get(name))


@dataclass
class SpecConfig:
    alg: str                       # none, eagle, dspark or SGLang's name
    k_draft: int                   # drafts a request may verify (the deepest depth)
    default_k: int                 # what SGLang verifies without us
    full_width: bool = False       # every request verifies the width (EAGLE's chain)
    tiers: Optional[list] = None   # DSpark compact: the decode runner's captured token grid
    depths: list = field(default_factory=list)  # EAGLE: the depths SGLang can run
    adaptive: bool = False         # EAGLE with SGLang's adaptive steps (the plan sets them)

    @classmethod
    def none(cls) -> "SpecConfig":
        return cls("none", 0, 0)

    @classmethod
    def from_sglang(cls, model_runner) -> "SpecConfig":
        alg = getattr(model_runner, "spec_algorithm", None)
        if alg is None or alg.is_none():
            return cls.none()
        from sglang.srt.runtime_context import get_spec

        spec = get_spec()
        if alg.is_eagle():
            steps = int(spec.speculative_num_steps or 0)
            adaptive = bool(getattr(spec, "speculative_adaptive", False))
            depths = eagle_depths(steps, spec) if adaptive else [steps]
            # The plugin plans depths up to MAX_DEPTH and needs SGLang's own depth among them.
            depths = sorted({d for d in depths if d <= MAX_DEPTH} | {min(steps, MAX_DEPTH)})
            return cls("eagle", max(depths), min(steps, MAX_DEPTH), full_width=True,
                       depths=depths, adaptive=adaptive)
        width = max(0, int(spec.speculative_num_draft_tokens or 1) - 1)
        name = "dspark" if alg.is_dspark() else alg.name.lower()
        tiers = ragged_tiers(model_runner) if name == "dspark" else None
        k = min(width, MAX_DEPTH)
        return cls(name, width, k, tiers=tiers)

    def plugin_config(self) -> str:
        """The config string: SGLang's choices where DPB_* leaves them unset (the config string
        wins over DPB_*, so only unset ones are passed)."""
        parts = []
        k = min(self.k_draft, MAX_DEPTH)
        if not _env_set("DPB_K_MAX"):
            parts.append(f"k_max={k}")
        if not _env_set("DPB_DEFAULT_K"):
            parts.append(f"default_k={min(self.default_k, k)}")
        if self.alg == "eagle":
            if not _env_set("DPB_GRANULARITY"):
                parts.append("granularity=instance")
            if not _env_set("DPB_DEPTHS"):
                parts.append("depths=" + ",".join(str(d) for d in self.depths))
        elif self.alg != "none" and not _env_set("DPB_DRAFT_US"):
            parts.append("draft_us=0")  # DSpark drafts its block whatever we verify
        return ";".join(parts)

    def describe(self) -> str:
        if self.alg == "eagle":
            return (f"eagle width {self.default_k}, depths {self.depths}"
                    f"{' (adaptive)' if self.adaptive else ''}")
        return f"{self.alg} drafts {self.k_draft}, tiers {self.tiers}"


def eagle_depths(initial: int, spec) -> list:
    """SGLang's adaptive candidate steps that every batch size can run: with CUDA graphs off,
    every candidate; else those in every batch-size slot of the adaptive config (a step outside a
    slot has no step graph for that slot's batch sizes, and DP ranks of different sizes must
    run one depth). Always holds the initial depth (SGLang's starting state)."""
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend
    from sglang.srt.speculative import adaptive_spec_params as asp

    _, slots = asp._load_adaptive_config(spec.speculative_adaptive_config)
    sets = [set(e["candidate_steps"]) for e in slots.values()]
    graphs = not check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED)
    every = set.intersection(*sets) if graphs else set.union(*sets)
    if initial not in every or len(every) < 2:
        log.warning("dpbalance_sglang: the adaptive config %s captures depths %s for every "
                    "batch size; dpbalance sets one depth for every DP rank, so it chooses among "
                    "%s (give one batch-size slot, e.g. {\"1\": {\"candidate_steps\": [1, 2, 3, "
                    "4]}}, to let it choose more)", spec.speculative_adaptive_config or
                    "(SGLang's default)", sorted(every), sorted(every | {initial}))
    return sorted(every | {initial})


def ragged_tiers(model_runner) -> Optional[list]:
    """DSpark compact: the decode runner's captured token grid (the tiers SGLang pads to)."""
    runner = getattr(model_runner, "decode_cuda_graph_runner", None)
    if runner is None or not getattr(runner, "ragged_verify_mode", False):
        return None
    return [int(t) for t in runner.capture_num_tokens]
