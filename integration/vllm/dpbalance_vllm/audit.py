"""Counts the torch.distributed collectives this package runs itself (tests, and a user who wants
to see it): DPBALANCE_VLLM_AUDIT_COLLECTIVES=1, installed by `register()` in every vLLM process.

Every collective function of `torch.distributed` is wrapped; a call counts as the package's own
when its nearest caller outside torch is this package's code and vLLM's DP sync
(`dp_utils._run_ar`, which dp_ride.py extends) is not on its stack; the MoE collectives the
package's CPU communicator runs for vLLM are vLLM's. The engine core reports its count in the `final` and `stats` records
(`audit_own_collectives`), the workers theirs with each forward's timing.
"""
from __future__ import annotations

import os
import sys

ENV = "DPBALANCE_VLLM_AUDIT_COLLECTIVES"
_NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
          "broadcast_object_list", "barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor",
          "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv")
_PKG = os.path.dirname(os.path.abspath(__file__)) + os.sep
# The package's files that run vLLM's own collectives, not dpbalance's: this one, and the CPU
# communicator that supplies the DP-MoE all-gathers vLLM 0.32.0's CPU platform lacks
# (DPBALANCE_VLLM_CPU_DP=1, cpu_communicator.py; the same collectives vLLM runs on a GPU).
_ENGINE_FILES = ("audit.py", "cpu_communicator.py", "cpu_platform.py")
_TORCH = os.sep + "torch" + os.sep
_DP_UTILS = os.path.join("worker", "dp_utils.py")
COUNTS = {"own": 0, "vllm_sync": 0}
_INSTALLED = False


def enabled() -> bool:
    return os.environ.get(ENV, "0") == "1"


def _classify() -> str:
    """`vllm_sync` inside vLLM's DP sync; `own` when the nearest caller outside torch is this
    package's code (not a file that runs vLLM's collectives); else "" (vLLM's, or anyone's).
    The nearest caller, not any frame: the worker's execute_model (this package) is on the
    stack of every MoE collective of the forward it wraps."""
    f = sys._getframe(2)
    nearest = None
    while f is not None:
        code = f.f_code
        if code.co_name == "_run_ar" and code.co_filename.endswith(_DP_UTILS):
            return "vllm_sync"
        if nearest is None and _TORCH not in code.co_filename:
            nearest = code.co_filename
        f = f.f_back
    if nearest is not None and nearest.startswith(_PKG) and not nearest.endswith(_ENGINE_FILES):
        return "own"
    return ""


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    import torch.distributed as dist
    for name in _NAMES:
        real = getattr(dist, name, None)
        if real is None:
            continue

        def counted(*args, _real=real, **kwargs):
            kind = _classify()
            if kind:
                COUNTS[kind] += 1
            return _real(*args, **kwargs)
        setattr(dist, name, counted)


def counts() -> dict:
    return dict(COUNTS) if _INSTALLED else {}
