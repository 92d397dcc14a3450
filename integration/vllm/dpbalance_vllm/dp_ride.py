"""The summary record on vLLM's own per-step DP sync, in the worker (no collective of our own).

Every forward of a DP instance, real or dummy, runs vLLM's DP sync before the model:
`GPUModelRunner._determine_batch_execution_and_padding` calls
`vllm.v1.worker.dp_utils.coordinate_batch_across_dp`, whose `_run_ar` all-reduces a
(4, dp_size) int32 tensor (tokens unpadded, padded, micro-batching, CUDA-graph mode), each rank
filling its own column, over vLLM's DP group (gloo on CPU and under async scheduling, NCCL
otherwise). Read at vLLM 0.32.0, vllm/v1/worker/dp_utils.py `_run_ar` / `_synchronize_dp_ranks`
and vllm/v1/worker/gpu_model_runner.py `execute_model` (the sync runs after `_prepare_inputs`).

`install()` (the worker, DPB_PLUGIN set, DPBALANCE_VLLM_EXCHANGE=ride, DP > 1) makes that
all-reduce carry `CARRY_INT32` more rows: this rank's carry (the package's payload and the
plugin's record, `engine_plan.EnginePlan`) in its own column, zeros elsewhere, so the sum is every
rank's bytes, exactly. vLLM's rows go back into vLLM's tensor unchanged. Nothing of vLLM's code
is copied: `dp_utils.dist` becomes a proxy of `torch.distributed` whose `all_reduce` appends the
rows only while `_run_ar` runs, and forwards everything else.

Every rank of the instance installs it (the same environment), so every `_run_ar` has the same
shape on every rank; vLLM already requires every rank to run the same sequence of syncs. A rank
with nothing armed sends zero rows. The carry handed to the worker for a step (`arm`) rides the
first sync after it, which is that step's forward or dummy forward, on every rank alike; later
syncs of the same step (a model drafter's own forward) carry zeros.

The sync runs after vLLM's scheduler fixed the step's drafts, so the records it gathers plan the
next step: the engine core plans step s from the records of step s - 1 (s - 2 under vLLM's async
scheduler), every rank from the same bytes. The plugin pairs each rank's measurement with the
records that carried it (Balancer::ArrivedMeasured).
"""
from __future__ import annotations

import os
import time
from typing import Optional

MODES = ("ride", "own")
ENV = "DPBALANCE_VLLM_EXCHANGE"


def mode() -> str:
    """DPBALANCE_VLLM_EXCHANGE: `ride` (default) or `own` (the plugin's own all-reduce on the
    engine core's DP group every step, as before). Raises ValueError naming a bad value."""
    v = os.environ.get(ENV, "") or "ride"
    if v not in MODES:
        raise ValueError(f"environment variable {ENV}: '{v}' is not one of {', '.join(MODES)}")
    return v


class _State:
    def __init__(self, width_int32: int):
        self.width = width_int32
        self.rank = -1            # the DP rank of the _run_ar now running (-1: none)
        self.armed: Optional[bytes] = None
        self.gathered: Optional[bytes] = None
        self.syncs = 0            # vLLM syncs seen
        self.carried = 0          # of them, syncs that carried an armed record
        self.sync_s = 0.0         # time in vLLM's syncs since `take_sync_us`
        self.ext = None           # the taller CPU tensor of the last sync, reused (`_carrying`)


_STATE: Optional[_State] = None


