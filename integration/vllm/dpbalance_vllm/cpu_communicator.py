"""vLLM's CpuCommunicator plus all_gatherv / reduce_scatterv (see cpu_platform.py for why).

Its own module: vLLM imports it by name once its platform is chosen (importing
vllm.distributed from the platform's module would be circular)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator


# Seconds this process spent inside the MoE dispatch's all-gathers since the worker last took
# them (DpbWorker logs them per forward as `coll_us`): a rank that reaches the collective first
# waits there for the last one, so over a step the wait at the barrier is this time minus the
# last-arriving rank's (the transfer alone).
GATHER_WAIT_S = [0.0]


def take_gather_wait_us() -> float:
    us = GATHER_WAIT_S[0] * 1e6
    GATHER_WAIT_S[0] = 0.0
    return us


class DpbCpuCommunicator(CpuCommunicator):
    """CpuCommunicator plus all_gatherv / reduce_scatterv (dim 0, as vLLM's CUDA one)."""

    def _sizes(self, n: int, sizes):
        return list(sizes) if sizes is not None else [n] * self.world_size

    def _gatherv_one(self, x: "torch.Tensor", sizes) -> "torch.Tensor":
        sizes = self._sizes(x.shape[0], sizes)
        if x.shape[0] != sizes[self.rank_in_group]:
            raise ValueError(f"all_gatherv: rank {self.rank_in_group} has {x.shape[0]} rows "
                             f"but sizes say {sizes}")
        m = max(sizes)
        pad = x
        if x.shape[0] < m:
            pad = torch.zeros((m,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
            pad[: x.shape[0]] = x
        parts = [torch.empty_like(pad) for _ in range(self.world_size)]
        t0 = time.perf_counter()
        dist.all_gather(parts, pad.contiguous(), group=self.device_group)
        GATHER_WAIT_S[0] += time.perf_counter() - t0
        return torch.cat([p[:s] for p, s in zip(parts, sizes)], dim=0)

    def all_gatherv(self, input_, dim: int = 0, sizes=None):
        if dim != 0:
            raise NotImplementedError("only dim 0 all-gatherv is supported")
        if isinstance(input_, torch.Tensor):
            return self._gatherv_one(input_, sizes)
        return [self._gatherv_one(t, sizes) for t in input_]

    def reduce_scatterv(self, input_: "torch.Tensor", dim: int = -1, sizes=None):
        if dim < 0:
            dim += input_.dim()
        if dim != 0:
            raise NotImplementedError("only dim 0 reduce-scatterv is supported")
        n = input_.shape[0]
        if sizes is None:
            if n % self.world_size:
                raise ValueError(f"reduce_scatterv: {n} rows over {self.world_size} ranks")
            sizes = [n // self.world_size] * self.world_size
        if sum(sizes) != n:
            raise ValueError(f"reduce_scatterv: sizes {list(sizes)} do not add up to {n}")
        summed = input_.contiguous().clone()
        dist.all_reduce(summed, group=self.device_group)
        start = sum(sizes[: self.rank_in_group])
        return summed[start:start + sizes[self.rank_in_group]].contiguous()
