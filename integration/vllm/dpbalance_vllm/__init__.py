"""dpbalance for vLLM: per-request speculative verify lengths balanced across DP ranks.

Installed with pip, it registers `register` under vLLM's `vllm.general_plugins` entry point, which
vLLM calls in every process it starts. Nothing changes unless DPB_PLUGIN names the library
(`DPB_PLUGIN=dpbalance`: the copy bundled with this package); the DPB_* flags are the plugin's
(docs/flags.md). The engine side is three classes named on vLLM's command line:

    DPB_PLUGIN=dpbalance vllm serve MODEL --data-parallel-size N --speculative-config ... \\
        --scheduler-cls dpbalance_vllm.scheduler.DpbScheduler \\
        --worker-cls dpbalance_vllm.worker.DpbWorker \\
        --distributed-executor-backend dpbalance_vllm.executor.DpbExecutor

(`ENGINE_ARGS` below holds the same for the Python API.) See docs/live_vllm.md.
"""
from __future__ import annotations

import logging
import os

__version__ = "0.1.0"

ENGINE_ARGS = {
    "scheduler_cls": "dpbalance_vllm.scheduler.DpbScheduler",
    "worker_cls": "dpbalance_vllm.worker.DpbWorker",
    "distributed_executor_backend": "dpbalance_vllm.executor.DpbExecutor",
}

log = logging.getLogger("dpbalance.vllm")
REGISTERED = False


def register() -> None:
    """vLLM's general-plugin hook (every vLLM process). With DPB_PLUGIN set, checks here, at
    start-up and in every process, that the library loads and exports the plugin's symbol, so a
    missing or broken library stops vLLM at once with its name, not at the first step's
    exchange where the other ranks would wait for this one."""
    global REGISTERED
    if REGISTERED:
        return
    REGISTERED = True
    from . import engine_plan

    path = engine_plan.library_path()
    if path is None:
        log.debug("dpbalance_vllm: DPB_PLUGIN unset or none; vLLM runs unchanged")
        return
    import ctypes

    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        getattr(lib, engine_plan.adapter.SYMBOL_V2)
    except (OSError, AttributeError) as e:
        raise RuntimeError(f"dpbalance_vllm: DPB_PLUGIN={os.environ.get('DPB_PLUGIN')!r} "
                           f"resolves to '{path}', which cannot be used: {e}") from e
    log.warning("dpbalance_vllm: plugin entry point loaded in pid %d, library %s",
                os.getpid(), path)