class _RidingDist:
    """`torch.distributed` as `vllm.v1.worker.dp_utils` sees it."""

    def __init__(self, real, state: _State):
        self._real = real
        self._state = state

    def __getattr__(self, name):
        return getattr(self._real, name)

    def all_reduce(self, tensor, *args, **kwargs):
        st = self._state
        if st.rank < 0 or tensor.dim() != 2:
            return self._real.all_reduce(tensor, *args, **kwargs)
        t0 = time.perf_counter()
        try:
            return self._carrying(st, tensor, *args, **kwargs)
        finally:
            st.sync_s += time.perf_counter() - t0

    def _carrying(self, st, tensor, *args, **kwargs):
        if st.width == 0:  # timing only: vLLM's sync as shipped
            st.syncs += 1
            return self._real.all_reduce(tensor, *args, **kwargs)
        if tensor.device.type == "cpu" and tensor.is_contiguous() and not kwargs.get("async_op"):
            return self._carrying_cpu(st, tensor, *args, **kwargs)
        import torch
        dp = tensor.shape[1]
        extra = torch.zeros(st.width, dp, dtype=tensor.dtype)
        carry, st.armed = st.armed, None
        if carry is not None:
            col = torch.frombuffer(bytearray(carry.ljust(st.width * 4, b"\0")), dtype=torch.int32)
            extra[:, st.rank] = col.to(tensor.dtype)
        ext = torch.cat([tensor, extra.to(tensor.device)], dim=0)
        out = self._real.all_reduce(ext, *args, **kwargs)
        rows = tensor.shape[0]
        tensor.copy_(ext[:rows])
        st.syncs += 1
        if carry is not None:
            st.carried += 1
        # Rank r's bytes are column r: transposed, each rank's carry is one contiguous row. A
        # sync where no rank carried anything (a drafter's own forward, after the step's first
        # sync took every carry) leaves the step's records in place.
        mine = ext[rows:].to("cpu", torch.int32)
        if carry is not None or bool(mine.any()):
            st.gathered = mine.t().contiguous().numpy().tobytes()
        return out

    def _carrying_cpu(self, st, tensor, *args, **kwargs):
        """`_carrying` for a CPU tensor (gloo: vLLM on CPUs, and its CPU group under async
        scheduling): the taller tensor is kept between syncs and filled and read through numpy
        views of the same memory, where a chain of small torch ops cost ~150 us a sync on the
        2-core VM (bench/vllm_sync_rows_bench.py)."""
        import numpy as np
        import torch
        rows, dp = tensor.shape
        ext = st.ext
        if ext is None or tuple(ext.shape) != (rows + st.width, dp) or ext.dtype != tensor.dtype:
            ext = st.ext = torch.zeros(rows + st.width, dp, dtype=tensor.dtype)
        a = ext.numpy()
        a[:rows] = tensor.numpy()
        a[rows:] = 0
        carry, st.armed = st.armed, None
        if carry is not None:
            a[rows:, st.rank] = np.frombuffer(carry.ljust(st.width * 4, b"\0"), dtype=np.int32)
        out = self._real.all_reduce(ext, *args, **kwargs)
        tensor.numpy()[:] = a[:rows]
        st.syncs += 1
        if carry is not None:
            st.carried += 1
        mine = a[rows:]
        if carry is not None or mine.any():  # as `_carrying`: rank r's bytes, one row each
            st.gathered = np.ascontiguousarray(mine.T, dtype=np.int32).tobytes()
        return out


# vLLM's per-step DP syncs, as (module, function, where the function gets its DP rank): the V1
# model runner's (`_run_ar`, keyword `parallel_config`, 5th positional) and the V2 runner's
# (vllm/v1/worker/gpu/dp_utils.py `sync_cudagraph_and_dp_padding`, a (6, dp) int32 CPU all-reduce
# on the DP group's cpu_group, keyword `dp_rank`, 7th positional). A deployment runs one of them;
# the V2 one is wired the same way and not run here (the V2 runner needs Triton: GPUs).
SYNCS = (("vllm.v1.worker.dp_utils", "_run_ar",
          lambda a, k: int(k.get("parallel_config", a[4] if len(a) > 4 else None).data_parallel_rank)),
         ("vllm.v1.worker.gpu.dp_utils", "sync_cudagraph_and_dp_padding",
          lambda a, k: int(k.get("dp_rank", a[6] if len(a) > 6 else -1))))


def _wrap(fn, st: _State, rank_of):
    def riding(*args, **kwargs):
        st.rank = rank_of(args, kwargs)
        try:
            return fn(*args, **kwargs)
        finally:
            st.rank = -1
    riding.__wrapped__ = fn
    return riding


def install(width_bytes: int) -> bool:
    """Makes vLLM's DP sync carry `width_bytes` per rank (rounded up to int32; 0: nothing
    carried, the sync only timed, for the step log of vLLM as shipped), in every module of
    SYNCS that this vLLM has. Idempotent; False when it has none of them."""
    global _STATE
    if _STATE is not None:
        return True
    import importlib
    st = _State((width_bytes + 3) // 4)
    done = 0
    for module, name, rank_of in SYNCS:
        try:
            mod = importlib.import_module(module)
        except Exception:  # noqa: BLE001 - a vLLM without that runner (or its imports here)
            continue
        fn, real = getattr(mod, name, None), getattr(mod, "dist", None)
        if fn is None or real is None:
            continue
        mod.dist = _RidingDist(real, st)
        setattr(mod, name, _wrap(fn, st, rank_of))
        done += 1
    if done:
        _STATE = st
    return done > 0


def installed() -> bool:
    return _STATE is not None


def arm(carry: Optional[bytes]) -> None:
    """The bytes the next vLLM sync carries for this rank (None: zeros)."""
    if _STATE is not None and carry is not None:
        _STATE.armed = bytes(carry)


def take() -> Optional[bytes]:
    """What the latest sync gathered (every rank's carry, rank order), once; None if nothing."""
    if _STATE is None:
        return None
    g, _STATE.gathered = _STATE.gathered, None
    return g


def counts() -> dict:
    return {"syncs": _STATE.syncs, "carried": _STATE.carried} if _STATE is not None else {}


def take_sync_us() -> Optional[float]:
    """Time in vLLM's DP syncs since the last call (us), or None when not installed."""
    if _STATE is None:
        return None
    us, _STATE.sync_s = _STATE.sync_s * 1e6, 0.0
    return us
