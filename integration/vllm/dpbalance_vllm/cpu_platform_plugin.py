"""The `vllm.platform_plugins` hook for dpbalance_vllm.cpu_platform (read its docstring).

Kept apart from the platform class: vLLM calls the hook while it is still choosing its platform,
when importing vllm.platforms.cpu would be circular."""
from __future__ import annotations

import os


def activate():
    """vLLM's platform-plugin hook: the platform's qualified name, or None to stay out."""
    if os.environ.get("DPBALANCE_VLLM_CPU_DP", "0") != "1":
        return None
    from vllm.platforms import cpu_platform_plugin

    if cpu_platform_plugin() is None:  # not a CPU build of vLLM: leave the choice to vLLM
        return None
    return "dpbalance_vllm.cpu_platform.DpbCpuPlatform"
