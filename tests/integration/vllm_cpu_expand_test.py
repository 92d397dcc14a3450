#!/usr/bin/env python3
"""The package's fix of vLLM's CPU `expand_kernel` (dpbalance_vllm/patch/cpu_expand_kernel.py),
against the real vLLM in the venv (run with the venv's python).

vLLM's rejection sampler spreads each request's temperature, top_k and top_p over its draft
positions with `expand_batch_to_tokens`. On vLLM 0.32.0's CPU build the registered CPU kernel
drops its output for any tensor that is not int64. Checks, through vLLM's own function and
registry: that vLLM's kernel as shipped leaves the output unwritten (so the patch is still
needed: an upstream fix fails this check and the patch must go), that the package's CPU platform
registers the fix, and that the fixed kernel gives exactly what the Triton kernel's contract
says for int32 and float32 inputs, with replace_from/replace_to, including empty requests.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("DPBALANCE_VLLM_CPU_DP", "1")


def main() -> int:
    import torch
    from vllm.triton_utils import HAS_TRITON

    checks = []

    def check(name, ok, detail=""):
        checks.append((name, bool(ok), detail))

    if HAS_TRITON:
        print("SKIP: Triton runs vLLM's kernels here (no CPU override to fix)")
        return 0
    from dpbalance_vllm.cpu_platform import DpbCpuPlatform
    from dpbalance_vllm.patch import cpu_expand_kernel
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.sample import rejection_sampler as rs

    x32 = torch.tensor([5, 7, 0, 9], dtype=torch.int32)
    cu = torch.tensor([2, 5, 5, 6], dtype=torch.int32)  # the third request has no drafts
    want32 = torch.tensor([5, 5, 7, 7, 7, 9], dtype=torch.int32)

    # vLLM as shipped: its CPU override alone.
    CpuPlatform.register_triton_kernel_overrides()
    torch.manual_seed(0)
    shipped = [rs.expand_batch_to_tokens(x32, cu, 6) for _ in range(3)]
    check("vLLM's shipped CPU expand_kernel drops its int32 output (the patch is needed)",
          any(not torch.equal(s, want32) for s in shipped), str(shipped[0].tolist()))

    # The package's platform: vLLM's overrides, then the fix.
    DpbCpuPlatform.register_triton_kernel_overrides()
    check("the patch applies at vLLM " + cpu_expand_kernel.READ_AT,
          cpu_expand_kernel.apply() == "applied")
    got = rs.expand_batch_to_tokens(x32, cu, 6)
    check("int32 (top_k)", torch.equal(got, want32), str(got.tolist()))
    temps = torch.tensor([0.7, -1.0, 1.3], dtype=torch.float32)
    cu3 = torch.tensor([1, 4, 7], dtype=torch.int32)
    got = rs.expand_batch_to_tokens(temps, cu3, 7, replace_from=-1, replace_to=1)
    want = torch.tensor([0.7, 1, 1, 1, 1.3, 1.3, 1.3], dtype=torch.float32)
    check("float32 with replace_from -1 -> 1 (temperature)", torch.allclose(got, want),
          str(got.tolist()))
    got = rs.expand_batch_to_tokens(torch.tensor([0.9], dtype=torch.float32),
                                    torch.tensor([0], dtype=torch.int32), 0)
    check("no draft tokens at all", got.numel() == 0, str(got.tolist()))
    # Random batches against a plain reference.
    g = torch.Generator().manual_seed(1)
    ok = True
    for _ in range(50):
        n = int(torch.randint(1, 9, (1,), generator=g))
        counts = torch.randint(0, 8, (n,), generator=g)
        vals = torch.randint(0, 50, (n,), generator=g, dtype=torch.int64).to(torch.int32)
        ref = torch.cat([v.repeat(int(c)) for v, c in zip(vals, counts)]) if counts.sum() else \
            torch.empty(0, dtype=torch.int32)
        out = rs.expand_batch_to_tokens(vals, torch.cumsum(counts, 0).to(torch.int32),
                                        int(counts.sum()))
        ok = ok and torch.equal(out, ref)
    check("50 random batches equal the reference", ok)

    bad = 0
    for name, ok, detail in checks:
        print(f'{"PASS" if ok else "FAIL"} {name}{": " + detail if detail else ""}')
        bad += not ok
    print(f"{len(checks) - bad} passed, {bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
