"""vLLM's executors with the idle rank's dpbalance exchange in the dummy batch.

`--distributed-executor-backend dpbalance_vllm.executor.DpbExecutor` (vLLM resolves a qualified
class name there; vllm/v1/executor/abstract.py `Executor.get_class`). A DP rank with no requests
does not reach the scheduler (`EngineCore.step()` returns before `schedule()`); vLLM's DP busy
loop (`DPEngineCoreProc.run_busy_loop`) runs `execute_dummy_batch` instead, so that the rank
still joins every MoE collective. The rank joins dpbalance's exchange there, with no requests,
before the dummy forward: the same place in the step as the active ranks' exchange in
`schedule()`, before their forward. Riding vLLM's DP sync (dp_ride.py), the dummy forward's sync
carries the idle rank's record, handed to the worker with the call (`DpbWorker.dpb_dummy_batch`),
and what it gathered comes back with the worker's timing. With DPB_PLUGIN unset the executors
are vLLM's.

The executor's `shutdown` is also where a rank writes its `final` stats record: vLLM's
`EngineCore.shutdown` (vllm/v1/engine/core.py, 0.32.0) shuts the executor down first and the
scheduler last, and the engine-core process manager kills what is still running after its
SIGTERM (vllm/v1/utils.py `shutdown`: at once under `vllm serve`'s default `--shutdown-timeout`
0), before the workers' teardown would end.

`DpbExecutor` is vLLM's `MultiprocExecutor` (what vLLM's CPU platform and multi-GPU workers
use); `DpbUniProcExecutor` is its `UniProcExecutor` (one GPU per DP rank, in-process worker).
"""
from __future__ import annotations

from vllm import envs
from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.executor.uniproc_executor import UniProcExecutor

from . import engine_plan


def _idle_step(rpc):
    """`rpc(method, args)`: the executor's collective_rpc, the output rank's reply. The worker's
    dummy forward: vLLM's own while the plugin is off; else `DpbWorker.dpb_dummy_batch`, whose
    sync carries this step's record when the package rides vLLM's DP sync, returning the
    worker's timing dict with what that sync gathered."""
    plan = engine_plan.get()
    if plan is None or not plan.enabled:
        return rpc("execute_dummy_batch", ())
    plan.join_idle()
    timing = rpc("dpb_dummy_batch", (plan.take_carry() if plan.ride else None,))
    timing = timing if isinstance(timing, dict) else {}
    plan.received(timing.pop("gathered", None))
    plan.after_step(timing.get("att_us"), timing.get("fwd_us"), [], 0,
                    worker=timing.get("worker"))
    return timing


def _close_plan() -> None:
    plan = engine_plan.get()
    if plan is not None:
        plan.close()


class DpbExecutor(MultiprocExecutor):
    def execute_dummy_batch(self) -> None:
        _idle_step(lambda method, args: self.collective_rpc(
            method, args=args, unique_reply_rank=self.output_rank,
            timeout=envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS))

    def shutdown(self) -> None:
        _close_plan()
        super().shutdown()


class DpbUniProcExecutor(UniProcExecutor):
    def execute_dummy_batch(self) -> None:
        _idle_step(lambda method, args: (self.collective_rpc(method, args=args) or [None])[0])

    def shutdown(self) -> None:
        _close_plan()
        super().shutdown()
