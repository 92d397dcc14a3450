"""A CPU platform for SGLang's process groups on gloo (DPBALANCE_SGLANG_CPU=1 only).

Without a GPU and without SGLANG_USE_CPU_ENGINE=1 (which routes SGLang's imports to its
sgl_kernel CPU build, not on PyPI for this torch), SGLang 0.5.23 falls back to its base
SRTPlatform, which is not out-of-tree, so `init_model_parallel_group`
(sglang/srt/distributed/parallel_state.py) asks for a PyNccl communicator on every group and
`PyNcclCommunicator` fails on the CPU device ("Expected a cuda device, but got: cpu"). SGLang's
CPU platform (sglang/srt/platforms/cpu.py, CpuSRTPlatform) declared out-of-tree, with
`supports_pynccl=False` (the capability SGLang reads for out-of-tree platforms), builds the same
GroupCoordinators with gloo device and CPU groups. That is all this class changes; it exists so
that SGLang's own DP sync (scheduler_components/dp_attn.py) runs on CPUs, as the contract tests
do. It does not make SGLang's model runner run on CPUs (docs/engines.md, "SGLang").
"""
from __future__ import annotations

from sglang.srt.platforms.cpu import CpuSRTPlatform
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities


class DpbCpuPlatform(CpuSRTPlatform):
    """SGLang's CPU platform as an out-of-tree one without PyNccl."""

    _enum = PlatformEnum.OOT
    capabilities = PlatformCapabilities(supports_pynccl=False)
